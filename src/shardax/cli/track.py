"""Tracking for the train jobs: ``--log-dir``, ``--log-every``, ``--log``, ``--profile-steps``.

A job builds one ``Tracker`` before training (so a bad ``--log-dir``, a missing
extra or a profile range past the end is a usage error before the first step), hands it
its input iterator (``Tracker.watch``), wraps its step with ``Tracker.wrap``,
calls ``Tracker.step`` after every step (the loop's logging hook writes its timing
scalars with the train metrics) and ``Tracker.scalars`` for validation figures, and
adds ``Tracker.summary`` to its summary. Scalars go to ``metrics.jsonl`` in the run
directory always, to TensorBoard event files in ``--log-dir``, and to W&B /
MLflow with ``--log wandb|mlflow``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax

import shardax as sx
from shardax.cli.common import UsageError, path_arg, positive_int, warning
from shardax.track.profile import parse_steps

BACKENDS = ("tensorboard", "wandb", "mlflow")


def step_range(text: str) -> tuple[int, int]:
    """An argparse type: ``A:B``, steps A to B (from 1)."""
    try:
        return parse_steps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The tracking options every train job takes."""
    parser.add_argument(
        "--log-dir",
        type=path_arg,
        default=None,
        help="write TensorBoard event files here (tensorboard --logdir DIR); metrics.jsonl "
        "always goes to the run directory",
    )
    parser.add_argument(
        "--log-every", type=positive_int, default=10, help="log scalars every N steps (10)"
    )
    parser.add_argument(
        "--log",
        action="append",
        choices=BACKENDS,
        default=None,
        help="a metric backend (repeatable): tensorboard (the default with --log-dir), "
        "wandb (offline unless WANDB_MODE says otherwise), mlflow (DIR/mlruns unless "
        "MLFLOW_TRACKING_URI is set); each needs the extra of its name",
    )
    parser.add_argument(
        "--profile-steps",
        type=step_range,
        default=None,
        metavar="A:B",
        help="write a JAX profiler trace of steps A to B of this run (from 1) to "
        "LOG_DIR/profile (or RUN_DIR/profile), one per process; view it with TensorBoard's "
        "profile plugin or Perfetto",
    )


class Metrics:
    """The run's [`shardax.MetricWriter`][shardax.MetricWriter], whose failure to write (a
    full disk) is one warning naming the option of the directory (``where``): the run
    goes on without metrics from then on, so no step is lost for them, and the summary
    records the failure (``error``)."""

    def __init__(self, writer: Any, where: str) -> None:
        self.writer, self.where, self.error = writer, where, None
        self.path, self.log_dir = writer.path, writer.log_dir

    def _failed(self, e: Exception) -> None:
        if not isinstance(e.__cause__, OSError):  # not the disk: shardax's or a bad value
            raise e
        self.error = str(e.__cause__)
        warning(
            f"{self.where}: the metrics are not written from here on: {self.error}; the "
            "run goes on without them",
            "shardax train",
        )

    def write(self, step: int, scalars: Any) -> None:
        if self.error is None:
            try:
                self.writer.write(step, scalars)
            except RuntimeError as e:
                self._failed(e)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.writer.flush()
            except RuntimeError as e:
                self._failed(e)

    def close(self) -> None:
        try:
            self.writer.close()
        except RuntimeError as e:
            if self.error is None:
                self._failed(e)


class Tracker:
    """Metrics, step clock, input-bound note and profiling of one training run.

    Args:
      args: the parsed options (``--log-dir``, ``--log-every``, ``--log``,
        ``--profile-steps``).
      run_dir: the run directory (process 0; None elsewhere).
      steps: the number of steps this run will take.
      examples_per_step / tokens_per_step: for throughput.
      config: the run's settings, for the backends that record them.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        run_dir: Path | None,
        *,
        steps: int,
        examples_per_step: int,
        tokens_per_step: int = 0,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.every = args.log_every
        self.profile = args.profile_steps
        if self.profile is not None and self.profile[1] > steps:
            raise UsageError(
                f"--profile-steps {self.profile[0]}:{self.profile[1]}: this run has {steps} "
                f"steps, so B must be <= {steps}"
            )
        backends = list(
            dict.fromkeys([*(["tensorboard"] if args.log_dir else []), *(args.log or [])])
        )
        if "tensorboard" in backends and not args.log_dir:
            raise UsageError("--log tensorboard needs --log-dir (where the event files go)")
        # Every process needs the directory; only process 0 knows a run_dir it named itself.
        base = args.log_dir or args.run_dir or (run_dir if jax.process_count() == 1 else None)
        if self.profile is not None and base is None:
            raise UsageError(
                "--profile-steps with several processes needs --log-dir or --run-dir, so "
                "that every process writes its trace into the same directory"
            )
        self.profile_dir = Path(base or ".") / "profile"
        try:
            writer = sx.MetricWriter(
                run_dir if run_dir is not None else ".",
                log_dir=args.log_dir,
                backends=backends,
                config=config,
            )
            where = f"--run-dir {args.run_dir}" if args.run_dir else f"the run directory {run_dir}"
            if args.log_dir:
                where += f" or --log-dir {args.log_dir}"
            self.writer = Metrics(writer, where)
        except OSError as e:
            raise UsageError(f"--log-dir: {e.strerror or e}") from None
        except ImportError as e:
            raise UsageError(f"--log {' '.join(backends)}: {e}") from None
        self.is_main = jax.process_index() == 0
        self.clock = sx.track.StepClock(examples_per_step, tokens_per_step)
        self.done = self.calls = 0
        self.profiler: Any = None

    def watch(self, feed: Any) -> Any:
        """Counts the time the loop waits on ``feed`` (``sx.prefetch_to_device``'s iterator
        or ``sx.data.timed(...)``) as data wait; returns ``feed``."""
        clock = self.clock
        self.clock = sx.track.StepClock(clock.examples_per_step, clock.tokens_per_step, input=feed)
        return feed

    def wrap(self, step: Any) -> Any:
        """``step``, profiled over ``--profile-steps`` when given."""
        if self.profile is None:
            return step

        self.profiler = sx.track.profile_steps(step, self.profile_dir, *self.profile)
        return self.profiler

    def step(self, step: int, ready: Any) -> dict[str, float] | None:
        """After each step (``step``: the global step number): counts it, and every
        ``--log-every`` steps returns the window's timing scalars (the loop writes them
        with the train metrics it fetched). The clock starts after this run's first
        (compiling) step, once ``ready`` (the step's output) is."""
        self.done = step
        self.calls += 1
        if self.calls == 1:
            jax.block_until_ready(ready)
            self.clock.start()
            return None
        self.clock.tick()
        if step % self.every == 0:
            return self.clock.lap().scalars()
        return None

    def scalars(self, scalars: dict[str, Any]) -> None:
        """Queues ``scalars`` (e.g. ``{"val/loss": ...}``) at the current step."""
        self.writer.write(self.done, scalars)

    @property
    def data_wait_fraction(self) -> float:
        """Of the wall time since the first step, the fraction spent waiting for input."""
        return self.clock.total().data_wait_fraction

    def input_bound(self) -> str | None:
        """The input-bound note, the first time the run so far is input-bound."""
        return self.clock.input_bound(self.clock.total())

    def close(self) -> None:
        """Stops a trace still open and writes every queued scalar."""
        if self.profiler is not None:
            self.profiler.close()
        self.writer.close()

    def summary(self) -> dict[str, Any]:
        """Figures for the run's summary: data-wait fraction, where metrics and trace went."""
        total = self.clock.total()
        return {
            "data_wait_fraction": total.data_wait_fraction,
            "step_time_s": total.step_time,
            "metrics_jsonl": str(self.writer.path) if self.is_main else None,
            "metrics_error": self.writer.error,
            "log_dir": str(self.writer.log_dir) if self.writer.log_dir else None,
            "profile_trace": str(self.profiler.trace_dir)
            if self.profiler is not None and self.profiler.trace_dir
            else None,
        }
