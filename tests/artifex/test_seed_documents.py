# ruff: noqa: E501  (tables of cases, one per line)
"""Each seed method returns what the seed documents (shared/seeds/000, 001) say it returns.

One test per documented method: its return value, and its error behaviour. The rule for
errors: the seed documents one error (``all_reduce_gradients``: ``ValueError`` for a
``reduce_type`` other than "mean" or "sum"); otherwise a value of the wrong type may
raise, naming the argument, while a well-typed value the table judges (a batch size of 0)
is answered as the seed answers it, never raised.
"""

import dataclasses
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

SEED_TABLE = {  # seed 000, "Hardware-Specific Values": min, optimal, critical
    "TPU_V5E": (64, 256, 240),
    "TPU_V5P": (128, 512, 480),
    "TPU_V4": (64, 256, 192),
    "H100": (64, 320, 298),
    "A100": (32, 256, 240),
    "V100": (16, 128, 96),
    "CPU": (1, 32, 16),
}


def _seed_mesh():
    return Mesh(np.array(jax.devices()), axis_names=("data",))  # as seed 000 builds it


# --- 000: HardwareType, BatchSizeRecommendation ------------------------------------------


def test_hardware_type_and_recommendation_are_the_seeds():
    assert {h.name: h.value for h in sx.HardwareType} == {
        "TPU_V5E": "tpu_v5e", "TPU_V5P": "tpu_v5p", "TPU_V4": "tpu_v4", "H100": "h100",
        "A100": "a100", "V100": "v100", "CPU": "cpu", "UNKNOWN": "unknown",
    }  # fmt: skip
    fields = [(f.name, f.default) for f in dataclasses.fields(sx.BatchSizeRecommendation)]
    assert fields == [
        ("min_batch_size", dataclasses.MISSING), ("optimal_batch_size", dataclasses.MISSING),
        ("critical_batch_size", dataclasses.MISSING), ("max_memory_batch_size", None), ("notes", ""),
    ]  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        sx.BatchSizeRecommendation(1, 2, 3).min_batch_size = 4


# --- 000: DevicePlacement ---------------------------------------------------------------


def test_constructor_default_device_and_properties():
    placement = sx.DevicePlacement()
    assert placement.default_device == jax.devices()[0]
    assert isinstance(placement.hardware_type, sx.HardwareType)
    assert placement.hardware_type is sx.HardwareType.CPU
    assert isinstance(placement.num_devices, int) and placement.num_devices == 8
    assert sx.DevicePlacement(jax.devices()[3]).default_device == jax.devices()[3]


def test_place_on_device_returns_the_pytree_on_that_device():
    devices = jax.devices()
    data = {"images": np.ones((4, 28), np.float32), "labels": jnp.zeros(4)}
    placed = sx.DevicePlacement().place_on_device(data)  # None: the default device
    assert jax.tree.structure(placed) == jax.tree.structure(data)
    for leaf in jax.tree.leaves(placed):
        assert isinstance(leaf, jax.Array) and leaf.sharding == SingleDeviceSharding(devices[0])
    assert sx.DevicePlacement(devices[3]).place_on_device(data)["images"].devices() == {devices[3]}
    assert sx.DevicePlacement().place_on_device(data, devices[5])["labels"].devices() == {
        devices[5]
    }
    np.testing.assert_array_equal(placed["images"], data["images"])
    with pytest.raises(
        TypeError,
        match=r"^sx\.DevicePlacement\.place_on_device: device must be a jax\.Device, got 'gpu0'",
    ):
        sx.DevicePlacement().place_on_device(data, "gpu0")


def test_distribute_batch_returns_the_pytree_with_that_sharding():
    sharding = NamedSharding(_seed_mesh(), P("data", None))
    batch = {"images": jnp.ones((8, 28, 28, 3)), "labels": jnp.zeros((8,))}
    for distributed in (
        sx.DevicePlacement().distribute_batch(batch, sharding),
        sx.distribute_batch(batch, sharding),  # the convenience function
    ):
        assert distributed["images"].sharding.spec == P("data", None)
        assert distributed["labels"].sharding.spec == P("data")
        assert len(distributed["images"].addressable_shards) == 8
    with pytest.raises(
        TypeError,
        match=r"^sx\.DevicePlacement\.distribute_batch: sharding must be a jax\.sharding\.Sharding, got 'data'",
    ):
        sx.DevicePlacement().distribute_batch(batch, "data")


def test_replicate_across_devices_copies_to_all_or_the_given_devices():
    weights = {"layer1": jnp.arange(12.0).reshape(3, 4), "layer2": jnp.ones((4, 2))}
    everywhere = sx.DevicePlacement().replicate_across_devices(weights)
    assert everywhere["layer1"].sharding.is_fully_replicated
    assert everywhere["layer1"].sharding.device_set == set(jax.devices())
    for shard in everywhere["layer1"].addressable_shards:
        np.testing.assert_array_equal(shard.data, weights["layer1"])
    two = sx.DevicePlacement().replicate_across_devices(weights, devices=jax.devices()[:2])
    assert two["layer2"].sharding.device_set == set(jax.devices()[:2])
    with pytest.raises(
        ValueError, match=r"^sx\.DevicePlacement\.replicate_across_devices: devices is empty"
    ):
        sx.DevicePlacement().replicate_across_devices(weights, devices=[])


def test_shard_batch_dim_splits_the_batch_axis_over_the_mesh_axis():
    mesh = _seed_mesh()
    batch = {"images": jnp.ones((16, 4, 4, 3)), "labels": jnp.zeros((16,), jnp.int32)}
    sharded = sx.DevicePlacement().shard_batch_dim(batch, mesh)  # batch_axis=0, mesh_axis="data"
    assert sharded["images"].sharding.spec == P("data") and sharded["labels"].sharding.spec == P(
        "data"
    )
    assert sharded["images"].addressable_shards[0].data.shape == (2, 4, 4, 3)
    assert sx.DevicePlacement().shard_batch_dim({"x": jnp.ones((3, 16))}, mesh, batch_axis=1)[
        "x"
    ].sharding.spec == P(None, "data")
    with pytest.raises(
        ValueError,
        match=r"^sx\.DevicePlacement\.shard_batch_dim: leaf 'x' with shape \(5, 2\): dimension 0 of size 5 is not divisible",
    ):
        sx.DevicePlacement().shard_batch_dim({"x": jnp.ones((5, 2))}, mesh)
    with pytest.raises(
        ValueError,
        match=r"^sx\.DevicePlacement\.shard_batch_dim: batch axis 'batch' is not in the mesh",
    ):
        sx.DevicePlacement().shard_batch_dim(batch, mesh, mesh_axis="batch")


def test_prefetch_to_device_returns_an_iterator_of_placed_data_in_order():
    def data_generator():
        for i in range(5):
            yield {"batch": np.ones((4, 3), np.float32) * i}

    prefetched = sx.DevicePlacement().prefetch_to_device(data_generator(), buffer_size=2)
    assert isinstance(prefetched, Iterator)
    out = list(prefetched)
    assert [float(b["batch"][0, 0]) for b in out] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(b["batch"].devices() == {jax.devices()[0]} for b in out)
    with pytest.raises(
        ValueError,
        match=r"^sx\.DevicePlacement\.prefetch_to_device: buffer_size must be an integer >= 1, got 0",
    ):
        sx.DevicePlacement().prefetch_to_device(data_generator(), buffer_size=0)


@pytest.mark.parametrize("name", SEED_TABLE)
def test_get_batch_size_recommendation_is_the_seed_table(name):
    hw = sx.HardwareType[name]
    for rec in (
        sx.DevicePlacement().get_batch_size_recommendation(hw),
        sx.get_batch_size_recommendation(hw),
    ):
        assert isinstance(rec, sx.BatchSizeRecommendation)
        assert (rec.min_batch_size, rec.optimal_batch_size, rec.critical_batch_size) == SEED_TABLE[
            name
        ]


def test_get_batch_size_recommendation_defaults_to_the_detected_hardware():
    cpu = sx.get_batch_size_recommendation(sx.HardwareType.CPU)
    assert sx.DevicePlacement().get_batch_size_recommendation() == cpu
    assert sx.get_batch_size_recommendation() == cpu
    placement = sx.DevicePlacement()
    placement._hardware_type = sx.HardwareType.H100  # as artifex's tests pin the hardware
    assert placement.get_batch_size_recommendation().critical_batch_size == 298
    with pytest.raises(
        ValueError,
        match=r"^sx\.get_batch_size_recommendation: hardware_type must be a HardwareType or one of its values \('tpu_v5e', .*\), got 'b200'$",
    ):
        sx.get_batch_size_recommendation("b200")


@pytest.mark.parametrize(
    "hw,batch,warn,valid,phrase",
    [
        ("CPU", 0, True, False, "Batch size 0 is below minimum recommended 1 for cpu."),
        ("CPU", -3, True, False, "Batch size -3 is below minimum recommended 1 for cpu."),
        ("H100", 8, True, False, "Batch size 8 is below minimum recommended 64 for h100."),
        ("H100", 100, True, True, "Batch size 100 is below critical size 298 for h100."),
        ("H100", 100, False, True, "Batch size 100 is acceptable for h100."),
        ("H100", np.int64(320), True, True, "Batch size 320 is optimal for h100."),
        ("CPU", 256, True, True, "Batch size 256 is optimal for cpu."),
    ],
)  # fmt: skip
def test_validate_batch_size_returns_is_valid_and_message(hw, batch, warn, valid, phrase):
    placement = sx.DevicePlacement()
    placement._hardware_type = sx.HardwareType[hw]
    result = placement.validate_batch_size(batch, warn_suboptimal=warn)
    assert isinstance(result, tuple) and len(result) == 2
    assert result[0] is valid and isinstance(result[1], str) and result[1].startswith(phrase)


@pytest.mark.parametrize("value", ["8", 8.0, True, None])
def test_validate_batch_size_wrong_type_raises_naming_the_argument(value):
    pattern = rf"^sx\.DevicePlacement\.validate_batch_size: batch_size must be an integer, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=pattern):
        sx.DevicePlacement().validate_batch_size(value)
    with pytest.raises(
        TypeError,
        match=r"^sx\.DevicePlacement\.validate_batch_size: warn_suboptimal must be True or False, got 'no'",
    ):
        sx.DevicePlacement().validate_batch_size(64, warn_suboptimal="no")


def test_get_device_info_has_the_documented_keys():
    info = sx.DevicePlacement().get_device_info()
    assert {"num_devices", "hardware_type", "platforms", "device_kinds", "devices"} <= set(info)
    assert (
        info["num_devices"] == 8 and info["hardware_type"] == "cpu" and info["platforms"] == ["cpu"]
    )
    assert [d["id"] for d in info["devices"]] == [d.id for d in jax.devices()]
    assert all({"id", "platform", "device_kind"} <= set(d) for d in info["devices"])


def test_place_on_device_function_uses_the_first_device_or_the_given_one():
    assert sx.place_on_device(jnp.ones(3)).devices() == {jax.devices()[0]}
    assert sx.place_on_device({"x": np.ones(3)}, jax.devices()[2])["x"].devices() == {
        jax.devices()[2]
    }


# --- 001: DeviceMeshManager, DataParallel ------------------------------------------------


def test_data_parallel_sharding_and_shard_batch_instance_and_static():
    manager = sx.DeviceMeshManager()
    mesh = manager.create_data_parallel_mesh()
    assert isinstance(mesh, Mesh) and dict(mesh.shape) == {"data": 8}
    assert dict(manager.create_device_mesh({"data": 4}).shape) == {"data": 4}
    dp = sx.DataParallel()
    assert isinstance(dp, nnx.Module)
    for sharding in (
        dp.create_data_parallel_sharding(mesh),
        sx.DataParallel.create_data_parallel_sharding_static(mesh),
    ):
        assert (
            isinstance(sharding, NamedSharding)
            and sharding.spec == P("data")
            and sharding.mesh == mesh
        )
    sharding = dp.create_data_parallel_sharding(mesh)
    batch = {"inputs": jnp.ones((32, 784)), "targets": jnp.zeros((32,))}
    for sharded in (
        dp.shard_batch(batch, sharding),
        sx.DataParallel.shard_batch_static(batch, sharding),
    ):
        assert {k: v.sharding.spec for k, v in sharded.items()} == {
            "inputs": P("data"),
            "targets": P("data"),
        }
        np.testing.assert_array_equal(sharded["inputs"], batch["inputs"])
    with pytest.raises(
        ValueError,
        match=r"^sx\.DataParallel\.create_data_parallel_sharding: batch axis 'batch' is not in the mesh",
    ):
        dp.create_data_parallel_sharding(mesh, "batch")


def test_shard_model_state_and_replicate_params_keep_values_and_structure(mesh):
    dp = sx.DataParallel()
    model = nnx.Linear(64, 256, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    for out in (
        dp.shard_model_state(state, mesh),
        dp.shard_model_state(state, mesh, param_sharding="replicate"),
        dp.replicate_params(state, mesh),
    ):
        assert jax.tree.structure(out) == jax.tree.structure(state)
        assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(out))
    sharded = dp.shard_model_state(state, mesh, param_sharding="shard")
    assert sharded["kernel"][...].sharding.spec == P(None, "data")
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(
        ValueError,
        match=r"^sx\.DataParallel\.shard_model_state: param_sharding must be 'replicate' or 'shard', got 'bogus'",
    ):
        dp.shard_model_state(state, mesh, param_sharding="bogus")


@pytest.mark.parametrize("reduce_type,expected", [("mean", 3.5), ("sum", 28.0)])
def test_all_reduce_gradients_in_pmap_instance_and_static(reduce_type, expected):
    dp = sx.DataParallel()
    for reduce in (dp.all_reduce_gradients, sx.DataParallel.all_reduce_gradients_static):
        out = jax.pmap(lambda g, r=reduce: r({"g": g}, reduce_type=reduce_type), axis_name="batch")(
            jnp.arange(8.0)
        )
        np.testing.assert_array_equal(out["g"], np.full(8, expected))


@pytest.mark.parametrize("reduce_type", ["max", "MEAN", None])
def test_all_reduce_gradients_raises_value_error_as_documented(reduce_type):
    seed = f"Unsupported reduce_type: {reduce_type}. Use 'mean' or 'sum'"
    for reduce in (
        sx.DataParallel().all_reduce_gradients,
        sx.DataParallel.all_reduce_gradients_static,
    ):
        with pytest.raises(
            ValueError, match="^" + re.escape(f"sx.DataParallel.all_reduce_gradients: {seed}")
        ):
            reduce({"g": jnp.ones(2)}, reduce_type=reduce_type)
