"""The hooks a run calls around each step; each owns one concern and its own schedule.

A [`Run`][shardax.loop.Run] calls every hook, in order:
[`Hook.start`][shardax.loop.Hook.start] on entry,
[`Hook.before_step`][shardax.loop.Hook.before_step] and
[`Hook.after_step`][shardax.loop.Hook.after_step] around each step,
[`Hook.finish`][shardax.loop.Hook.finish] when the loop ends normally, and
[`Hook.close`][shardax.loop.Hook.close] (in reverse order) on exit, error or not. A hook
says with [`Hook.due`][shardax.loop.Hook.due] that it acts after this step and needs the
step metrics on the host; the [`MetricsWindow`][shardax.loop.MetricsWindow] then fetches
every step's metrics since the last fetch in one transfer, before the hooks after it run.
Each method gets the [`Run`][shardax.loop.Run] (``run``).

- [`Goodput`][shardax.loop.Goodput]: the goodput ledger
([`shardax.track.Ledger`][shardax.track.Ledger]);
- [`Watchdog`][shardax.loop.Watchdog]: the hang watchdog
([`shardax.StepWatchdog`][shardax.StepWatchdog]) and its report;
- [`Preemption`][shardax.loop.Preemption]: a SIGTERM makes every process stop at the same step;
- [`MetricsWindow`][shardax.loop.MetricsWindow]: one host transfer per window, and the NaN guard;
- [`Progress`][shardax.loop.Progress]: the progress bar (rich, process 0);
- [`Logging`][shardax.loop.Logging]: train metrics to a
[`shardax.MetricWriter`][shardax.MetricWriter];
- [`Evaluation`][shardax.loop.Evaluation]: evaluates the state every N steps and at the end;
- [`Checkpoints`][shardax.loop.Checkpoints]: saves every N steps, at the end and on preemption, with
the data
  position ([`shardax.CheckpointManager`][shardax.CheckpointManager]).

A hook of one's own: its schedule ([`shardax.loop.itstime`][shardax.loop.itstime]) and its
action; being due, it gets every step's metrics since the last fetch, fetched once:

>>> class Show(sx.loop.Hook):
...     every = 2
...     def due(self, run):
...         return sx.loop.itstime(run.step, self.every)
...     def after_step(self, run):
...         if self.due(run):
...             print(run.step, [step for step, _ in run.flushed])
>>> with sx.loop.Run(state, [sx.loop.MetricsWindow(), Show()]) as run:
...     for batch in run.batches(batches, steps=4):
...         state, metrics = train_step(state, batch)
...         run.after_step(state, metrics)
2 [1, 2]
4 [3, 4]
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from shardax.checkpoint.preemption import reached_preemption, watch_preemption
from shardax.checks import as_count, as_float, as_function, public, received
from shardax.loop.schedule import itstime
from shardax.loop.state import saveable
from shardax.runtime import compile_stats, status
from shardax.runtime.processes import host_reduce
from shardax.runtime.watchdog import StepWatchdog
from shardax.track.goodput import Ledger


@public("sx.loop.Hook")
class Hook:
    """A part of the loop with its own schedule; every method is optional.

    ``every``: the hook's interval in steps (None: only at the last step), read by
    [`due`][shardax.loop.Hook.due] through [`shardax.loop.itstime`][shardax.loop.itstime].
    """

    every: int | None = None
    waits: bool = False
    """True: the hook marks the steps completed itself
    ([`Run.done`][shardax.loop.Run.done]), once it has waited for their results; else the
    run marks each step completed after it."""

    def due(self, run: Any) -> bool:
        """Acts after step ``run.step`` and needs its metrics on the host."""
        return False

    def start(self, run: Any) -> None:
        """On entering the run (the state restored, before the first step)."""

    def before_batch(self, run: Any) -> None:
        """Before the batch of step ``run.step + 1`` is fetched (by
        [`Run.batches`][shardax.loop.Run.batches]; a loop that fetches its own batches has
        no such call)."""

    def before_step(self, run: Any) -> None:
        """Before step ``run.step`` (its batch is fetched)."""

    def after_step(self, run: Any) -> None:
        """After step ``run.step`` (the metrics flushed if a hook was due)."""

    def finish(self, run: Any) -> None:
        """After the last step of a run that ended without an error."""

    def close(self, run: Any) -> None:
        """On leaving the run, error or not (hooks close in reverse order)."""


@public("sx.loop.Goodput")
class Goodput(Hook):
    """Every second of the run in a bucket
    ([`shardax.track.Ledger`][shardax.track.Ledger]): start-up until the first step, then
    steps, with the compile seconds and the input wait moved to their buckets; evaluations
    and the blocking part of saves through [`Run.phase`][shardax.loop.Run.phase]. Kept in
    ``path`` (``<checkpoint dir>/goodput.json``, which ``shardax goodput`` reads; None: in
    memory), saved with every checkpoint and at the end. ``since``: the session's start (a
    ``time.time()``; default: now); ``compiled``: the compile seconds counted before
    ``since``."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        since: float | None = None,
        compiled: float | None = None,
    ) -> None:
        self.path, self.since, self.compiled = path, since, compiled

    def start(self, run: Any) -> None:
        self.ledger = run.ledger = Ledger(self.path, since=self.since)
        self.ledger.count("compile", lambda: compile_stats().seconds, since=self.compiled)
        self.ledger.count("data", lambda: getattr(run.feed, "wait_seconds", 0.0))
        if run.first:
            self.ledger.resumed(run.first)

    def before_step(self, run: Any) -> None:
        if self.ledger.bucket != "step":
            self.ledger.switch("step")

    def close(self, run: Any) -> None:
        self.ledger.close()


@public("sx.loop.Watchdog")
class Watchdog(Hook):
    """A step after the session's first (which compiles) that takes longer than
    ``timeout`` seconds ends the process with code 124, after a line naming the processes
    behind, with their step and phase, and every thread's stack
    ([`shardax.StepWatchdog`][shardax.StepWatchdog]). ``on_fire(step)`` runs first
    (default: the goodput ledger saved with the hung step's time as ``hang``).

    The clock runs from the wait for the step's batch (under
    [`Run.batches`][shardax.loop.Run.batches]), so a stuck loader is named too. It waits
    for the device one step behind: after step N is dispatched, for step N-1's result, so
    the device queue stays fed; a step counts as completed
    ([`Run.done`][shardax.loop.Run.done]) once waited for. When a later hook is due after
    step N (it fetches the metrics or the state anyway), it waits for step N too, and at
    the end for the last step."""

    waits = True

    def __init__(self, timeout: float, on_fire: Any = None) -> None:
        self.timeout = as_float("watchdog (seconds)", timeout, above=0)
        self.on_fire = on_fire
        self._armed = False
        self._behind: tuple[int, Any] | None = None  # a step's result not yet waited for

    def start(self, run: Any) -> None:
        def hang(step: int | None) -> None:
            if run.ledger is not None:
                run.ledger.close("hang")

        self.watchdog = StepWatchdog(self.timeout, on_fire=self.on_fire or hang)
        status.STATUS.probe = self._ready

    def _ready(self) -> int | None:
        """The step not yet waited for, once its result is ready (for the hang report:
        a process stuck before its next step still shows the last step it completed)."""
        behind = self._behind
        return behind[0] if behind is not None and _running(behind) is None else None

    def before_batch(self, run: Any) -> None:
        self._arm(run, run.step + 1)  # the wait for the step's batch counts too

    def before_step(self, run: Any) -> None:
        self._arm(run, run.step)

    def _arm(self, run: Any, step: int) -> None:
        if step > run.first + 1 and not self._armed:
            behind = self._behind
            self.watchdog.arm(step, lambda: _running(behind))
            self._armed = True

    def after_step(self, run: Any) -> None:
        latest = (run.step, (run.pending[-1][1] if run.pending else {}) or _token(run.state))
        waits = [self._behind] if self._behind is not None else []
        if any([hook.due(run) for hook in run.hooks if hook is not self]):
            waits.append(latest)  # the host reads this step now anyway
            self._behind = None
        else:
            self._behind = latest
        if self._armed and waits:
            self._wait(run, waits)
        self._disarm()

    def finish(self, run: Any) -> None:
        if self._behind is not None:
            self._wait(run, [self._behind])
            self._behind = None
        self._disarm()  # also the clock armed for a batch the loader did not have

    def _wait(self, run: Any, waits: list[tuple[int, Any]]) -> None:
        """Waits, under the clock, for these steps' results on the device: the clock this
        step armed (its deadline kept, so every process's watchdog fires about together;
        a hang names the earlier step while its result is computing), else a new one."""
        if not self._armed:
            behind = waits[0]
            self.watchdog.arm(behind[0], lambda: _running(behind))
            self._armed = True
        self.watchdog.phase(status.DEVICE)
        jax.block_until_ready([result for _, result in waits])
        run.done(waits[-1][0])

    def _disarm(self) -> None:
        """Stops the clock. The armed step is not recorded as completed: it may still be
        computing (one step behind); [`Run.done`][shardax.loop.Run.done] records what was waited
        for."""
        if self._armed:
            self.watchdog.disarm(completed=False)
            self._armed = False

    def close(self, run: Any) -> None:
        self._disarm()
        if status.STATUS.probe == self._ready:
            status.STATUS.probe = None
        self.watchdog.close()


def _token(state: Any) -> Any:
    """What to wait on for the step that made ``state`` when it gave no scalar metrics:
    one element of its smallest array on one device, copied by a tiny op queued behind
    the step. The state itself may be donated to the next step before it is waited for,
    and a donated array cannot be waited on. (NNX objects updated in place, with no
    arrays among their leaves, are returned as they are.)"""
    arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array) and x.size]
    if not arrays:
        return state
    smallest = min(arrays, key=lambda x: x.size).addressable_shards[0].data
    return smallest.reshape(-1)[:1]


def _running(result: tuple[int, Any] | None) -> int | None:
    """The step of ``result`` (``(step, its arrays)``) while still computing, else None."""
    if result is None:
        return None
    leaves = jax.tree.leaves(result[1])
    ready = all(leaf.is_ready() for leaf in leaves if isinstance(leaf, jax.Array))
    return None if ready else result[0]


@public("sx.loop.Preemption")
class Preemption(Hook):
    """From the first step on, a SIGTERM makes every process stop at the same step
    ([`shardax.checkpoint.reached_preemption`][shardax.checkpoint.reached_preemption]);
    the [`Checkpoints`][shardax.loop.Checkpoints] hook saves it, then the run raises
    [`shardax.Preempted`][shardax.Preempted] (exit code 75)."""

    def start(self, run: Any) -> None:
        self.watch = watch_preemption()

    def after_step(self, run: Any) -> None:
        run.preempted = reached_preemption(run.step)  # the same step everywhere

    def due(self, run: Any) -> bool:
        return run.preempted

    def close(self, run: Any) -> None:
        self.watch.close()


@public("sx.loop.MetricsWindow")
class MetricsWindow(Hook):
    """When a later hook is due, fetches the metrics of every step since the last fetch in
    one device-to-host transfer ([`Run.flush`][shardax.loop.Run.flush]), and is the NaN
    guard: each fetched step's loss must be finite before anything is logged, evaluated or
    saved ([`shardax.train.check_finite`][shardax.train.check_finite] names the step)."""

    def after_step(self, run: Any) -> None:
        later = run.hooks[run.hooks.index(self) + 1 :]
        if any([hook.due(run) for hook in later]):
            run.flush()

    def finish(self, run: Any) -> None:
        run.flush()


@public("sx.loop.Progress")
class Progress(Hook):
    """A progress bar (rich; process 0): the step each step, and the metrics of the
    last step fetched whenever the window is (so it adds no transfer of its own), or
    every ``every`` steps when given."""

    def __init__(self, every: int | None = None, console: Any = None) -> None:
        self.every, self.console = every, console

    def columns(self) -> list[Any]:
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn  # not at start-up

        return [
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[text]}"),
            TimeRemainingColumn(),
        ]

    def fields(self, run: Any) -> dict[str, Any]:
        """The bar's fields after a fetch (default: the last fetched metrics as text)."""
        metrics = run.flushed[-1][1]
        return {"text": "  ".join(f"{k} {v:.4g}" for k, v in metrics.items())}

    def due(self, run: Any) -> bool:
        return bool(self.every) and itstime(run.step, self.every)

    def start(self, run: Any) -> None:
        from rich.progress import Progress as Bar  # not loaded by import shardax

        self.bar = Bar(*self.columns(), console=self.console, disable=jax.process_index() != 0)
        self.task = self.bar.add_task(
            "train",
            total=run.total,
            completed=run.first,
            **dict.fromkeys(self.blank(), 0.0),
            text="",
        )
        self.bar.__enter__()

    def blank(self) -> tuple[str, ...]:
        """The numeric fields [`fields`][shardax.loop.Progress.fields] fills (shown as 0 until the
        first fetch)."""
        return ()

    def after_step(self, run: Any) -> None:
        fields = self.fields(run) if run.flushed else {}
        self.bar.update(self.task, total=run.total, completed=run.step, **fields)

    def close(self, run: Any) -> None:
        self.bar.__exit__(None, None, None)


@public("sx.loop.Logging")
class Logging(Hook):
    """Every ``every`` steps and at the last, the step's scalar metrics as
    ``train/<name>`` to ``run.writer`` (a [`shardax.MetricWriter`][shardax.MetricWriter]), from the
    fetched window: no transfer of its own."""

    def __init__(self, every: int | None = 10) -> None:
        self.every = every

    def due(self, run: Any) -> bool:
        return run.writer is not None and itstime(run.step, self.every, run.total)

    def after_step(self, run: Any) -> None:
        if self.due(run):
            self.log(run)

    def log(self, run: Any) -> None:
        step, metrics = run.flushed[-1]
        run.writer.write(step, {f"train/{k}": v for k, v in metrics.items()})


@public("sx.loop.Evaluation")
class Evaluation(Hook):
    """Every ``every`` steps and at the last: ``evaluate(state) -> {name: number}``
    in the ledger's ``eval`` bucket; the scores (with the goodput figures) go to
    ``run.writer`` and to ``run.scores``."""

    def __init__(self, evaluate: Any, every: int | None = None) -> None:
        self.evaluate = as_function("evaluate", evaluate, "a function state -> {name: number}")
        self.every = every
        self.done_at: int | None = None

    def due(self, run: Any) -> bool:
        return itstime(run.step, self.every, run.total)

    def after_step(self, run: Any) -> None:
        if self.due(run):
            self.run(run)

    def finish(self, run: Any) -> None:
        if self.done_at != run.step and run.step > run.first and run.handed == run.step:
            self.run(run)

    def run(self, run: Any) -> None:
        with run.phase("eval"):
            scores = self.evaluate(run.state)
        if not isinstance(scores, Mapping):
            raise TypeError(
                f"evaluate must return a dict {{name: number}} of scores, got "
                f"{received(scores)}; return e.g. {{'accuracy': accuracy}}"
            )
        scores = dict(scores)
        self.done_at = run.step
        run.scores = scores
        self.record(run, scores)

    def record(self, run: Any, scores: dict[str, Any]) -> None:
        """Writes the scores and the goodput figures to ``run.writer``."""
        if run.writer is not None:
            goodput = run.ledger.scalars() if run.ledger is not None else {}
            run.writer.write(run.step, {**scores, **goodput})


@public("sx.loop.Every")
class Every(Hook):
    """Calls ``fn(run)`` every ``every`` steps and at the last, with the metrics of every
    step since the last fetch in ``run.flushed`` (fetched once): a function as a hook,
    for ``sx.loop.run(..., hooks=[...])``, as levanter's ``add_hook(fn, every=N)``.

    >>> seen = []
    >>> every_2 = sx.loop.Every(lambda run: seen.append(run.step), every=2)
    >>> with sx.loop.run({"w": jnp.zeros(2)}, hooks=[every_2]) as run:
    ...     for batch in run.batches(range(3)):  # the last step: the loader's end
    ...         run.after_step(run.state, jnp.float32(batch))
    >>> seen
    [2, 3]
    """

    def __init__(self, fn: Any, every: int | None = None) -> None:
        self.fn = as_function("fn", fn, "a function run -> None")
        self.every = None if every is None else as_count("every", every)
        self.done_at: int | None = None

    def start(self, run: Any) -> None:
        self.done_at = None  # a hook handed to a second run starts afresh

    def due(self, run: Any) -> bool:
        return itstime(run.step, self.every, run.total)

    def after_step(self, run: Any) -> None:
        if self.due(run):
            self.fn(run)
            self.done_at = run.step

    def finish(self, run: Any) -> None:
        if self.done_at != run.step and run.step > run.first and run.handed == run.step:
            self.fn(run)  # the last step, where the run did not know it was the last
            self.done_at = run.step


@public("sx.loop.Checkpoints")
class Checkpoints(Hook):
    """Every ``every`` steps, at the last and on preemption: saves the state with the data
    position ([`Run.data_state`][shardax.loop.Run.data_state]) through ``run.manager``
    ([`shardax.CheckpointManager`][shardax.CheckpointManager]), in the ledger's
    ``checkpoint`` bucket, and the ledger beside it. At the end it saves only the state of
    the last step (``Run.handed``), never an older one under the last step's number. On
    closing, waits for the save in flight. A save that fails (a full disk) raises the
    manager's ``OSError`` with the way out, naming ``option`` (the argument that chose the
    directory: ``sx.loop.run`` says ``checkpoints=``; None: as it is)."""

    def __init__(self, every: int | None = None, option: str | None = None) -> None:
        self.every = every
        self.option = option  # what chose the directory, named when a save fails
        self.saved_at: int | None = None

    def due(self, run: Any) -> bool:
        return itstime(run.step, self.every, run.total) or run.preempted

    def after_step(self, run: Any) -> None:
        if self.due(run):
            self.save(run)

    def finish(self, run: Any) -> None:
        if self.saved_at != run.step and run.step > run.first and run.handed == run.step:
            self.save(run)

    def save(self, run: Any) -> None:
        with run.phase("checkpoint"), self._naming(run):  # the blocking part of an async save
            # One asynchronous save at a time: two managers' saves in flight at once run
            # orbax's cross-process barriers side by side, and they collide by name.
            if getattr(run, "snapshots", None) is not None:
                run.snapshots.wait()
            run.manager.save(run.step, saveable(run.state), run.data_state())
        self.saved_at = run.step
        run.done(run.step)  # the save fetched the step's state
        if run.ledger is not None:
            run.ledger.save()

    def close(self, run: Any) -> None:
        with run.phase("checkpoint"), self._naming(run):
            run.manager.wait()  # the save in flight

    @contextlib.contextmanager
    def _naming(self, run: Any) -> Iterator[None]:
        """A save that failed (a full disk) says which argument chose its directory."""
        try:
            yield
        except OSError as e:
            if self.option is None or type(e) is not OSError:
                raise
            raise OSError(
                f"{e}. Free space in {run.manager.directory}, or pass another directory as "
                f"{self.option}"
            ) from e


@public("sx.loop.Snapshots")
class Snapshots(Checkpoints):
    """Every ``every`` steps: a snapshot of the state and the data position in
    ``manager``, a [`shardax.CheckpointManager`][shardax.CheckpointManager] of its own in
    host memory (``shardax launch --max-restarts`` owns one in ``/dev/shm``, which
    outlives a process). Asynchronous: the step goes on while the arrays are written; a
    snapshot cut short by a kill is not committed, and the one before it stays
    restorable. After a failure, the restarted processes resume from the newest of the
    snapshots and the persistent checkpoints. Not taken on preemption or at the end: the
    persistent checkpoint is (``Checkpoints``). ``shardax train --snapshot-every`` adds it.

    Every step (``every`` 1), a failure loses at most one step: under
    [`Run.batches`][shardax.loop.Run.batches] the next step starts once the last snapshot
    is committed (the write overlaps the steps between snapshots, none when there are
    none; a loop that fetches its own batches starts its step before the run hears of it,
    so there a write longer than a step can cost two).

    ``every=None`` (auto) snapshots every step while a snapshot's blocking part (its copy
    to the host, and the wait for its commit before the next step) costs at most
    ``budget`` of a step's time (measured: the median of the last 20 steps, from one
    call's return to the next), else every ``ceil(snapshot / (budget * step))`` steps,
    tuned after each snapshot, the largest of every process's (they snapshot together);
    ``every`` holds the interval in force.
    """

    def __init__(self, manager: Any, every: int | None = 1, budget: float = 0.05) -> None:
        super().__init__(every or 1)
        self.manager, self.auto, self.budget = manager, every is None, budget
        self.snapshot_s: float | None = None  # the last snapshot's blocking time
        self._steps: list[float] = []  # the last step times
        self._end: float | None = None
        self._waited = 0.0  # this step's wait for the last snapshot's commit

    def due(self, run: Any) -> bool:
        return itstime(run.step, self.every, run.total) and run.step != run.total

    def before_step(self, run: Any) -> None:
        if self.every != 1 or self.saved_at != run.step - 1:
            return
        # The snapshot of the step before commits before this step starts: a failure in
        # this step then loses this step only (the write of a snapshot longer than a step
        # would otherwise leave two completed steps behind the newest committed one).
        start = time.perf_counter()
        with run.phase("checkpoint"):
            self.manager.wait()
        status.STATUS.set(status.DISPATCH, run.step)
        self._waited = time.perf_counter() - start

    def after_step(self, run: Any) -> None:
        now = time.perf_counter()
        if self._end is not None:  # since the last call returned: the step, no snapshot
            self._steps = [*self._steps[-19:], now - self._end - self._waited]
        waited, self._waited = self._waited, 0.0
        if self.due(run):
            self.save(run)
            self.snapshot_s = time.perf_counter() - now + waited
            if self.auto and self._steps:
                step = statistics.median(self._steps)
                every = max(1, math.ceil(self.snapshot_s / (self.budget * step)))
                # Every process snapshots at the same steps (orbax saves together): the
                # slowest's interval. Each is here at the same step, after the same save.
                self.every = int(host_reduce(np.int64(every), "max"))
        self._end = time.perf_counter()

    def finish(self, run: Any) -> None:
        pass

    def save(self, run: Any) -> None:
        status.STATUS.flush()  # a kill during the snapshot counts this step as lost
        with run.phase("checkpoint"):  # the blocking part: the copy to the host
            if run.manager is not None:
                run.manager.wait()  # one asynchronous save at a time (Checkpoints.save)
            self.manager.save(run.step, saveable(run.state), run.data_state())
        self.saved_at = run.step

    def close(self, run: Any) -> None:
        with run.phase("checkpoint"):
            self.manager.wait()


ORDER = (
    "watchdog",
    "goodput",
    "preemption",
    "metrics",
    "progress",
    "logging",
    "checkpoints",
    "snapshots",
    "evaluation",
    "yours",
)
"""The order hooks run in, written once (``in_order``, which ``sx.loop.run`` and ``shardax
train`` build their hooks with): the watchdog first (under it a step counts as completed,
in the ledger too, once it waited for the step's result, one step behind), the goodput
ledger, preemption, the metrics window (it fetches for the hooks after it), the progress
bar, logging, the saves (checkpoints, then host-memory snapshots) before the evaluation of
the same step (an ``evaluate`` that raises never costs a save), and last your own hooks,
in the order given."""


def in_order(
    *,
    watchdog: Hook | None = None,
    goodput: Hook | None = None,
    progress: Hook | None = None,
    logging: Hook | None = None,
    checkpoints: Hook | None = None,
    snapshots: Hook | None = None,
    evaluation: Hook | None = None,
    yours: tuple[Hook, ...] | list[Hook] = (),
) -> list[Hook]:
    """The hooks given (None: not in this run), with preemption and the metrics window,
    in ``ORDER`` (its names are this function's keywords, ``metrics`` and ``preemption``
    its own).

    >>> [type(h).__name__ for h in in_order(logging=Logging(), yours=[Every(print, 5)])]
    ['Preemption', 'MetricsWindow', 'Logging', 'Every']
    """
    given = {**locals(), "preemption": Preemption(), "metrics": MetricsWindow()}
    hooks = [given[name] for name in ORDER if name != "yours"]
    return [hook for hook in hooks if hook is not None] + list(yours)


def usual_hooks(
    every: dict[str, int | None],
    *,
    watchdog: float | None,
    goodput: str | bool | None,
    progress: bool,
    logging: bool,
    evaluate: Any,
    checkpoints: bool,
    snapshots: Hook | None = None,
    yours: tuple[Hook, ...] | list[Hook] = (),
) -> list[Hook]:
    """The hooks ``sx.loop.run`` adds, in ``ORDER``: the watchdog (``watchdog`` seconds),
    the goodput ledger (at the path ``goodput``; None: in memory; False: none), then as
    asked the progress bar, logging every ``every["log"]`` steps (10 by default),
    checkpoints every ``every["save"]``, ``snapshots``, evaluation every
    ``every["eval"]``, and ``yours``."""
    return in_order(
        watchdog=Watchdog(watchdog) if watchdog is not None else None,
        goodput=Goodput(goodput or None) if goodput is not False else None,
        progress=Progress() if progress else None,
        logging=Logging(every.get("log", 10)) if logging else None,
        checkpoints=Checkpoints(every.get("save"), option="checkpoints=") if checkpoints else None,
        snapshots=snapshots,
        evaluation=Evaluation(evaluate, every.get("eval")) if evaluate is not None else None,
        yours=yours,
    )
