"""Pieces every command shares: argument types, usage errors, consoles, plots, timing.

Human output (tables, progress) goes to stderr when ``--json`` asks for JSON on stdout,
so ``shardax CMD --json | jq`` always reads clean JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
from rich.console import Console

from shardax._format import titled_table
from shardax.checkpoint.manager import remote_scheme, remote_why
from shardax.cli.extras import install_hint
from shardax.cost.flops import compiled_flops
from shardax.cost.hlo import attention_kernel


class UsageError(Exception):
    """A bad option found after parsing; ``main`` prints it in one line and exits 2."""


def refuse_given(args: argparse.Namespace, dests: Iterable[str], rule: str) -> None:
    """A usage error naming the first of ``dests`` given (not None), its value and ``rule``.

    >>> refuse_given(argparse.Namespace(memory_fraction=None), ["memory_fraction"], "never")
    """
    for dest in dests:
        value = getattr(args, dest, None)
        if value is not None:
            raise UsageError(f"--{dest.replace('_', '-')} {value}: {rule}")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def float_type(expected: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a finite float for which ``ok`` holds, else "expected
    <expected>" (``inf`` and ``nan`` are never a size, a rate or a number of seconds)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and ok(value)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_float = float_type("a finite number > 0", lambda v: v > 0)
nonneg_float = float_type("a finite number >= 0", lambda v: v >= 0)


def warning(message: str, prefix: str = "shardax", file: Any = None) -> None:
    """``message`` as one ``<prefix>: warning: ...`` line on stderr (a command's warnings,
    without Python's file name and source line)."""
    out = file or sys.stderr
    out.write(f"{prefix}: warning: {' '.join(str(message).splitlines())}\n")
    out.flush()


def nonneg_int(text: str) -> int:
    """An argparse type: an integer >= 0 (a seed)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def tcp_port(text: str) -> int:
    """An argparse type: a TCP port, 1..65535, or 0 for a free one."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port in 1..65535 (0 = a free one), got {text!r}"
        )
    return value


def check_batch_divides(batch_size: int, data_devices: int, accumulate: int = 1) -> None:
    """Raises ``UsageError`` unless ``--batch-size`` splits evenly over the data
    devices and ``--accumulate`` microbatches: found after parsing, once the mesh is
    known, and answered like a bad option (one line, exit 2)."""
    divisor = data_devices * accumulate
    if batch_size % divisor:
        fit = (batch_size // divisor or 1) * divisor
        raise UsageError(
            f"--batch-size {batch_size} is not divisible by the {data_devices} data devices × "
            f"--accumulate {accumulate} = {divisor}; use a multiple of {divisor}, e.g. {fit}"
        )


def env_int(name: str, parse: Callable[[str], int], default: int) -> int:
    """``$name`` read with the argparse type ``parse`` (``default`` when unset); a bad
    value is a ``UsageError`` naming the variable."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return parse(raw)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"${name}: {e}") from None


def check_writable_dir(option: str, path: str) -> None:
    """Raises ``UsageError`` unless directory ``path`` exists and is writable, or
    can be created: checked before any work starts, creating nothing. A
    ``--checkpoint-dir`` URL (``gs://``, ``s3://``) is refused here, by its scheme, before
    the run imports or builds anything (``file://`` is a local path)."""
    scheme = remote_scheme(path) if option == "--checkpoint-dir" else None
    if scheme:
        raise UsageError(
            f"{option} {path}: the {scheme}:// URL of an object store, not a directory of a "
            f"local or mounted file system; {remote_why(scheme)}"
        )
    if option == "--checkpoint-dir" and path.lower().startswith("file://"):
        path = path[len("file://") :] or "/"
    target = Path(path).expanduser().absolute()
    way_out = "; name a directory this user can write (created if missing)" + (
        ", or off for none" if option == "--compile-cache" else ""
    )
    if target.exists() and not target.is_dir():
        raise UsageError(f"{option} {path}: exists and is not a directory{way_out}")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(
            f"{option} {path}: cannot create it, {existing} is not a directory{way_out}"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == target else f"cannot be created in {existing}"
        raise UsageError(f"{option} {path}: {what} (permission denied){way_out}")


STARTED = time.time()
"""When the CLI was imported: the start of a run's start-up in the goodput ledger."""

OUTPUT_DIRS = (
    ("--run-dir", "run_dir"),
    ("--checkpoint-dir", "checkpoint_dir"),
    ("--compile-cache", "compile_cache"),
)
"""The options of every command that name a directory it writes to."""

RUN_FILES = ("summary.json", "metrics.jsonl", "goodput.json")
"""What ``shardax train`` writes into its run directory."""


def check_output_dirs(args: argparse.Namespace) -> None:
    """``check_writable_dir`` for every output directory option in ``args``, and a
    ``--run-dir`` of ``shardax train`` that holds an earlier run is refused (its summary,
    metrics and goodput would be overwritten or mixed) unless it is ``--resume``d."""
    for option, attr in OUTPUT_DIRS:
        value = getattr(args, attr, None)
        if value and value != "off":
            check_writable_dir(option, value)
    restarted = bool(os.environ.get("SHARDAX_RESTART"))  # shardax launch --max-restarts
    if args.command == "train" and args.run_dir and not args.resume and not restarted:
        earlier = [f for f in RUN_FILES if (Path(args.run_dir) / f).exists()]
        if earlier:
            raise UsageError(
                f"--run-dir {args.run_dir}: holds an earlier run ({', '.join(earlier)}), "
                "which this one would overwrite and mix with its own; pass --resume to "
                "continue that run, or name a new --run-dir (without one, each run gets "
                "runs/train-<time>)"
            )


def path_arg(text: str) -> str:
    """An argparse type: a non-empty path. An empty one (``--checkpoint-dir "$UNSET"``)
    would otherwise read as the option not given (no checkpoints, the default run
    directory or corpus) or as the working directory.

    >>> path_arg("runs/a")
    'runs/a'
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"expected a path, got {text!r} (an unset variable?); leave the option out "
            "for its default"
        )
    return text


def required_path(text: str) -> str:
    """An argparse type for a positional path: ``path_arg`` with no default to fall
    back on."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (an unset variable?)")
    return text


def off_or_dir(text: str) -> str:
    """An argparse type: ``off`` (in any case) or a directory path.

    >>> off_or_dir("OFF"), off_or_dir("cache")
    ('off', 'cache')
    """
    if text.strip().lower() == "off":
        return "off"
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a directory or 'off', got ''")
    return text


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, e.g. ``8,16,32``."""
    try:
        return [positive_int(t) for t in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1 such as 8,16,32, got {text!r}"
        ) from None


def mesh_spec(text: str) -> list[tuple[str, int]]:
    """An argparse type: ``data=4,model=2`` (``-1`` = the remaining devices).

    >>> mesh_spec("data=-1,model=2")
    [('data', -1), ('model', 2)]
    """
    pairs = []
    for item in text.split(","):
        name, sep, size = item.partition("=")
        try:
            value = int(size)
        except ValueError:
            value = 0
        if not sep or not name.strip() or (value < 1 and value != -1):
            raise argparse.ArgumentTypeError(
                f"expected AXIS=SIZE pairs such as data=4,model=2 (SIZE >= 1 or -1), got {text!r}"
            )
        pairs.append((name.strip(), value))
    return pairs


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json``: print the result as JSON on stdout."""
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON on stdout (tables go away)"
    )


def add_run_dir(parser: argparse.ArgumentParser, help: str) -> None:
    """``--run-dir``: where the command writes its results (a non-empty path, checked
    writable before the command runs: ``OUTPUT_DIRS``)."""
    parser.add_argument("--run-dir", type=path_arg, default=None, help=help)


def console(args: argparse.Namespace) -> Any:
    """A rich console: stdout, or stderr when ``--json`` owns stdout."""
    stderr = bool(getattr(args, "json", False))
    out = Console(stderr=stderr)
    # Piped output (tests, `| less`) gets $COLUMNS, else a readable 120 instead of rich's 80.
    return out if out.is_terminal else Console(stderr=stderr, width=piped_width())


PIPED_WIDTH = 120
"""The width of piped output where ``$COLUMNS`` does not give one."""


def piped_width() -> int:
    """``$COLUMNS`` (a positive integer), else ``PIPED_WIDTH``; a ``$COLUMNS`` that is no
    width is a usage error naming it.

    >>> import os
    >>> saved = os.environ.pop("COLUMNS", None)
    >>> piped_width()
    120
    >>> os.environ["COLUMNS"] = "100"
    >>> piped_width()
    100
    >>> _ = os.environ.pop("COLUMNS") if saved is None else os.environ.update(COLUMNS=saved)
    """
    return env_int("COLUMNS", positive_int, PIPED_WIDTH)


def print_json(obj: Any) -> None:
    """Writes ``obj`` as indented JSON on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def require(module: str, extra: str, command: str) -> Any:
    """Imports ``module``, or stops with a message naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SystemExit(
            f"shardax {command}: error: this needs {module.split('.')[0]}; "
            f"install it with: {install_hint(extra)}"
        ) from None


def pyplot(command: str) -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    require("matplotlib", "plot", command).use("Agg")
    return require("matplotlib.pyplot", "plot", command)


def write_results(
    args: argparse.Namespace,
    out: Any,
    result: dict[str, Any],
    command: str,
    name: str,
    plot: Callable[[dict[str, Any], Path], None],
    render: Callable[[dict[str, Any], Any], None],
) -> Path:
    """Writes ``<name>.png`` and ``<name>.json`` to the run directory, then prints the
    result: as JSON on stdout with ``--json``, else as tables. Returns the directory."""
    directory = run_dir(args.run_dir, command)
    result["plot"] = str(directory / f"{name}.png")
    plot(result, directory / f"{name}.png")
    (directory / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print_json(result)
    else:
        render(result, out)
        out.print(f"wrote {directory}/{name}.json and {name}.png", soft_wrap=True, markup=False)
    return directory


def run_dir(path: str | None, command: str) -> Path:
    """``path``, or a new ``runs/<command>-<timestamp>`` directory; created."""
    out = Path(path) if path else Path("runs") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def time_step(fn: Callable[[], Any], warmup: int = 2, repeats: int = 5) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls, each waited for.

    ``fn`` must return the arrays it computes, so the clock stops when they are ready.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def time_interleaved(
    fns: list[Callable[[], Any]], warmup: int = 2, repeats: int = 5
) -> list[list[float]]:
    """Like ``time_step`` for several functions, timed in turns.

    Round ``r`` times every function once, so load from other processes during the
    run falls on all of them alike instead of on whichever ran at the time.
    """
    for fn in fns:
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            out.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    """The median of ``values``."""
    return float(statistics.median(values))


def step_flops(step: Any, state: Any, batch: Any, *, with_attention: bool = False) -> Any:
    """FLOPs of one step over all devices, from the compiled step's ``cost_analysis()``
    (XLA counts one device's partitioned program); with ``with_attention``, also the
    attention kernel it compiled to (``"cudnn"``, ``"splash"`` or ``"dense"``, read from
    the compiled HLO: ``shardax.cost.hlo.attention_kernel``).

    Called before the first step, it compiles the program that step runs: JAX keeps the
    executable, and the step's call finds it (``tests/cli/test_compiles.py`` counts one
    compile); the HLO text is read once, for the FLOPs and the kernel both."""
    compiled = step.lower(state, batch).compile()
    try:
        hlo = compiled.as_text()
    except Exception:  # a program without text (some modes): its FLOPs and kernel unknown
        hlo = None
    per_device = compiled_flops(compiled, hlo=hlo) if hlo is not None else None
    devices = 1 if step.mode == "single" else step.mesh.size
    flops = None if per_device is None else per_device * devices
    if not with_attention:
        return flops
    return flops, None if hlo is None else attention_kernel(hlo)


def plot_curves(
    summary: dict[str, Any],
    path: Any,
    what: str,
    x: str,
    panels: list[tuple[str, str]],
    note: str = "",
) -> None:
    """One panel per ``(metric, label)``: train and held-out curves against ``x``, titled
    ``what`` on the run's devices, mesh and plan (then ``note``).

    Each panel plots ``train_<metric>`` and the held-out ``<split>_<metric>`` entries
    (``test_`` or ``val_``) found in the ``summary``'s history.
    """
    history = summary["history"]
    title = (
        f"{what}, {summary['devices']} × {summary['platform']}, mesh {summary['mesh']}, "
        f"plan {summary['plan']}" + (f"; {note}" if note else "")
    )
    plt = pyplot("train")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (metric, label) in zip(axes[0], panels, strict=True):
        for split, style in (("train", "-"), ("val", "s-"), ("test", "s-")):
            points = [(h[x], h[f"{split}_{metric}"]) for h in history if f"{split}_{metric}" in h]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, label=split, ms=4)
        ax.set(xlabel=x, ylabel=label, title=metric)
        ax.grid(alpha=0.3)
        ax.legend()
    # Wrapped to the figure's width (about 12 characters per inch at this size).
    fig.suptitle(textwrap.fill(title, 12 * 5 * len(panels)), fontsize=10)
    save_figure(plt, fig, path)


def machine() -> dict[str, str]:
    """What a result was measured on: the ``platform`` and ``device_kind`` of the devices."""
    first = jax.devices()[0]
    return {"platform": first.platform, "device_kind": str(first.device_kind)}


def save_figure(plt: Any, fig: Any, path: Any) -> None:
    """Lays ``fig`` out, writes it to ``path`` (PNG, 110 dpi) and closes it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rows_table(
    title: str,
    columns: dict[str, Callable[[dict[str, Any]], str]],
    rows: Sequence[dict[str, Any]],
    caption: str | None = None,
    *,
    left: int = 0,
    style: Callable[[dict[str, Any]], str | None] = lambda row: None,
) -> Any:
    """A rich ``Table`` with a line per row: ``columns`` maps each column's header to how
    a row shows in it. Right-aligned (numbers) but the first ``left`` columns; ``style``
    gives a row's style."""
    table = titled_table(title, caption=caption)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < left else "right")
    for row in rows:
        table.add_row(*(show(row) for show in columns.values()), style=style(row))
    return table
