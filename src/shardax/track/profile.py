"""``profile_steps``: a JAX profiler trace of steps A to B of any training loop.

Wrap the step function; calls are counted from 1. The trace starts before call ``A``
and stops after call ``B``'s results are ready, each profiled call annotated as a step
(``jax.profiler.StepTraceAnnotation``) for the profile plugin's step view. Each process
writes its own trace, under ``directory/process_<index>``, so several processes on one
host never overwrite each other's files. A trace is TensorBoard's profile format
(``plugins/profile/<time>/<host>.xplane.pb``: ``tensorboard --logdir directory``, or
xprof) plus ``perfetto_trace.json.gz`` for https://ui.perfetto.dev.

>>> step = sx.track.profile_steps(step, "runs/profile", 2, 3)
>>> for batch in batches:
...     state, metrics = step(state, batch)     # calls 2..3 traced
>>> step.close()                                 # stops a trace a short loop left open
>>> str(step.trace_dir)                          # doctest: +ELLIPSIS
'runs/profile/process_0/plugins/profile/...'
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from shardax.checks import as_count, as_function, as_path, public
from shardax.track.sinks import check_writable


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` -> ``(A, B)`` with ``1 <= A <= B``; else a ``ValueError`` saying so."""
    first, sep, last = text.partition(":")
    try:
        start, stop = int(first), int(last)
    except ValueError:
        start = stop = 0
    if not sep or start < 1 or stop < start:
        raise ValueError(f"expected A:B with 1 <= A <= B (steps A to B, from 1), got {text!r}")
    return start, stop


@public("sx.track.StepProfiler")
class StepProfiler:
    """The wrapped step: calls ``fn``, tracing calls ``start`` to ``stop``. Other
    attributes (``shard``, ``init``, ``mesh``, ...) are ``fn``'s."""

    def __init__(
        self, fn: Callable[..., Any], directory: str | os.PathLike[str], start: int, stop: int
    ) -> None:
        as_function("fn", fn, "callable (e.g. a train step)")
        as_path("directory", directory)
        start = as_count("start", start)
        stop = as_count("stop", stop)
        if stop < start:
            raise ValueError(f"stop must be >= start, got {start}:{stop}")
        self.fn, self.start, self.stop = fn, start, stop
        # Created and checked now, not at step ``start`` after hours of training.
        # An OSError with an errno keeps its own format (no door prefix): name the door here.
        self.directory = check_writable(
            Path(directory) / f"process_{jax.process_index()}", "sx.track.profile_steps: directory"
        )
        self.calls = 0
        self.trace_dir: Path | None = None
        self._tracing = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.start:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self._tracing = True
        if not self._tracing:
            return self.fn(*args, **kwargs)
        with jax.profiler.StepTraceAnnotation("train", step_num=self.calls):
            out = self.fn(*args, **kwargs)
        if self.calls == self.stop:
            jax.block_until_ready(out)
            self._finish()
        return out

    def _finish(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False
        runs = (self.directory / "plugins" / "profile").iterdir()
        self.trace_dir = max(runs, key=lambda p: p.stat().st_mtime)

    def close(self) -> None:
        """Stops a trace still running (the loop ended before ``stop``)."""
        if self._tracing:
            self._finish()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        if name == "fn":
            raise AttributeError(name)
        return getattr(self.fn, name)


@public("sx.track.profile_steps")
def profile_steps(
    fn: Callable[..., Any], directory: str | os.PathLike[str], start: int, stop: int
) -> StepProfiler:
    """``fn`` (e.g. a train step), writing a profiler trace of its calls ``start`` to
    ``stop`` (from 1, inclusive) under ``directory/process_<index>``; see the module."""
    return StepProfiler(fn, directory, start, stop)
