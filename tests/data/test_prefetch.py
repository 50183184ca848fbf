"""The threaded prefetch: order, placement, errors in place, stopping, no deadlock."""

import contextlib
import signal
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.data.prefetch import Prefetcher


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "shardax-prefetch"]


GONE_S = 10.0
"""How long a worker may take to leave: generous, as CI's two cores are shared by four
test workers (1 s once failed there); a worker that never leaves still fails."""


def gone_within(seconds: float, before: set[threading.Thread]) -> bool:
    """True once no prefetch worker is left, nor any other thread of shardax's started
    since ``before`` (the threads then). Threads of other libraries are not counted: one
    that an earlier test in the same worker set going (a checkpoint's, JAX's) may start or
    stay while this test runs, which once failed a plain thread count on CI."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        new = [t for t in threading.enumerate() if t not in before]
        if not workers() and not [t for t in new if t.name.startswith("shardax")]:
            return True
        time.sleep(0.01)
    return False


def endless(consumed=None, rows=8):
    i = 0
    while True:
        if consumed is not None:
            consumed.append(i)
        yield {"x": np.full((rows, 2), i, np.float32)}
        i += 1


@pytest.fixture
def before():
    assert not workers(), "a previous test left a prefetch worker behind"
    return set(threading.enumerate())


def test_in_order_and_placed_on_each_kind_of_target(mesh):
    source = [{"x": np.full((8, 2), i), "step": np.int32(i), "tag": "t"} for i in range(6)]
    out = list(sx.prefetch_to_device(source, mesh, buffer_size=3))
    assert [int(b["x"][0, 0]) for b in out] == list(range(6))
    for b in out:
        assert b["x"].sharding.spec == P("data") and b["step"].sharding.is_fully_replicated
        assert {s.data.shape for s in b["x"].addressable_shards} == {(1, 2)}
        assert b["tag"] == "t"
    d = jax.devices()[6]
    assert next(iter(sx.prefetch_to_device(source, d)))["x"].devices() == {d}
    spec = NamedSharding(sx.make_mesh({"data": 4, "model": 2}), P("data", "model"))
    first = next(iter(sx.prefetch_to_device(source, spec)))
    assert first["x"].sharding.spec == P("data", "model")
    assert {s.data.shape for s in first["x"].addressable_shards} == {(2, 1)}


def test_worker_reads_ahead_on_its_own(mesh, before):
    consumed = []
    with sx.prefetch_to_device(endless(consumed), mesh, buffer_size=3) as it:
        next(it)
        deadline = time.monotonic() + 2
        while len(consumed) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        # 1 consumed + 3 in the queue + 1 in the worker's hands, and no more.
        assert len(consumed) == 5
        time.sleep(0.1)
        assert len(consumed) == 5
    assert gone_within(GONE_S, before)


class SourceError(Exception):
    pass


def test_source_error_raised_at_its_item_with_its_type(mesh, before):
    def source():
        for i in range(3):
            yield {"x": np.full((8,), i)}
        raise SourceError("item 3 is broken")

    it = sx.prefetch_to_device(source(), mesh)
    got = [int(next(it)["x"][0]) for _ in range(3)]
    assert got == [0, 1, 2]
    with pytest.raises(SourceError, match="item 3 is broken"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert gone_within(GONE_S, before)


def test_placement_error_raised_at_its_item(mesh, before):
    source = [{"x": np.zeros((8, 2))}, {"x": np.zeros((8, 2))}, {"x": np.zeros((12, 2))}]
    it = sx.prefetch_to_device(source, mesh)
    next(it), next(it)
    with pytest.raises(ValueError, match=r"'x' with shape \(12, 2\).*size 12.*size 8"):
        next(it)
    assert gone_within(GONE_S, before)


def test_break_close_del_and_with_stop_the_worker(mesh, before):
    for _ in sx.prefetch_to_device(endless(), mesh):  # early break, iterator not named
        break
    assert gone_within(GONE_S, before)

    it = sx.prefetch_to_device(endless(), mesh)
    next(it)
    it.close()
    assert gone_within(GONE_S, before)
    with pytest.raises(StopIteration):
        next(it)

    it = sx.prefetch_to_device(endless(), mesh)
    next(it)
    del it
    assert gone_within(GONE_S, before)

    with sx.prefetch_to_device(endless(), mesh) as it:
        for i, _ in enumerate(it):
            if i == 3:
                break
    assert gone_within(GONE_S, before)


def test_keyboard_interrupt_in_the_loop_body(mesh, before):
    with pytest.raises(KeyboardInterrupt), sx.prefetch_to_device(endless(), mesh) as it:
        for _ in it:
            raise KeyboardInterrupt
    assert gone_within(GONE_S, before)


def test_keyboard_interrupt_while_waiting_for_a_batch(before):
    assert threading.current_thread() is threading.main_thread()

    def slow():
        while True:
            time.sleep(0.05)
            yield np.zeros(4)

    it = sx.prefetch_to_device(slow())
    next(it)
    main = threading.main_thread().ident
    timer = threading.Timer(0.02, signal.pthread_kill, (main, signal.SIGINT))
    # Python's own handler, also where SIGINT was inherited ignored (a background job)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):  # the real signal, delivered inside next()
            while True:
                next(it)
    finally:
        signal.signal(signal.SIGINT, previous)
    timer.join()
    assert gone_within(GONE_S, before)
    with pytest.raises(StopIteration):
        next(it)


def test_slow_consumer_and_full_queue_do_not_deadlock(mesh, before):
    with sx.prefetch_to_device(endless(), mesh, buffer_size=1) as it:
        for i, b in enumerate(it):
            assert int(b["x"][0, 0]) == i
            time.sleep(0.05)  # the worker waits on a full queue meanwhile
            if i == 4:
                break
        start = time.monotonic()
    assert time.monotonic() - start < 0.5
    assert gone_within(GONE_S, before)


def test_source_blocking_forever_does_not_block_close(before):
    release = threading.Event()

    def stuck():
        yield np.zeros(4)
        release.wait()  # blocks inside next() until the test lets it go
        yield np.ones(4)

    it = sx.prefetch_to_device(stuck())
    next(it)
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 0.5  # close() returns although the source is stuck
    assert workers() and all(t.daemon for t in workers())  # a daemon cannot block exit
    release.set()
    assert gone_within(GONE_S, before)  # it leaves as soon as the source returns


def test_policy_pads_the_short_last_batch_without_recompiling(mesh):
    sizes = [16, 16, 5]
    source = [{"x": np.arange(n, dtype=np.float32) + 1} for n in sizes]
    masked_sum = jax.jit(lambda b: jnp.sum(jnp.where(b["mask"], b["x"], 0.0)))
    out = []
    with sx.prefetch_to_device(source, mesh, policy="pad") as it:
        for b in it:
            assert b["x"].shape == (16,) and b["mask"].sharding.spec == P("data")
            out.append(float(masked_sum(b)))
    assert out == [float(np.sum(np.arange(n) + 1)) for n in sizes]
    assert masked_sum._cache_size() == 1


def test_policy_drop_and_error(mesh):
    source = [{"x": np.zeros(16)}, {"x": np.zeros(16)}, {"x": np.zeros(8)}]
    assert len(list(sx.prefetch_to_device(source, mesh, policy="drop"))) == 2
    it = sx.prefetch_to_device(source, mesh, policy="error")
    next(it), next(it)
    with pytest.raises(ValueError, match="batch has 8 examples but the batch size is 16"):
        next(it)
    with pytest.raises(ValueError, match="policy must be one of"):
        sx.prefetch_to_device(source, mesh, policy="truncate")


def test_state_is_the_consumers_not_the_read_ahead(mesh):
    data = {"x": np.arange(256, dtype=np.float32)}
    loader = sx.batches(data, 8, shuffle=True, seed=1)
    reference = sx.batches(data, 8, shuffle=True, seed=1)
    with sx.prefetch_to_device(loader, mesh, buffer_size=4) as it:
        assert it.get_state() == reference.get_state()
        for _ in range(3):
            next(it)
            next(reference)
        time.sleep(0.1)  # the worker is ahead by now
        assert loader.get_state()["index"] > 3
        assert it.get_state() == reference.get_state()
    with pytest.raises(TypeError, match="has no get_state"):
        sx.prefetch_to_device([np.zeros(8)]).get_state()


class Stateful:
    """A stateful source: ``n`` rows of 8 (the one at ``short`` 4), position ``i``; like
    a re-iterable loader, its ``StopIteration`` moves it to the next epoch."""

    def __init__(self, n, short=None, fail_set=False):
        self.n, self.short, self.fail_set = n, short, fail_set
        self.epoch, self.i = 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == self.n:
            self.epoch, self.i = self.epoch + 1, 0
            raise StopIteration
        self.i += 1
        return {"x": np.full((4 if self.i - 1 == self.short else 8,), self.i - 1.0)}

    def get_state(self):
        return {"epoch": self.epoch, "i": self.i}

    def set_state(self, state):
        if self.fail_set:
            raise OSError("the shard server is gone")
        self.epoch, self.i = state["epoch"], state["i"]


def read_ahead(source, at_least, timeout=30.0):
    """Waits (polling) until the worker has read ``source`` to ``at_least``."""
    deadline = time.monotonic() + timeout
    while source.get_state()["i" if isinstance(source, Stateful) else "index"] < at_least:
        assert time.monotonic() < deadline, "the prefetch worker did not read ahead"
        time.sleep(0.01)


def test_close_puts_the_callers_loader_back_after_the_last_consumed_batch(mesh):
    """The batches read ahead and dropped by close() are the next ones the loader yields:
    breaking out of a prefetched loop and going on with the loader loses none."""
    data = {"x": np.arange(256, dtype=np.float32)}
    loader = sx.batches(data, 8, shuffle=True, seed=1, num_epochs=None)
    reference = sx.batches(data, 8, shuffle=True, seed=1, num_epochs=None)
    with sx.prefetch_to_device(loader, mesh, buffer_size=4) as it:
        for _, want in zip(range(3), reference, strict=False):
            np.testing.assert_array_equal(np.asarray(next(it)["x"]), want["x"])
        read_ahead(loader, 6)
    assert loader.get_state() == reference.get_state()
    for got, want in zip(loader, reference, strict=False):  # the rest of the epoch, in order
        np.testing.assert_array_equal(got["x"], want["x"])
        if reference.get_state()["index"] == 0:
            break
    it = sx.prefetch_to_device(loader, mesh, buffer_size=2)  # close() itself, after a break
    for batch in it:
        first = batch
        break
    it.close()
    assert loader.get_state() == {**reference.get_state(), "epoch": 1, "index": 1}
    np.testing.assert_array_equal(np.asarray(first["x"]), next(reference)["x"])


def test_close_moves_nothing_at_the_end_and_names_what_a_dropped_prefetcher_lost(mesh):
    """Read to its end, the source keeps its own end state (here: the next epoch), even
    past a short batch the policy skipped; a prefetcher dropped unclosed leaves the source
    where its worker left it (no rewind from the collector) and names the batches lost."""
    source = Stateful(3, short=2)
    assert [float(b["x"][0]) for b in sx.prefetch_to_device(source, mesh, policy="drop")] == [0, 1]
    assert source.get_state() == {"epoch": 1, "i": 0}
    source = Stateful(20)
    it = sx.prefetch_to_device(source, mesh, buffer_size=2)
    next(it)
    read_ahead(source, 3)
    time.sleep(0.05)
    with pytest.warns(RuntimeWarning) as caught:
        del it  # as when a name is bound to a new prefetcher: no rewind from the collector
    lost = source.get_state()["i"] - 1
    assert str(caught[0].message) == (
        f"prefetch close(): batches 2..{1 + lost} of this prefetcher (counted from 1; read "
        "ahead, never consumed) are lost to the source iterator, which stays after them: it "
        "was dropped unclosed (a break out of `for batch in prefetch_to_device(loader)`); use "
        "a with block, or call close()"
    )
    assert lost >= 2


def test_a_with_block_left_by_an_exception_puts_the_loader_back(mesh):
    """A caught exception out of a with block over the prefetched batches skips no batch:
    the loader goes on after the last one consumed; where it cannot be put back (its
    set_state() fails) a warning names the batches, and the exception is the block's own."""
    source = Stateful(20)
    with contextlib.suppress(KeyError), sx.prefetch_to_device(source, mesh, buffer_size=2) as it:
        assert float(next(it)["x"][0]) == 0
        read_ahead(source, 3)
        raise KeyError("the block's")
    assert source.get_state() == {"epoch": 0, "i": 1}
    assert float(next(source)["x"][0]) == 1  # the next batch is the one after the consumed
    source = Stateful(20, fail_set=True)
    with (
        pytest.raises(KeyError, match="the block's"),
        pytest.warns(RuntimeWarning, match=r"batches 2\.\.\d+ of this .* set_state\(\) raised"),
        sx.prefetch_to_device(source, mesh, buffer_size=2) as it,
    ):
        next(it)
        read_ahead(source, 3)
        raise KeyError("the block's")
    assert source.get_state()["i"] >= 3


def test_a_plain_iterator_left_by_an_exception_or_dropped_names_the_batches_lost(mesh):
    """A generator cannot go back: left by an exception, or dropped unclosed, the
    prefetcher names the batches its worker read ahead from it (they are gone from it);
    a close() or a with block's own end drops them as asked, and an iterable (a list)
    is read through the prefetcher's own iterator, so nothing is said."""

    def plain(read):
        for i in range(20):
            read.append(i)
            yield {"x": np.full((8,), float(i))}

    def wait_read(read, at_least):
        deadline = time.monotonic() + 30
        while len(read) < at_least:
            assert time.monotonic() < deadline, "the prefetch worker did not read ahead"
            time.sleep(0.01)

    read = []
    source = plain(read)
    with (
        pytest.raises(KeyError, match="the block's"),
        pytest.warns(RuntimeWarning) as caught,
        sx.prefetch_to_device(source, mesh, buffer_size=2) as it,
    ):
        assert float(next(it)["x"][0]) == 0
        wait_read(read, 3)
        raise KeyError("the block's")
    last = len(read)
    assert str(caught[0].message) == (
        f"prefetch close(): batches 2..{last} of this prefetcher (counted from 1; read ahead, "
        "never consumed) are lost to the source iterator, which stays after them: it was left "
        "by an exception and has no get_state() and set_state() to go back with (sx.batches "
        "and grain's DatasetIterator have them)"
    )
    assert float(next(source)["x"][0]) == last  # the generator goes on after them
    read = []
    it = sx.prefetch_to_device(plain(read), mesh, buffer_size=2)
    next(it)
    wait_read(read, 3)
    with pytest.warns(RuntimeWarning, match=r"batches 2\.\.\d+ .* it was dropped unclosed"):
        del it  # a break out of `for batch in prefetch_to_device(gen, mesh)`
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read = []
        with sx.prefetch_to_device(plain(read), mesh, buffer_size=2) as it:
            next(it)
            wait_read(read, 3)  # a break: the read-ahead is dropped, as the caller asked
        read = []

        def feed(source):  # a with block in a generator its consumer breaks out of
            with sx.prefetch_to_device(source, mesh, buffer_size=2) as it:
                for batch in it:  # noqa: UP028 (yield from would close it first)
                    yield batch

        fed = feed(plain(read))
        next(fed)
        wait_read(read, 3)
        fed.close()  # GeneratorExit through the with block: a close, as asked
        batches = [{"x": np.full((8,), float(i))} for i in range(20)]
        with contextlib.suppress(KeyError), sx.prefetch_to_device(batches, mesh) as it:
            next(it)
            raise KeyError("the list is the caller's and unmoved")


def test_close_warns_where_it_cannot_put_the_source_back(mesh):
    """Moved by something else meanwhile, or a set_state() that fails: the batches read
    ahead are lost, and close() says so (a warning: it may run under an exception)."""
    source = Stateful(20)
    it = sx.prefetch_to_device(source, mesh, buffer_size=2)
    next(it)
    read_ahead(source, 3)
    time.sleep(0.05)
    next(source)  # another reader of the same iterator
    with pytest.warns(
        RuntimeWarning, match=r"batches 2\.\.4 of this .* lost .*something else moved"
    ):
        it.close()
    source = Stateful(20, fail_set=True)
    it = sx.prefetch_to_device(source, mesh, buffer_size=2)
    next(it)
    read_ahead(source, 3)
    with pytest.warns(RuntimeWarning, match="set_state\\(\\) raised OSError: the shard server"):
        it.close()


def test_bad_target_and_placement_facade(mesh):
    with pytest.raises(TypeError, match=r"target must be a jax\.Device.*got str"):
        sx.prefetch_to_device([np.zeros(2)], "cpu:0")
    it = sx.DevicePlacement().prefetch_to_device(iter([np.zeros(8)]), mesh)
    assert isinstance(it, Prefetcher)
    assert next(it).sharding.spec == P("data")
