"""A model that draws from its own nnx.Rngs (the VAE pattern) under shard_map and pmap:
refused by name before training, with the way out; ``rng_per_device=True`` accepts the
per-device draws."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardax as sx


class VAE(nnx.Module):
    def __init__(self, rngs):
        self.encoder = nnx.Linear(4, 2 * 2, rngs=rngs)
        self.decoder = nnx.Linear(2, 4, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x, rngs=None):
        mean, logvar = jnp.split(self.encoder(x), 2, axis=-1)
        key = (rngs or self.rngs).noise()
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        return self.decoder(z)


def own_rng_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["x"]) ** 2)


BATCH = {"x": np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)}


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_model_rngs_refused_under_mapped_modes_unless_opted_in(mesh, mode):
    state = sx.TrainState.create(VAE(nnx.Rngs(0, noise=1)), optax.sgd(1e-2))
    step = sx.make_train_step(own_rng_loss, mesh=mesh, mode=mode)
    with pytest.raises(
        ValueError,
        match=rf"model_state/rngs/noise/key\).*mode='{mode}'.*'step_rng'.*mode='jit'.*"
        r"rng_per_device=True",
    ):
        step(step.shard(state), BATCH)
    opted = sx.make_train_step(own_rng_loss, mesh=mesh, mode=mode, rng_per_device=True)
    _, metrics = opted(opted.shard(state), BATCH)
    assert np.isfinite(float(metrics["loss"]))


def test_rng_per_device_must_be_a_bool(mesh):
    with pytest.raises(TypeError, match=r"rng_per_device must be True or False, got 'yes'"):
        sx.make_train_step(own_rng_loss, mesh=mesh, mode="shard_map", rng_per_device="yes")
