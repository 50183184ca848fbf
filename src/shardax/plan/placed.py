"""What each placed leaf was planned to be: recorded when
[`shardax.prepare`][shardax.prepare] places a loop's objects, read back by
[`shardax.keep_plan`][shardax.keep_plan] (which holds the plan after the user's own step)
and by [`shardax.describe`][shardax.describe] (plan against actual).

Two records, one per kind of object:

- an NNX ``Variable`` carries its planned sharding in its own metadata
  (``METADATA_KEY``), which survives ``nnx.jit``'s split and merge;
- any other pytree (an Equinox module, a ``flax.training`` train state, params, an optax
  state) is recorded by structure: its treedef and leaf shapes map to its shardings, so a
  new tree of the same structure (the step's output) finds them.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 8})
>>> tree = {"w": np.zeros((8, 4), np.float32), "b": np.zeros(4, np.float32)}
>>> tree = jax.device_put(tree, sx.fsdp(mesh, min_size=1)(tree))
>>> record(tree)
>>> planned(tree)["w"].spec
P('data', None)
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax.sharding import Sharding

from shardax.plan.tree import is_array, path_str

#: The NNX ``Variable`` metadata key holding the sharding its plan gave it.
METADATA_KEY = "shardax_plan"

# treedef -> [(leaf signatures, leaf shardings)]: every structure prepare placed.
_RECORDS: dict[Any, list[tuple[tuple[Any, ...], tuple[Any, ...]]]] = {}


def signature(leaf: Any) -> Any:
    """A leaf's shape and dtype (None for a leaf that is not an array)."""
    if is_array(leaf) or isinstance(leaf, jax.core.Tracer):
        return (tuple(leaf.shape), str(leaf.dtype))
    return None


def _sharding(leaf: Any) -> Sharding | None:
    sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
    return sharding if isinstance(sharding, Sharding) else None


def _hashable(treedef: Any) -> bool:
    try:
        hash(treedef)
    except TypeError:
        return False
    return True


def is_variable(x: Any) -> bool:
    """An NNX ``Variable`` (without importing flax where it is not loaded)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def variables(node: Any) -> list[tuple[str, Any]]:
    """``(path, Variable)`` of every NNX Variable in ``node`` (a module, an optimizer, or
    a pytree holding them): the objects themselves, so setting their value updates them."""
    if "flax.nnx" not in sys.modules:
        return []
    flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_variable)[0]
    return [(path_str(p), v) for p, v in flat if is_variable(v)]


def record(tree: Any) -> None:
    """Records the shardings ``tree``'s arrays have now as their plan: NNX Variables in
    their metadata, every other pytree by structure."""
    found = variables(tree)
    for _, var in found:
        sharding = _sharding(var.get_value() if hasattr(var, "get_value") else var.value)
        if sharding is not None:
            var.set_metadata(**{METADATA_KEY: sharding})
    if found:
        return
    leaves, treedef = jax.tree.flatten(tree)
    if treedef.num_leaves < 1 or not _hashable(treedef) or not any(map(is_array, leaves)):
        return
    if jax.tree_util.treedef_is_leaf(treedef):
        return
    sig = tuple(map(signature, leaves))
    entries = _RECORDS.setdefault(treedef, [])
    entries[:] = [e for e in entries if e[0] != sig]
    entries.append((sig, tuple(map(_sharding, leaves))))


def _lookup(treedef: Any, leaves: list[Any]) -> tuple[Any, ...] | None:
    if not _hashable(treedef):
        return None
    want = tuple(map(signature, leaves))
    for sig, shardings in _RECORDS.get(treedef, ()):
        if sig == want:
            return shardings
    return None


def is_recorded(node: Any) -> bool:
    """Whether ``node``'s structure and leaf shapes were recorded (a subtree to keep)."""
    leaves, treedef = jax.tree.flatten(node)
    if jax.tree_util.treedef_is_leaf(treedef):
        return False
    return _lookup(treedef, leaves) is not None


def planned(tree: Any) -> Any:
    """``tree`` with each leaf replaced by the sharding its plan gave it (``None`` where
    nothing was recorded): recorded subtrees by structure, NNX Variables by metadata."""

    def go(node: Any) -> Any:
        if is_variable(node):
            return node.get_metadata().get(METADATA_KEY)
        leaves, treedef = jax.tree.flatten(node)
        shardings = _lookup(treedef, leaves)
        if shardings is None:
            return jax.tree.map(lambda _: None, node)
        return jax.tree.unflatten(treedef, shardings)

    return jax.tree.map(go, tree, is_leaf=lambda n: is_variable(n) or is_recorded(n))


def planned_leaves(tree: Any) -> list[Sharding | None]:
    """The planned sharding of each leaf of ``jax.tree.leaves(tree)``, in that order
    (``None`` where nothing was recorded)."""
    out: list[Sharding | None] = []
    for node in jax.tree.leaves(tree, is_leaf=lambda n: is_variable(n) or is_recorded(n)):
        if is_variable(node):
            want = node.get_metadata().get(METADATA_KEY)
            out.extend(want for _ in jax.tree.leaves(node))
        elif is_recorded(node):
            leaves, treedef = jax.tree.flatten(node)
            out.extend(_lookup(treedef, leaves) or ())
        else:
            out.append(None)
    return out
