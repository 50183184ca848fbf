"""The state of your own step function, as verify sees it: NNX objects or a pytree.

NNX objects (a model, an ``nnx.Optimizer``) are read through ``nnx.state`` and copied
through ``nnx.split`` / ``nnx.merge``; any other state is a pytree of arrays. verify runs
your step on copies, so the state you pass is never changed or donated.

>>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> is_graph((model,)), sorted(arrays((model,))[0])
(True, ['bias', 'kernel'])
>>> copy = copied((model,), fresh)[0]
>>> copy is not model and bool((copy.kernel[...] == model.kernel[...]).all())
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardax.plan.tree import path_str


def _node_type() -> type:
    return getattr(nnx, "Pytree", nnx.Object)  # flax 0.12: Module and Optimizer are Pytrees


def is_graph(tree: Any) -> bool:
    """Whether ``tree`` holds NNX objects."""
    return bool(objects(tree, _node_type()))


def objects(args: Any, kind: type) -> list[Any]:
    """The objects of type ``kind`` among the leaves of ``args``."""
    return [
        x
        for x in jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(x, kind)
    ]


def arrays(args: tuple[Any, ...], which: Any = None) -> Any:
    """The array leaves of the state (NNX objects through ``nnx.state``, ``which``: a
    variable filter), as a pytree."""
    if is_graph(args):
        state = nnx.state(args) if which is None else nnx.state(args, which)
        return nnx.to_pure_dict(state)
    return args


def copied(args: tuple[Any, ...], put: Callable[[jax.Array], jax.Array]) -> tuple[Any, ...]:
    """A copy of ``args`` (NNX objects rebuilt) whose arrays are ``put(array)``."""

    def one(x: Any) -> Any:
        return put(x) if isinstance(x, jax.Array | np.ndarray) else x

    if is_graph(args):
        graphdef, state = nnx.split(args)
        return nnx.merge(graphdef, jax.tree.map(one, state))
    return jax.tree.map(one, args)


def fresh(x: Any) -> Any:
    """A copy of an array in a buffer of its own (no compilation for a placed array)."""
    if isinstance(x, jax.Array):  # an uncommitted array stays uncommitted
        return jax.device_put(x, x.sharding if x.committed else None, may_alias=False)
    return jnp.copy(x)


def shapes(tree: Any) -> list[tuple[int, ...]]:
    """The shapes of ``tree``'s leaves, in order."""
    return [np.shape(x) for x in jax.tree.leaves(tree)]


def has_batchnorm(args: Any) -> bool:
    """Whether the state holds a BatchNorm (an NNX one, or ``batch_stats`` leaves)."""
    if is_graph(args):
        objs = objects(args, _node_type())
        if any(
            isinstance(m, nnx.BatchNorm)
            for o in objs
            if isinstance(o, nnx.Module)
            for _, m in nnx.iter_modules(o)
        ):
            return True
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(arrays(args))]
    return any("batch_stats" in p or "BatchNorm" in p for p in paths)
