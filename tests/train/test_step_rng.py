"""``step_rng``: one key per step for call-time RNG, such as ``nnx.Rngs(dropout=...)``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from train_models import IN, OUT, batches, leaves

import shardax as sx


class CallTimeDropout(nnx.Module):
    """Dropout that takes its RNG at call time, as Flax's gemma example does."""

    def __init__(self, rngs):
        self.hidden = nnx.Linear(IN, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.out = nnx.Linear(32, OUT, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.out(self.drop(jnp.tanh(self.hidden(x)), rngs=rngs))


def loss_fn(model, batch, step_rng):
    prediction = model(batch["x"], rngs=nnx.Rngs(dropout=step_rng))
    return jnp.mean((prediction - batch["y"]) ** 2)


def no_dropout(model, batch):
    model = nnx.view(model, deterministic=True)
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train(mesh, mode, data, fn=loss_fn, **kwargs):
    step = sx.make_train_step(fn, mesh=mesh, mode=mode, **kwargs)
    state = step.shard(sx.TrainState.create(CallTimeDropout(nnx.Rngs(0)), optax.sgd(0.1), rng=7))
    for batch in data:
        state, _ = step(state, batch)
    return state


def test_nnx_dropout_from_step_rng_is_the_same_on_1_and_8_devices():
    data = batches(2)
    eight = sx.make_mesh({"data": -1})
    one = sx.make_mesh({"data": 1}, devices=jax.devices()[:1])
    expected = train(eight, "single", data)
    for mesh, mode, accumulate in [(eight, "jit", 1), (one, "jit", 1)]:
        state = train(mesh, mode, data, accumulate=accumulate)
        for a, e in zip(leaves(state.params), leaves(expected.params), strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    # Microbatch j draws with fold_in(step_rng, j): the same on any mesh, too.
    folded = train(eight, "single", data, accumulate=2)
    state = train(eight, "jit", data, accumulate=2)
    for a, e in zip(leaves(state.params), leaves(folded.params), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    # Dropout was on, and the key changes with the step.
    plain = train(eight, "single", data, fn=no_dropout)
    assert not np.allclose(leaves(plain.params)[0], leaves(expected.params)[0])


def test_step_rng_is_fold_in_of_the_state_key_and_the_step():
    def with_key(model, batch, step_rng):
        return no_dropout(model, batch), {"key": jax.random.key_data(step_rng)}

    mesh = sx.make_mesh({"data": -1})
    step = sx.make_train_step(with_key, mesh=mesh)
    state = step.shard(sx.TrainState.create(CallTimeDropout(nnx.Rngs(0)), optax.sgd(0.1), rng=7))
    for i, batch in enumerate(batches(2)):
        state, metrics = step(state, batch)
        expected = jax.random.key_data(jax.random.fold_in(jax.random.key(7), i))
        np.testing.assert_array_equal(metrics["key"], expected)
