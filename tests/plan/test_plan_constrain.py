"""sx.constrain in every mode: jit under a mesh, explicit mesh, shard_map, pmap, no mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx


def layer(x):
    return sx.constrain(x * 2.0, P("data", "model"))


def test_jit_under_set_mesh_constrains_the_activation():
    mesh = sx.make_mesh({"data": 4, "model": 2})
    x = jnp.arange(64.0).reshape(8, 8)
    with jax.set_mesh(mesh):
        y = jax.jit(layer)(x)
        hlo = jax.jit(layer).lower(x).as_text()
    assert y.sharding.spec == P("data", "model")
    assert {s.data.shape for s in y.addressable_shards} == {(2, 4)}
    np.testing.assert_array_equal(y, 2 * np.asarray(x))
    assert "sharding_constraint" in hlo or "mhlo.sharding" in hlo


def test_mesh_argument_or_named_sharding_without_a_context_mesh():
    mesh = sx.make_mesh({"data": 4, "model": 2})
    x = jnp.ones((8, 8))
    y = jax.jit(lambda x: sx.constrain(x + 1, P(None, "model"), mesh=mesh))(x)
    assert y.sharding.spec == P(None, "model")
    z = jax.jit(lambda x: sx.constrain(x + 1, NamedSharding(mesh, P("data"))))(x)
    assert z.sharding.spec == P("data")


def test_explicit_axes_use_reshard():
    mesh = sx.make_mesh({"data": 4, "model": 2}, axis_types=AxisType.Explicit)
    x = jnp.ones((8, 8))
    with jax.set_mesh(mesh):
        y = jax.jit(layer)(x)
    assert y.sharding.spec == P("data", "model")


def test_no_op_in_shard_map_pmap_and_without_mesh():
    mesh = sx.make_mesh({"data": 4, "model": 2})
    x = jnp.arange(64.0).reshape(8, 8)
    f = jax.shard_map(layer, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model"))
    np.testing.assert_array_equal(f(x), 2 * np.asarray(x))
    g = jax.pmap(lambda v: sx.constrain(v * 2.0, P("data")), axis_name="data")
    np.testing.assert_array_equal(g(x), 2 * np.asarray(x))
    # Single-device mode: no mesh known, nothing to constrain.
    y = jax.jit(layer)(x)
    assert len(y.sharding.device_set) == 1
    np.testing.assert_array_equal(layer(x), 2 * np.asarray(x))


def test_bad_specs_name_shape_and_axis():
    mesh = sx.make_mesh({"data": 8})
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match=r"logical axis 'model' has no entry.*'data': 8"),
    ):
        jax.jit(layer)(jnp.ones((8, 8)))
    with (
        jax.set_mesh(mesh),
        pytest.raises(ValueError, match="size 6 is not divisible by the size 8"),
    ):
        jax.jit(lambda x: sx.constrain(x, P("data")))(jnp.ones((6,)))
    with pytest.raises(ValueError, match="spec must be a PartitionSpec"):
        sx.constrain(jnp.ones(3), ("data",))


def test_logical_names_follow_axis_rules():
    x = jnp.ones((8, 8))
    for shape, rules, expected in [
        ({"data": 4, "model": 2}, {"batch": "data", "mlp": "model"}, P("data", "model")),
        ({"data": 8}, {"batch": "data", "mlp": None}, P("data")),
        (
            {"data": 4, "model": 2},
            {"batch": ("data", "model"), "mlp": None},
            P(("data", "model")),
        ),
    ]:
        # Rules are read at trace time (like jax.set_mesh): a new function per mapping.
        f = jax.jit(lambda x: sx.constrain(x * 2.0, P("batch", "mlp")))
        with jax.set_mesh(sx.make_mesh(shape)), sx.plan.axis_rules(rules):
            assert f(x).sharding.spec == expected


def test_make_train_step_traces_under_its_mesh():
    """sx.constrain inside a model applies in make_train_step's jit mode."""
    import optax

    seen = []

    def apply(params, x):
        h = sx.constrain(x @ params["w"], P("data", "model"))
        jax.debug.inspect_array_sharding(h, callback=lambda s: seen.append(s.spec))
        return h.sum(axis=-1)

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    mesh = sx.make_mesh({"data": 4, "model": 2})
    state = sx.TrainState.from_params({"w": jnp.ones((4, 8))}, apply, optax.sgd(0.1))
    batch = {"x": np.ones((8, 4), np.float32), "y": np.ones(8, np.float32)}
    step = sx.make_train_step(loss_fn, mesh=mesh)
    step(step.shard(state), batch)
    assert seen and all(s == P("data", "model") for s in seen)
