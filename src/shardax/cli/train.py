"""``shardax train``: a training job on all devices, with one loop for every model.

``--model mlp`` (default) fits an NNX MLP to scikit-learn's digits; ``--model gpt``
trains the byte-level transformer of ``shardax.models.gpt`` on a text corpus. Both
build a mesh (``--mesh``), shard the model and Adam state with a plan (``--plan``), feed
each global batch split over the ``data`` axis, and show a progress bar (process 0 only).
At the end they write ``summary.json`` and ``curves.png`` to the run directory.

This module is the command: its shared options and ``run``. The jobs
(``shardax.cli.train_mlp``, ``shardax.cli.train_gpt``) register with it through
``shardax.cli.job``, each with its own options, declared once in its module; the loop
is ``shardax.cli.loop``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import jax

from shardax.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardax.cli import config, islands, track, train_gpt, train_mlp  # noqa: F401 (the jobs register)
from shardax.cli.common import (
    UsageError,
    add_json_flag,
    add_run_dir,
    console,
    mesh_spec,
    nonneg_int,
    off_or_dir,
    path_arg,
    positive_float,
    positive_int,
    print_json,
    warning,
)
from shardax.cli.extras import available, install_hint, missing
from shardax.cli.job import JOBS, add_job_arguments, apply_options, check_model_options, plan_names
from shardax.cli.loop import loop
from shardax.cli.recovery import shrink, snapshot_interval
from shardax.plan.zero import GATHERS
from shardax.runtime import cache
from shardax.runtime.compat import backends_are_initialized
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE
from shardax.train.compiler import set_gpu_environment
from shardax.train.config import MODES
from shardax.train.precision import PRECISIONS
from shardax.train.verification import verify_first_batch


def _defaults(dest: str) -> str:
    """``"mlp 128, gpt 16"``: each job's default for the shared option ``dest``."""
    return ", ".join(f"{m} {job.defaults[dest]}" for m, job in JOBS.items() if dest in job.defaults)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax train``: the shared ones, then each job's own
    (``shardax.cli.job.add_job_arguments``, from the jobs' declarations)."""
    parser.add_argument(
        "--model",
        choices=list(JOBS),
        default="mlp",
        help="mlp: an MLP on the digits data set (default); gpt: a byte-level transformer "
        "LM on a text corpus (default: the Python standard library's sources)",
    )
    parser.add_argument(
        "--mesh",
        type=mesh_spec,
        default=None,
        help="mesh axes, e.g. data=4,model=2 (default: data=-1; with a tp plan: data=-1,model=2)",
    )
    only = {p: [m for m, job in JOBS.items() if p in job.plans] for p in plan_names()}
    some = [f"{p}: --model {'/'.join(ms)} only" for p, ms in only.items() if len(ms) < len(JOBS)]
    parser.add_argument(
        "--plan",
        choices=plan_names(),
        default="replicate",
        help=f"how to shard the model and Adam state ({', '.join(some)})",
    )
    parser.add_argument(
        "--zero-gather",
        choices=GATHERS,
        default="update",
        help="with --plan zero1/zero2, where the params are gathered: update (the updated "
        "params, in their float32, after the update; default) or forward (the params kept "
        "split, their compute-dtype copy gathered at the step's start, under the forward "
        "pass: sx.zero1(mesh, gather='forward'))",
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="jit",
        help="jit: one program over the mesh, any plan (default); shard_map: per-device "
        "step with an explicit gradient all-reduce; pmap: the batch reshaped to (devices, "
        "per device, ...); single: one "
        "device. shard_map and pmap keep a whole copy of the state per device (replicate)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help=f"global batch ({_defaults('batch_size')})",
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help=f"peak Adam learning rate ({_defaults('lr')})",
    )
    parser.add_argument(
        "--accumulate", type=positive_int, default=1, help="microbatches per step (default: 1)"
    )
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default=None,
        help="compute precision of the forward and backward passes (default: fp32; bf16 "
        "for --model gpt on a GPU or TPU, where attention then takes the fused kernel)",
    )
    parser.add_argument("--seed", type=nonneg_int, default=0, help="random seed (default: 0)")
    add_job_arguments(parser)
    add_run_dir(parser, "where to write summary.json and curves.png (default: runs/train-<time>)")
    parser.add_argument(
        "--checkpoint-dir",
        type=path_arg,
        default=None,
        help="save checkpoints here: every --save-every steps, else at every evaluation; and "
        f"on SIGTERM (preemption): at the next step, then exit code {PREEMPTED_EXIT_CODE}",
    )
    parser.add_argument(
        "--save-every", type=positive_int, default=None, help="steps between checkpoints"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--snapshot-every",
        type=snapshot_interval,
        default=None,
        metavar="N|auto",
        help="steps between host-memory snapshots of the state and data position, from which "
        "shardax launch --max-restarts resumes a failed run, losing at most N steps; auto: "
        "every step while a snapshot costs at most 5%% of a step, else as often as that "
        "allows (default: auto under such a launch, else 0: none)",
    )
    parser.add_argument(
        "--sync-save",
        action="store_true",
        help="save checkpoints synchronously (default: asynchronously, the steps go on while "
        "the arrays are written)",
    )
    parser.add_argument(
        "--compile-cache",
        type=off_or_dir,
        default=None,
        metavar="DIR|off",
        help="JAX's persistent compilation cache (default: the one JAX is configured with, "
        "else ~/.cache/shardax/jax-compile); off: none",
    )
    parser.add_argument(
        "--step-timeout",
        type=positive_float,
        default=None,
        help="hang watchdog: a step (after the first, which compiles) that takes longer than "
        f"S seconds dumps every thread's stack and exits with code {WATCHDOG_EXIT_CODE} "
        "(default: off)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="before training, check the distributed step against one device on the first "
        "batch (sx.verify); a mismatch prints the report and exits with code 1",
    )
    parser.add_argument(
        "--verify-rtol",
        type=positive_float,
        default=None,
        help="--verify's relative tolerance (default: by --precision: fp32 1e-4, bf16 5e-2, "
        "fp16 2e-2)",
    )
    islands.add_arguments(parser)
    track.add_arguments(parser)
    add_json_flag(parser)
    config.add_arguments(parser)  # last: every option above is a key of --config


def check(args: argparse.Namespace, out: Any, job: Any) -> bool:
    """``--verify``: [`shardax.verify`][shardax.verify] on the job's first batch (the loader is put
    back); prints the report and returns whether it passed."""
    try:
        report = verify_first_batch(job.step, job.state, job.loader, rtol=args.verify_rtol)
    except ValueError as e:
        raise UsageError(f"--verify: {e}") from None
    if args.json and not report.ok:
        print_json({"command": "train", "verify": report.to_dict()})
    elif not args.json:
        out.print(report)
    return report.ok


def check_extras(args: argparse.Namespace) -> bool:
    """Before anything is built: the job's extras (``--model mlp``'s scikit-learn) and,
    with ``--checkpoint-dir``, orbax are a usage error when missing, naming how to install
    them; a missing matplotlib only costs the plot (a warning). Returns whether to plot."""
    needs = dict(JOBS[args.model].needs)
    if args.checkpoint_dir:
        needs["orbax.checkpoint"] = "checkpoint"
    for module, extra in missing(needs).items():
        why = "--checkpoint-dir" if extra == "checkpoint" else f"--model {args.model}"
        raise UsageError(f"{why} needs {module}; install it with: {install_hint(extra)}")
    if not available("matplotlib"):
        warning(
            f"curves.png will not be written: plotting needs matplotlib; install it with: "
            f"{install_hint('plot')}",
            "shardax train",
        )
        return False
    return True


def plot(summary: dict[str, Any], job: Any, directory: Path, plots: bool) -> str | None:
    """Writes ``summary.json``, then ``curves.png`` (when ``plots``); returns the plot's
    path, or None. A plot that fails is a warning, never a lost summary."""
    path = directory / "curves.png"
    summary["plot"] = str(path) if plots and job.plot is not None else None
    (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if summary["plot"] is None:
        return None
    try:
        job.plot(summary, path)
    except (Exception, SystemExit) as e:  # SystemExit: a library the plot requires
        warning(f"curves.png was not written: {e}", "shardax train")
        summary["plot"] = None
        (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary["plot"]


def default_precision(model: str, platform: str) -> str:
    """``--precision``'s default: bf16 for the GPT on a GPU or TPU (cuDNN's fused
    attention takes bf16), fp32 otherwise.

    >>> default_precision("gpt", "gpu"), default_precision("gpt", "cpu")
    ('bf16', 'fp32')
    """
    return "bf16" if model == "gpt" and platform in ("gpu", "tpu") else "fp32"


def run(args: argparse.Namespace) -> int:
    """Trains, writes ``summary.json`` and ``curves.png``, prints the result."""
    # CUDA reads CUDA_DEVICE_MAX_CONNECTIONS when JAX starts the GPU: set it (where unset)
    # while no backend is up; summary.json records what was set and what was in effect.
    args.environment_set = {} if backends_are_initialized() else set_gpu_environment()

    out = console(args)
    check_model_options(args)
    apply_options(args)
    settings = config.resolved(args)  # the run as a --config file holds it
    if args.print_config:  # a file for --config: YAML, or JSON with --json
        print_json(settings) if args.json else sys.stdout.write(config.dump(settings))
        return 0
    plots = check_extras(args)
    if args.verify_rtol is not None and not args.verify:
        raise UsageError(f"--verify-rtol {args.verify_rtol} needs --verify")
    if args.compile_cache == "off":
        cache.disable_compile_cache()
        args.compile_cache_dir = None
    else:
        args.compile_cache_dir = cache.compile_cache(args.compile_cache)
    args.compile_before = cache.compile_stats()
    if args.precision is None:
        args.precision = default_precision(args.model, jax.default_backend())
    shrunk = shrink(args)  # a run shardax launch --min-processes shrank
    if shrunk and jax.process_index() == 0:
        out.print(shrunk, soft_wrap=True, markup=False)
    islands.island_mesh(args)
    job = islands.islands_job(args, JOBS[args.model].make(args, out))
    if args.verify and not check(args, out, job):
        return 1
    summary = loop(args, out, job)
    unwritten = None
    if jax.process_index() == 0:
        directory = Path(summary["run_dir"])
        summary["config"] = settings
        try:
            summary["plot"] = plot(summary, job, directory, plots)
        except OSError as e:  # a full disk: the summary goes to stdout instead
            summary["plot"], unwritten = None, e
        if args.json or unwritten is not None:
            print_json(summary)
        else:
            if job.report is not None:
                job.report(summary, out)
            # a path is printed whole (never broken at the terminal's width) and as it is
            # (no rich markup read into its brackets)
            out.print(
                f"{summary['data_wait_fraction']:.1%} of the time waiting for input; wrote "
                f"{directory}/summary.json, {'curves.png, ' if summary['plot'] else ''}"
                "metrics.jsonl",
                soft_wrap=True,
                markup=False,
            )
            if summary["log_dir"]:
                out.print(
                    f"TensorBoard: tensorboard --logdir {summary['log_dir']}",
                    soft_wrap=True,
                    markup=False,
                )
        if summary["profile_trace"]:
            out.print(
                f"profiler trace: {summary['profile_trace']} (one per process under "
                f"{Path(summary['profile_trace']).parents[3]})",
                soft_wrap=True,
                markup=False,
            )
    if unwritten is not None:  # raised out of the except, so main names this error
        where = f"--run-dir {args.run_dir}" if args.run_dir else f"run directory {directory}"
        kept = f"; the checkpoints are in {args.checkpoint_dir}" if args.checkpoint_dir else ""
        raise OSError(
            f"{where}: summary.json was not written ({unwritten.strerror or unwritten}); the "
            f"summary is printed above as JSON instead{kept}"
        )
    return 0
