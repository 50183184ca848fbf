"""The batch-leaf check every door that places or steps on a batch shares.

``distribute_batch``, ``global_batch``, ``shard_batch_dim``, ``prefetch_to_device``,
``place_on_device`` and the train step all call ``check_batch_leaves``, so a leaf
JAX cannot hold (strings, objects) is named by its path, and leaves that disagree on
the batch dimension are refused alike, before anything is placed.

>>> check_batch_leaves({"x": np.ones((16, 3)), "y": np.ones(16)}, dims=(0,))
[('x', (16, 3)), ('y', (16,))]
>>> sx.distribute_batch({"x": np.ones((16, 3)), "y": np.ones(24)}, sx.batch_sharding(mesh))
Traceback (most recent call last):
ValueError: sx.distribute_batch: batch leaves disagree on the batch size (dimension 0); ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding

from shardax.plan.tree import is_array, path_str

# NumPy dtype kinds no JAX array can hold: strings, bytes, objects, dates and times.
_NOT_JAX_KINDS = "USOMm"


def sharded_dims(sharding: Sharding) -> tuple[int, ...]:
    """The dimensions ``sharding`` splits (its non-None spec entries); () for others."""
    if not isinstance(sharding, NamedSharding):
        return ()
    return tuple(d for d, e in enumerate(sharding.spec) if e is not None)


def shapes_text(leaves: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    return ", ".join(f"{path or '<root>'!r}: {shape}" for path, shape in leaves)


Leaves = list[tuple[tuple[Any, ...], Any]]
"""``(key path, leaf)`` pairs of a batch, as ``batch_leaves`` walks it."""


def batch_leaves(tree: Any) -> Leaves:
    """``(key path, leaf)`` of every leaf of ``tree``, a subtree whose leaves are not
    examples (a graph batch, a sparse array: ``not_examples``) kept whole: the one walk
    of a batch that its checks share (``check_leaves``, ``not_examples``).

    >>> [(path_str(key), leaf) for key, leaf in batch_leaves({"x": 1, "y": [2, 3]})]
    [('x', 1), ('y/0', 2), ('y/1', 3)]
    """
    return jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: _not_examples_kind(x) is not None
    )[0]


def check_batch_leaves(
    tree: Any, *, dims: Sequence[int] = (), arrays_only: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, shape)`` of every array leaf of ``tree``, after checking that

    - every array leaf has a dtype JAX can hold (a ``TypeError`` names the leaf);
    - with ``arrays_only``, every leaf is an array (Python lists and numbers are named);
    - every leaf with a dimension ``d`` in ``dims`` has the same size there as the others
      (a ``ValueError`` lists every leaf's shape).
    """
    return check_leaves(batch_leaves(tree), dims=dims, arrays_only=arrays_only)


def check_leaves(
    flat: Leaves, *, dims: Sequence[int] = (), arrays_only: bool = False
) -> list[tuple[str, tuple[int, ...]]]:
    """``check_batch_leaves`` of the tree that ``batch_leaves`` walked to ``flat``."""
    leaves = []
    for key, leaf in _every_leaf(flat):
        path = path_str(key)
        if not is_array(leaf):
            if arrays_only:
                hint = " (convert lists with np.asarray)" if key and _in_list(key) else ""
                raise TypeError(
                    f"batch leaf {path or '<root>'!r} is a {type(leaf).__name__} "
                    f"({leaf!r}), not an array; every batch leaf must be a NumPy or JAX "
                    f"array with a leading batch dimension{hint}"
                )
            continue
        # Extended dtypes (PRNG keys) have no NumPy kind; bfloat16 & co. have kind "V".
        if getattr(leaf.dtype, "kind", "V") in _NOT_JAX_KINDS:
            raise TypeError(
                f"leaf {path or '<root>'!r} has dtype {np.dtype(leaf.dtype)} "
                f"(shape {np.shape(leaf)}), which a JAX array cannot hold; keep strings and "
                "objects out of the tree, or encode them as numbers (e.g. class ids)"
            )
        leaves.append((path, tuple(np.shape(leaf))))
    for d in dims:
        sizes = {shape[d] for _, shape in leaves if len(shape) > d}
        if len(sizes) > 1:
            raise ValueError(
                f"batch leaves disagree on the batch size (dimension {d}); they must "
                f"all have the same size there. Received {shapes_text(leaves)}. A batch "
                "whose leaves are not examples (a graph batch: nodes, edges, graphs) "
                "says how each leaf is split instead: batch_spec=P() (not split) or one "
                "spec per field (shardax.data.spec)"
            )
    return leaves


# The fields that make a NamedTuple a graph batch (jraph.GraphsTuple's, by name: jraph
# need not be installed).
_GRAPH_FIELDS = frozenset({"senders", "receivers", "n_node", "n_edge"})


def _not_examples_kind(node: Any) -> str | None:
    """What ``node`` is when its array leaves are clearly not a list of examples: a graph
    batch (a NamedTuple with ``jraph.GraphsTuple``'s fields), or a ``jax.experimental.sparse``
    array (its leaves are nonzeros and their indices, its shape static); else None."""
    fields = getattr(type(node), "_fields", None)
    if isinstance(node, tuple) and fields and set(fields) >= _GRAPH_FIELDS:
        return f"a graph batch ({type(node).__name__}: nodes, edges and graphs)"
    module = type(node).__module__ or ""
    if module.startswith("jax.experimental.sparse") and hasattr(node, "nse"):
        return f"a sparse array ({type(node).__name__}: nonzeros and their indices)"
    return None


def not_examples(flat: Leaves) -> list[tuple[str, str]]:
    """``(path, what)`` of each subtree of the batch (walked to ``flat``) whose leaves are
    clearly not examples (``_not_examples_kind``): cutting their rows would not cut whole
    examples, whatever their sizes.

    >>> import collections
    >>> fields = "nodes edges receivers senders globals n_node n_edge"
    >>> g = collections.namedtuple("GraphsTuple", fields)(*[np.zeros(4, np.int32)] * 7)
    >>> not_examples(batch_leaves({"graph": g, "y": np.ones(4)}))
    [('graph', 'a graph batch (GraphsTuple: nodes, edges and graphs)')]
    """
    return [
        (path_str(path), kind)
        for path, node in flat
        if (kind := _not_examples_kind(node)) is not None
    ]


def _every_leaf(flat: Leaves) -> Leaves:
    """``flat`` with the subtrees ``batch_leaves`` kept whole opened to their leaves."""
    out = []
    for key, node in flat:
        if _not_examples_kind(node) is None:
            out.append((key, node))
        else:
            out += [((*key, *k), x) for k, x in jax.tree_util.tree_leaves_with_path(node)]
    return out


def _in_list(key: tuple[Any, ...]) -> bool:
    return isinstance(key[-1], jax.tree_util.SequenceKey)
