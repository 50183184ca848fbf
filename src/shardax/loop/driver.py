"""The driver: a run of the user's own steps, with hooks around each (:mod:`.hooks`).

:func:`run` builds the usual hooks from a few arguments; the user's loop keeps its
step and adds three lines:

>>> with sx.loop.run(state, checkpoints=tmp_path / "ckpt", every={"save": 2}) as run:
...     state = run.state  # the latest checkpoint's, when there is one
...     for batch in run.batches(batches, steps=3):
...         state, metrics = train_step(state, batch)
...         run.after_step(state, metrics)
>>> sx.CheckpointManager(tmp_path / "ckpt").all_steps()
[2, 3]

Entering the run restores the latest checkpoint (state, steps done and the loader's
position); :meth:`Run.batches` moves the loader there and counts the steps;
:meth:`Run.after_step` hands the new state and metrics to the hooks. A SIGTERM saves
at a step every process agrees on, then ends the process with exit code 75
(:class:`shardax.Preempted`); leaving the block normally saves the last step.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from shardax.checks import as_bool, as_count, public
from shardax.loop.hooks import (
    Checkpoints,
    Evaluation,
    Goodput,
    Hook,
    Logging,
    MetricsWindow,
    Preemption,
    Progress,
    Watchdog,
)
from shardax.loop.state import restore_into, saveable
from shardax.runtime import status

EVERY = ("save", "eval", "log")
"""The periodic actions :func:`run` schedules (``every={"save": 1000, ...}``)."""


@public("sx.loop.Run")
class Run:
    """A training run: the state, the steps done, the metrics window, and the hooks.

    Args:
        state: the state to train and save: a ``sx.TrainState``, any pytree of arrays,
            or NNX objects (``(model, optimizer)``, restored in place).
        hooks: the hooks, in the order they run after each step (:mod:`.hooks`).
        manager: the :class:`shardax.CheckpointManager` to resume from and save to.
        total: the run's last step, when known (else the loader's end is).
        resume: restore the manager's latest checkpoint when there is one (True), start
            afresh (False), or continue from a ``Restored`` the caller already has.
        data_state: ``() -> dict`` of JSON values saved beside the steps done and the
            loader position (restored as ``run.restored``).
        writer: the :class:`shardax.MetricWriter` the logging and evaluation hooks use.
        exit_on_preemption: after the save on a SIGTERM, end the process with exit code
            75 (else :class:`shardax.Preempted` propagates).
        window: the most steps whose metrics wait on the device: after that many steps
            with no fetch (no hook due), they are fetched and checked in one transfer
            before the hooks run, so :attr:`pending` stays bounded.

    Attributes:
        state: the state after the last step (the restored one before the first).
        step: the current step (from 1); after it, the steps done.
        first: the steps done before this session (resumed from a checkpoint).
        completed: the last step known completed (:meth:`done`): the step itself, or the
            step before it under a :class:`~shardax.loop.Watchdog`, which waits one behind.
        restored: the checkpoint's data state (``{"step": ..., "loader": ...}``), or {}.
        flushed: ``[(step, {name: float})]`` fetched after this step (empty when no hook
            was due); ``scores``: the last evaluation's.
    """

    def __init__(
        self,
        state: Any,
        hooks: list[Hook],
        *,
        manager: Any = None,
        total: int | None = None,
        resume: Any = True,
        data_state: Any = None,
        writer: Any = None,
        exit_on_preemption: bool = True,
        window: int = 1000,
    ) -> None:
        self.state, self.hooks, self.manager, self.writer = state, list(hooks), manager, writer
        self.total = None if total is None else as_count("steps", total, minimum=0)
        self.resume, self._extra = resume, data_state
        self.exit_on_preemption = as_bool("exit_on_preemption", exit_on_preemption)
        self.window = as_count("window", window)
        self.step = self.first = self.completed = 0
        self.restored: dict[str, Any] = {}
        self.pending: list[tuple[int, dict[str, Any]]] = []
        self.flushed: list[tuple[int, dict[str, float]]] = []
        self.scores: dict[str, Any] = {}
        self.preempted = self._in_step = False
        self.ledger: Any = None
        self.feed: Any = None
        self._stack = contextlib.ExitStack()
        self._owned = contextlib.ExitStack()  # closed after the hooks (run() fills it)

    # --- entering and leaving -------------------------------------------------------

    def __enter__(self) -> Run:
        try:
            restored = self.resume
            latest = self.manager is not None and self.manager.latest_step() is not None
            if restored is True and latest:
                restored = self.manager.restore(like=saveable(self.state))
            if not (isinstance(restored, bool) or restored is None):
                self.state = restore_into(self.state, restored.state)
                self.restored = dict(restored.data_state or {})
                self.step = self.first = int(self.restored.get("step", restored.step))
                self.completed = self.first
            status.STATUS.completed(self.completed)
            self._stack.__enter__()
            for hook in self.hooks:
                hook.start(self)
                self._stack.callback(hook.close, self)
        except BaseException:
            self._stack.__exit__(*sys.exc_info())
            self._owned.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        from shardax.checkpoint.preemption import Preempted

        with self._owned:  # what run() opened for this run, closed last
            try:
                if kind is None:
                    for hook in self.hooks:
                        hook.finish(self)
            except BaseException:
                self._stack.__exit__(*sys.exc_info())
                raise
            self._stack.__exit__(kind, error, tb)
        if isinstance(error, Preempted) and self.exit_on_preemption:
            sys.stderr.write(f"{error}\n")
            sys.stderr.flush()
            raise SystemExit(error.exit_code) from None
        return False

    # --- the loop ---------------------------------------------------------------------

    def batches(
        self, loader: Iterable[Any], mesh: Any = None, *, steps: int | None = None
    ) -> Iterator[Any]:
        """The batches of ``loader``, moved to the checkpoint's position first (it needs
        ``set_state``, as ``sx.batches`` has), placed and prefetched on ``mesh`` (a mesh
        or a sharding) when given, until ``steps`` (or the run's total) steps are done
        or the loader ends."""
        total = self.total if steps is None else as_count("steps", steps, minimum=0)
        self.total = total
        position = self.restored.get("loader")
        if position is not None:
            if not callable(getattr(loader, "set_state", None)):
                raise TypeError(
                    f"loader must have set_state() to resume at the checkpoint's position, "
                    f"got a {type(loader).__qualname__}; pass the unplaced loader "
                    "(sx.batches) and mesh=, so it is moved before it is prefetched"
                )
            loader.set_state(position)
        return self._steps(loader, mesh, total)

    def _steps(self, loader: Any, mesh: Any, total: int | None) -> Iterator[Any]:
        from shardax.data import prefetch_to_device, timed

        with contextlib.ExitStack() as owned:
            if mesh is not None:
                feed = owned.enter_context(prefetch_to_device(loader, mesh))
            else:
                feed = loader if hasattr(loader, "wait_seconds") else timed(loader)
            self.feed = feed
            while total is None or self.step < total:
                status.STATUS.set(status.DATA, self.step + 1)
                for hook in self.hooks:
                    hook.before_batch(self)
                try:
                    batch = next(feed)
                except StopIteration:
                    return
                self.before_step()
                yield batch

    def before_step(self) -> None:
        """Starts the next step (:meth:`batches` calls it for each batch)."""
        self.step += 1
        self._in_step = True
        status.STATUS.set(status.DISPATCH, self.step)
        for hook in self.hooks:
            hook.before_step(self)

    def after_step(self, state: Any, metrics: Any = None) -> None:
        """Hands the step's new ``state`` and ``metrics`` (a dict of scalars, or the
        loss) to the hooks; raises :class:`shardax.Preempted` once a SIGTERM's step is
        saved."""
        from shardax.checkpoint.preemption import Preempted

        if not self._in_step:
            self.before_step()  # a loop that does not take its batches from batches()
        self._in_step = False
        self.state = state
        if metrics is not None and not isinstance(metrics, dict):
            metrics = {"loss": metrics}
        scalars = {k: v for k, v in (metrics or {}).items() if np.ndim(v) == 0}
        self.pending.append((self.step, scalars))
        self.flushed = []
        if len(self.pending) >= self.window:  # no hook was due for a whole window
            self.flush()
        if not any(hook.waits for hook in self.hooks):
            self.done(self.step)
        for hook in self.hooks:
            hook.after_step(self)
        if self.preempted:
            directory = self.manager.directory if self.manager is not None else None
            raise Preempted(self.step, directory)

    # --- what hooks share -------------------------------------------------------------

    def done(self, step: int) -> None:
        """Steps up to ``step`` completed: :attr:`completed`, the goodput ledger's step
        count (each step counted once), and this process's last completed step in the
        hang report (:mod:`shardax.runtime.status`)."""
        if step > self.completed:
            if self.ledger is not None:
                self.ledger.completed(step, step - self.completed)
            self.completed = step
            status.STATUS.completed(step)

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        """The metrics of the steps since the last flush, fetched in one transfer, each
        loss checked finite; also kept as :attr:`flushed`."""
        from shardax.train.guard import check_finite

        if not self.pending:
            return self.flushed
        steps = [step for step, _ in self.pending]
        fetched = jax.device_get([metrics for _, metrics in self.pending])
        self.pending = []
        floats = [{k: float(v) for k, v in m.items()} for m in fetched]
        done = list(zip(steps, floats, strict=True))
        for step, metrics in done:
            if "loss" in metrics:
                check_finite(metrics["loss"], step)
        self.flushed = done
        return done

    @contextlib.contextmanager
    def phase(self, bucket: str) -> Iterator[None]:
        """The block as ``bucket`` ("eval" or "checkpoint") in the goodput ledger, and
        as this process's phase (evaluating, saving) for the hang report."""
        status.STATUS.set(status.EVAL if bucket == "eval" else status.SAVE)
        with self.ledger.phase(bucket) if self.ledger else contextlib.nullcontext():
            yield

    def data_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the state: the steps done, the loader's position
        and ``data_state()``'s values."""
        get = getattr(self.feed, "get_state", None)
        loader = None
        if callable(get):
            with contextlib.suppress(TypeError, AttributeError):  # a source without get_state()
                loader = get()
        extra = self._extra() if self._extra is not None else {}
        return {**extra, "step": self.step, "loader": loader}


@public("sx.loop.run")
def run(
    state: Any,
    *,
    checkpoints: str | os.PathLike[str] | Any = None,
    every: dict[str, int] | None = None,
    steps: int | None = None,
    evaluate: Any = None,
    watchdog: float | None = None,
    writer: str | os.PathLike[str] | Any = None,
    progress: bool = False,
    goodput: bool | str | os.PathLike[str] = True,
    data_state: Any = None,
    resume: bool = True,
    exit_on_preemption: bool = True,
) -> Run:
    """A :class:`Run` of the user's loop with the usual hooks; use it as a context manager.

    Args:
        state: the state the loop trains (a ``sx.TrainState``, a pytree, or NNX objects
            such as ``(model, optimizer)``, restored in place).
        checkpoints: a directory or a :class:`shardax.CheckpointManager`: resume from
            its latest step; save every ``every["save"]`` steps, at the end and on
            SIGTERM (then exit 75), with the loader's position.
        every: steps between ``"save"``, ``"eval"`` and ``"log"`` (default: save at
            the end only, evaluate at the end only, log every 10 steps).
        steps: the run's last step (else the loader's end, or ``batches(steps=)``).
        evaluate: ``state -> {name: number}``, run every ``every["eval"]`` steps.
        watchdog: seconds a step may take (after the first) before the process ends
            naming the processes behind (:class:`shardax.StepWatchdog`).
        writer: a :class:`shardax.MetricWriter`, or a directory for one: the train
            metrics every ``every["log"]`` steps, the scores and goodput figures.
        progress: show a progress bar (process 0).
        goodput: keep the goodput ledger (``goodput.json`` in the checkpoint directory,
            which ``shardax goodput`` reads; written by process 0), or a path for it;
            False: none.
        data_state: ``() -> dict`` of JSON values saved with each checkpoint.
        resume: resume from the latest checkpoint (default), or start afresh.
        exit_on_preemption: end the process with code 75 after the SIGTERM save.
    """
    every = dict(every or {})
    unknown = sorted(set(every) - set(EVERY))
    if unknown:
        raise ValueError(f"every takes the keys {list(EVERY)}, got {unknown}")
    for key, value in every.items():
        as_count(f"every[{key!r}]", value)
    manager = checkpoints
    if checkpoints is not None and isinstance(checkpoints, str | os.PathLike):
        from shardax.checkpoint import CheckpointManager

        manager = CheckpointManager(checkpoints)
    owned = contextlib.ExitStack()
    if manager is not checkpoints:
        owned.callback(manager.close)
    if writer is not None and isinstance(writer, str | os.PathLike):
        from shardax.track import MetricWriter

        writer = owned.enter_context(MetricWriter(writer))
    # The watchdog first: under it a step counts as completed (in the ledger too) once it
    # waited for the step's result, one step behind (Run.done).
    hooks: list[Hook] = [Watchdog(watchdog)] if watchdog is not None else []
    if goodput:
        from shardax.track.goodput import FILE

        where = goodput if not isinstance(goodput, bool) else None
        if where is None and manager is not None:
            where = os.path.join(manager.directory, FILE)
        if jax.process_index() != 0:
            where = None  # process 0 keeps the ledger; the others count in memory
        hooks.append(Goodput(where))
    hooks += [Preemption(), MetricsWindow()]
    if progress:
        hooks.append(Progress())
    if writer is not None:
        hooks.append(Logging(every.get("log", 10)))
    if evaluate is not None:
        hooks.append(Evaluation(evaluate, every.get("eval")))
    if manager is not None:
        hooks.append(Checkpoints(every.get("save")))
    made = Run(
        state, hooks, manager=manager, total=steps, resume=resume, data_state=data_state,
        writer=writer, exit_on_preemption=exit_on_preemption,
    )  # fmt: skip
    made._owned = owned
    return made
