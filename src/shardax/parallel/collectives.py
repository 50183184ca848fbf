"""Collectives over named mesh axes that work under jit, shard_map and pmap.

Inside ``jax.shard_map`` or ``jax.pmap`` a named axis is bound and values are per-device:
the reductions are ``psum``/``pmean``/``pmax``/``pmin``. Under plain ``jax.jit`` (or
eagerly) no axis is bound and values are already global, so the reductions of
[`reduce`][shardax.parallel.reduce] return them unchanged; naming an axis that is not
bound while *other* axes are is an error: under shard_map a name that is not bound would
otherwise be taken as a global value.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> f = jax.shard_map(lambda x: reduce(x, "sum", "data"), mesh=mesh,
...                   in_specs=P("data"), out_specs=P())
>>> int(f(jnp.ones(mesh.size))[0])  # each device held a 1, shape (1,)
8
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from shardax.checks import public
from shardax.plan.tree import is_array

AxisName = str | Sequence[str] | None
ReduceType = Literal["mean", "sum", "max", "min"]

_REDUCERS: dict[str, Callable[..., Any]] = {
    "mean": lax.pmean,
    "sum": lax.psum,
    "max": lax.pmax,
    "min": lax.pmin,
}


def bound_axes() -> dict[str, int]:
    """The named axes bound here (by shard_map or pmap), with their sizes."""
    mesh = jax.sharding.get_abstract_mesh()
    return {name: mesh.shape[name] for name in mesh.manual_axes}


def _names(axis_name: AxisName) -> tuple[str, ...]:
    if axis_name is None:
        return tuple(bound_axes())
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def require_bound(axis_name: AxisName, caller: str) -> tuple[str, ...]:
    """The axis names in ``axis_name``; raises ``NameError`` naming any that is unbound."""
    names = _names(axis_name)
    bound = bound_axes()
    missing = [n for n in names if n not in bound]
    if missing:
        where = f"the bound axes here are {sorted(bound)}" if bound else "no axis is bound here"
        raise NameError(
            f"{caller}: axis name {missing[0]!r} is unbound ({where}). Call it inside "
            f"jax.shard_map over a mesh with axis {missing[0]!r}, or inside "
            f"jax.pmap(..., axis_name={missing[0]!r}); under plain jax.jit values are "
            "already global and need no reduction."
        )
    return names


def _check_reduce_type(reduce_type: str) -> None:
    if reduce_type not in _REDUCERS:
        raise ValueError(
            f"Unsupported reduce_type: {reduce_type!r}; reduce_type must be one of "
            f"{sorted(_REDUCERS)}"
        )


@public("sx.parallel.reduce")
def reduce(tree: Any, reduce_type: ReduceType = "mean", axis_name: AxisName = None) -> Any:
    """Reduces every array leaf of ``tree`` across ``axis_name`` (default: all bound axes).

    With no axis bound at all (plain jit, or eager), values are global and returned
    unchanged. With axes bound, ``axis_name`` must be one of them.
    """
    _check_reduce_type(reduce_type)
    if not bound_axes():
        return tree
    names = require_bound(axis_name, f"reduce_{reduce_type}")
    op = _REDUCERS[reduce_type]
    return jax.tree.map(lambda x: op(x, names) if is_array(x) else x, tree)


@public("sx.parallel.all_reduce")
def all_reduce(tree: Any, reduce_type: ReduceType = "mean", axis_name: AxisName = "data") -> Any:
    """Strict all-reduce: ``axis_name`` must be bound (inside shard_map or pmap).

    Raises ``ValueError`` for an unknown ``reduce_type`` and ``NameError`` naming the
    axis when it is unbound.
    """
    _check_reduce_type(reduce_type)
    names = require_bound(axis_name, "all_reduce")
    op = _REDUCERS[reduce_type]
    return jax.tree.map(lambda x: op(x, names) if is_array(x) else x, tree)


@public("sx.parallel.all_gather")
def all_gather(tree: Any, axis_name: AxisName = None) -> Any:
    """Stacks every array leaf across ``axis_name`` on a new leading axis.

    With no axis bound (plain jit or eager), the one global value gets a leading axis
    of size 1.
    """
    if not bound_axes():
        return jax.tree.map(lambda x: x[None] if is_array(x) else x, tree)
    names = require_bound(axis_name, "all_gather")
    return jax.tree.map(lambda x: lax.all_gather(x, names) if is_array(x) else x, tree)


@public("sx.parallel.weighted_mean")
def weighted_mean(tree: Any, weight: Any = None, axis_name: AxisName = None) -> Any:
    """The mean over all shards of each leaf, shard ``i`` weighted by ``weight_i``.

    Inside shard_map or pmap it is ``psum(x * w) / psum(w)`` over ``axis_name``
    (default: all bound axes); ``weight=None`` gives equal weights (``pmean``). Under
    plain jit or eagerly, values are already global and are returned unchanged. So
    one metric function gives the global mean in every mode, even when shards hold
    different numbers of real examples. Total weight 0 gives 0.

    >>> mesh = sx.make_mesh({"data": -1})
    >>> f = jax.shard_map(lambda x, w: weighted_mean(x[0], w[0], "data"), mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P(), check_vma=False)
    >>> float(f(jnp.arange(8.0), jnp.ones(8)))
    3.5
    """
    if not bound_axes():
        return tree
    if weight is None:
        return reduce(tree, "mean", axis_name)
    names = require_bound(axis_name, "weighted_mean")
    total = lax.psum(weight, names)
    denominator = jnp.where(total == 0, 1, total)

    def one(x: Any) -> Any:
        if not is_array(x):
            return x
        return (lax.psum(x * weight.astype(x.dtype), names) / denominator.astype(x.dtype)).astype(
            x.dtype
        )

    return jax.tree.map(one, tree)
