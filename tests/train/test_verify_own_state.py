"""``sx.verify`` of your own step, written as Haiku's examples write it, in plain JAX/optax.

The state is a ``TrainingState(params, opt_state, step)`` NamedTuple and the step is
``update(state, data) -> (state, metrics)`` under ``jax.jit``. The attention's key bias
has an exact gradient of zero (softmax ignores a constant added to every key), so Adam
turns its rounding noise into steps of ±lr: verify names that update as rounding noise
and does not fail the step for it. A ``jax.jit`` bound to the mesh by its shardings gets
a one-device reference jitted without them; one whose body names the mesh is refused,
naming ``reference=``.
"""

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from xla_flags import LEGACY_EMITTERS

import shardax as sx
from shardax.train.verification.function import FunctionSide, spread
from shardax.train.verification.noise import unread

VOCAB, D, HEADS, T = 16, 8, 2, 6


class TrainingState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    step: jax.Array


def linear(key, n_in, n_out):
    return {"w": jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in), "b": jnp.zeros(n_out)}


def init_params(key):
    keys = jax.random.split(key, 6)
    names = ("query", "key", "value", "linear")
    return {
        "embed": {"embeddings": jax.random.normal(keys[0], (VOCAB, D))},
        "attention": {n: linear(k, D, D) for n, k in zip(names, keys[1:5], strict=True)},
        "logits": linear(keys[5], D, VOCAB),
    }


def forward(params, tokens):
    h = params["embed"]["embeddings"][tokens]
    att = params["attention"]
    heads = lambda n: (h @ att[n]["w"] + att[n]["b"]).reshape(*h.shape[:-1], HEADS, -1)  # noqa: E731
    q, k, v = heads("query"), heads("key"), heads("value")
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -1e30)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores), v).reshape(h.shape)
    h = h + o @ att["linear"]["w"] + att["linear"]["b"]
    return h @ params["logits"]["w"] + params["logits"]["b"]


optimiser = optax.adam(3e-2)


def loss_fn(params, data):
    logits = forward(params, data["obs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, data["target"]).mean()


def update(state, data):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, data)
    updates, opt_state = optimiser.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainingState(params, opt_state, state.step + 1), {"loss": loss}


def placed(mesh):
    params = init_params(jax.random.key(0))
    state = TrainingState(params, optimiser.init(params), jnp.zeros((), jnp.int32))
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, T + 1)).astype(np.int32)
    data = {"obs": tokens[:, :-1], "target": tokens[:, 1:]}
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return jax.device_put(state, replicated), jax.device_put(data, rows)


def test_a_named_tuple_is_one_state_a_plain_tuple_is_spread():
    state = TrainingState({}, (), jnp.zeros(()))
    assert spread(state) == (state,)
    assert spread((1, 2)) == (1, 2)


@pytest.mark.skipif(
    LEGACY_EMITTERS in os.environ.get("XLA_FLAGS", ""),
    reason="the rounding noise of XLA:CPU's fusion emitters, which leg 1's tests turn off "
    "to compile faster (tests/xla_flags.py); leg 2 (JAX 0.12) runs it",
)
def test_the_key_bias_update_is_named_rounding_noise_and_forgiven(mesh):
    state, data = placed(mesh)
    report = sx.verify(jax.jit(update), state, data)
    assert report.ok and report.cause == "update of rounding noise"
    assert "state/0/params/attention/key/b" in report.hint
    noise = [d for d in report.diffs if d.noise]
    assert [d.path for d in noise] == ["state/0/params/attention/key/b"]
    assert not noise[0].within(report.rtol, report.atol)  # it does differ, by ~lr
    assert "not a difference: update of rounding noise" in str(report)


def one_device(start):
    """A reference over ``{"w", "b", "n"}``: the loss reads ``w`` only."""
    x = jnp.arange(4.0)
    loss = jnp.sum(start["w"] * x)
    return {"returned": {"loss": loss}, "state": {"w": start["w"] - 0.1 * x, "b": start["b"]}}


@pytest.mark.parametrize(
    ("paths", "found"),
    [(["state/b"], {"state/b"}), (["state/w"], set()), (["state/n"], set())],
)
def test_unread_names_only_leaves_nothing_reads(paths, found):
    start = {"w": jnp.ones(4), "b": jnp.zeros(4), "n": jnp.zeros((), jnp.int32)}
    assert unread(one_device, start, one_device(start), paths, 1e-4, 1e-6) == found


def test_a_jit_bound_to_its_mesh_gets_a_one_device_reference(mesh):
    state, data = placed(mesh)
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    bound = jax.jit(update, in_shardings=(replicated, rows), out_shardings=replicated)
    report = sx.verify(bound, state, data)
    assert report.ok and "jitted again without its shardings" in report.judged

    def constrained(state, data):
        return update(state, jax.lax.with_sharding_constraint(data, rows))

    with pytest.raises(ValueError, match=r"sx.verify: the step constrained is bound to its "
                       r"8-device mesh's devices .* pass reference="):  # fmt: skip
        sx.verify(jax.jit(constrained), state, data)
    assert sx.verify(jax.jit(constrained), state, data, reference=jax.jit(update)).ok


def test_a_leaf_the_step_carries_along_unread_is_never_noise():
    def step(w, ema, batch):  # ema: read by nothing but its own update
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((batch["x"] @ w) ** 2))(w)
        return w - 0.1 * grad, 0.9 * ema + 0.1 * w, {"loss": loss}

    side = FunctionSide(jax.jit(step), (jnp.ones((4, 2)), jnp.zeros((4, 2))),
                        {"x": np.ones((8, 4), np.float32)})  # fmt: skip
    assert side._read_elsewhere(side._args, {"state/0"})
    assert not side._read_elsewhere(side._args, {"state/1"})
