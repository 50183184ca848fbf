import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx


def test_place_on_device_commits_numpy_pytrees():
    d = jax.devices()[3]
    out = sx.place_on_device({"a": np.ones((4, 2)), "b": [jnp.zeros(3)], "c": "tag"}, d)
    assert out["a"].devices() == {d} and out["b"][0].devices() == {d}
    assert isinstance(out["a"], jax.Array) and out["c"] == "tag"
    assert out["a"].committed


def test_placement_default_device():
    d = jax.devices()[5]
    placed = sx.DevicePlacement(default_device=d).place_on_device(np.ones(2))
    assert placed.devices() == {d}
    assert sx.place_on_device(np.ones(2)).devices() == {jax.devices()[0]}


def test_distribute_batch_shards_numpy_and_replicates_scalars(mesh):
    batch = {"images": np.ones((16, 28, 28, 3)), "labels": np.arange(16), "lr": np.float32(0.1)}
    out = sx.distribute_batch(batch, NamedSharding(mesh, P("data", None)))
    assert all(isinstance(v, jax.Array) for v in out.values())
    assert [s.data.shape for s in out["images"].addressable_shards] == [(2, 28, 28, 3)] * 8
    assert out["labels"].sharding.spec == P("data")
    shards = sorted(out["labels"].addressable_shards, key=lambda s: s.device.id)
    np.testing.assert_array_equal(np.concatenate([s.data for s in shards]), np.arange(16))
    assert out["lr"].sharding.is_fully_replicated
    assert len(out["lr"].addressable_shards) == 8
    # The facades are the same function.
    again = sx.DevicePlacement().distribute_batch(batch, sx.batch_sharding(mesh))
    assert again["images"].sharding.spec == P("data")


def test_shard_batch_dim_honours_batch_axis(mesh):
    data = {"seq": np.zeros((3, 16, 5)), "scalar": np.float32(1.0)}
    out = sx.DevicePlacement().shard_batch_dim(data, mesh, batch_axis=1)
    assert out["seq"].sharding.spec == P(None, "data")
    assert {s.data.shape for s in out["seq"].addressable_shards} == {(3, 2, 5)}
    assert out["scalar"].sharding.is_fully_replicated
    with pytest.raises(ValueError, match="has no batch_axis 1"):
        sx.data.shard_batch_dim({"v": np.zeros(16)}, mesh, batch_axis=1)


def test_indivisible_batch_names_leaf_sizes(mesh):
    with pytest.raises(ValueError, match=r"'x'.*\(30, 2\).*size 30.*size 8"):
        sx.distribute_batch({"x": np.zeros((30, 2))}, sx.batch_sharding(mesh))


def test_unknown_batch_axis_name(mesh):
    with pytest.raises(ValueError, match="'batch' is not in the mesh"):
        sx.batch_sharding(mesh, "batch")


def test_seq_axis_splits_the_sequence_too():
    mesh = sx.make_mesh({"data": 2, "context": 4})
    sharding = sx.batch_sharding(mesh, seq_axis="context")
    tokens = np.arange(2 * 16).reshape(2, 16)
    placed = sx.distribute_batch({"tokens": tokens}, sharding)["tokens"]
    assert placed.sharding.spec == P("data", "context")
    for shard in placed.addressable_shards:
        rows, cols = shard.index
        np.testing.assert_array_equal(np.asarray(shard.data), tokens[rows, cols])
        assert np.asarray(shard.data).shape == (1, 4)
    for bad in ("data", "seq", 1):
        with pytest.raises(ValueError, match=r"sx.batch_sharding: seq_axis must be a mesh axis"):
            sx.batch_sharding(mesh, seq_axis=bad)


def test_replicate_across_devices_full_value_everywhere():
    w = {"w": np.arange(12.0).reshape(3, 4)}
    out = sx.DevicePlacement().replicate_across_devices(w)
    assert len(out["w"].addressable_shards) == 8
    for s in out["w"].addressable_shards:
        np.testing.assert_array_equal(s.data, w["w"])
    some = jax.devices()[2:5]
    out = sx.data.replicate_across_devices(w, devices=some)
    assert out["w"].devices() == set(some)
    for s in out["w"].addressable_shards:
        np.testing.assert_array_equal(s.data, w["w"])


def test_prefetch_in_order_and_placed(mesh):
    batches = ({"x": np.full((8, 2), i)} for i in range(5))
    out = list(sx.DevicePlacement().prefetch_to_device(batches, sx.batch_sharding(mesh)))
    assert [int(b["x"][0, 0]) for b in out] == list(range(5))
    assert all(b["x"].sharding.spec == P("data") for b in out)


def test_prefetch_default_device_and_early_stop():
    consumed = []

    def source():
        for i in range(100):
            consumed.append(i)
            yield np.full(4, i)

    it = sx.DevicePlacement().prefetch_to_device(source(), buffer_size=2)
    first = next(it)
    assert first.devices() == {jax.devices()[0]} and int(first[0]) == 0
    it.close()
    assert len(consumed) <= 4  # only the buffer was read ahead
    with pytest.raises(StopIteration):
        next(it)


def test_prefetch_rejects_bad_buffer():
    with pytest.raises(ValueError, match="buffer_size must be an integer >= 1, got 0"):
        next(iter(sx.prefetch_to_device([np.ones(2)], buffer_size=0)))
