"""A model that draws from its own nnx.Rngs (the VAE pattern) under shard_map and pmap:
refused by name before training, with the way out; ``rng_per_device=True`` accepts the
per-device draws."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
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


class LinenDropout(nn.Module):
    deterministic: bool = False

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.Dropout(0.5, deterministic=self.deterministic)(x))


def linen_state(deterministic=False):
    module = LinenDropout(deterministic)
    variables = module.init(jax.random.key(0), jnp.ones((1, 4)))
    return sx.TrainState.from_linen(module, variables, optax.sgd(1e-2))


@pytest.mark.parametrize(("mode", "accumulate"), [("jit", 2), ("shard_map", 1), ("pmap", 1)])
def test_linen_make_rng_refused_where_not_one_devices(mesh, mode, accumulate):
    state = linen_state()
    step = sx.make_train_step(own_rng_loss, mesh=mesh, mode=mode, accumulate=accumulate)
    where = f"accumulate={accumulate}" if accumulate > 1 else f"mode='{mode}'"
    with pytest.raises(
        ValueError, match=rf"make_rng\('dropout'\).*{where}.*sx.train.dropout\(rng, x, rate\)"
    ):
        step(step.shard(state), BATCH)


def test_linen_make_rng_accepted_by_jit_opt_in_or_deterministic(mesh):
    state = linen_state()
    for step in (
        sx.make_train_step(own_rng_loss, mesh=mesh),
        sx.make_train_step(own_rng_loss, mesh=mesh, mode="shard_map", rng_per_device=True),
    ):
        _, metrics = step(step.shard(state), BATCH)
        assert np.isfinite(float(metrics["loss"]))
    # a module that never calls make_rng trains under accumulation, equal to one device
    state = linen_state(deterministic=True)
    two = sx.make_train_step(own_rng_loss, mesh=mesh, accumulate=2)
    one = sx.make_train_step(own_rng_loss, mesh=mesh)
    got, _ = two(two.shard(state), BATCH)
    want, _ = one(one.shard(state), BATCH)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class EqxDropout(eqx.Module):
    lin: eqx.nn.Linear
    drop: eqx.nn.Dropout

    def __init__(self, key):
        self.lin, self.drop = eqx.nn.Linear(4, 4, key=key), eqx.nn.Dropout(0.5)

    def __call__(self, x, key):
        return self.lin(self.drop(x, key=key))


def eqx_loss(model, batch):
    return jnp.mean(jax.vmap(model)(batch["x"], batch["key"]) ** 2)


def test_equinox_keys_in_the_batch_one_per_example_equal_one_device(mesh):
    """Equinox's pattern: the key travels in the batch. One key per example splits with
    its row, so every mode and accumulation draws what one device draws; a single key
    is refused by name with the way out."""
    state = sx.TrainState.create(EqxDropout(jax.random.key(0)), optax.sgd(0.1))
    batch = {**BATCH, "key": jax.random.split(jax.random.key(1), 16)}
    losses = []
    for mode, accumulate in [("single", 1), ("jit", 2), ("shard_map", 1), ("pmap", 1)]:
        step = sx.make_train_step(eqx_loss, mesh=mesh, mode=mode, accumulate=accumulate)
        _, metrics = step(step.shard(state), batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, losses[0], rtol=1e-6)
    step = sx.make_train_step(eqx_loss, mesh=mesh)
    with pytest.raises(ValueError, match=r"batch leaf 'key' is a scalar.*jax.random.split"):
        step(step.shard(state), {**BATCH, "key": jax.random.key(1)})


def test_model_rngs_not_drawn_from_are_no_reason_to_refuse(mesh):
    """The VAE holds its nnx.Rngs, but this loss hands it the step's key at call time:
    the traced step never draws from the model's own generator, so nothing is refused
    and its count stays where it was."""

    def step_rng_loss(model, batch, step_rng):
        out = model(batch["x"], rngs=nnx.Rngs(noise=step_rng))
        return jnp.mean((out - batch["x"]) ** 2)

    state = sx.TrainState.create(VAE(nnx.Rngs(0, noise=1)), optax.sgd(1e-2))
    for mode, accumulate in [("jit", 2), ("shard_map", 1)]:
        step = sx.make_train_step(step_rng_loss, mesh=mesh, mode=mode, accumulate=accumulate)
        new, metrics = step(step.shard(state), BATCH)
        assert np.isfinite(float(metrics["loss"]))
        assert counts(new.model_state) == counts(state.model_state) == {"default": 4, "noise": 0}


def counts(model_state):
    return {
        jax.tree_util.keystr(p).split("'")[3]: int(np.asarray(x))
        for p, x in jax.tree_util.tree_flatten_with_path(model_state)[0]
        if "count" in jax.tree_util.keystr(p)
    }
