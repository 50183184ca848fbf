"""Instrumented optimizers: an ``nnx.Optimizer`` that hands verify its gradients.

In verify's copy of your state (never in yours), each ``nnx.Optimizer``'s transformation
is wrapped so that its state also holds the last gradients it was given. verify then
compares those gradients with one device's, and judges the update against the optimizer
applied, on one device, to the distributed gradients.

>>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
>>> [type(opt).__name__ for opt, _ in recorded((model, optimizer))]
['Optimizer']
>>> sorted(optimizer_view(recorded_pairs((model, optimizer)))["0"])
['grads', 'opt_state', 'params']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state

from shardax.train.verification.user_state import is_graph, objects, shapes


def _recording(tx: Any) -> Any:
    """``tx``, whose state also holds the last gradients it was given."""

    def init(params: Any) -> Any:
        return tx.init(params), jax.tree.map(jnp.zeros_like, params)

    def update(grads: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        updates, inner = tx.update(grads, state[0], params, **extra)
        return updates, (inner, grads)

    return optax.GradientTransformationExtraArgs(init, update)


def _pairs(args: tuple[Any, ...], fits: Callable[[Any, Any], bool]) -> list[tuple[Any, Any]]:
    """``(optimizer, model)`` for each ``nnx.Optimizer`` of ``args`` and the first model
    (its own, else any module of ``args``) whose params ``fits(optimizer, params)``."""
    if not is_graph(args):
        return []
    modules = [m for m in objects(args, nnx.Module) if not isinstance(m, nnx.Optimizer)]
    out = []
    for opt in objects(args, nnx.Optimizer):
        for model in [getattr(opt, "model", None), *modules]:
            if isinstance(model, nnx.Module) and fits(opt, _params(opt, model)):
                out.append((opt, model))
                break
    return out


def _params(opt: Any, model: Any) -> Any:
    return nnx.as_pure(nnx.state(model, opt.wrt))


def recorded(args: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(optimizer, model)`` for each ``nnx.Optimizer`` in a copy of the state, its
    transformation made to record the gradients (in the copy only)."""

    def fits(opt: Any, params: Any) -> bool:
        want = shapes(nnx.as_pure(opt.opt_state))
        return shapes(jax.eval_shape(opt.tx.init, params)) == want

    out = _pairs(args, fits)
    for opt, model in out:
        zeros = to_opt_state(jax.tree.map(jnp.zeros_like, _params(opt, model)))
        opt.opt_state = nnx.data((opt.opt_state, zeros))
        opt.tx = _recording(opt.tx)
    return out


def recorded_pairs(args: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(optimizer, model)`` for the recording optimizers of a copy (made from a copy
    that ``recorded`` instrumented: the instrumentation is copied with it)."""

    def fits(opt: Any, params: Any) -> bool:
        state = opt.opt_state
        return isinstance(state, tuple) and shapes(nnx.as_pure(state)[1]) == shapes(params)

    return _pairs(args, fits)


def optimizer_view(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Each recorded optimizer's gradients, params and (inner) state, by its position."""
    out = {}
    for i, (opt, model) in enumerate(pairs):
        inner, grads = nnx.as_pure(opt.opt_state)
        out[str(i)] = {"grads": grads, "params": _params(opt, model), "opt_state": inner}
    return out


def _expected_update(tx: Any, params: Any, opt_state: Any, grads: Any) -> dict[str, Any]:
    updates, new = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": new}


_expected_jit = jax.jit(_expected_update, static_argnums=0)


def applied(pairs: list[tuple[Any, Any]], grads: dict[str, Any]) -> dict[str, Any]:
    """Each recorded optimizer of ``pairs`` (of the state before a step) applied to
    ``grads`` (by position, as ``optimizer_view`` gives them): its params and (inner)
    state after the step."""
    view = optimizer_view(pairs)
    out = {}
    for i, (opt, _) in enumerate(pairs):
        start = view[str(i)]
        expected = _expected_jit(
            opt.tx, start["params"], (start["opt_state"], start["grads"]), grads[str(i)]
        )
        out[str(i)] = {"params": expected["params"], "opt_state": expected["opt_state"][0]}
    return out
