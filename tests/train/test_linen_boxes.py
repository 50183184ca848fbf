"""A Linen LM that shards itself with ``nn.with_partitioning``, in every mode.

``nn.DenseGeneral`` with 3-D names draws its kernel flat (2-D) and unboxes it at every
apply for flax's shape check; under the step's global mesh flax would constrain it (a
rank error under jit) and, under shard_map and pmap, constrain per-device values (Manual
axes). The step unboxes the boxes without their constraint (``shardax.train.boxes``):
the plan places the params, and ``sx.from_linen`` turns the boxes' names into the plan.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.train.boxes import unconstrained_boxes

VOCAB, D, HEADS = 16, 8, 2
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(8, 5)).astype(np.int32)
BATCH = {"x": TOKENS, "y": np.roll(TOKENS, -1, axis=1)}


def sharded(init, names):
    return nn.with_partitioning(init, names)


class SelfAttention(nn.Module):
    @nn.compact
    def __call__(self, x):
        qkv = nn.DenseGeneral(
            (3, HEADS, D // HEADS),
            kernel_init=sharded(nn.initializers.xavier_uniform(), ("data", None, None, None)),
            name="qkv",
        )(x)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        o = nn.dot_product_attention(q, k, v)
        return nn.DenseGeneral(
            D,
            axis=(-2, -1),
            kernel_init=sharded(nn.initializers.xavier_uniform(), (None, None, "data")),
            name="out",
        )(o)


class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D, embedding_init=sharded(nn.initializers.normal(1.0),
                                                          (None, "data")))  # fmt: skip
        h = embed(tokens)
        h = h + SelfAttention()(nn.LayerNorm()(h))
        return embed.attend(nn.LayerNorm()(h))


def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.fixture(scope="module")
def variables():
    return TinyLM().init(jax.random.key(0), TOKENS)


def state_of(variables, tx=None):
    # SGD by default: the key projection's bias has a gradient of rounding noise (softmax
    # ignores a constant added to every key), which Adam turns into steps of +-lr
    return sx.TrainState.from_linen(TinyLM(), variables, tx or optax.sgd(0.5))


def flat(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def one_device(variables):
    """Two steps on one device: ``mode="single"``, the model's own (no mesh) run."""
    step = sx.make_train_step(loss_fn, mesh=sx.make_mesh({"data": -1}), mode="single")
    state = step.shard(state_of(variables))
    for _ in range(2):
        state, metrics = step(state, BATCH)
    return state, float(metrics["loss"])


def test_outside_the_step_flax_still_constrains_its_boxes(mesh):
    box = nn.with_partitioning(nn.initializers.ones, ("data", None, None))(None, (8, 6))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="rank"):
        jax.jit(lambda b: b.unbox())(box)
    with jax.set_mesh(mesh), unconstrained_boxes():
        assert jax.jit(lambda b: b.unbox())(box).shape == (8, 6)


@pytest.mark.parametrize("mode", ["jit", "shard_map", "pmap"])
def test_every_mode_agrees_with_one_device(mesh, variables, one_device, mode):
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode)
    state = step.shard(state_of(variables))
    for _ in range(2):
        state, metrics = step(state, BATCH)
    want, loss = one_device
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5)
    for a, b in zip(flat(state.params), flat(want.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_boxes_names_as_the_plan_init_verify_and_estimate(mesh, variables, one_device):
    state = state_of(variables)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.from_linen(mesh, variables))
    # built straight onto the boxes' plan: DenseGeneral's flat kernel is drawn under the mesh
    placed = step.init(lambda key: state_of(TinyLM().init(key, TOKENS)), jax.random.key(0))
    qkv = placed.params["SelfAttention_0"]["qkv"]["kernel"].value
    assert qkv.sharding.spec == P("data", None, None, None)
    assert {s.data.shape for s in qkv.addressable_shards} == {(1, 3, HEADS, D // HEADS)}
    new, _ = step(placed, BATCH)
    new, _ = step(new, BATCH)
    for a, b in zip(flat(new.params), flat(one_device[0].params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert sx.verify(step, state_of(variables, optax.adam(1e-2)), BATCH).ok
    report = sx.estimate(step, jax.eval_shape(lambda: state), BATCH)
    assert report.compile_error is None and report.memory["peak"] > 0
