"""``StepClock``: where a loop's wall time goes: step time, throughput, waiting for input.

The clock reads the host's wall time at each ``tick()`` (one per step) and the input
iterator's ``wait_seconds`` ([`shardax.prefetch_to_device`][shardax.prefetch_to_device]'s
iterator, or any iterable wrapped in [`sx.data.timed`][shardax.data.timed]): the seconds
the loop stood blocked on input. Over a window of steps,
``data_wait_fraction = waited / wall``: near 0 when prefetching hides the input, near
``T_in / (T_in + T_c)`` when every batch is read while the device idles. Above
``INPUT_BOUND`` the run is input-bound, and
[`StepClock.input_bound`][shardax.track.StepClock.input_bound] says so, once.

>>> feed = sx.prefetch_to_device(batches, mesh)
>>> clock = StepClock(examples_per_step=16, input=feed)
>>> for batch in feed:
...     state, metrics = step(state, batch)
...     clock.tick()
>>> sorted(clock.lap().scalars())
['perf/data_wait_fraction', 'perf/examples_per_s', 'perf/step_time_s']
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from shardax.checks import as_count, public

INPUT_BOUND = 0.2
"""Data-wait fraction above which a run is called input-bound."""


@public("sx.track.Window")
@dataclasses.dataclass(frozen=True)
class Window:
    """A stretch of steps: their count, wall seconds, seconds waiting for input, and the
    examples and tokens they processed."""

    steps: int
    seconds: float
    wait_seconds: float
    examples: int
    tokens: int

    @property
    def step_time(self) -> float:
        return self.seconds / max(self.steps, 1)

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def data_wait_fraction(self) -> float:
        return min(self.wait_seconds / self.seconds, 1.0) if self.seconds > 0 else 0.0

    def scalars(self, prefix: str = "perf/") -> dict[str, float]:
        """The window as metric scalars (tokens/s only when tokens were counted)."""
        out = {
            f"{prefix}step_time_s": self.step_time,
            f"{prefix}examples_per_s": self.examples_per_s,
            f"{prefix}data_wait_fraction": self.data_wait_fraction,
        }
        if self.tokens:
            out[f"{prefix}tokens_per_s"] = self.tokens_per_s
        return out


@public("sx.track.StepClock")
class StepClock:
    """Counts steps, wall time and input wait; ``lap()`` gives the window since the last
    lap, ``total()`` the whole run since ``start()`` (or construction).

    Args:
      examples_per_step: examples in one (global) batch.
      tokens_per_step: tokens in one batch (0: not a token model).
      input: the loop's input iterator, with a ``wait_seconds`` attribute (None: no input
        wait is counted).
    """

    def __init__(self, examples_per_step: int, tokens_per_step: int = 0, input: Any = None):
        if input is not None and not hasattr(input, "wait_seconds"):
            raise TypeError(
                f"input must count its wait_seconds (sx.prefetch_to_device(...) or "
                f"sx.data.timed(iterable)), got {type(input).__name__}"
            )
        self.examples_per_step = as_count("examples_per_step", examples_per_step)
        self.tokens_per_step = as_count("tokens_per_step", tokens_per_step, minimum=0)
        self._input = input
        self._said = False
        self.start()

    def _waited(self) -> float:
        return self._input.wait_seconds if self._input is not None else 0.0

    def start(self) -> None:
        """Starts counting from now (e.g. after the first, compiling step)."""
        self._now = time.perf_counter()
        self._start = self._lap = (self._now, self._waited(), 0)
        self._steps = 0

    def tick(self, steps: int = 1) -> None:
        """Marks the end of ``steps`` more steps."""
        self._steps += as_count("steps", steps, minimum=0)
        self._now = time.perf_counter()

    def _window(self, since: tuple[float, float, int]) -> Window:
        t0, w0, s0 = since
        now = self._now
        steps = self._steps - s0
        return Window(
            steps=steps,
            seconds=max(now - t0, 0.0),
            wait_seconds=self._waited() - w0,
            examples=steps * self.examples_per_step,
            tokens=steps * self.tokens_per_step,
        )

    def lap(self) -> Window:
        """The steps since the last lap (or start), up to the last tick; starts a new lap."""
        window = self._window(self._lap)
        self._lap = (self._now, self._waited(), self._steps)
        return window

    def total(self) -> Window:
        """The steps since [`start`][shardax.track.StepClock.start], up to the last tick."""
        return self._window(self._start)

    def input_bound(self, window: Window, threshold: float = INPUT_BOUND) -> str | None:
        """A one-line note the first time a window waits on input more than ``threshold``
        of its wall time; None otherwise, and always after the first note."""
        if self._said or window.steps == 0 or window.data_wait_fraction <= threshold:
            return None
        self._said = True
        return (
            f"input-bound: {window.data_wait_fraction:.0%} of the wall time over "
            f"{window.steps} steps went to waiting for input (data-wait fraction "
            f"{window.data_wait_fraction:.2f} > {threshold}); a faster loader, more "
            f"loader workers or a larger prefetch buffer would speed this run up"
        )
