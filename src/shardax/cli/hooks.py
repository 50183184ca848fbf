"""The training loop's hooks: each owns one concern and its own schedule.

The loop (:mod:`shardax.cli.loop`) runs one step at a time and calls every hook, in
order, before and after it. A hook says with :meth:`Hook.due` whether it acts after
this step and needs the step metrics on the host; :class:`MetricsWindow` then flushes
them once (one device-to-host transfer per window, not per step) before the hooks that
follow it run. Hooks are context managers: the loop enters them in order before the first step
and exits them in reverse after the last (or on an error).

- :class:`Goodput`: the goodput ledger (:mod:`shardax.track.goodput`) beside the
  checkpoints, and each process's step and phase for the hang report;
- :class:`Watchdog`: times each step after the first (``--step-timeout``);
- :class:`Progress`: the progress bar, every 4 steps;
- :class:`Preemption`: a SIGTERM makes every process stop at the same step;
- :class:`MetricsWindow`: flushes the window when a later hook is due; the NaN guard;
- :class:`Evaluation`: every ``eval_every`` steps, evaluates and records the window;
- :class:`Checkpoint`: every ``--save-every`` steps, at the last and on preemption.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax

from shardax.cli.common import UsageError
from shardax.runtime import compile_stats, status


@dataclasses.dataclass
class Run:
    """What the hooks share: the run's position, its state and its metrics.

    Attributes:
        job: the :class:`~shardax.cli.job.Job`.
        state: the train state (after the current step).
        i: the current step (from 1).
        first_done: steps done before this run (resumed from a checkpoint).
        history: the history entries so far.
        window: this evaluation window's metrics, on the host.
        pending: the metrics of the steps since the last flush, still on device.
        feed: the prefetching batch iterator (``get_state()`` for checkpoints).
        tracker: the :class:`~shardax.cli.track.Tracker`.
        window_start, window_first: when and at which step the window began.
        step_seconds: seconds per step of each completed window but the first.
        preempted: a SIGTERM asked this step to be the last.
        directory: the run directory (process 0; None elsewhere).
        ledger: the goodput ledger (:class:`shardax.track.Ledger`), or None.
    """

    job: Any
    state: Any
    first_done: int
    history: list[dict[str, Any]]
    window: list[dict[str, float]]
    feed: Any
    tracker: Any
    i: int = 0
    pending: list[Any] = dataclasses.field(default_factory=list)
    window_start: float = 0.0
    window_first: int = 0
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    preempted: bool = False
    directory: Any = None
    ledger: Any = None

    @contextlib.contextmanager
    def phase(self, bucket: str) -> Any:
        """The block as ``bucket`` ("eval" or "checkpoint") in the goodput ledger, and
        as this process's phase (evaluating, saving) for the hang report."""
        from shardax.runtime import status

        status.STATUS.set(status.EVAL if bucket == "eval" else status.SAVE)
        with self.ledger.phase(bucket) if self.ledger else contextlib.nullcontext():
            yield

    @property
    def last(self) -> bool:
        """This is the run's last step."""
        return self.i == self.job.steps

    def flush(self) -> list[dict[str, float]]:
        """The pending metrics as host floats (one transfer), appended to the window."""
        done = [{k: float(v) for k, v in m.items()} for m in jax.device_get(self.pending)]
        self.pending = []
        self.window += done
        return done

    def data_state(self) -> dict[str, Any]:
        """What a checkpoint keeps beside the state: steps done, history, loader
        position and the metrics of the window so far."""
        return {"step": self.i, "history": self.history, "loader": self.feed.get_state(),
                "window": self.window}  # fmt: skip


class Hook:
    """A part of the loop with its own schedule; every method is optional."""

    def due(self, run: Run) -> bool:
        """Acts after step ``run.i`` and needs its metrics on the host."""
        return False

    def before_step(self, run: Run) -> None:
        """Before step ``run.i``."""

    def after_step(self, run: Run) -> None:
        """After step ``run.i`` (the metrics flushed if any hook was due)."""

    def __enter__(self) -> Hook:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class Watchdog(Hook):
    """``--step-timeout``: a step after the first (which compiles) that takes longer
    dumps every thread's stack and exits (:class:`shardax.StepWatchdog`). A watched step
    waits for its loss, so the time counts the device work."""

    def __init__(self, timeout: float, on_fire: Any = None) -> None:
        import shardax as sx

        self.watchdog = sx.StepWatchdog(timeout, on_fire=on_fire)
        self._watched: Any = None

    def before_step(self, run: Run) -> None:
        if run.i > run.first_done + 1:
            self._watched = self.watchdog.step(run.i)
            self._watched.__enter__()

    def after_step(self, run: Run) -> None:
        if self._watched is not None:
            self.watchdog.phase(status.DEVICE)
            jax.block_until_ready(run.pending[-1]["loss"])
            self._watched.__exit__(None, None, None)
            self._watched = None

    def __enter__(self) -> Watchdog:
        self.watchdog.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._watched is not None:
            self._watched.__exit__(*exc)
        self.watchdog.__exit__(*exc)


class Goodput(Hook):
    """Every second of the run in a bucket (:class:`shardax.track.Ledger`): start-up
    until the first step, then steps, with the compile seconds
    (:func:`shardax.runtime.compile_stats`) and the input wait moved to their buckets;
    evaluations and the blocking part of saves through :meth:`Run.phase`. Kept in
    ``goodput.json`` beside the checkpoints (else in the run directory; process 0),
    saved with every checkpoint and at the end; its scalars go to the metric writers
    with every evaluation's. Also marks this process's phase, for the hang report."""

    def __init__(self, run: Run, path: Any, since: float, compiled: float = 0.0) -> None:
        from shardax.track.goodput import Ledger

        try:
            self.ledger = run.ledger = Ledger(path, since=since)
        except ValueError as e:  # an unreadable goodput.json
            raise UsageError(str(e)) from None
        self.ledger.count("compile", lambda: compile_stats().seconds, since=compiled)
        self.ledger.count("data", lambda: run.feed.wait_seconds)
        if run.first_done:
            self.ledger.resumed(run.first_done)

    def before_step(self, run: Run) -> None:
        if self.ledger.bucket != "step":
            self.ledger.switch("step")
        status.STATUS.set(status.DISPATCH, run.i)

    def after_step(self, run: Run) -> None:
        self.ledger.completed(run.i)

    def __exit__(self, *exc: Any) -> None:
        self.ledger.close()


class Progress(Hook):
    """The progress bar (process 0): step, the job's metrics text, throughput, the
    data-wait fraction and the seconds spent compiling, updated every ``every`` steps
    and at the last."""

    def __init__(self, job: Any, console: Any, first_done: int, every: int = 4) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.job, self.every = job, every
        self.bar = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[text]}"),
            TextColumn("{task.fields[rate]:,.0f} " + job.unit + "/s  wait {task.fields[wait]:.0%}"),
            TextColumn("compile {task.fields[compile]:.1f}s"),
            TimeRemainingColumn(),
            console=console,
            disable=jax.process_index() != 0,
        )
        self.task = self.bar.add_task(
            "train", total=job.steps, completed=first_done, text="", rate=0.0, wait=0.0,
            compile=0.0,
        )  # fmt: skip

    def after_step(self, run: Run) -> None:
        if run.i % self.every and not run.last:
            return
        metrics = {k: float(v) for k, v in run.pending[-1].items()}
        rate = (run.i - run.window_first + 1) * self.job.items_per_step
        self.bar.update(
            self.task,
            completed=run.i,
            text=self.job.progress(metrics),
            rate=rate / (time.perf_counter() - run.window_start),
            wait=run.tracker.data_wait_fraction,
            compile=compile_stats().seconds,
        )

    def __enter__(self) -> Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)


class Preemption(Hook):
    """From the first step on, a SIGTERM makes every process stop at the same step
    (:func:`shardax.watch_preemption`); the checkpoint hook saves it, then the loop
    raises :class:`shardax.Preempted`."""

    def __init__(self) -> None:
        import shardax as sx

        self.watch = sx.watch_preemption()

    def after_step(self, run: Run) -> None:
        import shardax as sx

        run.preempted = sx.checkpoint.reached_preemption(run.i)  # the same step everywhere

    def due(self, run: Run) -> bool:
        return run.preempted

    def __enter__(self) -> Preemption:
        self.watch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.watch.__exit__(*exc)


class MetricsWindow(Hook):
    """Flushes the metrics window when a later hook is due (one device-to-host transfer
    for all the steps since the last flush), and is the NaN guard: every flushed step's
    loss must be finite, checked before anything is evaluated or saved
    (:func:`shardax.train.check_finite` names the step)."""

    def __init__(self, later: list[Hook]) -> None:
        self.later = later

    def after_step(self, run: Run) -> None:
        import shardax as sx

        if not any([hook.due(run) for hook in self.later]):
            return
        flushed = run.flush()
        for j, metrics in enumerate(flushed):
            sx.train.check_finite(metrics["loss"], run.i - len(flushed) + j + 1)


class Evaluation(Hook):
    """Every ``job.eval_every`` steps and at the last: evaluates the state, writes the
    scores, and turns the window's metrics into history entries."""

    def __init__(self, job: Any, console: Any) -> None:
        self.job, self.console = job, console

    def due(self, run: Run) -> bool:
        return run.i % self.job.eval_every == 0 or run.last

    def after_step(self, run: Run) -> None:
        if not self.due(run):
            return
        with run.phase("eval"):
            self._evaluate(run)

    def _evaluate(self, run: Run) -> None:
        seconds = time.perf_counter() - run.window_start
        if run.window_first > run.first_done + 1:  # the first window includes compilation
            run.step_seconds.append(seconds / (run.i - run.window_first + 1))
        scores = self.job.evaluate(run.state)
        goodput = run.ledger.scalars() if run.ledger is not None else {}
        run.tracker.scalars({**{k.replace("_", "/", 1): v for k, v in scores.items()}, **goodput})
        note = run.tracker.input_bound()
        if note and jax.process_index() == 0:
            self.console.print(f"[yellow]{note}[/]")
        first = run.i - len(run.window) + 1
        run.history += self.job.records(first, run.window, scores, seconds)
        run.window = []
        run.window_start, run.window_first = time.perf_counter(), run.i + 1


class Checkpoint(Hook):
    """Every ``save_every`` steps, at the last and on preemption: saves the state with
    the data position (:class:`shardax.CheckpointManager`)."""

    def __init__(self, manager: Any, save_every: int) -> None:
        self.manager, self.save_every = manager, save_every

    def due(self, run: Run) -> bool:
        return run.i % self.save_every == 0 or run.last or run.preempted

    def after_step(self, run: Run) -> None:
        self.run = run
        if self.due(run):
            with run.phase("checkpoint"):  # the blocking part of an async save
                self.manager.save(run.i, run.state, run.data_state())
            if run.ledger is not None:
                run.ledger.save()

    def __exit__(self, *exc: Any) -> None:
        run = getattr(self, "run", None)
        with run.phase("checkpoint") if run else contextlib.nullcontext():
            self.manager.close()  # waits for the save in flight


@contextlib.contextmanager
def entered(hooks: list[Hook]) -> Any:
    """Enters ``hooks`` in order; exits them in reverse."""
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook)
        yield hooks
