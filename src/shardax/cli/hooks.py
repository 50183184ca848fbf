"""What ``shardax train`` adds to the library's hooks (``shardax.loop.hooks``).

The loop is the library's ([`shardax.loop.Run`][shardax.loop.Run]); the command adds only what is
its own: the job's history (``History``: the metrics since the last evaluation
and the entries of ``summary.json``), the progress bar's columns (``Bar``), and
the tracker's timing scalars beside the train metrics (``Log``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
from rich.progress import BarColumn, TextColumn, TimeRemainingColumn

from shardax.loop import Evaluation, Logging, Progress
from shardax.runtime import compile_stats


@dataclasses.dataclass
class Record:
    """The run's record, kept in every checkpoint's data state.

    Attributes:
        job: the ``Job``.
        tracker: the ``Tracker``.
        history: the history entries so far.
        window: this evaluation window's metrics, on the host.
        window_start, window_first: when and at which step the window began.
        step_seconds: seconds per step of each completed window but the first.
        snapshots: the run's ``Snapshots`` hook (None: none).
    """

    job: Any
    tracker: Any
    history: list[dict[str, Any]]
    window: list[dict[str, float]]
    window_first: int
    window_start: float = 0.0
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    snapshots: Any = None

    def data_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (beside the steps done and the loader position)."""
        return {"history": self.history, "window": self.window}


class History(Evaluation):
    """Every ``job.eval_every`` steps and at the last: evaluates, writes the scores and
    the goodput figures, and turns the window's metrics (``Log`` gathers them) into
    history entries. The saves come before it (``shardax.loop.hooks.ORDER``), so a run
    resumed at a step it evaluates at evaluates the restored state first: the history
    is the uninterrupted run's."""

    def __init__(self, record: Record, console: Any) -> None:
        super().__init__(record.job.evaluate, record.job.eval_every)
        self.record_, self.console = record, console

    def start(self, run: Any) -> None:
        # The window holds the step's metrics when its evaluation is still to come (an
        # empty one: a checkpoint saved after it, by shardax before the order was one).
        if run.first > 0 and self.record_.window and self.due(run):
            self.record_.window_start = time.perf_counter()
            self.run(run)

    def record(self, run: Any, scores: dict[str, Any]) -> None:
        rec = self.record_
        seconds = time.perf_counter() - rec.window_start
        if rec.window_first > run.first + 1:  # the first window includes compilation
            rec.step_seconds.append(seconds / (run.step - rec.window_first + 1))
        goodput = run.ledger.scalars() if run.ledger is not None else {}
        rec.tracker.scalars({**{k.replace("_", "/", 1): v for k, v in scores.items()}, **goodput})
        note = rec.tracker.input_bound()
        if note and jax.process_index() == 0:
            self.console.print(f"[yellow]{note}[/]")
        first = run.step - len(rec.window) + 1
        rec.history += rec.job.records(first, rec.window, scores, seconds)
        rec.window = []
        rec.window_start, rec.window_first = time.perf_counter(), run.step + 1


class Log(Logging):
    """Every ``--log-every`` steps after the session's first (which starts the step
    clock): the train metrics of the fetched window and the clock's timing scalars. After
    each step: the fetched metrics into the record's window, before a save keeps it."""

    def __init__(self, record: Record) -> None:
        super().__init__(record.tracker.every)
        self.record, self.tracker = record, record.tracker

    def due(self, run: Any) -> bool:
        return run.step % self.every == 0 and run.step > run.first + 1

    def after_step(self, run: Any) -> None:
        self.record.window += [metrics for _, metrics in run.flushed]
        lap = self.tracker.step(run.step, run.state)
        if lap is not None:
            metrics = run.flushed[-1][1]
            self.tracker.writer.write(
                run.step, {**{f"train/{k}": v for k, v in metrics.items()}, **lap}
            )


class Bar(Progress):
    """The progress bar: step, the job's metrics text (as fetched), throughput, the
    data-wait fraction and the seconds spent compiling."""

    def __init__(self, record: Record, console: Any) -> None:
        super().__init__(console=console)
        self.record = record

    def columns(self) -> list[Any]:
        unit = self.record.job.unit
        return [
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[text]}"),
            TextColumn("{task.fields[rate]:,.0f} " + unit + "/s  wait {task.fields[wait]:.0%}"),
            TextColumn("compile {task.fields[compile]:.1f}s"),
            TimeRemainingColumn(),
        ]

    def blank(self) -> tuple[str, ...]:
        return ("rate", "wait", "compile")

    def fields(self, run: Any) -> dict[str, Any]:
        rec = self.record
        items = (run.step - rec.window_first + 1) * rec.job.items_per_step
        return {
            "text": rec.job.progress(run.flushed[-1][1]),
            "rate": items / max(time.perf_counter() - rec.window_start, 1e-9),
            "wait": rec.tracker.data_wait_fraction,
            "compile": compile_stats().seconds,
        }
