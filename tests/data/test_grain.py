"""grain datasets go straight into prefetch_to_device (grain is the `grain` extra)."""

import threading
import time

import grain
import numpy as np
from jax.sharding import PartitionSpec as P

import shardax as sx

N = 45


def records():
    return [{"x": np.full(3, i, np.float32), "y": np.int32(i)} for i in range(N)]


def threads_back_to(count: int, seconds: float = 1.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if threading.active_count() <= count:
            return True
        time.sleep(0.01)
    return False


def test_map_dataset_with_padded_last_batch(mesh):
    ds = grain.MapDataset.source(records()).shuffle(seed=3).batch(16)
    expected = list(ds)  # grain alone: 16, 16, 13
    before = threading.active_count()
    with sx.prefetch_to_device(ds, mesh, policy="pad") as it:
        got = list(it)
    assert [int(b["mask"].sum()) for b in got] == [16, 16, 13]
    for b, e in zip(got, expected, strict=True):
        assert b["x"].shape == (16, 3) and b["x"].sharding.spec == P("data")
        n = len(e["y"])
        np.testing.assert_array_equal(np.asarray(b["y"])[:n], e["y"])
        np.testing.assert_array_equal(np.asarray(b["x"])[:n], e["x"])
    assert threads_back_to(before)  # our worker and grain's own threads


def test_iter_dataset_resumes_from_the_consumed_position(mesh):
    ds = grain.MapDataset.source(records()).shuffle(seed=1).to_iter_dataset().batch(8)
    uninterrupted = [np.asarray(b["y"]) for b in sx.prefetch_to_device(ds, mesh, policy="drop")]
    assert len(uninterrupted) == N // 8
    with sx.prefetch_to_device(ds, mesh, buffer_size=3, policy="drop") as it:
        head = [np.asarray(next(it)["y"]) for _ in range(2)]
        state = it.get_state()  # grain's state after batch 2, not after the read-ahead
    source = iter(ds)
    source.set_state(state)
    with sx.prefetch_to_device(source, mesh, policy="drop") as it:
        rest = [np.asarray(b["y"]) for b in it]
    np.testing.assert_array_equal(np.stack(head + rest), np.stack(uninterrupted))


def test_early_break_closes_grain_iterator(mesh):
    before = threading.active_count()
    ds = grain.MapDataset.source(records()).repeat(None).batch(8)
    for _ in sx.prefetch_to_device(ds, mesh):
        break
    assert threads_back_to(before)
