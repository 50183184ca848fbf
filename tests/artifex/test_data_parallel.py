import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx


def test_is_nnx_module_and_static_twins_are_aliases():
    from shardax import artifex

    assert isinstance(sx.DataParallel(), nnx.Module)
    assert isinstance(sx.DistributedMetrics(), nnx.Module)
    for cls, module, names in [
        (
            sx.DataParallel,
            artifex,
            [
                "create_data_parallel_sharding",
                "shard_batch",
                "all_reduce_gradients",
                "shard_model_state",
                "replicate_params",
            ],
        ),
        (
            sx.DistributedMetrics,
            artifex,
            ["all_gather", "reduce_mean", "reduce_sum", "reduce_max", "reduce_min"],
        ),
    ]:
        for name in names:
            fn = getattr(module, name)
            assert getattr(cls, f"{name}_static") is fn, name  # the twin is the function
            # the method calls it (both behind the door that names their errors)
            assert inspect.unwrap(getattr(cls, name)) is inspect.unwrap(fn), name
            # The seed's signature: self first, then the function's own parameters.
            method_params = list(inspect.signature(getattr(cls, name)).parameters)
            assert method_params == ["self", *inspect.signature(fn).parameters], name


def test_seed_signatures_and_defaults():
    sig = inspect.signature(sx.DataParallel.all_reduce_gradients)
    assert str(sig).startswith("(self, gradients: 'Any', reduce_type")
    assert sig.parameters["reduce_type"].default == "mean"
    assert sig.parameters["axis_name"].default == "batch"
    assert (
        inspect.signature(sx.DataParallel.create_data_parallel_sharding_static)
        .parameters["data_axis"]
        .default
        == "data"
    )
    sig = inspect.signature(sx.DataParallel.shard_model_state)
    assert sig.parameters["param_sharding"].default == "replicate"
    assert (
        inspect.signature(sx.DistributedMetrics.reduce_mean).parameters["axis_name"].default
        == "batch"
    )


def test_sharding_and_shard_batch(mesh):
    dp = sx.DataParallel()
    sharding = dp.create_data_parallel_sharding(mesh)
    assert sharding.spec == P("data")
    batch = dp.shard_batch({"inputs": np.ones((32, 784)), "targets": np.zeros(32)}, sharding)
    assert {s.data.shape for s in batch["inputs"].addressable_shards} == {(4, 784)}
    assert {s.data.shape for s in batch["targets"].addressable_shards} == {(4,)}
    static = sx.DataParallel.shard_batch_static(
        batch, sx.DataParallel.create_data_parallel_sharding_static(mesh)
    )
    assert static["inputs"].sharding.spec == P("data")


def test_shard_model_state_fsdp_semantics(mesh):
    state = {
        "big": np.arange(64 * 48, dtype=np.float32).reshape(64, 48),  # both divisible: 64 wins
        "tall": np.ones((3, 4096), np.float32),  # only dim 1 divisible
        "odd": np.ones((7, 5), np.float32),  # nothing divisible
        "small": np.ones((8,), np.float32),  # below threshold
        "scalar": np.float32(3.0),
        "step": 7,  # not an array
    }
    out = sx.DataParallel().shard_model_state(state, mesh, param_sharding="shard")
    assert out["big"].sharding.spec == P("data", None)
    assert {s.data.shape for s in out["big"].addressable_shards} == {(8, 48)}
    assert out["tall"].sharding.spec == P(None, "data")
    assert out["odd"].sharding.is_fully_replicated
    assert out["small"].sharding.is_fully_replicated
    assert out["scalar"].sharding.is_fully_replicated and out["step"] == 7
    for k in ("big", "tall", "odd", "small", "scalar"):
        np.testing.assert_array_equal(np.asarray(out[k]), state[k])


def test_shard_model_state_replicate_and_nnx_state(mesh):
    model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    out = sx.DataParallel().shard_model_state(state, mesh)
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(out))
    sharded = sx.DataParallel.shard_model_state_static(state, mesh, "shard")
    assert sharded["kernel"][...].sharding.spec == P("data", None)
    with pytest.raises(ValueError, match="'replicate' or 'shard', got 'zero'"):
        sx.DataParallel().shard_model_state(state, mesh, "zero")


def test_replicate_params(mesh):
    params = {"w": np.arange(6.0).reshape(2, 3)}
    out = sx.DataParallel().replicate_params(params, mesh)
    assert len(out["w"].addressable_shards) == 8
    for s in out["w"].addressable_shards:
        np.testing.assert_array_equal(s.data, params["w"])


GRADS = {"w": np.arange(8 * 3, dtype=np.float32).reshape(8, 3), "b": np.arange(8.0) ** 2}


@pytest.mark.parametrize("reduce_type,np_op", [("mean", np.mean), ("sum", np.sum)])
def test_all_reduce_gradients_in_shard_map(mesh, reduce_type, np_op):
    dp = sx.DataParallel()

    def per_device(g):
        g = jax.tree.map(lambda x: x[0], g)  # this device's row
        return dp.all_reduce_gradients(g, reduce_type, axis_name="data")

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P()))
    out = f(GRADS)
    for k in GRADS:
        np.testing.assert_allclose(np.asarray(out[k]), np_op(GRADS[k], axis=0), rtol=1e-6)


@pytest.mark.parametrize("reduce_type,np_op", [("mean", np.mean), ("sum", np.sum)])
def test_all_reduce_gradients_static_in_pmap(reduce_type, np_op):
    f = jax.pmap(
        lambda g: sx.DataParallel.all_reduce_gradients_static(g, reduce_type=reduce_type),
        axis_name="batch",
    )
    out = f(GRADS)
    for k in GRADS:
        for row in np.asarray(out[k]):
            np.testing.assert_allclose(row, np_op(GRADS[k], axis=0), rtol=1e-6)


def test_all_reduce_gradients_bad_reduce_type():
    with pytest.raises(
        ValueError,
        match=r"^sx\.DataParallel\.all_reduce_gradients: Unsupported reduce_type: max\. Use 'mean'",
    ):
        sx.DataParallel().all_reduce_gradients(GRADS, reduce_type="max")
    # The seed's whole sentence comes first after the method's name, detail after it.
    seed = "Unsupported reduce_type: invalid. Use 'mean' or 'sum'"
    door = "sx.DataParallel.all_reduce_gradients: "
    with pytest.raises(ValueError, match="^" + re.escape(door + seed)):
        sx.DataParallel.all_reduce_gradients_static(GRADS, reduce_type="invalid")


def test_all_reduce_gradients_unbound_axis_says_where(mesh):
    with pytest.raises(NameError, match=r"'batch' is unbound.*shard_map"):
        jax.jit(lambda g: sx.DataParallel.all_reduce_gradients_static(g))(GRADS)
    with pytest.raises(NameError, match=r"'batch' is unbound.*bound axes here are \[.data.\]"):
        jax.shard_map(
            lambda g: sx.DataParallel().all_reduce_gradients(g),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )(GRADS)


def test_metrics_reductions_against_numpy(mesh):
    values = np.array([3.0, -1.0, 4.0, 1.0, -5.0, 9.0, 2.0, 6.0], np.float32)
    dm = sx.DistributedMetrics()

    def per_device(v):
        m = {"loss": v[0]}
        return (
            dm.reduce_mean(m, "data"),
            dm.reduce_sum(m, "data"),
            dm.reduce_max(m, "data"),
            dm.reduce_min(m, "data"),
        )

    out = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P())(values)
    expect = [values.mean(), values.sum(), values.max(), values.min()]
    for got, want in zip(out, expect, strict=True):
        np.testing.assert_allclose(np.asarray(got["loss"]), want, rtol=1e-6)
    # all_gather is varying (as lax.all_gather): every device holds all 8 values.
    gathered = jax.shard_map(
        lambda v: dm.all_gather({"loss": v[0]}, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )(values)
    np.testing.assert_array_equal(
        np.asarray(gathered["loss"]).reshape(8, 8), np.tile(values, (8, 1))
    )


def test_metrics_in_pmap_default_axis():
    values = np.arange(8, dtype=np.float32)
    out = jax.pmap(lambda v: sx.DistributedMetrics.reduce_mean_static({"a": v}), axis_name="batch")(
        values
    )
    np.testing.assert_allclose(np.asarray(out["a"]), np.full(8, values.mean()))


def test_metrics_under_jit_need_no_axis(mesh):
    x = sx.distribute_batch(np.arange(16, dtype=np.float32), sx.batch_sharding(mesh))

    @jax.jit
    def f(x):
        m = {"loss": jnp.mean(x)}
        return sx.DistributedMetrics().reduce_mean(m), sx.DistributedMetrics().reduce_sum(m)

    mean, total = f(x)
    assert float(mean["loss"]) == pytest.approx(7.5) and float(total["loss"]) == pytest.approx(7.5)


def test_metrics_reduce_custom_and_errors(mesh):
    values = np.arange(8, dtype=np.float32)
    dm = sx.DistributedMetrics()
    f = jax.shard_map(
        lambda v: dm.reduce_custom(
            {"a": v[0], "b": v[0], "c": v[0]}, {"a": "sum", "b": "max"}, axis_name="data"
        ),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    out = f(values)
    assert float(out["a"]) == 28 and float(out["b"]) == 7 and float(out["c"]) == 3.5
    with pytest.raises(ValueError, match="Unsupported reduce_type: 'median'"):
        jax.shard_map(
            lambda v: dm.reduce_custom({"a": v}, {"a": "median"}, "data"),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )(values)
