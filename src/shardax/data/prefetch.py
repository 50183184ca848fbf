"""Asynchronous prefetch: a background thread places batches on devices ahead of the consumer.

One worker thread reads the source, places each batch with
[`global_batch`][shardax.global_batch] (so it works on many hosts) and waits for the
transfer, and puts it in a bounded queue of ``buffer_size`` batches. The consumer gets
them in order. Nothing hangs and nothing is swallowed:

- an exception the source (or the placement) raises at item ``k`` is raised in the consumer
  at item ``k``, with its original type; the iterator is finished after it;
- ``close()``, the end of a ``with`` block, an early ``break`` out of
  ``for b in prefetch_to_device(...)``, ``del``, or a ``KeyboardInterrupt`` while waiting
  for a batch stop the worker: it notices within 50 ms, even while blocked on a full
  queue, and ``close()`` joins it;
- a source that blocks inside ``next()`` cannot be interrupted from another thread: the
  worker is a daemon thread, ``close()`` returns after at most 0.25 s anyway, and the
  worker exits as soon as the source returns.

``wait_seconds`` is the time the consumer has spent blocked waiting for a batch: the input
time prefetching did not hide (see [`shardax.track.StepClock`][shardax.track.StepClock]).

If the source iterator has ``get_state()`` (``sx.batches``, grain's ``DatasetIterator``),
[`Prefetcher.get_state`][shardax.data.Prefetcher.get_state] is the source's state after
the last batch *consumed*, not after the last one read ahead, so a checkpoint resumes
exactly where the consumer was. If it has ``set_state()`` too, ``close()``, leaving a
``with`` block (by its end, a ``break`` or any exception) or a ``KeyboardInterrupt`` while
waiting put the caller's iterator back there, so the batches read ahead and dropped are
the next ones it yields. It does not where that would not be safe, and warns, naming the
batches lost: a worker still busy after 0.25 s, an iterator something else has moved
meanwhile (another prefetcher of it), or a prefetcher dropped unclosed (a ``break`` out of
``for b in prefetch_to_device(loader)``: the collector does not rewind, as a new
prefetcher may be reading the iterator already). A plain iterator of the caller's (a
generator: no ``set_state()``) cannot go back: a ``close()`` or a ``with`` block's end
drops its batches read ahead, as asked, and a prefetcher left by an exception or dropped
unclosed warns, naming them. An iterable (a list, a ``range``) is read through an iterator
of the prefetcher's own, so nothing of the caller's moves. A prefetcher ended by an error
of its source, or read to its end, moves nothing.

>>> mesh = sx.make_mesh({"data": -1})
>>> with prefetch_to_device(({"x": np.full((8, 2), i)} for i in range(3)), mesh) as it:
...     [int(b["x"][0, 0]) for b in it]
[0, 1, 2]
"""

from __future__ import annotations

import atexit
import copy
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from shardax.checks import as_count, public
from shardax.data.assembly import as_sharding, global_batch
from shardax.data.policy import batch_size_of, check_policy, fit_batch
from shardax.data.spec import check_batch_spec, place_by_spec

__all__ = ["Prefetcher", "as_sharding", "prefetch_to_device"]

_POLL_S = 0.05  # how often a blocked worker or consumer looks at the stop flag
_JOIN_S = 0.25  # how long close() waits for the worker before leaving it (a daemon)
_END = object()
_SKIP = object()
_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


class _Progress:
    """What the worker has read: the batches it handed on (or was handing on when
    stopped), and the source's state after its last ``next()``. Shared with the
    Prefetcher, which the worker holds no reference to."""

    def __init__(self) -> None:
        self.read = 0
        self.state: Any = None


class _Raised:
    """An exception from the worker, delivered to the consumer in its place in the order."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts ``item``, waiting for room but giving up (False) once ``stop`` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _work(
    source: Iterator[Any],
    owned: bool,
    place: Callable[[Any], Any],
    stateful: bool,
    q: queue.Queue,
    stop: threading.Event,
    progress: _Progress,
) -> None:
    """The worker's loop. It holds no reference to the Prefetcher, so ``del`` reaches it."""
    try:
        while not stop.is_set():
            try:
                item = next(source)
            except StopIteration:
                _put(q, (_END, None), stop)
                return
            state = copy.deepcopy(source.get_state()) if stateful else None
            progress.state = state
            placed = place(item)
            if placed is _SKIP:
                continue
            progress.read += 1
            if not _put(q, (placed, state), stop):
                return
    except BaseException as e:  # delivered to the consumer, which re-raises it
        _put(q, (_Raised(e), None), stop)
    finally:
        close = getattr(source, "close", None)
        if owned and callable(close):
            close()


def _placer(sharding: Any, policy: str | None, batch_size: int | None) -> Callable[[Any], Any]:
    """``batch -> global batch`` with the uneven-batch ``policy`` applied first (if any)."""
    sizes = [batch_size]

    def place(batch: Any) -> Any:
        if policy is not None:
            if sizes[0] is None:
                sizes[0] = batch_size_of(batch)  # the first batch fixes the size
            batch = fit_batch(batch, sizes[0], policy)
            if batch is None:
                return _SKIP
        return jax.block_until_ready(global_batch(batch, sharding))

    return place


@public("sx.data.Prefetcher")
class Prefetcher(Iterator[Any]):
    """The iterator [`prefetch_to_device`][shardax.prefetch_to_device] returns:
    ``close()``, context manager, ``get_state()``, ``wait_seconds``. See the module
    docstring for the guarantees."""

    wait_seconds: float
    """Seconds ``next()`` has spent blocked on the queue, waiting for the worker."""

    def __init__(
        self,
        iterable: Iterable[Any],
        place: Callable[[Any], Any],
        buffer_size: int,
    ) -> None:
        source = iter(iterable)
        get_state = getattr(source, "get_state", None)
        self._stateful = callable(get_state)
        self._state = copy.deepcopy(get_state()) if callable(get_state) else None
        rewinds = (
            self._stateful and source is iterable and callable(getattr(source, "set_state", None))
        )
        self._source = source if rewinds else None  # the caller's own: close() rewinds it
        self._held = source if source is iterable else None  # the caller's own iterator
        self._progress, self._consumed = _Progress(), 0
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._finished = self._closed = False
        self.wait_seconds = 0.0
        self._thread = threading.Thread(
            target=_work,
            args=(
                source,
                source is not iterable,
                place,
                self._stateful,
                self._queue,
                self._stop,
                self._progress,
            ),
            name="shardax-prefetch",
            daemon=True,
        )
        self._thread.start()
        _LIVE.add(self)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        start = time.perf_counter()
        try:
            item, state = self._get()
        except BaseException:  # KeyboardInterrupt while waiting: stop the worker first
            self._close(rewind=True, failed=True)
            raise
        finally:
            self.wait_seconds += time.perf_counter() - start
        if item is _END:
            self._close(rewind=False)
            raise StopIteration
        if isinstance(item, _Raised):
            self._close(rewind=False)
            raise item.error
        self._state = state
        self._consumed += 1
        return item

    def _get(self) -> tuple[Any, Any]:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the prefetch worker stopped without a result") from None

    def get_state(self) -> Any:
        """The source iterator's ``get_state()`` after the last consumed batch."""
        if not self._stateful:
            raise TypeError("the source iterator has no get_state(), so neither has its prefetch")
        return self._state

    def close(self) -> None:
        """Stops the worker, drops the batches it read ahead, and joins it (<= 0.25 s); the
        caller's iterator, where it has ``set_state()``, goes back after the last consumed
        batch (see the module docstring)."""
        self._close(rewind=True)

    def _close(self, rewind: bool, dropping: bool = False, failed: bool = False) -> None:
        if self._closed:
            return
        self._finished = self._closed = True
        self._stop.set()
        self._drain()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_JOIN_S)
        self._drain()
        dropped = self._progress.read - self._consumed
        if rewind and self._source is not None and dropped > 0:
            self._rewind(dropped)
        elif dropping and self._source is not None and dropped > 0:
            self._lost(
                dropped,
                "it was dropped unclosed (a break out of `for batch in "
                "prefetch_to_device(loader)`); use a with block, or call close()",
            )
        elif (failed or dropping) and self._held is not None and dropped > 0:
            self._lost(
                dropped,
                f"it was {'left by an exception' if failed else 'dropped unclosed'} and has no "
                "get_state() and set_state() to go back with (sx.batches and grain's "
                "DatasetIterator have them)",
                stacklevel=4,
            )
        self._source = self._held = None

    def _rewind(self, dropped: int) -> None:
        """Puts the caller's iterator back over the ``dropped`` batches read ahead, or
        warns that they are lost (never raises: close() may run under an exception)."""
        if self._thread.is_alive():
            why = f"its worker was still busy {_JOIN_S} s after close()"
        else:
            try:
                if self._source.get_state() != self._progress.state:  # type: ignore[union-attr]
                    why = "something else moved the iterator meanwhile"
                else:
                    self._source.set_state(copy.deepcopy(self._state))  # type: ignore[union-attr]
                    return
            except Exception as e:
                why = f"its set_state() raised {type(e).__name__}: {e}"
        self._lost(dropped, why)

    def _lost(self, dropped: int, why: str, stacklevel: int = 5) -> None:
        first, last = self._consumed + 1, self._consumed + dropped
        which = f"batch {first}" if dropped == 1 else f"batches {first}..{last}"
        warnings.warn(
            f"prefetch close(): {which} of this prefetcher (counted from 1; read ahead, never "
            f"consumed) are lost to the source iterator, which stays after them: {why}",
            RuntimeWarning,
            stacklevel=stacklevel,
        )

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        # A with block left by an exception loses no batch either, or says which it lost;
        # one inside a generator that is closed (its consumer's break: GeneratorExit) is
        # a close as asked.
        failed = isinstance(kind, type) and not issubclass(kind, GeneratorExit)
        self._close(rewind=True, failed=failed)

    def __del__(self) -> None:  # a break out of an unnamed prefetcher
        if hasattr(self, "_thread"):
            # No rewind from the collector (a new prefetcher of the same iterator may be
            # reading it already), but a word when batches are lost.
            self._close(rewind=False, dropping=True)


@atexit.register
def _close_all() -> None:
    for prefetcher in list(_LIVE):
        prefetcher._close(rewind=False)


@public("sx.prefetch_to_device")
def prefetch_to_device(
    iterable: Iterable[Any],
    target: Any = None,
    buffer_size: int = 2,
    *,
    policy: str | None = None,
    batch_size: int | None = None,
    batch_spec: Any = None,
) -> Prefetcher:
    """Yields the batches of ``iterable`` in order, placed on ``target`` by a background
    thread that keeps up to ``buffer_size`` of them ready.

    Args:
      iterable: any iterable of pytrees of arrays: a generator, ``sx.batches(...)``, a grain
        ``MapDataset`` or ``IterDataset`` (batched), ... Each process yields its own slice.
      target: a ``Device``, any ``Sharding``, or a ``Mesh`` (the batch split over its
        ``"data"`` axis); default: the first local device.
      buffer_size: how many placed batches wait for the consumer (>= 1).
      policy: None (batches pass as they are), or ``"error"``, ``"drop"`` or ``"pad"`` for
        batches smaller than ``batch_size``; see ``shardax.data.policy``.
      batch_size: the fixed (process-local) batch size for ``policy``; default: the size
        of the first batch. With many processes, each decides for its own slice, so they
        must agree on which batches are short; ``sx.batches`` decides globally.
      batch_spec: for batches whose leaves are not examples (a graph batch), how each
        leaf is split over the ``target`` mesh: a ``PartitionSpec`` (``P()``: not
        split) or a pytree of them (``shardax.data.spec``); not with ``policy``.

    Returns a [`Prefetcher`][shardax.data.Prefetcher]: an iterator with ``close()``,
    usable as a context manager. Every ``break`` out of a named iterator should be
    followed by ``close()``, or use ``with``.
    """
    if isinstance(iterable, Mapping):
        raise TypeError(
            f"iterable must be an iterable of batches (a list of them, a generator, "
            f"sx.batches(...)), got a {type(iterable).__name__} (keys {list(iterable)[:4]}), "
            "which would yield its keys: pass [batch] for one batch, or sx.batches(data, "
            "batch_size) to cut a dict of arrays into batches"
        )
    buffer_size = as_count("buffer_size", buffer_size)
    if policy is not None:
        check_policy(policy)
    if batch_size is not None:
        batch_size = as_count("batch_size", batch_size)
    if batch_spec is not None:
        place = _spec_placer(target, batch_spec, policy)
    else:
        place = _placer(as_sharding(target), policy, batch_size)
    return Prefetcher(iterable, place, buffer_size)


def _spec_placer(target: Any, batch_spec: Any, policy: str | None) -> Callable[[Any], Any]:
    """Places each batch leaf by leaf as ``batch_spec`` says, over the mesh ``target``."""
    check_batch_spec(batch_spec)
    if not isinstance(target, Mesh):
        raise TypeError(
            f"with batch_spec, target must be the Mesh the specs name, got "
            f"{type(target).__name__}: {target!r}"
        )
    if policy is not None:
        raise ValueError(
            f"policy={policy!r} pads or drops rows as examples, but batch_spec says the "
            "batch's leaves are not examples; fit such batches before prefetching"
        )
    return lambda batch: jax.block_until_ready(place_by_spec(batch, target, batch_spec))
