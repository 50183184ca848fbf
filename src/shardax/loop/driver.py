"""The driver: a run of the user's own steps, with hooks around each (``hooks``).

[`run`][shardax.loop.run] builds the usual hooks from a few arguments; the user's loop keeps its
step and adds three lines:

>>> with sx.loop.run(state, checkpoints=tmp_path / "ckpt", every={"save": 2}) as run:
...     state = run.state  # the latest checkpoint's, when there is one
...     for batch in run.batches(batches, steps=3):
...         state, metrics = train_step(state, batch)
...         run.after_step(state, metrics)
>>> sx.CheckpointManager(tmp_path / "ckpt").all_steps()
[2, 3]

Entering the run restores the latest checkpoint (state, steps done and the loader's
position); [`Run.batches`][shardax.loop.Run.batches] moves the loader there and counts the
steps; [`Run.after_step`][shardax.loop.Run.after_step] hands the new state and metrics to
the hooks. A SIGTERM saves at a step every process agrees on, then ends the process with
exit code 75 ([`shardax.Preempted`][shardax.Preempted]); leaving the block normally saves
the last step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from shardax.checkpoint import CheckpointManager
from shardax.checkpoint.convert import array_leaves
from shardax.checkpoint.manager import Restored, check_directory
from shardax.checkpoint.preemption import Preempted
from shardax.checks import as_bool, as_count, as_function, as_path, public, received
from shardax.data import prefetch_to_device, timed
from shardax.loop.hooks import Hook, Snapshots, usual_hooks
from shardax.loop.recovery import Recovery, newest, snapshot_directory, snapshot_manager
from shardax.loop.state import check_same_state, leaf_types, restore_into, saveable, structure
from shardax.runtime import status
from shardax.runtime.distributed import exit_on_error
from shardax.track import MetricWriter
from shardax.track.goodput import FILE
from shardax.train.guard import NonFiniteLossError, check_finite
from shardax.train.program import compile_only

EVERY = ("save", "eval", "log")
"""The periodic actions [`run`][shardax.loop.run] schedules (``every={"save": 1000, ...}``)."""


@public("sx.loop.Run")
class Run:
    """A training run: the state, the steps done, the metrics window, and the hooks.

    Args:
        state: the state to train and save: a ``sx.TrainState``, any pytree of arrays,
            or NNX objects (``(model, optimizer)``, restored in place).
        hooks: the hooks, in the order they run after each step (``hooks``).
        manager: the [`shardax.CheckpointManager`][shardax.CheckpointManager] to resume from and
            save to.
        total: the run's last step, when known (else the loader's end is).
        resume: restore the manager's latest checkpoint when there is one (True), start
            afresh (False: the manager's directory must hold no checkpoint), or continue
            from a ``Restored`` the caller already has.
        data_state: ``() -> dict`` of JSON values saved beside the steps done and the
            loader position (restored as ``run.restored``).
        writer: the [`shardax.MetricWriter`][shardax.MetricWriter] the logging and evaluation hooks
            use.
        exit_on_preemption: after the save on a SIGTERM, end the process with exit code
            75 (else [`shardax.Preempted`][shardax.Preempted] propagates).
        window: the most steps whose metrics wait on the device: after that many steps
            with no fetch (no hook due), they are fetched and checked in one transfer
            before the hooks run, so ``pending`` stays bounded.
        resume_hint: how to continue after a preemption, in the line it ends with
            (default: this library's; ``shardax train`` says ``--resume``).

    Attributes:
        state: the state after the last step (the restored one before the first).
        step: the current step (from 1); after it, the steps done.
        first: the steps done before this session (resumed from a checkpoint).
        completed: the last step known completed ([`done`][shardax.loop.Run.done]): the step itself,
            or the step before it under a [`Watchdog`][shardax.loop.Watchdog], which waits
            one behind.
        restored: the checkpoint's data state (``{"step": ..., "loader": ...}``), or {}.
        handed: the step whose state [`after_step`][shardax.loop.Run.after_step] got last (None:
            none this session); the end-of-run save is of that state, and only when it is
            the last step's.
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
        resume_hint: str | None = None,
        snapshots: Any = None,
    ) -> None:
        self.state, self.hooks, self.manager, self.writer = state, list(hooks), manager, writer
        self.snapshots = snapshots  # the host-memory snapshots' manager (in-job recovery)
        self.recovery = Recovery()
        self.total = None if total is None else as_count("steps", total, minimum=0)
        self._asked = self.total  # the run's own steps=, which batches(steps=) cannot move
        if not isinstance(resume, bool | Restored):
            raise TypeError(
                f"resume must be True (the latest checkpoint), False (start afresh) or a "
                f"sx.checkpoint.Restored, got {received(resume)}"
            )
        self.resume, self._extra, self.resume_hint = resume, data_state, resume_hint
        self.exit_on_preemption = as_bool("exit_on_preemption", exit_on_preemption)
        self.window = as_count("window", window)
        self.step = self.first = self.completed = 0
        self.handed: int | None = None
        self._open: bool | None = None  # None: not entered yet; False: ended
        self.restored: dict[str, Any] = {}
        self.pending: list[tuple[int, dict[str, Any]]] = []
        self.flushed: list[tuple[int, dict[str, float]]] = []
        self.scores: dict[str, Any] = {}
        self.preempted = self._in_step = self._moved = self._feeding = False
        self.ledger: Any = None
        self.feed: Any = None
        self._stack = contextlib.ExitStack()
        self._owned = contextlib.ExitStack()  # closed after the hooks (run() fills it)

    # --- entering and leaving -------------------------------------------------------

    def __enter__(self) -> Run:
        if self._open is not None:
            raise RuntimeError(
                f"this run was already entered (it is {'open' if self._open else 'ended'}, at "
                f"step {self.step}): a run is entered once, its hooks started and closed "
                "once. Make a new one with sx.loop.run(state, ...)"
            )
        try:
            claim = getattr(self.manager, "_take_lock", None)
            if callable(claim):  # the directory's writer from the start: a second run
                claim()  # stops here, naming this one, before it trains or deletes anything
            restored = self.resume
            if restored is False and self.manager is not None:
                where = f"the checkpoint directory {self.manager.directory}"
                refuse_earlier_run(self.manager, where, "resume=True")
            source = newest(self.manager, self.snapshots)
            if restored is True and source is not None:
                if self.recovery.restart and jax.process_index() == 0:
                    print(
                        f"sx.loop.run: restart {self.recovery.restart}: resuming from step "
                        f"{source[0].latest_step()}, {source[1]}",
                        flush=True,
                    )
                self.recovery.restored(source[0].latest_step(), source[1])
                restored = source[0].restore(like=saveable(self.state))
            elif restored is True and self.recovery.restart:  # before any save: step 0 again
                self.recovery.restored(0, "nothing (no snapshot or checkpoint yet): from step 0")
            if not isinstance(restored, bool):
                self.state = restore_into(self.state, restored.state)
                self.restored = dict(restored.data_state or {})
                self.step = self.first = int(self.restored.get("step", restored.step))
                self.completed = self.first
            self._structure = structure(self.state)
            # what a resume restores into: checked on each state handed (with checkpoints)
            self._leaf_types = leaf_types(self.state) if self.manager is not None else None
            self._open = True
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
        self._open = False
        # An error of one of several processes: out now, its peers wait in a collective.
        # (A preemption and a non-finite loss come on every process at the same step.)
        if not isinstance(error, Preempted | NonFiniteLossError):
            exit_on_error(kind, error, tb)
        with self._owned:  # what run() opened for this run, closed last
            try:
                if kind is None:
                    self._check_handed()
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

    def _check_handed(self) -> None:
        """At the end of a run: raises when steps ran but
        [`after_step`][shardax.loop.Run.after_step] never got a
        state (there is none to save), and warns when the last step's did not come (the
        end-of-run save, which needs it, is skipped)."""
        ran = self.step - self.first
        if ran and self.handed is None:
            raise RuntimeError(
                f"the loop took {ran} batches (steps {self.first + 1}..{self.step}) but never "
                "called run.after_step(state, metrics), so the run never had a state of "
                "theirs: nothing was saved at the end (it would have saved the state the run "
                f"started with as step {self.step}), and no metric was checked or logged. "
                "Call run.after_step(state, metrics) after each step"
            )
        if self.handed is not None and self.handed < self.step:
            warnings.warn(
                f"sx.loop.Run: step {self.step}'s batch was taken but run.after_step was not "
                f"called for it (the last state handed is step {self.handed}'s): nothing was "
                f"saved at the end, since no state of step {self.step} exists to save with "
                "the loader past its batch. Call run.after_step(state, metrics) after every "
                "step, before leaving the loop",
                UserWarning,
                stacklevel=3,
            )

    def _check_open(self, call: str) -> None:
        if self._open is None:
            raise RuntimeError(
                f"the run has not started: call {call} inside its with block "
                "(with sx.loop.run(state, ...) as run:), which restores and starts the hooks"
            )
        if not self._open:
            raise RuntimeError(
                f"the run has ended (its with block was left at step {self.step}): "
                f"{call} after it would count, save or log nothing. Call it inside the block"
            )

    # --- the loop ---------------------------------------------------------------------

    def batches(
        self, loader: Iterable[Any], mesh: Any = None, *, steps: int | None = None
    ) -> Iterator[Any]:
        """The batches of ``loader``, moved to the checkpoint's position first (the first
        loop's loader, which needs ``set_state``, as ``sx.batches`` has), placed and
        prefetched on ``mesh`` (a mesh or a sharding) when given, until ``steps`` (or the
        run's total) steps are done or the loader ends; a loop that gets no batch (the run
        is at its total already, or the loader is exhausted) says so in a warning."""
        self._check_open("run.batches()")
        if not isinstance(loader, Iterable) and not callable(getattr(loader, "__next__", None)):
            raise TypeError(
                f"loader must be an iterable of batches (a list, a generator, sx.batches(...), "
                f"a data loader), got {received(loader)}"
            )
        check_placement("mesh", mesh)
        total = self.total if steps is None else as_count("steps", steps, minimum=0)
        if self._asked is not None and total != self._asked:
            raise ValueError(
                f"steps={total} here, but the run was made with steps={self._asked} (its last "
                "step, which the checkpoints and the end-of-run actions follow); give the "
                "number of steps once: in sx.loop.run(steps=) or in run.batches(steps=)"
            )
        self.total = total
        position = None if self._moved else self.restored.get("loader")
        if position is not None:
            if not callable(getattr(loader, "set_state", None)):
                raise TypeError(
                    f"loader must have set_state() to resume at the checkpoint's position, "
                    f"got a {type(loader).__qualname__}; pass the unplaced loader "
                    "(sx.batches) and mesh=, so it is moved before it is prefetched"
                )
            loader.set_state(position)
            self._moved = True  # the first loop's loader only: a later loop goes on
        return self._steps(loader, mesh, total)

    def _steps(self, loader: Any, mesh: Any, total: int | None) -> Iterator[Any]:
        first = True
        with contextlib.ExitStack() as owned:
            if mesh is not None:
                feed = owned.enter_context(prefetch_to_device(loader, mesh))
            else:
                feed = loader if hasattr(loader, "wait_seconds") else timed(loader)
            self.feed = feed
            if total is not None and self.step >= total:
                resumed = " (resumed from the checkpoint)" if self.step == self.first else ""
                warnings.warn(
                    f"sx.loop.Run.batches: the run is at step {self.step} of steps="
                    f"{total}{resumed}, so this loop gets no batch; pass a larger steps= "
                    "to train further",
                    UserWarning,
                    stacklevel=2,
                )
            self._feeding = True
            try:
                while total is None or self.step < total:
                    status.STATUS.set(status.DATA, self.step + 1)
                    for hook in self.hooks:
                        hook.before_batch(self)
                    try:
                        batch = next(feed)
                    except StopIteration:
                        if first:
                            warnings.warn(
                                f"sx.loop.Run.batches: the loader gave no batch, so this loop "
                                f"ran 0 steps (the run is at step {self.step}): it is empty or "
                                "exhausted (an iterator a loop before used up); pass a new one",
                                UserWarning,
                                stacklevel=2,
                            )
                        return
                    first = False
                    self.before_step()
                    yield batch
            finally:
                self._feeding = False

    def before_step(self) -> None:
        """Starts the next step ([`batches`][shardax.loop.Run.batches] calls it for each batch)."""
        self.step += 1
        self._in_step = True
        status.STATUS.set(status.DISPATCH, self.step)
        for hook in self.hooks:
            hook.before_step(self)

    def after_step(self, state: Any, metrics: Any = None) -> None:
        """Hands the step's new ``state`` (the run's state, as the step returned it) and
        ``metrics`` (a dict of scalars, the loss, or ``(loss, aux)`` with a dict ``aux``)
        to the hooks; raises [`shardax.Preempted`][shardax.Preempted] once a SIGTERM's
        step is saved. Another tree than the run's state (the metrics in its place), a
        metric that is not one number, or a call outside the run's ``with`` block raise,
        naming it."""
        self._check_open("run.after_step()")
        check_same_state(state, self.state, self._structure, self._leaf_types)
        scalars = scalar_metrics(metrics)
        if not self._in_step:
            if self._feeding:
                raise RuntimeError(
                    f"run.after_step() was called again for step {self.step}, whose batch "
                    "run.batches() gave once: each batch is one step, so a second call would "
                    "count a step that took no batch (the step count, the checkpoints' step "
                    "numbers and the loader's position would part). Call it once per batch"
                )
            self.before_step()  # a loop that does not take its batches from batches()
        self._in_step = False
        self.state, self.handed = state, self.step
        self.pending.append((self.step, scalars))
        self.flushed = []
        if len(self.pending) >= self.window:  # no hook was due for a whole window
            self.flush()
        if not any(hook.waits for hook in self.hooks):
            self.done(self.step)
        for hook in self.hooks:
            hook.after_step(self)
        if self.recovery.restart and self.recovery.restored_step is not None:
            jax.block_until_ready(state)  # once: the first step after a restart completed
            self.recovery.first_step_done(self.step)
            self.recovery.restored_step = None
        if self.preempted:
            directory = self.manager.directory if self.manager is not None else None
            hint = self.resume_hint or (
                "run the script again to continue from it (sx.loop.run resumes from the "
                "latest checkpoint)"
                if self.resume is not False
                else "run it again with sx.loop.run(..., resume=True) to continue from it"
            )
            raise Preempted(self.step, directory, hint)

    # --- what hooks share -------------------------------------------------------------

    def done(self, step: int) -> None:
        """Steps up to ``step`` completed: ``completed``, the goodput ledger's step
        count (each step counted once), and this process's last completed step in the
        hang report (``shardax.runtime.status``)."""
        if step > self.completed:
            if self.ledger is not None:
                self.ledger.completed(step, step - self.completed)
            self.completed = step
            status.STATUS.completed(step)

    def flush(self) -> list[tuple[int, dict[str, float]]]:
        """The metrics of the steps since the last flush, fetched in one transfer, each
        loss checked finite; also kept as ``flushed``."""
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


def scalar_metrics(metrics: Any) -> dict[str, Any]:
    """``metrics`` as ``{name: scalar}``: a dict of scalars as it is, a lone value as the
    loss, ``(loss, aux)`` with a dict ``aux`` (the loss contract's) merged; raises naming
    a value that is not one number (a vector loss would pass the NaN guard unchecked)."""
    if metrics is None:
        return {}
    if isinstance(metrics, tuple) and len(metrics) == 2 and not isinstance(metrics[0], Mapping):
        loss, aux = metrics
        if not isinstance(aux, Mapping):
            raise TypeError(
                f"metrics (loss, aux) must have a dict of scalar metrics as aux, got aux "
                f"{received(aux)}; pass the loss alone, or a dict of scalars {{'loss': loss, ...}}"
            )
        if "loss" in aux:
            raise ValueError("metrics (loss, aux): aux has a 'loss' of its own; rename it")
        metrics = {"loss": loss, **aux}
    elif not isinstance(metrics, Mapping):
        metrics = {"loss": metrics}
    for name, value in metrics.items():
        if value is None or isinstance(value, str | bytes) or np.ndim(value) != 0:
            what = f"shape {np.shape(value)}" if np.ndim(value) else received(value)
            raise ValueError(
                f"metrics[{name!r}] must be a scalar (one number per step, which the run "
                f"logs and, for the loss, checks finite), got {what}; reduce it (jnp.mean), "
                "or take one device's value of a pmap step's per-device metrics ([0])"
            )
    return dict(metrics)


def _snapshot_interval(snapshots: Any) -> int | None:
    """``snapshots=`` as ``Snapshots`` takes it (None: auto; 0: none), checked."""
    if snapshots is None:
        return None if snapshot_directory() is not None else 0
    if snapshots != "auto":
        snapshots = as_count("snapshots", snapshots, minimum=0)
    if snapshots and snapshot_directory() is None:
        snapshot_manager("loop")  # raises: no launcher owns a directory
    return None if snapshots == "auto" else snapshots


def refuse_earlier_run(manager: Any, where: str, resume: str) -> None:
    """Raises ``ValueError`` when a run that starts afresh would save into a directory
    holding checkpoints (``manager``'s; None: none): its steps would mix with the earlier
    run's, ``max_to_keep`` would delete some of either, and a resume would take the newest
    of them, whichever run it is from. ``where`` names the directory, ``resume`` the way
    to continue from them (``sx.loop.run``'s ``resume=True``, ``--resume``)."""
    steps = manager.all_steps() if manager is not None else []
    if steps:
        shown = steps if len(steps) <= 5 else [*steps[:2], "...", steps[-1]]
        raise ValueError(
            f"{where} already holds checkpoints (steps {', '.join(map(str, shown))}) of an "
            "earlier run: a run started afresh would save its steps among them and a resume "
            f"would take the newest, whichever run it is from. Pass {resume} to continue "
            "from them, or choose an empty directory"
        )


def _every(every: Any) -> dict[str, int | None]:
    """``every`` checked: a dict of ``EVERY`` keys to counts (None: only at the end)."""
    if every is None:
        return {}
    if not isinstance(every, Mapping):
        raise TypeError(
            f"every must be a dict of the steps between actions, with the keys "
            f"{list(EVERY)} (e.g. every={{'save': 1000, 'log': 50}}), got {received(every)}"
        )
    unknown = sorted(set(every) - set(EVERY), key=str)
    if unknown:
        raise ValueError(f"every takes the keys {list(EVERY)}, got {unknown}")
    return {
        key: None if value is None else as_count(f"every[{key!r}]", value)
        for key, value in every.items()
    }


def _check_hooks(hooks: Any) -> list[Hook]:
    """``hooks`` checked: a list or tuple of ``sx.loop.Hook``s."""
    if not isinstance(hooks, list | tuple):
        raise TypeError(f"hooks must be a list of sx.loop.Hook, got {received(hooks)}")
    for i, hook in enumerate(hooks):
        if not isinstance(hook, Hook):
            raise TypeError(
                f"hooks[{i}] must be a sx.loop.Hook, got {received(hook)}; wrap a function "
                "as sx.loop.Every(fn, every=N) (fn(run) every N steps and at the last)"
            )
    return list(hooks)


def _check_writer(writer: Any) -> None:
    """``writer`` checked: None, a ``MetricWriter`` (anything with ``write(step,
    scalars)``), or a directory this process can write (made if needed)."""
    if writer is None or callable(getattr(writer, "write", None)):
        return
    if not isinstance(writer, str | os.PathLike):
        raise TypeError(
            "writer must be a sx.MetricWriter (or any object with write(step, metrics)) or "
            f"a directory for one (str or os.PathLike), got {received(writer)}"
        )
    check_directory("writer", writer, writable=True)


def _check_every_has_its_hook(
    every: dict[str, int | None], directory: Any, evaluate: Any, writer: Any
) -> None:
    """An ``every`` entry whose action has nothing to act on: a save without
    ``checkpoints`` and an evaluation without ``evaluate`` raise (the schedule would be
    ignored); a log without ``writer`` warns (the metrics are still checked)."""
    for key, needs, given, what, done in (
        ("save", "checkpoints", directory, "saves", "saved"),
        ("eval", "evaluate", evaluate, "evaluations", "evaluated"),
    ):
        if every.get(key) is not None and given is None:
            raise ValueError(
                f"every[{key!r}]={every[key]} schedules {what}, but {needs}= is not given, "
                f"so nothing would be {done}: pass {needs}=, or drop {key!r}"
            )
    if every.get("log") is not None and writer is None:
        warnings.warn(
            f"sx.loop.run: every['log']={every['log']} schedules logging, but writer= is not "
            "given, so no metric is written (the loss is still checked finite): pass "
            "writer= (a directory or a sx.MetricWriter), or drop 'log'",
            UserWarning,
            stacklevel=3,
        )


def check_placement(name: str, mesh: Any) -> None:
    """``mesh`` for placing batches: None, a ``Mesh`` or a ``Sharding`` of this
    machine's devices (a compile-only target's hold no arrays)."""
    if mesh is None:
        return
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.Sharding):
        raise TypeError(
            f"{name} must be a jax.sharding.Mesh (sx.make_mesh) or a jax.sharding.Sharding "
            f"to place the batches on, or None to take them as they come, got {received(mesh)}"
        )
    grid = mesh if isinstance(mesh, jax.sharding.Mesh) else getattr(mesh, "mesh", None)
    kind = compile_only(grid) if isinstance(grid, jax.sharding.Mesh) else None
    if kind is not None:
        raise ValueError(
            f"{name} is of compile-only devices ({grid.devices.size} x {kind}, from "
            "sx.target), which hold no arrays: no batch can be placed on them. Place the "
            "batches on a mesh of this machine's devices (sx.make_mesh without devices=)"
        )


def _checkpoint_directory(checkpoints: Any) -> str | None:
    """The directory ``checkpoints`` saves into, checked writable; None for none."""
    if checkpoints is None:
        return None
    if isinstance(checkpoints, CheckpointManager):
        return check_directory("checkpoints", checkpoints.directory, writable=True)
    if not isinstance(checkpoints, str | os.PathLike):
        raise TypeError(
            "checkpoints must be a directory (str or os.PathLike) or a "
            f"sx.CheckpointManager, got {received(checkpoints)}"
        )
    return check_directory("checkpoints", checkpoints, writable=True)


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
    snapshots: int | str | None = None,
    hooks: list[Hook] | tuple[Hook, ...] = (),
) -> Run:
    """A [`Run`][shardax.loop.Run] of the user's loop with the usual hooks and your own; use it
    as a context manager.

    Args:
        state: the state the loop trains (a ``sx.TrainState``, a pytree, or NNX objects
            such as ``(model, optimizer)``, restored in place).
        checkpoints: a directory (made if needed; it must be writable) or a
            [`shardax.CheckpointManager`][shardax.CheckpointManager]: resume from its
            latest step; save every ``every["save"]`` steps, at the end and on SIGTERM
            (then exit 75), with the loader's position. A restored leaf goes where the
            live one was (an uncommitted one, such as a key never placed, stays
            uncommitted).
        every: a dict of the steps between ``"save"``, ``"eval"`` and ``"log"``
            (default, or None: save at the end only, evaluate at the end only, log every
            10 steps). Each needs what it acts on: ``"save"`` ``checkpoints``, ``"eval"``
            ``evaluate`` (else refused: the schedule would be ignored), ``"log"``
            ``writer`` (else a warning: nothing is written).
        steps: the run's last step (else the loader's end, or ``batches(steps=)``).
        evaluate: ``state -> {name: number}``, run every ``every["eval"]`` steps.
        watchdog: seconds a step may take (after the first) before the process ends
            naming the processes behind ([`shardax.StepWatchdog`][shardax.StepWatchdog]).
        writer: a [`shardax.MetricWriter`][shardax.MetricWriter], or a directory for one (made if
            needed; it must be writable): the train metrics every ``every["log"]`` steps,
            the scores and goodput figures.
        progress: show a progress bar (process 0).
        goodput: keep the goodput ledger (``goodput.json`` in the checkpoint directory,
            which ``shardax goodput`` reads; written by process 0), or a path for it;
            False: none.
        data_state: ``() -> dict`` of JSON values saved with each checkpoint.
        resume: resume from the latest checkpoint (default), or start afresh (False:
            refused when ``checkpoints`` holds checkpoints, which the new run would mix
            with its own).
        exit_on_preemption: end the process with code 75 after the SIGTERM save.
        snapshots: steps between host-memory snapshots of the state and data position
            ([`shardax.loop.Snapshots`][shardax.loop.Snapshots]), from which a run that
            ``shardax launch --max-restarts`` restarted after a failure resumes;
            ``"auto"``: every step while a snapshot costs at most 5% of a step, else as
            often as that allows; 0: none. Default: ``"auto"`` under such a launch
            (which owns the directory, ``$SHARDAX_SNAPSHOT_DIR``), else none. A restarted
            run resumes from the newest of the snapshots and the checkpoints, and says
            which.
        hooks: your own hooks ([`shardax.loop.Hook`][shardax.loop.Hook]s; a function with
            a schedule: [`shardax.loop.Every`][shardax.loop.Every]``(fn, every=N)``), run
            after the usual ones, in the order given. Every hook runs in
            ``shardax.loop.hooks.ORDER``: watchdog, goodput, preemption, metrics
            window, progress, logging, checkpoints, snapshots, evaluation, yours.
    """
    every = _every(every)
    resume = as_bool("resume", resume)
    progress = as_bool("progress", progress)
    if evaluate is not None:
        as_function("evaluate", evaluate, "a function state -> {name: number}")
    if data_state is not None:
        as_function("data_state", data_state, "a function () -> dict of JSON values")
    if not isinstance(goodput, bool):
        goodput = as_path("goodput", goodput, "True keeps it beside the checkpoints")
    total = None if steps is None else as_count("steps", steps, minimum=0)
    directory = _checkpoint_directory(checkpoints)
    _check_writer(writer)
    _check_every_has_its_hook(every, directory, evaluate, writer)
    if directory is not None and not array_leaves(saveable(state)):
        raise ValueError(
            f"state has no array or number leaf to save, got {state!r:.80}, and checkpoints= "
            "saves the state: pass the state the loop trains (a sx.TrainState, a pytree of "
            "arrays, (model, optimizer)), or leave checkpoints out"
        )
    where = False  # the goodput ledger's path (None: in memory; False: none)
    if goodput:
        where = goodput if not isinstance(goodput, bool) else None
        if where is None and directory is not None:
            where = os.path.join(directory, FILE)
        if jax.process_index() != 0:
            where = None  # process 0 keeps the ledger; the others count in memory
    yours = _check_hooks(hooks)
    interval = _snapshot_interval(snapshots)
    # Every argument is checked: now what the run opens (closed if a later one fails).
    owned = contextlib.ExitStack()
    try:
        manager = checkpoints
        if isinstance(checkpoints, str | os.PathLike):
            manager = CheckpointManager(directory)
            owned.callback(manager.close)
        if writer is not None and isinstance(writer, str | os.PathLike):
            writer = owned.enter_context(MetricWriter(writer))
        snaps = None
        if interval != 0:
            snaps = snapshot_manager("loop", like=saveable(state))
            owned.callback(snaps.close)
        chosen = usual_hooks(
            every,
            watchdog=watchdog,
            goodput=where,
            progress=progress,
            logging=writer is not None,
            evaluate=evaluate,
            checkpoints=directory is not None,
            snapshots=None if snaps is None else Snapshots(snaps, interval),
            yours=yours,
        )
        made = Run(
            state,
            chosen,
            manager=manager,
            total=total,
            resume=resume,
            data_state=data_state,
            writer=writer,
            exit_on_preemption=exit_on_preemption,
            snapshots=snaps,
        )
    except BaseException:
        owned.close()
        raise
    made._owned = owned
    return made
