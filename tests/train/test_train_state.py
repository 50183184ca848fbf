"""TrainState: a pytree built from NNX, Equinox, Linen and plain params."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import IN, NNXMLP, OUT, LinenMLP, make_state

import shardax as sx


class NNXWithNorm(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(IN, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox", "pytree"])
def test_state_is_a_pytree_whose_model_predicts_like_the_original(framework):
    state = make_state(framework)
    x = jnp.ones((3, IN))
    leaves, treedef = jax.tree.flatten(state)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.adapter == state.adapter and rebuilt.tx is state.tx
    assert int(state.step) == 0 and state.rng.dtype == jnp.uint32 and state.rng.shape == (2,)
    out = jax.jit(lambda s: s.model(x) if framework != "equinox" else jax.vmap(s.model)(x))(state)
    assert out.shape == (3, OUT)
    doubled = jax.tree.map(lambda v: v * 2, state)
    assert type(doubled.model) is type(state.model)


def test_create_splits_nnx_params_from_model_state():
    model = NNXWithNorm(nnx.Rngs(0))
    state = sx.TrainState.create(model, optax.sgd(0.1))
    params = nnx.to_pure_dict(state.params)
    assert set(params) == {"linear", "norm"} and set(params["norm"]) == {"scale", "bias"}
    stats = nnx.to_pure_dict(state.model_state)
    assert set(stats["norm"]) == {"mean", "var"}
    np.testing.assert_array_equal(params["linear"]["kernel"], model.linear.kernel[...])
    assert isinstance(state.model, NNXWithNorm)


def test_create_splits_equinox_floats_from_other_arrays():
    class WithCounter(eqx.Module):
        linear: eqx.nn.Linear
        counter: jax.Array

    model = WithCounter(eqx.nn.Linear(2, 3, key=jax.random.key(0)), jnp.arange(3))
    state = sx.TrainState.create(model, optax.sgd(0.1))
    assert [x.dtype.kind for x in jax.tree.leaves(state.params)] == ["f", "f"]
    np.testing.assert_array_equal(jax.tree.leaves(state.model_state)[0], np.arange(3))
    assert isinstance(state.model, WithCounter)


def test_from_linen_keeps_other_collections_as_model_state():
    class WithNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))

    module = WithNorm()
    variables = module.init(jax.random.key(0), jnp.ones((2, IN)))
    state = sx.TrainState.from_linen(module, variables, optax.sgd(0.1))
    assert set(state.model_state) == {"batch_stats"}
    assert jax.tree.structure(state.params) == jax.tree.structure(variables["params"])
    with pytest.raises(ValueError, match=r"'params' collection, got collections \['batch_stats'\]"):
        sx.TrainState.from_linen(module, {"batch_stats": variables["batch_stats"]}, optax.sgd(0.1))


def test_from_params_model_is_a_partial_of_apply_fn():
    def apply_fn(params, x):
        return x * params["w"]

    state = sx.TrainState.from_params({"w": jnp.float32(3.0)}, apply_fn, optax.sgd(0.1))
    assert isinstance(state.model, functools.partial) and float(state.model(2.0)) == 6.0
    with pytest.raises(TypeError, match="apply_fn must be callable, got 3"):
        sx.TrainState.from_params({"w": 1.0}, 3, optax.sgd(0.1))


def test_rng_from_an_int_a_typed_key_or_raw_key_data():
    expected = np.asarray(jax.random.key_data(jax.random.key(7)))
    for rng in (7, jax.random.key(7), jax.random.PRNGKey(7)):
        state = sx.TrainState.from_params({"w": jnp.zeros(2)}, jnp.dot, optax.sgd(0.1), rng=rng)
        np.testing.assert_array_equal(state.rng, expected)


def test_apply_gradients_is_one_optax_update():
    state = sx.TrainState.from_params({"w": jnp.ones(2)}, jnp.dot, optax.sgd(0.5))
    state = state.apply_gradients({"w": jnp.array([1.0, -2.0])})
    assert int(state.step) == 1
    np.testing.assert_allclose(state.params["w"], [0.5, 2.0])


def test_unsupported_model_types_are_named():
    with pytest.raises(TypeError, match=r"got builtins\.dict.*from_params"):
        sx.TrainState.create({"w": jnp.ones(2)}, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"LinenMLP\. For a Flax Linen module use .*from_linen"):
        sx.TrainState.create(LinenMLP(), optax.sgd(0.1))
    assert isinstance(sx.TrainState.create(NNXMLP(nnx.Rngs(0)), optax.sgd(0.1)).model, NNXMLP)
