"""``shardax train``: a training job on all devices, with one loop for every model.

``--model mlp`` (default) fits an NNX MLP to scikit-learn's digits; ``--model gpt``
trains the byte-level transformer of :mod:`shardax.models.gpt` on a text corpus. Both
build a mesh (``--mesh``), shard the model and Adam state with a plan (``--plan``), feed
each global batch split over the ``data`` axis, and show a progress bar (process 0 only).
At the end they write ``summary.json`` and ``curves.png`` to the run directory.

This module is the part the jobs share: the options, the mesh, checkpoint resume,
the loop (progress, NaN guard, evaluation, checkpoints every ``--save-every`` steps),
FLOPs and the summary. A job (:mod:`shardax.cli.train_mlp`, :mod:`shardax.cli.train_gpt`)
only builds a :class:`Job`: its state, step, batches and evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardax.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardax.cli import track
from shardax.cli.common import (
    UsageError,
    add_json_flag,
    console,
    mesh_spec,
    nonneg_int,
    positive_float,
    positive_int,
    print_json,
    pyplot,
    run_dir,
    step_flops,
)
from shardax.runtime.watchdog import WATCHDOG_EXIT_CODE

MODELS = ("mlp", "gpt")
MODES = ("jit", "single", "shard_map", "pmap")
PLANS = ("replicate", "fsdp", "zero1", "zero2", "tp", "fsdp+tp", "pipeline")
PRECISIONS = ("fp32", "bf16", "fp16")
REMAT = ("none", "full", "dots", "dots_no_batch", "offload_dots_no_batch")
# Options that only one model reads; giving them to the other is an error, not ignored.
MODEL_OPTIONS = {
    "mlp": ("epochs", "hidden"),
    "gpt": (
        "steps", "layers", "d_model", "heads", "seq_len", "max_seq_len", "positions",
        "remat", "scan_layers", "data", "eval_every", "microbatches", "pipeline_repeats",
    ),
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax train``."""
    parser.add_argument(
        "--model",
        choices=MODELS,
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
        "step with an explicit gradient all-reduce; pmap: seed 003's layout; single: one "
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
        default="fp32",
        help="compute precision of the forward and backward passes (default: fp32)",
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
        "--step-timeout",
        type=positive_float,
        default=None,
        help="hang watchdog: a step (after the first, which compiles) that takes longer than "
        f"S seconds dumps every thread's stack and exits with code {WATCHDOG_EXIT_CODE} "
        "(default: off)",
    )
    track.add_arguments(parser)
    add_json_flag(parser)


def check_model_options(args: argparse.Namespace) -> None:
    """Options of the other model are an error (they would be silently ignored)."""
    for model, names in MODEL_OPTIONS.items():
        if model == args.model:
            continue
        given = [n for n in names if getattr(args, n) is not None]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise UsageError(f"{flags}: only for --model {model}, got --model {args.model}")
    if args.save_every is not None and args.checkpoint_dir is None:
        raise UsageError(f"--save-every {args.save_every} needs --checkpoint-dir")


def make_mesh(args: argparse.Namespace) -> Any:
    """The mesh of ``--mesh`` (default: ``data`` over every device, plus ``model=2`` for
    a TP plan), or the first device for ``--mode single``."""
    import jax

    import shardax as sx

    if args.mode == "single":
        if args.mesh is not None or args.plan != "replicate":
            raise UsageError("--mode single runs on one device: drop --mesh and --plan")
        return sx.make_mesh({"data": 1}, devices=jax.devices()[:1])
    tp = "tp" in args.plan.split("+")
    spec = args.mesh or ([("data", -1), ("model", 2)] if tp else [("data", -1)])
    if args.plan == "pipeline" and args.mesh is None:
        spec = [("data", -1), ("stage", 2)]
    if "data" not in dict(spec):
        raise UsageError(f"--mesh needs a 'data' axis for the batch, got {args.mesh}")
    try:
        return sx.make_mesh(spec)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None


def check_batch_fits(args: argparse.Namespace, mesh: Any) -> None:
    """The global batch must split evenly over the data axis; the error names both sizes
    and the ways out (a resumed run keeps its batch size, so only the mesh can change)."""
    data_size, batch = mesh.shape["data"], args.batch_size
    if batch % data_size == 0:
        return
    fits = [d for d in range(mesh.size, 0, -1) if batch % d == 0 and mesh.size % d == 0]
    meshes = ", ".join(
        f"data={d}" + (f",model={mesh.size // d}" if d < mesh.size else "") for d in fits[:3]
    )
    if args.resume:
        way = (
            f"a resumed run keeps the checkpoint's global batch (its data position counts "
            f"batches of {batch}), so pass a --mesh whose data axis divides {batch} on these "
            f"{mesh.size} devices ({meshes}), or run on a device count it divides"
        )
    else:
        way = (
            f"pass a --batch-size that is a multiple of {data_size}, or a --mesh whose data "
            f"axis divides {batch} ({meshes})"
        )
    raise UsageError(
        f"--batch-size {batch} is not divisible by the data axis size {data_size} of mesh "
        f"{dict(mesh.shape)}; {way}"
    )


@dataclasses.dataclass
class Job:
    """What a model brings to the shared loop.

    Attributes:
        title: what is trained, e.g. "an MLP on digits" (printed, and the plot's title).
        mesh: the mesh.
        state: the placed train state.
        step: the ``sx.make_train_step`` step.
        loader: an iterator of process-local batches with ``get_state()``/``set_state()``.
        steps: total steps of the run.
        eval_every: steps between evaluations (and default checkpoints).
        evaluate: ``state -> {name: float}`` on the held-out data.
        records: ``(first step, per-step metrics as floats, evaluation, seconds) ->``
            history entries (each with ``step``) for the steps since the last evaluation.
        unit: what ``items_per_step`` counts ("examples" or "tokens").
        items_per_step: examples or tokens in one global batch.
        progress: ``metrics -> str`` shown on the progress bar.
        summary: ``common summary -> job-specific entries`` (added to it).
        estimate_flops: a FLOPs-per-step estimate from the model's sizes, if it has one.
    """

    title: str
    mesh: Any
    state: Any
    step: Any
    loader: Any
    steps: int
    eval_every: int
    evaluate: Callable[[Any], dict[str, float]]
    records: Callable[[int, list[dict[str, float]], dict[str, float], float], list[dict]]
    unit: str
    items_per_step: int
    progress: Callable[[dict[str, float]], str]
    summary: Callable[[dict[str, Any]], dict[str, Any]] = lambda common: {}
    estimate_flops: float | None = None


def build_steps(args: argparse.Namespace, loss_fn: Any, mesh: Any, plan: Any) -> tuple[Any, Any]:
    """The train step (``sx.make_train_step``) and its no-update twin for validation
    (``sx.make_eval_step``, the model in inference mode), with the CLI's mode,
    accumulation and precision; bad combinations are usage errors naming the options."""
    import shardax as sx
    from shardax.train.stats import STATS

    plan = None if args.mode == "single" else plan  # one device: no sharding plan
    options = {"mesh": mesh, "plan": plan, "mode": args.mode, "precision": args.precision}
    try:
        # The CLI logs every update statistic, param norm included.
        step = sx.make_train_step(loss_fn, accumulate=args.accumulate, stats=STATS, **options)
        return step, sx.make_eval_step(loss_fn, **options)
    except ValueError as e:
        raise UsageError(f"--plan {args.plan} --mode {args.mode}: {e}") from None


def place(args: argparse.Namespace, step: Any, state: Any) -> Any:
    """``step.shard(state)``, a bad plan/mode/mesh combination being a usage error."""
    try:
        return step.shard(state)
    except ValueError as e:
        raise UsageError(
            f"--plan {args.plan} --mode {args.mode} on mesh {dict(step.mesh.shape)}: {e}"
        ) from None


def resume(args: argparse.Namespace, manager: Any, state: Any) -> tuple[Any, dict[str, Any]]:
    """The state and data state (steps done, history, loader position, the metrics of
    the steps since the last evaluation) to start from."""
    fresh = {"step": 0, "history": [], "loader": None, "window": []}
    if not args.resume:
        if manager is not None and manager.latest_step() is not None:
            raise UsageError(
                f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints; pass "
                "--resume to continue from them, or choose an empty directory"
            )
        return state, fresh
    if manager is None:
        raise UsageError("--resume needs --checkpoint-dir")
    if manager.latest_step() is None:
        raise UsageError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
    try:
        restored = manager.restore(like=state)
    except ValueError as e:
        raise UsageError(f"--resume: the checkpoint does not fit this model: {e}") from None
    return restored.state, {**fresh, **restored.data_state}


def _host(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def loop(args: argparse.Namespace, out: Any, job: Job) -> dict[str, Any]:
    """Runs ``job`` to ``job.steps`` and returns the summary (plain data)."""
    import jax
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    import shardax as sx
    from shardax.cost.flops import format_utilization, utilization

    mesh, step = job.mesh, job.step
    is_main = jax.process_index() == 0
    manager = sx.CheckpointManager(args.checkpoint_dir) if args.checkpoint_dir else None
    try:  # a usage error closes the manager first, or orbax complains at shutdown
        state, data_state = resume(args, manager, job.state)
        first_done, history = int(data_state["step"]), list(data_state["history"])
        window: list[dict[str, float]] = list(data_state["window"])
        if first_done >= job.steps:
            raise UsageError(
                f"--resume: the checkpoint has done {first_done} steps, as many as this run "
                "asks for; ask for more to train further"
            )
        if data_state["loader"] is not None:
            try:
                job.loader.set_state(data_state["loader"])
            except ValueError as e:
                raise UsageError(f"--resume: {e}") from None
    except UsageError:
        if manager is not None:
            manager.close()
        raise
    save_every = args.save_every or job.eval_every
    directory = run_dir(args.run_dir, "train") if is_main else None
    tokens = job.items_per_step if job.unit == "tokens" else 0
    tracker = track.Tracker(
        args,
        directory,
        steps=job.steps - first_done,
        examples_per_step=job.items_per_step if not tokens else args.batch_size,
        tokens_per_step=tokens,
        config={k: v for k, v in vars(args).items() if isinstance(v, int | float | str)},
    )
    step = tracker.wrap(step)
    described = sx.describe(state)
    if is_main:
        out.print(sx.describe(state.params))
        out.print(
            f"train state (params + Adam) per device: "
            f"{described.total_bytes_per_device / 2**10:.1f} KiB of "
            f"{described.total_bytes / 2**10:.1f} KiB"
        )
        out.print(
            f"training {job.title}: {mesh.size} {jax.devices()[0].platform} device(s), "
            f"mesh {dict(mesh.shape)}, plan {args.plan}, mode {args.mode}, "
            f"batch {job.items_per_step} {job.unit}, {job.steps} steps"
        )
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[text]}"),
        TextColumn("{task.fields[rate]:,.0f} " + job.unit + "/s  wait {task.fields[wait]:.0%}"),
        TimeRemainingColumn(),
        console=out,
        disable=not is_main,
    )
    start = time.perf_counter()
    flops = None
    step_seconds: list[float] = []
    feed = tracker.watch(sx.prefetch_to_device(job.loader, sx.batch_sharding(mesh)))
    watchdog = sx.StepWatchdog(args.step_timeout) if args.step_timeout else None
    # From the first step on, a SIGTERM saves (at the step every process agrees on) and stops.
    preemption = sx.watch_preemption()
    with (
        progress,
        feed,
        preemption,
        manager or contextlib.nullcontext(),
        contextlib.closing(tracker),
        watchdog or contextlib.nullcontext(),
    ):
        task = progress.add_task(
            "train", total=job.steps, completed=first_done, text="", rate=0.0, wait=0.0
        )
        pending: list[Any] = []  # this window's metrics, still on device
        window_start, window_first = time.perf_counter(), first_done + 1
        for i in range(first_done + 1, job.steps + 1):
            batch = next(feed)
            if flops is None:
                flops = step_flops(step, state, batch)
            # The first step compiles: not watched. A watched step waits for its loss.
            watched = watchdog.step(i) if watchdog and i > first_done + 1 else None
            with watched or contextlib.nullcontext():
                state, m = step(state, batch)
                if watched:
                    jax.block_until_ready(m["loss"])
            pending.append(m)
            tracker.step(i, m)
            if i % 4 == 0 or i == job.steps:
                now = time.perf_counter()
                progress.update(
                    task,
                    completed=i,
                    text=job.progress(_host(m)),
                    rate=(i - window_first + 1) * job.items_per_step / (now - window_start),
                    wait=tracker.data_wait_fraction,
                )
            evaluate = i % job.eval_every == 0 or i == job.steps
            preempted = sx.checkpoint.reached_preemption(i)  # the same step on every process
            save = manager is not None and (i % save_every == 0 or i == job.steps or preempted)
            if not (evaluate or save or preempted):
                continue
            done = [_host(p) for p in pending]
            for j, d in enumerate(done):  # stop at the first non-finite step, before saving
                sx.train.check_finite(d["loss"], i - len(done) + j + 1)
            window += done
            pending = []
            if evaluate:
                seconds = time.perf_counter() - window_start
                if window_first > first_done + 1:  # the first window includes compilation
                    step_seconds.append(seconds / (i - window_first + 1))
                scores = job.evaluate(state)
                tracker.scalars({k.replace("_", "/", 1): v for k, v in scores.items()})
                note = tracker.input_bound()
                if note and is_main:
                    out.print(f"[yellow]{note}[/]")
                history += job.records(i - len(window) + 1, window, scores, seconds)
                window = []
            if save:
                loader_state = feed.get_state()
                data_state = {"step": i, "history": history, "loader": loader_state,
                              "window": window}  # fmt: skip
                manager.save(i, state, data_state)
            if preempted:
                raise sx.Preempted(i, args.checkpoint_dir)
            if evaluate:
                window_start, window_first = time.perf_counter(), i + 1
    total = time.perf_counter() - start
    if not step_seconds:  # one window only: its time, compilation included
        step_seconds = [total / max(job.steps - first_done, 1)]
    seconds_per_step = float(np.median(step_seconds))
    use = utilization(flops, seconds_per_step, mesh.size if args.mode != "single" else 1)
    if is_main:
        out.print(format_utilization(use))
    shardings = sx.plan.map_arrays(lambda p, x: _spec_text(x), state)
    common = {
        "command": "train",
        "model": args.model,
        "devices": mesh.size,
        "processes": jax.process_count(),
        "platform": jax.devices()[0].platform,
        "device_kind": str(jax.devices()[0].device_kind),
        "mesh": dict(mesh.shape),
        "plan": args.plan,
        "mode": args.mode,
        "precision": args.precision,
        "accumulate": args.accumulate,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "steps": job.steps,
        "resumed_from_step": first_done,
        "state_bytes": described.total_bytes,
        "state_bytes_per_device": described.total_bytes_per_device,
        "checkpoint_dir": args.checkpoint_dir,
        "save_every": save_every if manager is not None else None,
        "seconds": total,
        "seconds_per_step": seconds_per_step,
        f"{job.unit}_per_s": job.items_per_step / seconds_per_step,
        **use,
        "flops_estimate_per_step": job.estimate_flops,
        "flops_estimate_ratio": (
            flops / job.estimate_flops if flops and job.estimate_flops else None
        ),
        "run_dir": str(directory) if directory is not None else None,
        **tracker.summary(),
        "param_specs": {k: v for k, v in _flatten(shardings).items() if k.startswith("params/")},
        "history": history,
    }
    return {**common, **job.summary(common), "history": history}


def _spec_text(x: Any) -> str:
    """The array's PartitionSpec, one entry per dimension (``P()`` when replicated), or
    "one device"."""
    from jax.sharding import PartitionSpec

    spec = getattr(x.sharding, "spec", None)
    if spec is None:
        return "one device"
    if all(entry is None for entry in spec):
        return str(PartitionSpec())
    return str(PartitionSpec(*spec, *[None] * (x.ndim - len(spec))))


def _flatten(tree: Any) -> dict[str, Any]:
    import jax

    from shardax.plan.tree import path_str

    return {path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def plot_curves(
    history: list[dict[str, Any]], path: Any, title: str, x: str, panels: list[tuple[str, str]]
) -> None:
    """One panel per ``(metric, label)``: train and held-out curves against ``x``.

    Each panel plots ``train_<metric>`` and the held-out ``<split>_<metric>`` entries
    (``test_`` or ``val_``) found in ``history``.
    """
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
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _job(args: argparse.Namespace, out: Any) -> tuple[Job, Callable[..., Any]]:
    """The job of ``--model`` and its reporter."""
    if args.model == "gpt":
        from shardax.cli import train_gpt as module
    else:
        from shardax.cli import train_mlp as module  # type: ignore[no-redef]
    return module.make_job(args, out), module


def run(args: argparse.Namespace) -> int:
    """Trains, writes ``summary.json`` and ``curves.png``, prints the result."""
    import jax

    out = console(args)
    check_model_options(args)
    job, module = _job(args, out)
    summary = loop(args, out, job)
    if jax.process_index() == 0:
        directory = Path(summary["run_dir"])
        summary["plot"] = str(directory / "curves.png")
        module.plot(summary, directory / "curves.png")
        (directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if args.json:
            print_json(summary)
        else:
            module.report(summary, out)
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
