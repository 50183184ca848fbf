"""What a run saves of the user's state, and how a restore comes back into it.

A ``sx.TrainState`` or any pytree of arrays is saved as it is and restored as a new
tree. Flax NNX objects (a model, an ``nnx.Optimizer``, or a tuple of them, as
``sx.prepare`` keeps them) are saved as their ``nnx.state`` and restored in place with
``nnx.update``: the loop's own objects hold the restored values, so the loop needs no
new names.

>>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
>>> tree = saveable((model,))
>>> restored = restore_into((model,), jax.tree.map(jnp.zeros_like, tree))
>>> restored[0] is model, float(model.kernel[...].sum())
(True, 0.0)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from shardax.plan.tree import path_str


def has_graph_nodes(state: Any) -> bool:
    """True when ``state`` is an NNX object, or a tuple/list of values one of which is."""
    parts = state if isinstance(state, tuple | list) else (state,)
    return any(nnx.graph.is_graph_node(part) for part in parts)


def saveable(state: Any) -> Any:
    """The pytree of arrays a checkpoint holds for ``state``."""
    return nnx.state(state) if has_graph_nodes(state) else state


def restore_into(state: Any, restored: Any) -> Any:
    """The state to continue from: NNX objects updated in place (and returned), or the
    restored tree itself."""
    if has_graph_nodes(state):
        nnx.update(state, restored)
        return state
    return restored


def structure(state: Any) -> tuple[str, Any]:
    """What [`after_step`][shardax.loop.Run.after_step] compares with the run's state: NNX
    objects (updated in place) by their types, any other tree by its tree structure."""
    if has_graph_nodes(state):
        parts = state if isinstance(state, tuple | list) else (state,)
        return ("nnx", tuple(type(part) for part in parts))
    return ("tree", jax.tree.structure(state))


def check_same_state(state: Any, like: Any, like_structure: tuple[str, Any]) -> None:
    """Raises ``TypeError`` when ``state`` is not a state of the run whose state is
    ``like`` (of structure ``like_structure``): another tree (the metrics passed in its
    place), or other objects; names the first leaf that differs."""
    got = structure(state)
    if got == like_structure:
        return
    detail = ""
    if got[0] == like_structure[0] == "tree":
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        want = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
        if paths == want:
            return  # the same leaves; static fields that compare unequal
        missing = [p for p in want if p not in set(paths)]
        extra = [p for p in paths if p not in set(want)]
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            detail = f" (it lacks the run's leaf {missing[0]!r}{more})"
        elif extra:
            detail = f" (its leaf {extra[0]!r} is not in the run's state)"
    raise TypeError(
        f"state must be the run's state, {_described(like)} as the run started, got "
        f"{_described(state)}{detail}; call run.after_step(state, metrics) with the state "
        "the step returned"
    )


def _described(tree: Any) -> str:
    if isinstance(tree, dict):
        keys = [str(k) for k in tree]
        return f"a dict with keys {keys[:6]}" + (" ..." if len(keys) > 6 else "")
    if has_graph_nodes(tree):
        parts = tree if isinstance(tree, tuple | list) else (tree,)
        return f"({', '.join(type(p).__qualname__ for p in parts)})"
    if isinstance(tree, jax.Array | np.ndarray | np.generic | int | float):
        return f"an array of shape {np.shape(tree)}"
    leaves = len(jax.tree.leaves(tree))
    return f"a {type(tree).__qualname__} of {leaves} leaf" + ("" if leaves == 1 else "s")
