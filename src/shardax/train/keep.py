"""``keep_plan``: the plan holds after every step of the user's own loop.

A user's ``jax.jit`` / ``nnx.jit`` / ``eqx.filter_jit`` step has no ``out_shardings``, so
XLA picks the layout of what it returns: after one step under :func:`shardax.zero1` the
params are no longer replicated, under a TP rule a LayerNorm bias moves. One line under
the framework's jit keeps every leaf that :func:`shardax.prepare` placed on its plan:

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
sharding :func:`shardax.prepare` wrote in their metadata, and every returned subtree
whose structure and shapes ``prepare`` placed (an Equinox model, an optax state, a
``flax.training`` train state) by structure. Placed over the jit
(``sx.keep_plan(jax.jit(step))``), the step has already chosen its layouts: it warns once,
naming each leaf that moved, and puts it back (a copy per step; move it under the jit).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax

from shardax.checks import public
from shardax.plan.placed import METADATA_KEY, is_recorded, is_variable, planned, variables


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


def _join(*paths: Any) -> str:
    from shardax.plan.tree import path_str

    return "/".join(s for s in (path_str(p) for p in paths) if s) or "(root)"


@public("sx.keep_plan")
def keep_plan(step: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps the user's train step so that every leaf :func:`shardax.prepare` placed keeps
    its plan's sharding after each step. Put it under the framework's jit::

        @nnx.jit                 # or jax.jit, eqx.filter_jit
        @sx.keep_plan
        def train_step(model, optimizer, batch): ...

    Traced, it ends the step with ``jax.lax.with_sharding_constraint`` on each planned
    leaf, so the compiled step returns the plan's layouts (and holds the plan's memory).
    Called on concrete arrays (placed over the jit), it warns once naming each leaf that
    moved and puts it back with ``jax.device_put``.
    """
    if not callable(step):
        raise TypeError(f"step must be a callable (the user's train step), got {step!r}")
    warned: set[str] = set()

    def constrain(path: str, x: Any, sharding: Any) -> Any:
        return jax.lax.with_sharding_constraint(x, sharding)

    def put_back(path: str, x: Any, sharding: Any) -> Any:
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

    @functools.wraps(step)
    def kept(*args: Any, **kwargs: Any) -> Any:
        traced = _traced((args, kwargs))
        out = step(*args, **kwargs)
        return _hold(args, kwargs, out, constrain if traced else put_back)

    return kept
