"""``keep_plan``: the plan holds after every step of the user's own loop.

A user's ``jax.jit`` / ``nnx.jit`` / ``eqx.filter_jit`` step has no ``out_shardings``, so
XLA picks the layout of what it returns: after one step under [`shardax.zero1`][shardax.zero1] the
params are no longer replicated, under a TP rule a LayerNorm bias moves. One line under
the framework's jit keeps every leaf that [`shardax.prepare`][shardax.prepare] placed on its plan:

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
>>> optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
>>> model, optimizer = sx.prepare(model, optimizer, mesh=mesh, plan=sx.zero1(mesh, min_size=1))
>>> @nnx.jit
... @sx.keep_plan
... def train_step(model, optimizer, x):
...     loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
...     optimizer.update(model, grads)
...     return loss
>>> _ = train_step(model, optimizer, jnp.ones((8, 64)))
>>> model.kernel.sharding.spec, optimizer.opt_state[0].mu["kernel"].sharding.spec
(P(), P('data',))

Under the jit (as above) it constrains each leaf to its plan at the end of the traced
step (``jax.lax.with_sharding_constraint``): NNX Variables (updated in place) by the
sharding [`shardax.prepare`][shardax.prepare] wrote in their metadata, and every returned subtree
whose structure and shapes ``prepare`` placed (an Equinox model, an optax state, a
``flax.training`` train state) by structure. Placed over the jit
(``sx.keep_plan(jax.jit(step))``), the step has already chosen its layouts: it warns once,
naming each leaf that moved, and puts it back (a copy per step; move it under the jit).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax

from shardax.checks import public, received
from shardax.plan.core import Plan
from shardax.plan.placed import (
    METADATA_KEY,
    is_recorded,
    is_variable,
    planned,
    planned_leaves,
    signature,
    variables,
)
from shardax.plan.tree import path_str


def _value(var: Any) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def _set(var: Any, value: Any) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # pragma: no cover - older flax
        var.value = value


def _traced(args: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def _moved(sharding: Any, x: Any) -> bool:
    have = getattr(x, "sharding", None)
    return sharding is not None and have is not None and not have.is_equivalent_to(sharding, x.ndim)


def _hold(
    args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, fix: Callable[[str, Any, Any], Any]
) -> Any:
    """Applies ``fix(name, value, sharding)`` to every planned leaf: the NNX Variables
    among the arguments (in place) and the recorded subtrees of ``out``."""
    for where, arg in [*enumerate(args), *kwargs.items()]:
        for path, var in variables(arg):
            sharding = var.get_metadata().get(METADATA_KEY)
            if sharding is not None:
                _set(var, fix(f"argument {where!r} {path}", _value(var), sharding))
    is_node = lambda n: is_variable(n) or is_recorded(n)  # noqa: E731
    shardings = planned(out)

    def go(path: Any, node: Any, sharding: Any) -> Any:
        if is_variable(node) or not is_recorded(node):
            return node
        return jax.tree_util.tree_map_with_path(
            lambda p, x, s: x if s is None else fix(f"output {_join(path, p)}", x, s),
            node,
            sharding,
        )

    return jax.tree_util.tree_map_with_path(go, out, shardings, is_leaf=is_node)


class _Held:
    """What ``_hold`` walks, found once: each argument's planned NNX Variables (by
    the argument object, while it lives) and each output structure's planned leaves (by
    its treedef and leaf shapes). For a step called on concrete arrays (over the jit),
    where the walk would otherwise run on every step."""

    def __init__(self) -> None:
        self.args: dict[int, tuple[Any, list[tuple[str, Any, Any]]]] = {}
        self.outs: dict[Any, list[tuple[str, Any] | None]] = {}

    def variables(self, where: Any, arg: Any) -> list[tuple[str, Any, Any]]:
        key = id(arg)
        entry = self.args.get(key)
        if entry is not None and entry[0]() is arg:
            return entry[1]
        try:
            ref = weakref.ref(arg, lambda _: self.args.pop(key, None))
        except TypeError:  # a batch, or a tuple or dict of objects: walked each call
            ref = None
            if not any(map(is_variable, jax.tree.leaves(arg, is_leaf=is_variable))):
                return []
        found = [
            (f"argument {where!r} {path}", var, var.get_metadata().get(METADATA_KEY))
            for path, var in variables(arg)
        ]
        found = [(name, var, s) for name, var, s in found if s is not None]
        if ref is not None:
            self.args[key] = (ref, found)
        return found

    def hold(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, fix: Any) -> Any:
        for where, arg in [*enumerate(args), *kwargs.items()]:
            for name, var, sharding in self.variables(where, arg):
                _set(var, fix(name, _value(var), sharding))
        leaves, treedef = jax.tree.flatten(out, is_leaf=is_variable)
        try:
            key = (treedef, tuple(map(signature, leaves)))
            plan = self.outs.get(key)
        except TypeError:  # an unhashable structure
            return _hold((), {}, out, fix)
        if plan is None:
            plan = self.outs[key] = _out_plan(out)
        new = [x if w is None else fix(w[0], x, w[1]) for x, w in zip(leaves, plan, strict=True)]
        return jax.tree.unflatten(treedef, new)


def _out_plan(out: Any) -> list[tuple[str, Any] | None]:
    """``(name, planned sharding)`` or None for each leaf of ``out`` (NNX Variables as
    leaves, left alone), in flattening order: the recorded subtrees' leaves."""
    is_node = lambda n: is_variable(n) or is_recorded(n)  # noqa: E731
    plan: list[tuple[str, Any] | None] = []
    for path, node in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_node)[0]:
        if is_variable(node) or not is_recorded(node):
            plan.append(None)
            continue
        inner = jax.tree_util.tree_flatten_with_path(node)[0]
        for (p, _), s in zip(inner, planned_leaves(node), strict=True):
            plan.append(None if s is None else (f"output {_join(path, p)}", s))
    return plan


def _join(*paths: Any) -> str:
    return "/".join(s for s in (path_str(p) for p in paths) if s) or "(root)"


@public("sx.keep_plan")
def keep_plan(step: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Wraps the user's train step so that every leaf [`shardax.prepare`][shardax.prepare]
    placed keeps its plan's sharding after each step. Put it under the framework's jit::

        @nnx.jit                 # or jax.jit, eqx.filter_jit
        @sx.keep_plan
        def train_step(model, optimizer, batch): ...

    Traced, it ends the step with ``jax.lax.with_sharding_constraint`` on each planned
    leaf, so the compiled step returns the plan's layouts (and holds the plan's memory).
    Called on concrete arrays (placed over the jit), it warns once naming each leaf that
    moved and puts it back with ``jax.device_put``. ``@sx.keep_plan()`` is the same.
    A step none of whose arguments or outputs ``sx.prepare`` placed has nothing to hold:
    it warns once, saying so.
    """
    if step is None:  # @sx.keep_plan()
        return keep_plan
    if isinstance(step, Plan | jax.sharding.Sharding | jax.sharding.Mesh):
        what = f"the plan {step.name!r}" if isinstance(step, Plan) else received(step)
        raise TypeError(
            f"step must be the user's train step, got {what}: sx.keep_plan takes no plan, "
            "it holds each leaf to the plan sx.prepare placed it with. Decorate the step: "
            "@jax.jit above @sx.keep_plan above def train_step(...)"
        )
    if not callable(step):
        raise TypeError(f"step must be a callable (the user's train step), got {step!r}")
    warned: set[str] = set()
    held = _Held()  # over the jit: what to hold, found once, not walked every step
    name = getattr(step, "__name__", type(step).__name__)
    kept_leaves = [0]  # planned leaves met by the last call

    def constrain(path: str, x: Any, sharding: Any) -> Any:
        kept_leaves[0] += 1
        return jax.lax.with_sharding_constraint(x, sharding)

    def put_back(path: str, x: Any, sharding: Any) -> Any:
        kept_leaves[0] += 1
        if not _moved(sharding, x):
            return x
        if path not in warned:
            warned.add(path)
            warnings.warn(
                f"sx.keep_plan: {path} left its plan after the step: "
                f"{getattr(x.sharding, 'spec', x.sharding)} instead of "
                f"{getattr(sharding, 'spec', sharding)}; put back with a copy. Put "
                "sx.keep_plan under the jit (@jax.jit above @sx.keep_plan) to keep it "
                "without one",
                stacklevel=4,
            )
        return jax.device_put(x, sharding)

    def nothing_held() -> None:
        if kept_leaves[0] or "" in warned:
            return
        warned.add("")
        warnings.warn(
            f"sx.keep_plan: {name} holds nothing: none of its arguments or outputs was "
            "placed by sx.prepare (NNX variables carry their plan; other models, optimizer "
            "states and train states are known by their structure and shapes), so no leaf "
            "is kept on a plan. Place them first: model, optimizer = sx.prepare(model, "
            "optimizer, mesh=mesh, plan=...)",
            stacklevel=3,
        )

    @functools.wraps(step)
    def kept(*args: Any, **kwargs: Any) -> Any:
        traced = _traced((args, kwargs))
        out = step(*args, **kwargs)
        kept_leaves[0] = 0
        if traced:  # once per trace
            out = _hold(args, kwargs, out, constrain)
        else:
            out = held.hold(args, kwargs, out, put_back)
        nothing_held()
        return out

    return kept
