"""Update statistics the train step returns beside the loss: grad norm, param norm, lr.

They are computed once inside the compiled step, from the gradients every device already
holds after the all-reduce, so they cost a few reductions and no extra communication.

>>> state = sx.TrainState.from_params({"w": jnp.ones(3)}, lambda p, x: x @ p["w"],
...                                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
>>> stats = update_stats(state, {"w": jnp.full(3, 2.0)})
>>> sorted(stats), float(stats["grad_norm"]) ** 2
(['grad_norm', 'learning_rate', 'param_norm'], 12.0)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

STATS = ("grad_norm", "param_norm", "learning_rate")
"""The metric names :func:`update_stats` may add; ``loss_fn``'s aux must not use them."""

_HYPERPARAMS = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def learning_rate(opt_state: Any) -> jax.Array | None:
    """The learning rate an ``optax.inject_hyperparams`` state holds (the first one found
    in ``opt_state``, e.g. inside a chain), or None when there is none.

    After ``tx.update`` it is the rate that update used, schedule included.
    """
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, _HYPERPARAMS)):
        if isinstance(node, _HYPERPARAMS) and "learning_rate" in node.hyperparams:
            return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)
    return None


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all the floating leaves of ``tree`` together, in float32."""
    squares = [
        jnp.sum(jnp.square(x.astype(jnp.float32)))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.sqrt(sum(squares, jnp.float32(0)))


def update_stats(state: Any, grads: Any) -> dict[str, jax.Array]:
    """``grad_norm`` (global L2 norm of ``grads``), ``param_norm`` (of ``state.params``)
    and, when ``state.opt_state`` has one, ``learning_rate``; float32 scalars."""
    stats = {
        "grad_norm": global_norm(grads),
        "param_norm": global_norm(state.params),
    }
    lr = learning_rate(state.opt_state)
    if lr is not None:
        stats["learning_rate"] = lr
    return stats
