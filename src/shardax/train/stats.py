"""Update statistics the train step returns beside the loss: grad norm, param norm, lr.

They are computed once inside the compiled step, from the gradients every device already
holds after the all-reduce, so they cost a pass over the gradients (``grad_norm``) or the
params (``param_norm``) and no extra communication under replicating plans.
``make_train_step(stats=...)`` picks them: ``DEFAULT_STATS`` unless told, which is
only the learning rate (a scalar the optimizer state holds already: free), so the default
step does no work a hand-written one does not. ``stats_every=N`` computes the norms
only on the steps whose count is a multiple of N (inside the one compiled step, under
``lax.cond``), NaN on the others: a loop that logs every N steps pays for them once per
log (``every_nth``).

>>> state = sx.TrainState.from_params({"w": jnp.ones(3)}, lambda p, x: x @ p["w"],
...                                   optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
>>> stats = update_stats(state, {"w": jnp.full(3, 2.0)}, STATS)
>>> sorted(stats), round(float(stats["grad_norm"]) ** 2, 4)
(['grad_norm', 'learning_rate', 'param_norm'], 12.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

STATS = ("grad_norm", "param_norm", "learning_rate")
"""The metric names ``update_stats`` may add; ``loss_fn``'s aux must not use them."""

DEFAULT_STATS = ("learning_rate",)
"""What the train step returns unless ``stats=`` says otherwise: ``grad_norm`` and
``param_norm`` are a pass over the gradients or the params, asked for by name (with
``stats_every=`` to pay for them only at logging steps)."""

NORMS = ("grad_norm", "param_norm")
"""The statistics that cost a pass over a tree (``stats_every`` applies to them)."""

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


def check_stats(stats: Sequence[str]) -> tuple[str, ...]:
    """``stats`` as a tuple of names from ``STATS``, or a ValueError naming the rule."""
    if isinstance(stats, str) or not all(isinstance(n, str) for n in stats):
        raise ValueError(
            f"stats must be a tuple of names from {list(STATS)} (() for none), got {stats!r}"
        )
    unknown = [n for n in stats if n not in STATS]
    if unknown:
        raise ValueError(f"stats {unknown} unknown: the step can return {list(STATS)}")
    return tuple(dict.fromkeys(stats))


def update_stats(state: Any, grads: Any, stats: Sequence[str] = DEFAULT_STATS) -> dict[str, Any]:
    """The ``stats`` asked for, as float32 scalars: ``grad_norm`` (global L2 norm of
    ``grads``), ``param_norm`` (of ``state.params``) and ``learning_rate`` (when
    ``state.opt_state`` holds one)."""
    out = {}
    if "grad_norm" in stats:
        out["grad_norm"] = global_norm(grads)
    if "param_norm" in stats:
        out["param_norm"] = global_norm(state.params)
    if "learning_rate" in stats:
        lr = learning_rate(state.opt_state)
        if lr is not None:
            out["learning_rate"] = lr
    return out


def every_nth(state: Any, grads: Any, stats: Sequence[str], every: int) -> dict[str, Any]:
    """``update_stats``, with the norms computed only when ``state.step`` (the count
    after the update) is a multiple of ``every`` and NaN otherwise, in one program."""
    if every == 1:
        return update_stats(state, grads, stats)
    out = update_stats(state, grads, [n for n in stats if n not in NORMS])
    norms = [n for n in stats if n in NORMS]
    if norms:
        out.update(
            lax.cond(
                state.step % every == 0,
                lambda: update_stats(state, grads, norms),
                lambda: {n: jnp.float32(jnp.nan) for n in norms},
            )
        )
    return out
