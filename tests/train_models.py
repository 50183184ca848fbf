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
