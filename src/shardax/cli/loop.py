"""The training loop of ``shardax train``: the library's loop ([`shardax.loop`][shardax.loop]).

``loop`` resumes (when asked), builds the hooks (the library's, and the command's
own in ``shardax.cli.hooks``), runs the job's steps and returns the run's summary.
Everything a run does around its steps (progress, the metrics window and NaN guard,
evaluation, checkpoints, preemption, the watchdog, the goodput ledger, logging) is a
hook with its own schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

import shardax as sx
from shardax.checkpoint import Restored
from shardax.cli import track
from shardax.cli.common import STARTED, UsageError, machine, run_dir, step_flops
from shardax.cli.hooks import Bar, History, Log, Record
from shardax.cli.job import Job, data_axes
from shardax.cli.recovery import snapshot_every, snapshot_manager
from shardax.cost.flops import format_utilization, utilization
from shardax.loop import Checkpoints, Goodput, Hook, Run, Watchdog
from shardax.loop.driver import refuse_earlier_run
from shardax.loop.hooks import Snapshots, in_order
from shardax.loop.recovery import Recovery, newest
from shardax.loop.recovery import history as recovery_history
from shardax.plan.tree import map_arrays, path_str
from shardax.runtime import compile_stats, faults
from shardax.track.goodput import FILE, fraction, load
from shardax.train.compiler import ENVIRONMENT
from shardax.train.explanation.placement import step_placement


def resume(
    args: argparse.Namespace,
    manager: Any,
    job: Job,
    snapshots: Any = None,
    recovery: Recovery | None = None,
) -> Any:
    """The checkpoint to continue from (``Restored``: state, data state with the steps
    done, history and the metrics since the last evaluation), the loader moved there;
    or False. A run that ``shardax launch`` restarted resumes from the newest of the
    snapshots and the checkpoints (``recovery``), as if ``--resume`` were given."""
    source = manager
    if recovery is not None and recovery.restart:
        chosen = newest(manager, snapshots)
        if chosen is None:  # it failed before its first save: it starts afresh
            recovery.restored(0, "nothing (no snapshot or checkpoint yet): from step 0")
            return False
        source, words = chosen
        recovery.restored(source.latest_step(), words)
        if jax.process_index() == 0:
            print(
                f"shardax train: restart {recovery.restart}: resuming from step "
                f"{source.latest_step()}, {words}",
                flush=True,
            )
    elif not args.resume:
        try:
            refuse_earlier_run(manager, f"--checkpoint-dir {args.checkpoint_dir}", "--resume")
        except ValueError as e:
            raise UsageError(str(e)) from None
        return False
    elif manager is None:
        raise UsageError("--resume needs --checkpoint-dir")
    elif manager.latest_step() is None:
        raise UsageError(f"--resume: no checkpoint in --checkpoint-dir {args.checkpoint_dir}")
    try:
        restored = source.restore(like=job.state)
    except ValueError as e:
        raise UsageError(f"--resume: the checkpoint does not fit this model: {e}") from None
    data_state = {"step": 0, "history": [], "loader": None, "window": [], **restored.data_state}
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
    # The loader is moved already (its prefetch starts from there).
    return Restored(restored.state, {**data_state, "loader": None}, restored.step)


def start(
    args: argparse.Namespace, job: Job, snapshots: Any = None, recovery: Recovery | None = None
) -> tuple[Any, Any, Any, Any, Record]:
    """The checkpoint manager (or None), the checkpoint to resume from (or False), the
    run directory, the placed batches and the ``Record`` to continue."""
    manager = None
    if args.checkpoint_dir:
        manager = sx.CheckpointManager(args.checkpoint_dir, async_save=not args.sync_save)
    # Any error before the loop starts (a usage error, a bad --log-dir) closes the manager
    # first, or orbax complains at shutdown.
    try:
        restored = resume(args, manager, job, snapshots, recovery)
        data_state = restored.data_state if restored else {"step": 0}
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
        if hasattr(job.step, "islands"):  # --islands: the rows over the islands too
            sharding = job.step.batch_sharding
        feed = tracker.watch(sx.prefetch_to_device(job.loader, sharding))
    except BaseException:
        for owned in (manager, snapshots):
            if owned is not None:
                owned.close()
        raise
    record = Record(
        job,
        tracker,
        list(data_state.get("history", [])),
        list(data_state.get("window", [])),
        window_first=first_done + 1,
    )
    return manager, restored, directory, feed, record


def hooks(
    args: argparse.Namespace, record: Record, out: Any, manager: Any, path: Any, snapshots: Any
) -> list[Hook]:
    """The hooks in the order they run after each step (``shardax.loop.hooks.ORDER``)."""
    if path is not None:  # a corrupt goodput.json is one line, before the run starts
        try:
            load(path)
        except ValueError as e:
            raise UsageError(str(e)) from None
    record.snapshots = None if snapshots is None else Snapshots(snapshots, snapshot_every(args))
    every = args.save_every or record.job.eval_every
    return in_order(
        watchdog=Watchdog(args.step_timeout) if args.step_timeout else None,
        # The ledger counts from the process's start: the compilations of start-up count too.
        goodput=Goodput(path, since=STARTED, compiled=args.compile_before.seconds),
        progress=Bar(record, out),
        logging=Log(record),
        checkpoints=None if manager is None else Checkpoints(every, "--checkpoint-dir"),
        snapshots=record.snapshots,
        evaluation=History(record, out),
    )


def loop(args: argparse.Namespace, out: Any, job: Job) -> dict[str, Any]:
    """Runs ``job`` to ``job.steps`` and returns the summary (plain data)."""
    try:
        faults.planned(os.environ.get(faults.ENV_FAULT))
    except ValueError as e:
        raise UsageError(str(e)) from None
    recovery = Recovery()
    faults.at_start(recovery.restart)  # a place a "lost" fault took stays lost
    snapshots = snapshot_manager(args, job.state)
    manager, restored, directory, feed, record = start(args, job, snapshots, recovery)
    where = args.checkpoint_dir or directory
    path = Path(where, FILE) if where is not None and directory is not None else None
    run = Run(
        job.state,
        hooks(args, record, out, manager, path, snapshots),
        manager=manager,
        snapshots=snapshots,
        total=job.steps,
        resume=restored,
        data_state=record.data_state,
        writer=record.tracker.writer,
        exit_on_preemption=False,
        resume_hint="continue it with --resume",
    )
    describe(out, job, restored.state if restored else job.state, args)
    step = record.tracker.wrap(job.step)
    began, flops, kernel = time.perf_counter(), None, None
    closing = manager if manager is not None else contextlib.nullcontext()
    owned = snapshots if snapshots is not None else contextlib.nullcontext()
    with closing, owned, feed, contextlib.closing(record.tracker), run:
        record.window_start = time.perf_counter()
        for batch in run.batches(feed):
            if flops is None:
                flops, kernel = step_flops(step, run.state, batch, with_attention=True)
            state, metrics = step(run.state, batch)
            if recovery.restart and recovery.restored_step is not None:
                jax.block_until_ready(metrics)  # once: the first step after a restart
                recovery.first_step_done(run.step + 1)
                recovery.restored_step = None
            run.after_step(state, metrics)
            faults.inject(run.step, jax.process_index(), recovery.restart)
    return summary(
        args, out, job, run, record, directory, time.perf_counter() - began, flops, kernel
    )


def describe(out: Any, job: Job, state: Any, args: argparse.Namespace) -> None:
    """Prints the state's placement and what is trained where (process 0)."""
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
    out.print(f"XLA compiler options: {getattr(job.step, 'compiler_summary', 'unknown')}")


def summary(
    args: argparse.Namespace,
    out: Any,
    job: Job,
    run: Run,
    record: Record,
    directory: Any,
    total: float,
    flops: float | None,
    kernel: str | None = None,
) -> dict[str, Any]:
    """The run's summary: settings, timing, utilization, placement and history
    (``attention_kernel``: the fused attention kernel the step compiled to, or dense)."""
    compiled = compile_stats() - args.compile_before
    buckets = run.ledger.totals()
    step_seconds = record.step_seconds or [total / max(job.steps - run.first, 1)]
    seconds_per_step = float(np.median(step_seconds))
    use = utilization(flops, seconds_per_step, job.mesh.size if args.mode != "single" else 1)
    if jax.process_index() == 0:
        out.print(format_utilization(use))
    described = sx.describe(run.state)
    specs = map_arrays(lambda p, x: _spec_text(x), run.state)
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
        "resumed_from_step": run.first,
        "restarts": recovery_history(),
        "snapshot_every": getattr(getattr(record, "snapshots", None), "every", 0),
        "state_bytes": described.total_bytes,
        "state_bytes_per_device": described.total_bytes_per_device,
        "checkpoint_dir": args.checkpoint_dir,
        "save_every": (args.save_every or job.eval_every) if run.manager is not None else None,
        "seconds": total,
        "seconds_per_step": seconds_per_step,
        f"{job.unit}_per_s": job.items_per_step / seconds_per_step,
        **use,
        "flops_estimate_per_step": job.estimate_flops,
        "attention_kernel": kernel,
        "compiler": compiler_record(job.step, getattr(args, "environment_set", {})),
        "flops_estimate_ratio": (
            flops / job.estimate_flops if flops and job.estimate_flops else None
        ),
        "run_dir": str(directory) if directory is not None else None,
        **record.tracker.summary(),
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
        "placement": _placement(job.step, run.state),
        "history": record.history,
    }
    return {**common, **job.summary(common), "history": record.history}


def _placement(step: Any, state: Any) -> dict[str, Any] | None:
    """The state's split against the step's plan's intent (sx.explain's placement)."""
    found = step_placement(step, state)
    return None if found is None else found.to_dict()


def compiler_record(step: Any, environment_set: dict[str, str]) -> dict[str, Any]:
    """What the step compiled with: the ``compiler_options`` setting, the XLA options it
    resolved to, and the environment they need (``shardax.train.compiler.ENVIRONMENT``)
    as it was in this process, with the variables ``shardax train`` set itself."""
    config = getattr(step, "config", None)
    return {
        "setting": getattr(config, "compiler_options", None),
        "options": dict(getattr(step, "compiler_options", {}) or {}),
        "summary": getattr(step, "compiler_summary", None),
        "environment": {k: os.environ.get(k) for k in ENVIRONMENT},
        "environment_set_by_shardax": dict(environment_set),
    }


def _spec_text(x: Any) -> str:
    """The array's PartitionSpec, one entry per dimension (``P()`` when replicated), or
    "one device"."""
    spec = getattr(x.sharding, "spec", None)
    if spec is None:
        return "one device"
    if all(entry is None for entry in spec):
        return str(PartitionSpec())
    return str(PartitionSpec(*spec, *[None] * (x.ndim - len(spec))))


def _flatten(tree: Any) -> dict[str, Any]:
    return {path_str(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}
