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


def leaf_types(state: Any) -> tuple[Any, ...] | None:
    """The shape and dtype of each array leaf of ``state`` (None for another leaf), which
    a checkpoint of it keeps and a restore into the run's state requires; None for NNX
    objects (updated in place, so they keep their own)."""
    if has_graph_nodes(state):
        return None
    return tuple(
        (tuple(x.shape), x.dtype) if isinstance(x, jax.Array | np.ndarray) else None
        for x in jax.tree.leaves(state)
    )


def check_same_state(
    state: Any, like: Any, like_structure: tuple[str, Any], like_types: Any = None
) -> None:
    """Raises ``TypeError`` when ``state`` is not a state of the run whose state is
    ``like`` (of structure ``like_structure``): another tree (the metrics passed in its
    place), or other objects; names the first leaf that differs. With ``like_types``
    (``leaf_types(like)``), ``ValueError`` for an array leaf whose shape or dtype
    changed, which a resume could not restore into the run's state."""
    got = structure(state)
    if got == like_structure:
        if like_types is not None:
            _check_leaf_types(state, like_types)
        return
    detail = ""
    if got[0] == like_structure[0] == "tree":
        paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
        want = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
        if paths == want:  # the same leaves; static fields that compare unequal
            if like_types is not None:
                _check_leaf_types(state, like_types)
            return
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


def _check_leaf_types(state: Any, like_types: tuple[Any, ...]) -> None:
    for (path, x), want in zip(
        jax.tree_util.tree_flatten_with_path(state)[0], like_types, strict=True
    ):
        if want is None or not isinstance(x, jax.Array | np.ndarray):
            continue
        if (tuple(x.shape), x.dtype) != want:
            raise ValueError(
                f"state leaf {path_str(path)!r} is {x.dtype}{list(x.shape)}, but the run's "
                f"state has {want[1]}{list(want[0])} there: a checkpoint of this state would "
                "not restore into the state the run starts with (a resume would be refused). "
                "Return each leaf with the shape and dtype it came in with (.astype), or "
                "start the run with a state of these"
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
