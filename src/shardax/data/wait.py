"""``timed(iterable)``: an iterator that counts the seconds its consumer waits in ``next()``.

For loops without [`shardax.prefetch_to_device`][shardax.prefetch_to_device] (whose
iterator counts its own ``wait_seconds``): wrapped in ``timed``, a synchronous loader
reports how long the loop stood still reading input, the same figure
[`shardax.track.StepClock`][shardax.track.StepClock] turns into a data-wait fraction.

>>> it = timed(iter([1, 2, 3]))
>>> list(it), it.wait_seconds >= 0
([1, 2, 3], True)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from shardax.checks import public


@public("sx.data.Timed")
class Timed(Iterator[Any]):
    """``iterable``'s items, in order; ``wait_seconds`` is the time spent in its ``next()``."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self._source = iter(iterable)
        self.wait_seconds = 0.0

    def __iter__(self) -> Timed:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self._source)
        finally:
            self.wait_seconds += time.perf_counter() - start

    def get_state(self) -> Any:
        """The source's ``get_state()``, when it has one."""
        return self._source.get_state()  # type: ignore[attr-defined]


@public("sx.data.timed")
def timed(iterable: Iterable[Any]) -> Timed:
    """Wraps ``iterable`` so that ``wait_seconds`` counts the time ``next()`` blocks."""
    return Timed(iterable)
