"""Layer-stacked NNX streams, as flax's NNX scan-over-layers examples build them.

``nnx.split_rngs(splits=L)`` + ``nnx.vmap`` makes ``L`` blocks whose Dropout streams
hold key arrays of shape ``(L,)``; ``nnx.scan`` runs the blocks, each with a BatchNorm.
Under shard_map and pmap every key of such an array gets the device folded in, so the
documented refusal is reached, ``rng_per_device=True`` runs with per-device draws, and
the deterministic model (BatchNorm inside the scan) agrees with one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardax as sx
from shardax.plan.tree import is_key

LAYERS, DIM = 3, 4
BATCH = {
    "x": np.random.default_rng(0).normal(size=(16, DIM)).astype(np.float32),
    "y": np.random.default_rng(1).normal(size=(16, 1)).astype(np.float32),
}


class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.norm = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return nnx.gelu(self.dropout(self.norm(self.linear(x))))


class ScannedMLP(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return Block(dim, rngs=rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(dim, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def scanned(deterministic: bool = False, tx=None) -> sx.TrainState:
    model = ScannedMLP(DIM, rngs=nnx.Rngs(0))
    if deterministic:
        model.set_attributes(deterministic=True)
    return sx.TrainState.create(model, tx or optax.adam(1e-2))


def stream_keys(state: sx.TrainState) -> list[np.ndarray]:
    return [np.asarray(jax.random.key_data(x)) for x in jax.tree.leaves(state.model_state)
            if is_key(x)]  # fmt: skip


def test_the_streams_are_key_arrays_of_the_layer_count():
    keys = [x for x in jax.tree.leaves(scanned().model_state) if is_key(x)]
    assert keys and all(k.shape == (LAYERS,) for k in keys)


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_drawing_from_stacked_streams_is_refused_by_name(mesh, mode):
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode)
    with pytest.raises(ValueError, match=r"own random generator \(model_state/blocks/dropout/rngs"
                       rf".*mode='{mode}'.*rng_per_device=True"):  # fmt: skip
        step(step.shard(scanned()), BATCH)


def test_rng_per_device_draws_per_device_and_keeps_the_keys(mesh):
    state = scanned()
    step = sx.make_train_step(loss_fn, mesh=mesh, mode="shard_map", rng_per_device=True)
    new, metrics = step(step.shard(state), BATCH)
    assert np.isfinite(float(metrics["loss"]))
    # the keys come back unfolded; the streams' counts advanced once
    for got, want in zip(stream_keys(new), stream_keys(state), strict=True):
        np.testing.assert_array_equal(got, want)
    report = sx.verify(step, state, BATCH)
    assert not report.ok and report.cause == "device-folded RNG"


def test_deterministic_scan_with_batchnorm_under_shard_map_is_one_devices(mesh):
    # SGD: the linear biases before BatchNorm have a gradient of rounding noise, which
    # Adam would turn into steps of +-lr (verify, below, judges those under Adam)
    state = scanned(deterministic=True, tx=optax.sgd(0.1))
    one = sx.make_mesh({"data": 1}, devices=jax.devices()[:1])
    runs = {}
    for name, m, mode in (("shard_map", mesh, "shard_map"), ("one", one, "jit")):
        step = sx.make_train_step(loss_fn, mesh=m, mode=mode)
        runs[name], _ = step(step.shard(state), BATCH)
    got, want = runs["shard_map"], runs["one"]
    mean = got.model_state["blocks"]["norm"]["mean"]
    assert mean.shape == (LAYERS, DIM) and mean.sharding.is_fully_replicated
    for a, b in zip(jax.tree.leaves((got.params, got.model_state)),
                    jax.tree.leaves((want.params, want.model_state)), strict=True):  # fmt: skip
        if is_key(a):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
