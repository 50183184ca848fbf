"""Entry point: parses arguments, sets simulated CPU devices, then runs a command.

Only the named command's module is imported, to add its options to the parser (``shardax
--help`` lists every command from ``COMMANDS`` without importing them). Simulated CPU
devices must be set before any JAX backend starts: importing a command starts none, and
``--cpu-devices`` is applied after the arguments are parsed (so a usage error comes first)
and before the command runs. Under ``shardax launch`` (or SLURM / Open MPI) each command
also joins the multi-process run then. A command module with ``STARTS_JAX = False``
(launch, goodput) gets neither.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax

from shardax import __version__
from shardax.checkpoint.preemption import Preempted
from shardax.cli import config
from shardax.cli.common import UsageError, check_output_dirs, env_int, positive_int, warning
from shardax.runtime.distributed import ENV_CPU_DEVICES, backend_started, initialize
from shardax.train.guard import NonFiniteLossError

COMMANDS = {
    "info": ("shardax.cli.info", "Show devices, hardware, batch-size advice and the mesh."),
    "launch": ("shardax.cli.launch", "Run a command in N local processes that form one JAX run."),
    "train": (
        "shardax.cli.train",
        "Train an MLP on digits, or a GPT (--model gpt), on all devices.",
    ),
    "bench": ("shardax.cli.bench", "Compare train-step times of single, jit, shard_map, pmap."),
    "plan": ("shardax.cli.plan", "Memory per device of DP, FSDP, TP and hybrids for a model."),
    "calibrate": (
        "shardax.cli.calibrate",
        "Measure this GPU's kernels: the tables the per-op cost model prices steps with.",
    ),
    "tune-batch": ("shardax.cli.tune_batch", "Measure throughput over batch sizes; find the knee."),
    "goodput": ("shardax.cli.goodput", "Where a run's wall time went: buckets and goodput."),
}


DEFAULT_CPU_DEVICES = 8


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit code 2, with no traceback."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; the modules of ``commands`` (default: all) are imported
    and add their own options, the others are listed with their help only."""
    parser = _Parser(
        prog="shardax",
        description="Take a JAX training loop from one device to many devices and many hosts.",
        epilog="examples: shardax info | shardax train --plan fsdp | "
        "shardax plan --params 7e9 --devices 8 --hardware h100 | shardax bench | "
        "shardax tune-batch | shardax launch -n 2 -- shardax train. "
        "Run shardax COMMAND --help for a command's options.",
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    chosen = set(COMMANDS if commands is None else commands)
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name not in chosen:
            continue
        command = importlib.import_module(module)
        if getattr(command, "STARTS_JAX", True):
            cmd.add_argument(
                "--cpu-devices",
                type=positive_int,
                default=None,
                help="simulated CPU devices (per process) when no accelerator is present "
                "(default: $SHARDAX_CPU_DEVICES, else 8)",
            )
        command.add_arguments(cmd)
    return parser


def version() -> str:
    """``shardax --version``: shardax's version, and the JAX and Python it runs on."""
    return f"shardax {__version__} (jax {jax.__version__}, Python {sys.version.split()[0]})"


def expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with a command's ``--config FILE`` and ``key=value`` arguments turned into
    its flags (``shardax.cli.config.expand``), for a command that takes ``--config``."""
    named = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices.get(argv[named]) if named is not None else None
    if command is None or "--config" not in command._option_string_actions:
        return argv
    return [*argv[: named + 1], *config.expand(command, argv[named + 1 :])]


def set_cpu_devices(n: int) -> None:
    """Asks JAX for ``n`` CPU devices and joins a multi-process run when there is one
    ([`shardax.initialize`][shardax.initialize]); both must happen before any backend starts. Called
    again in a process whose backend runs (``main`` in a test), it only sets ``n``."""
    if backend_started():
        jax.config.update("jax_num_cpu_devices", n)
        return
    try:
        initialize(cpu_devices=n)
    except ValueError as e:  # a malformed $SHARDAX_* coordinate, before JAX starts
        raise UsageError(str(e)) from None


@contextlib.contextmanager
def one_line_warnings(prefix: str) -> Iterator[None]:
    """``UserWarning``s (shardax's advice, e.g. a batch larger than the data) as one
    ``<prefix>: warning: <message>`` line on stderr, without Python's file name and
    source line; other categories (deprecations) as Python shows them."""
    with warnings.catch_warnings():
        default = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, UserWarning):
                warning(str(message), prefix, file)
            else:
                default(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def whole_lines(stream: Any) -> None:
    """Makes ``stream`` write each line in one piece. Under ``shardax launch``
    (``PYTHONUNBUFFERED``) ``print`` writes a text and its newline apart, and the
    runtime's native chatter on the same pipe (gloo) can land between them, splitting a
    JSON line; line buffering writes a line and its newline together."""
    if isinstance(stream, io.TextIOWrapper) and not stream.line_buffering:
        with contextlib.suppress(ValueError, io.UnsupportedOperation):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``shardax COMMAND [OPTIONS]`` and returns its exit code."""
    whole_lines(sys.stdout)
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((a for a in argv if not a.startswith("-")), None)  # the command, if any
    parser = build_parser([named] if named in COMMANDS else [])
    args = parser.parse_args(expand_config(parser, argv))
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        check_output_dirs(args)
        if getattr(module, "STARTS_JAX", True):
            if args.cpu_devices is None:
                args.cpu_devices = env_int(ENV_CPU_DEVICES, positive_int, DEFAULT_CPU_DEVICES)
            set_cpu_devices(args.cpu_devices)
        with one_line_warnings(f"shardax {args.command}"):
            return int(module.run(args) or 0)
    except UsageError as e:
        sys.stderr.write(f"shardax {args.command}: error: {e}\n")
        return 2
    except NonFiniteLossError as e:
        sys.stderr.write(f"shardax {args.command}: error: {e}\n")
        return 1
    except Preempted as e:
        sys.stderr.write(f"shardax {args.command}: {e}\n")
        return e.exit_code
    except OSError as e:  # a full or read-only disk: the first failure says why
        while isinstance(e.__context__, OSError):
            e = e.__context__
        sys.stderr.write(f"shardax {args.command}: error: {e}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
