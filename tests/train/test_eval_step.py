"""make_eval_step: the train step's twin without the update."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import (
    IN,
    OUT,
    batches,
    leaves,
    lm_loss,
    lm_losses_numpy,
    lm_state,
    padded_token_batches,
)

import shardax as sx


def snapshot(tree):
    """The leaves of ``tree`` as NumPy arrays (keys as their key data)."""
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree.leaves(tree)
    ]


def test_metrics_are_means_over_real_tokens_in_every_mode_and_the_state_is_untouched(mesh):
    batch = padded_token_batches(1, seed=3)[0]
    params = jax.tree.map(np.asarray, lm_state().params)
    losses = lm_losses_numpy(params, batch)
    expected = losses[batch["mask"]].mean()

    def metric_fn(model, batch):  # a dict of metrics, each a mean over real tokens
        loss, aux = lm_loss(model, batch)
        return {"loss": loss, "real": sx.masked_mean(jnp.ones(batch["mask"].shape), None), **aux}

    train_step = sx.make_train_step(lm_loss, mesh=mesh)
    for mode, accumulate in [("jit", 1), ("shard_map", 1), ("pmap", 1), ("single", 2)]:
        evaluate = sx.make_eval_step(metric_fn, mesh=mesh, mode=mode, accumulate=accumulate)
        state = evaluate.shard(lm_state())
        before = jax.tree.map(np.asarray, state)
        metrics = evaluate(state, batch)
        metrics = evaluate(state, batch)  # the state was neither donated nor changed
        np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
        assert set(metrics) == {"loss", "real", "accuracy"}
        for a, b in zip(leaves(state), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(a, b)
    # The train loss function works as is, and on the train step's state.
    evaluate = sx.make_eval_step(lm_loss, mesh=mesh)
    state, train_metrics = train_step(train_step.shard(lm_state()), batch)
    assert float(train_metrics["loss"]) == pytest.approx(expected, rel=1e-5)
    metrics = evaluate(state, batch)
    assert set(metrics) == {"loss", "accuracy"} and float(metrics["loss"]) < expected
    assert int(state.step) == 1


class Noisy(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(IN, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.norm(self.linear(x))))


def mse(model, batch):
    prediction = jax.vmap(model)(batch["x"]) if isinstance(model, eqx.Module) else model(batch["x"])
    return jnp.mean((prediction - batch["y"]) ** 2)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_nnx_modules_are_evaluated_in_deterministic_mode(mesh, mode):
    step = sx.make_train_step(mse, mesh=mesh, mode=mode, rng_per_device=True)
    state, _ = step(
        step.shard(sx.TrainState.create(Noisy(nnx.Rngs(0)), optax.sgd(0.1))), batches(1)[0]
    )
    batch = batches(1, seed=5)[0]
    model = nnx.view(state.model, deterministic=True, use_running_average=True)
    expected = float(mse(model, batch))
    before = snapshot(state.model_state)
    evaluate = sx.make_eval_step(mse, mesh=mesh, mode=mode, rng_per_device=True)
    for _ in range(2):  # no dropout mask, no RNG draw, no batch statistics update
        np.testing.assert_allclose(float(evaluate(state, batch)["loss"]), expected, rtol=1e-5)
    for a, b in zip(snapshot(state.model_state), before, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(AssertionError):  # in train mode the same loss differs
        np.testing.assert_allclose(float(mse(state.model, batch)), expected, rtol=1e-3)


def test_equinox_modules_are_evaluated_in_inference_mode(mesh):
    class Model(eqx.Module):
        linear: eqx.nn.Linear
        drop: eqx.nn.Dropout

        def __init__(self, key):
            self.linear = eqx.nn.Linear(IN, OUT, key=key)
            self.drop = eqx.nn.Dropout(0.5)

        def __call__(self, x):
            return self.drop(self.linear(x), key=jax.random.key(0))

    state = sx.TrainState.create(Model(jax.random.key(0)), optax.sgd(0.1))
    batch = batches(1)[0]
    expected = float(mse(eqx.nn.inference_mode(state.model), batch))
    metrics = sx.make_eval_step(mse, mesh=mesh)(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    assert float(mse(state.model, batch)) != pytest.approx(expected, rel=1e-3)
