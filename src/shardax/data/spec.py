"""The batch spec: how each leaf of a batch is split over the mesh, when its leaves are
not examples.

By default a batch is a list of examples: every leaf has the examples along dimension
0, the same count in every leaf, and the rows are split over the data axis. A batch
whose leaves are not examples (a ``jraph.GraphsTuple``: 192 nodes, 512 edges and 16
graphs, with ``senders``/``receivers`` indexing the whole batch) says instead how each
leaf is split, with a ``batch_spec``: one ``PartitionSpec`` for every leaf, or a pytree
of them, a prefix of the batch (one spec per field). ``P()`` is "not split": every
device holds the whole leaf. Leaves need not agree on any dimension; a split dimension
must divide by its mesh axes.

``make_train_step``, ``make_eval_step``, ``sx.prepare`` and ``sx.prefetch_to_device``
take it as ``batch_spec=``. Under ``mode="jit"`` (and ``"single"``) any split computes
one device's numbers: XLA sees the whole batch. ``"shard_map"``, ``"pmap"`` and
``accumulate > 1`` split rows as examples, and refuse a ``batch_spec``; without one they
also refuse a batch whose type says its leaves are not examples, whatever their sizes
(``shardax.data.leaves.not_examples``: a graph batch, a sparse array).

>>> mesh = sx.make_mesh({"data": -1})
>>> graphs = {"nodes": np.ones((192, 4)), "senders": np.zeros(512, np.int32)}
>>> placed = place_by_spec(graphs, mesh, P())
>>> placed["nodes"].sharding.spec == P(), placed["senders"].shape
(True, (512,))
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.data.assembly import global_batch
from shardax.data.leaves import check_batch_leaves
from shardax.data.placement import leaf_sharding
from shardax.plan.tree import map_arrays, path_str


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def check_batch_spec(batch_spec: Any) -> Any:
    """``batch_spec`` (a ``PartitionSpec`` or a pytree of them), or ``TypeError``."""
    if batch_spec is None:
        return None
    leaves = jax.tree.leaves(batch_spec, is_leaf=_is_spec)
    if not leaves or not all(_is_spec(x) for x in leaves):
        bad = next((x for x in leaves if not _is_spec(x)), batch_spec)
        raise TypeError(
            "batch_spec must be a PartitionSpec (P() for a batch that is not split) or a "
            f"pytree of them, a prefix of the batch; got {type(bad).__name__}: {bad!r}"
        )
    return batch_spec


def batch_shardings(batch: Any, mesh: Mesh, batch_spec: Any) -> Any:
    """One ``NamedSharding`` per array leaf of ``batch``, from ``batch_spec`` (a prefix
    of the batch), each fitted to its leaf (checked: a split dimension divides by its
    axes, the leaf is named otherwise).

    >>> mesh = sx.make_mesh({"data": -1})
    >>> batch_shardings({"x": np.ones((6, 2))}, mesh, P())["x"].spec == P()
    True
    """
    check_batch_spec(batch_spec)
    try:
        specs = jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda _: spec, sub),
            batch_spec,
            batch,
            is_leaf=_is_spec,
        )
    except ValueError as e:
        raise ValueError(
            f"batch_spec must be a PartitionSpec or a prefix of the batch's structure "
            f"({jax.tree.structure(batch)}); got {batch_spec!r}"
        ) from e
    return map_arrays(
        lambda path, x, spec: leaf_sharding(path, tuple(x.shape), NamedSharding(mesh, spec)),
        batch,
        specs,
    )


def place_by_spec(batch: Any, mesh: Mesh, batch_spec: Any, shardings: Any = None) -> Any:
    """``batch`` placed leaf by leaf as ``batch_spec`` says (a leaf already so placed
    passes untouched); with several processes, a split leaf is this process's part.
    ``shardings``: ``batch_shardings`` of a batch of this structure, computed before
    (a step caches them per structure)."""
    if shardings is None:
        check_batch_leaves(batch, arrays_only=True)
        shardings = batch_shardings(batch, mesh, batch_spec)

    def one(path: Any, x: Any, s: Any) -> Any:
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim):
            return x
        return global_batch({path_str(path) or "leaf": x}, s)[path_str(path) or "leaf"]

    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = [one(p, x, s) for (p, x), s in zip(flat, jax.tree.leaves(shardings), strict=True)]
    return jax.tree.unflatten(treedef, out)
