"""Tiny models in every framework, with one loss function each, for the train tests."""

from __future__ import annotations

import contextlib

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardax as sx

IN, HIDDEN, OUT = 4, 16, 2
FRAMEWORKS = ("nnx", "linen", "equinox", "pytree")


class NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(OUT)(jnp.tanh(nn.Dense(HIDDEN)(x)))


def pytree_apply(params: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def make_state(framework: str, tx: optax.GradientTransformation | None = None) -> sx.TrainState:
    """A fresh state; the same framework always starts from the same params."""
    tx = optax.sgd(0.1, momentum=0.9) if tx is None else tx
    if framework == "nnx":
        return sx.TrainState.create(NNXMLP(nnx.Rngs(0)), tx)
    if framework == "linen":
        module = LinenMLP()
        variables = module.init(jax.random.key(0), jnp.ones((1, IN)))
        return sx.TrainState.from_linen(module, variables, tx)
    if framework == "equinox":
        model = eqx.nn.MLP(IN, OUT, HIDDEN, 1, activation=jnp.tanh, key=jax.random.key(0))
        return sx.TrainState.create(model, tx)
    if framework == "pytree":
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {
            "w1": jax.random.normal(k1, (IN, HIDDEN)) / 2,
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, OUT)) / 4,
            "b2": jnp.zeros(OUT),
        }
        return sx.TrainState.from_params(params, pytree_apply, tx)
    raise ValueError(framework)


def predict(framework: str, model, x: jax.Array) -> jax.Array:
    return jax.vmap(model)(x) if framework == "equinox" else model(x)


def make_loss(framework: str):
    """Masked mean squared error, with the masked mean absolute error as aux."""

    def loss_fn(model, batch):
        err = predict(framework, model, batch["x"]) - batch["y"]
        mask = batch.get("mask")
        return sx.masked_mean(err**2, mask), {"mae": sx.masked_mean(jnp.abs(err), mask)}

    return loss_fn


def batches(n: int, size: int = 32, seed: int = 0, mask: bool = False) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(size, IN)).astype(np.float32)
        batch = {"x": x, "y": np.sin(x[:, :OUT]).astype(np.float32)}
        if mask:
            batch["mask"] = rng.random(size) < 0.6
        out.append(batch)
    return out


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# -- a tiny language model, for token-weighted losses -----------------------------------

VOCAB, EMBED, SEQ = 11, 8, 6


def lm_apply(params: dict, tokens: jax.Array) -> jax.Array:
    """Logits ``(batch, seq, vocab)``: each position sees its token and the previous one."""
    h = params["embed"][tokens]
    h = jnp.tanh(h + jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1] @ params["mix"])
    return h @ params["out"]


def lm_state(tx: optax.GradientTransformation | None = None) -> sx.TrainState:
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    params = {
        "embed": jax.random.normal(k1, (VOCAB, EMBED)),
        "mix": jax.random.normal(k2, (EMBED, EMBED)) / 3,
        "out": jax.random.normal(k3, (EMBED, VOCAB)) / 3,
    }
    return sx.TrainState.from_params(params, lm_apply, tx or optax.adam(1e-2))


def lm_loss(model, batch):
    """Next-token cross-entropy, the mean over the real tokens."""
    logits = model(batch["tokens"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    accuracy = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
    mask = batch["mask"]
    return sx.masked_mean(losses, mask), {"accuracy": sx.masked_mean(accuracy, mask)}


def padded_token_batches(n: int, size: int = 16, seed: int = 0) -> list[dict]:
    """Sequences of lengths 1..SEQ, padded with garbage tokens; mask (batch, seq)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        text = rng.integers(0, VOCAB, size=(size, SEQ + 1)).astype(np.int32)
        lengths = rng.integers(1, SEQ + 1, size=size)
        mask = np.arange(SEQ)[None, :] < lengths[:, None]
        out.append({"tokens": text[:, :-1], "targets": text[:, 1:], "mask": mask})
    return out


def lm_losses_numpy(params: dict, batch: dict) -> np.ndarray:
    """Per-token cross-entropy in NumPy (float64)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = p["embed"][batch["tokens"]]
    prev = np.concatenate([np.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    logits = np.tanh(h + prev @ p["mix"]) @ p["out"]
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]


@contextlib.contextmanager
def count_compiles():
    """Collects one entry per XLA compilation (``jax.monitoring``) while open."""
    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
