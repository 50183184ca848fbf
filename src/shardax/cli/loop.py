"""The training loop of ``shardax train``: one step at a time, with ordered hooks.

:func:`loop` resumes (when asked), builds the hooks (:mod:`shardax.cli.hooks`), runs
the job's steps and returns the run's summary. Everything else a run does (progress,
the metrics window and NaN guard, evaluation, checkpoints, preemption, the watchdog)
is a hook with its own schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardax.cli import track
from shardax.cli.common import STARTED, UsageError, machine, run_dir, step_flops
from shardax.cli.hooks import (
    Checkpoint,
    Evaluation,
    Goodput,
    Hook,
    MetricsWindow,
    Preemption,
    Progress,
    Run,
    Watchdog,
    entered,
)
from shardax.cli.job import Job, data_axes


def resume(args: argparse.Namespace, manager: Any, job: Job) -> tuple[Any, dict[str, Any]]:
    """The state and data state (steps done, history, loader position, the metrics of
    the steps since the last evaluation) to start from; the loader is moved there."""
    fresh = {"step": 0, "history": [], "loader": None, "window": []}
    if not args.resume:
        if manager is not None and manager.latest_step() is not None:
            raise UsageError(
                f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints; pass "
                "--resume to continue from them, or choose an empty directory"
            )
        return job.state, fresh
    if manager is None:
        raise UsageError("--resume needs --checkpoint-dir")
    if manager.latest_step() is None:
        raise UsageError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
    try:
        restored = manager.restore(like=job.state)
    except ValueError as e:
        raise UsageError(f"--resume: the checkpoint does not fit this model: {e}") from None
    data_state = {**fresh, **restored.data_state}
    if data_state["step"] >= job.steps:
        raise UsageError(
            f"--resume: the checkpoint has done {data_state['step']} steps, as many as this "
            "run asks for; ask for more to train further"
        )
    if data_state["loader"] is not None:
        try:
            job.loader.set_state(data_state["loader"])
        except ValueError as e:
            raise UsageError(f"--resume: {e}") from None
    return restored.state, data_state


def start(args: argparse.Namespace, job: Job) -> tuple[Any, Run, Any]:
    """The checkpoint manager (or None), the :class:`Run` to continue, and the tracker."""
    import jax

    import shardax as sx

    manager = None
    if args.checkpoint_dir:
        manager = sx.CheckpointManager(args.checkpoint_dir, async_save=not args.sync_save)
    # Any error before the loop starts (a usage error, a bad --log-dir) closes the manager
    # first, or orbax complains at shutdown.
    try:
        state, data_state = resume(args, manager, job)
        first_done = int(data_state["step"])
        directory = run_dir(args.run_dir, "train") if jax.process_index() == 0 else None
        tokens = job.items_per_step if job.unit == "tokens" else 0
        tracker = track.Tracker(
            args,
            directory,
            steps=job.steps - first_done,
            examples_per_step=job.items_per_step if not tokens else args.batch_size,
            tokens_per_step=tokens,
            config={k: v for k, v in vars(args).items() if isinstance(v, int | float | str)},
        )
        # The step's own placement: rows over data (and the sequence, with its seq_axis).
        seq = getattr(job.step, "seq_axis", None)
        sharding = sx.batch_sharding(job.mesh, data_axes(job.mesh), seq_axis=seq)
        feed = tracker.watch(sx.prefetch_to_device(job.loader, sharding))
    except BaseException:
        if manager is not None:
            manager.close()
        raise
    run = Run(job, state, first_done, list(data_state["history"]), list(data_state["window"]),
              feed, tracker, window_first=first_done + 1, directory=directory)  # fmt: skip
    return manager, run, tracker


def hooks(args: argparse.Namespace, job: Job, run: Run, out: Any, manager: Any) -> list[Hook]:
    """The hooks in the order they run after each step."""
    from shardax.track.goodput import FILE

    later: list[Hook] = [Preemption(), Evaluation(job, out)]
    if manager is not None:
        later.append(Checkpoint(manager, args.save_every or job.eval_every))
    where = args.checkpoint_dir or run.directory
    path = Path(where, FILE) if where is not None and run.directory is not None else None
    # First in, last out: it sees every second; the compilations of start-up count too.
    goodput = Goodput(run, path, since=STARTED, compiled=args.compile_before.seconds)
    first: list[Hook] = [goodput]
    if args.step_timeout:  # a hung step's time is the ledger's "hang"
        first.append(Watchdog(args.step_timeout, lambda i: goodput.ledger.close("hang")))
    return [*first, Progress(job, out, run.first_done), later[0], MetricsWindow(later), *later[1:]]


def loop(args: argparse.Namespace, out: Any, job: Job) -> dict[str, Any]:
    """Runs ``job`` to ``job.steps`` and returns the summary (plain data)."""
    import shardax as sx
    from shardax.runtime import status

    manager, run, tracker = start(args, job)
    describe(out, job, run.state, args)
    step = tracker.wrap(job.step)
    began = time.perf_counter()
    flops = None
    with run.feed, contextlib.closing(tracker), entered(hooks(args, job, run, out, manager)) as hs:
        run.window_start = time.perf_counter()
        for i in range(run.first_done + 1, job.steps + 1):
            status.STATUS.set(status.DATA, i)
            run.i, batch = i, next(run.feed)
            if flops is None:
                flops = step_flops(step, run.state, batch)
            for hook in hs:
                hook.before_step(run)
            run.state, metrics = step(run.state, batch)
            run.pending.append(metrics)
            tracker.step(run.i, metrics)
            for hook in hs:
                hook.after_step(run)
            if run.preempted:
                raise sx.Preempted(run.i, args.checkpoint_dir)
    return summary(args, out, job, run, time.perf_counter() - began, flops, manager)


def describe(out: Any, job: Job, state: Any, args: argparse.Namespace) -> None:
    """Prints the state's placement and what is trained where (process 0)."""
    import jax

    import shardax as sx

    if jax.process_index() != 0:
        return
    described = sx.describe(state)
    out.print(sx.describe(state.params))
    out.print(
        f"train state (params + Adam) per device: "
        f"{described.total_bytes_per_device / 2**10:.1f} KiB of "
        f"{described.total_bytes / 2**10:.1f} KiB"
    )
    out.print(
        f"training {job.title}: {job.mesh.size} {jax.devices()[0].platform} device(s), "
        f"mesh {dict(job.mesh.shape)}, plan {args.plan}, mode {args.mode}, "
        f"batch {job.items_per_step} {job.unit}, {job.steps} steps"
    )


def summary(
    args: argparse.Namespace,
    out: Any,
    job: Job,
    run: Run,
    total: float,
    flops: float | None,
    manager: Any,
) -> dict[str, Any]:
    """The run's summary: settings, timing, utilization, placement and history."""
    import jax

    import shardax as sx
    from shardax.cost.flops import format_utilization, utilization
    from shardax.runtime import compile_stats
    from shardax.track.goodput import fraction

    compiled = compile_stats() - args.compile_before
    buckets = run.ledger.totals()
    step_seconds = run.step_seconds or [total / max(job.steps - run.first_done, 1)]
    seconds_per_step = float(np.median(step_seconds))
    use = utilization(flops, seconds_per_step, job.mesh.size if args.mode != "single" else 1)
    if jax.process_index() == 0:
        out.print(format_utilization(use))
    described = sx.describe(run.state)
    specs = sx.plan.map_arrays(lambda p, x: _spec_text(x), run.state)
    common = {
        "command": "train",
        "model": args.model,
        "devices": job.mesh.size,
        "processes": jax.process_count(),
        **machine(),
        "mesh": dict(job.mesh.shape),
        "plan": args.plan,
        "mode": args.mode,
        "precision": args.precision,
        "accumulate": args.accumulate,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "steps": job.steps,
        "resumed_from_step": run.first_done,
        "state_bytes": described.total_bytes,
        "state_bytes_per_device": described.total_bytes_per_device,
        "checkpoint_dir": args.checkpoint_dir,
        "save_every": (args.save_every or job.eval_every) if manager is not None else None,
        "seconds": total,
        "seconds_per_step": seconds_per_step,
        f"{job.unit}_per_s": job.items_per_step / seconds_per_step,
        **use,
        "flops_estimate_per_step": job.estimate_flops,
        "flops_estimate_ratio": (
            flops / job.estimate_flops if flops and job.estimate_flops else None
        ),
        "run_dir": str(run.directory) if run.directory is not None else None,
        **run.tracker.summary(),
        "compile": {
            "seconds": compiled.seconds,
            "cache_hits": compiled.cache_hits,
            "cache_misses": compiled.cache_misses,
            "cache_dir": args.compile_cache_dir,
        },
        "goodput": {
            "fraction": fraction(buckets),
            "buckets_s": buckets,
            "ledger": str(run.ledger.path) if run.ledger.path else None,
        },
        "param_specs": {k: v for k, v in _flatten(specs).items() if k.startswith("params/")},
        "history": run.history,
    }
    return {**common, **job.summary(common), "history": run.history}


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
