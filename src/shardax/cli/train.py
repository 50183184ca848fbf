"""``shardax train``: a training job on all devices, with one loop for every model.

``--model mlp`` (default) fits an NNX MLP to scikit-learn's digits; ``--model gpt``
trains the byte-level transformer of :mod:`shardax.models.gpt` on a text corpus. Both
build a mesh (``--mesh``), shard the model and Adam state with a plan (``--plan``), feed
each global batch split over the ``data`` axis, and show a progress bar (process 0 only).
At the end they write ``summary.json`` and ``curves.png`` to the run directory.

This module is the command: its options and :func:`run`. The jobs
(:mod:`shardax.cli.train_mlp`, :mod:`shardax.cli.train_gpt`) register with it through
:mod:`shardax.cli.job`; the loop is :mod:`shardax.cli.loop`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardax.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardax.cli import track, train_gpt, train_mlp  # noqa: F401 (the jobs register themselves)
from shardax.cli.common import (
    UsageError,
    add_json_flag,
    console,
    mesh_spec,
    nonneg_int,
    off_or_dir,
    positive_float,
    positive_int,
    print_json,
)
from shardax.cli.job import JOBS, check_model_options
from shardax.cli.loop import loop
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE

MODES = ("jit", "single", "shard_map", "pmap")
PLANS = ("replicate", "fsdp", "zero1", "zero2", "tp", "fsdp+tp", "pipeline")
PRECISIONS = ("fp32", "bf16", "fp16")
REMAT = ("none", "full", "dots", "dots_no_batch", "offload_dots_no_batch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax train``."""
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
    parser.add_argument(
        "--plan",
        choices=PLANS,
        default="replicate",
        help="how to shard the model and Adam state (fsdp+tp, pipeline: --model gpt only)",
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
        "--batch-size", type=positive_int, default=None, help="global batch (mlp 128, gpt 16)"
    )
    parser.add_argument("--lr", type=positive_float, default=None, help="peak Adam learning rate")
    parser.add_argument(
        "--accumulate", type=positive_int, default=1, help="microbatches per step (default: 1)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="compute precision of the forward and backward passes (default: fp32; bf16 "
        "for --model gpt on a GPU or TPU, where attention then takes the fused kernel)",
    )
    parser.add_argument("--seed", type=nonneg_int, default=0, help="random seed (default: 0)")
    mlp = parser.add_argument_group("--model mlp")
    mlp.add_argument("--epochs", type=positive_int, default=None, help="passes over the data (15)")
    mlp.add_argument("--hidden", type=positive_int, default=None, help="hidden width (256)")
    gpt = parser.add_argument_group("--model gpt")
    gpt.add_argument("--steps", type=positive_int, default=None, help="training steps (200)")
    gpt.add_argument("--layers", type=positive_int, default=None, help="transformer blocks (2)")
    gpt.add_argument("--d-model", type=positive_int, default=None, help="model width (64)")
    gpt.add_argument("--heads", type=positive_int, default=None, help="attention heads (4)")
    gpt.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (64)")
    gpt.add_argument(
        "--max-seq-len", type=positive_int, default=None, help="the model's longest sequence (256)"
    )
    gpt.add_argument(
        "--positions", choices=("rotary", "learned"), default=None, help="rotary (default)"
    )
    gpt.add_argument(
        "--remat", choices=REMAT, default=None, help="activation remat policy per block (none)"
    )
    gpt.add_argument(
        "--scan-layers",
        action="store_const",
        const=True,
        default=None,
        help="run the layers in lax.scan: compile time independent of depth, and remat "
        "saves memory on XLA:CPU; compiled FLOPs then count one layer",
    )
    gpt.add_argument(
        "--data", default=None, help="a text file or directory of them (default: stdlib sources)"
    )
    gpt.add_argument("--eval-every", type=positive_int, default=None, help="steps per eval (50)")
    gpt.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="run the blocks with sx.pipeline in this many microbatches per data shard "
        "(default with --plan pipeline: the stage axis size)",
    )
    gpt.add_argument(
        "--attention",
        choices=("auto", "all_gather", "ring", "ulysses"),
        default=None,
        help="context-parallel attention over a 'context' mesh axis (--mesh data=2,context=4): "
        "ring, all_gather, ulysses or auto (default); without one, jax.nn.dot_product_attention",
    )
    gpt.add_argument(
        "--window",
        type=nonneg_int,
        default=None,
        help="sliding-window attention: each token sees itself and the L tokens before it",
    )
    gpt.add_argument(
        "--pack",
        action="store_const",
        const=True,
        default=None,
        help="packed rows: documents joined with segment ids (attention stays within a "
        "document, positions restart)",
    )
    gpt.add_argument(
        "--experts",
        type=positive_int,
        default=None,
        help="mixture of experts: E experts in the MLP of every --moe-every-th block, split "
        "over an 'expert' mesh axis (--mesh data=2,expert=4) where there is one",
    )
    gpt.add_argument(
        "--top-k", type=positive_int, default=None, help="experts per token (default: 2)"
    )
    gpt.add_argument(
        "--moe-every", type=positive_int, default=None, help="every n-th block is MoE (1)"
    )
    gpt.add_argument(
        "--capacity-factor",
        type=positive_float,
        default=None,
        help="expert capacity, as a multiple of an even share of the tokens (1.25)",
    )
    gpt.add_argument(
        "--pipeline-repeats",
        type=positive_int,
        default=None,
        help="sx.pipeline repeats: > 1 is the circular schedule (default: 1)",
    )
    parser.add_argument(
        "--run-dir",
        default=None,
        help="where to write summary.json and curves.png (default: runs/train-<time>)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here: every --save-every steps, else at every evaluation; and "
        f"on SIGTERM (preemption): at the next step, then exit code {PREEMPTED_EXIT_CODE}",
    )
    parser.add_argument(
        "--save-every", type=positive_int, default=None, help="steps between checkpoints"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
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
    track.add_arguments(parser)
    add_json_flag(parser)


def check(args: argparse.Namespace, out: Any, job: Any) -> bool:
    """``--verify``: :func:`shardax.verify` on the job's first batch (the loader is put
    back); prints the report and returns whether it passed."""
    from shardax.train.verification import verify_first_batch

    try:
        report = verify_first_batch(job.step, job.state, job.loader, rtol=args.verify_rtol)
    except ValueError as e:
        raise UsageError(f"--verify: {e}") from None
    if args.json and not report.ok:
        print_json({"command": "train", "verify": report.to_dict()})
    elif not args.json:
        out.print(report)
    return report.ok


def default_precision(model: str, platform: str) -> str:
    """``--precision``'s default: bf16 for the GPT on a GPU or TPU (cuDNN's fused
    attention takes bf16), fp32 otherwise.

    >>> default_precision("gpt", "gpu"), default_precision("gpt", "cpu")
    ('bf16', 'fp32')
    """
    return "bf16" if model == "gpt" and platform in ("gpu", "tpu") else "fp32"


def run(args: argparse.Namespace) -> int:
    """Trains, writes ``summary.json`` and ``curves.png``, prints the result."""
    import jax

    from shardax.runtime import cache

    out = console(args)
    check_model_options(args)
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
    job = JOBS[args.model].make(args, out)
    if args.verify and not check(args, out, job):
        return 1
    summary = loop(args, out, job)
    if jax.process_index() == 0:
        directory = Path(summary["run_dir"])
        summary["plot"] = str(directory / "curves.png")
        if job.plot is not None:
            job.plot(summary, directory / "curves.png")
        (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if args.json:
            print_json(summary)
        else:
            if job.report is not None:
                job.report(summary, out)
            out.print(
                f"{summary['data_wait_fraction']:.1%} of the time waiting for input; wrote "
                f"{directory}/summary.json, curves.png and metrics.jsonl"
            )
            if summary["log_dir"]:
                out.print(f"TensorBoard: tensorboard --logdir {summary['log_dir']}")
        if summary["profile_trace"]:
            out.print(
                f"profiler trace: {summary['profile_trace']} (one per process under "
                f"{Path(summary['profile_trace']).parents[3]})"
            )
    return 0
