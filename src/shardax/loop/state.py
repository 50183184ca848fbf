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


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional for pytrees
        return None
    return nnx


def has_graph_nodes(state: Any) -> bool:
    """True when ``state`` is an NNX object, or a tuple/list of values one of which is."""
    nnx = _nnx()
    if nnx is None:
        return False
    parts = state if isinstance(state, tuple | list) else (state,)
    return any(nnx.graph.is_graph_node(part) for part in parts)


def saveable(state: Any) -> Any:
    """The pytree of arrays a checkpoint holds for ``state``."""
    return _nnx().state(state) if has_graph_nodes(state) else state


def restore_into(state: Any, restored: Any) -> Any:
    """The state to continue from: NNX objects updated in place (and returned), or the
    restored tree itself."""
    if has_graph_nodes(state):
        _nnx().update(state, restored)
        return state
    return restored
