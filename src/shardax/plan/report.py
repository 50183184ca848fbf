"""Reports on a plan before and after placing: [`validate`][shardax.plan.validate] (a dry
run of its errors) and [`describe`][shardax.describe] (path, shape, dtype, spec and bytes
per device of every leaf).

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 8})
>>> report = sx.describe({"w": jax.ShapeDtypeStruct((1024, 16), "float32")}, sx.fsdp(mesh))
>>> report.rows[0].bytes_per_device, report.total_bytes_per_device
(8192, 8192)
>>> report.rows[0].spec  # print(report) shows a rich table; report.to_dicts() the rows
P('data', None)
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from shardax._format import format_bytes, rich_text, titled_table
from shardax.checks import public
from shardax.plan.core import Plan, as_plan
from shardax.plan.placed import planned_leaves
from shardax.plan.tree import dtype_name, is_array, itemsize, map_arrays, path_str


@dataclasses.dataclass(frozen=True)
class Row:
    """One array leaf: ``spec`` is ``None`` for a leaf not placed on a mesh."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: PartitionSpec | None
    bytes_per_device: int
    bytes: int
    #: the spec ``shardax.prepare`` placed the leaf on, where it has left it since
    #: (``None`` where the leaf is on its plan, or was not placed by ``prepare``)
    planned: PartitionSpec | None = None


@public("sx.plan.ShardingReport")
@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Rows of [`describe`][shardax.describe]; print it for a table, or read ``rows`` as data."""

    rows: tuple[Row, ...]
    title: str = "sharding"

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole tree, counting each leaf once."""
        return sum(r.bytes for r in self.rows)

    @property
    def total_bytes_per_device(self) -> int:
        """The largest shard of every leaf, summed: what one device holds when every
        leaf spans the same devices (an upper bound otherwise)."""
        return sum(r.bytes_per_device for r in self.rows)

    def to_dicts(self) -> list[dict[str, Any]]:
        """The rows as dicts, specs as strings (for JSON or a DataFrame)."""
        return [
            {
                **dataclasses.asdict(r),
                "spec": None if r.spec is None else str(r.spec),
                "planned": None if r.planned is None else str(r.planned),
            }
            for r in self.rows
        ]

    def __rich__(self) -> Any:
        moved = [r for r in self.rows if r.planned is not None]
        title = self.title + (f" ({len(moved)} off their plan)" if moved else "")
        table = titled_table(title)
        columns = [("path", "left"), ("shape", "right"), ("dtype", "left"), ("spec", "left")]
        columns += [("plan", "left")] if moved else []
        cells = [
            [r.path, str(r.shape), r.dtype, "-" if r.spec is None else str(tuple(r.spec))]
            + ([] if not moved else ["" if r.planned is None else str(tuple(r.planned))])
            + [format_bytes(r.bytes_per_device)]
            for r in self.rows
        ]
        for name, justify in [*columns, ("per device", "right")]:
            # on a narrow terminal a path folds (whole, over lines), never cut to "…"; the
            # other columns (a spec, a shape) keep their width, each on one line
            fit = {"overflow": "fold"} if name == "path" else {"no_wrap": True}
            table.add_column(name, justify=justify, **fit)  # type: ignore[arg-type]
        for row in cells:
            table.add_row(*row)
        table.add_section()
        table.add_row(
            f"total ({len(self.rows)} arrays, {format_bytes(self.total_bytes)})",
            *[""] * (len(columns) - 1),
            format_bytes(self.total_bytes_per_device),
        )
        return table

    def __str__(self) -> str:
        return rich_text(self, width=120)


def _row(path: str, leaf: Any, sharding: Sharding | None, want: Sharding | None = None) -> Row:
    shape = tuple(int(d) for d in np.shape(leaf))
    size, dtype = itemsize(leaf), dtype_name(leaf)
    nbytes = math.prod(shape) * size
    if sharding is None:
        return Row(path, shape, dtype, None, nbytes, nbytes)
    per_device = math.prod(sharding.shard_shape(shape)) * size
    spec = sharding.spec if isinstance(sharding, NamedSharding) else None
    planned = None
    if isinstance(want, NamedSharding) and not sharding.is_equivalent_to(want, len(shape)):
        planned = want.spec
    return Row(path, shape, dtype, spec, per_device, nbytes, planned)


@public("sx.describe")
def describe(tree: Any, plan: Plan | None = None) -> ShardingReport:
    """A [`ShardingReport`][shardax.plan.ShardingReport] of every array leaf of ``tree`` (arrays or
    ``ShapeDtypeStruct``s).

    With ``plan``, the specs are the plan's (raising its errors, as applying it would);
    without, each leaf's own ``sharding`` (``None`` for NumPy or unsharded leaves), and
    for a leaf [`shardax.prepare`][shardax.prepare] placed that has left its plan since (a
    user's jit step picked another layout), the plan's spec too (``Row.planned``, a "plan"
    column).
    """
    rows: list[Row] = []
    if plan is not None:
        as_plan("plan", plan)
    if plan is None:
        flat = leaf_names(tree)
        for (path, x), want in zip(flat, planned_leaves(tree), strict=True):
            if is_array(x):
                rows.append(_row(path, x, getattr(x, "sharding", None), want))
    else:
        map_arrays(lambda p, x, s: rows.append(_row(p, x, s)), tree, plan(tree))
    title = f"sharding ({plan.name} on mesh {dict(plan.mesh.shape)})" if plan else "sharding"
    return ShardingReport(tuple(rows), title)


@public("sx.plan.validate")
def validate(tree: Any, plan: Plan) -> list[str]:
    """Dry run: every error ``plan`` would raise on ``tree``, without allocating anything.

    ``tree`` may hold arrays or ``jax.ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``).
    Applying the plan raises a ``ValueError`` listing these same messages. Rules that
    match no leaf (a misspelt regex, an annotation whose path or shape fits no leaf) are
    listed too; applying the plan warns about them once.

    >>> sx.plan.validate({"w": jax.ShapeDtypeStruct((6, 4), "float32")},
    ...             sx.rules(mesh, [("w", P("data"))]))
    ["leaf 'w' with shape (6, 4): dimension 0 of size 6 is not divisible by ..."]
    """
    as_plan("plan", plan)
    return plan.resolve(tree)[1] + plan.notes(tree)


def leaf_names(tree: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for each leaf of ``jax.tree.leaves(tree)``, in that order: its key
    path, except that the entries of an Equinox ``eqx.nn.State`` are named by the layer
    that owns them (``bn.state_index/0``, not ``1/0``) and the parts of a top-level
    tuple or list are named by what they are (``model``, ``state``, ``optimizer``,
    ``opt_state``) where each kind appears once, as ``sx.prepare(model, state,
    opt_state)`` takes them.

    >>> [n for n, _ in leaf_names(({"w": np.ones(2)}, np.ones(1)))]
    ['0/w', '1']
    """
    parts = _part_names(tree)
    out: list[tuple[str, Any]] = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_eqx_state)[0]:
        if parts is not None and path:
            path = (jax.tree_util.GetAttrKey(parts[path[0].idx]), *path[1:])
        name = path_str(path)
        if not _is_eqx_state(node):
            out.append((name, node))
            continue
        values, markers = node.tree_flatten()
        for marker, value in zip(markers, values, strict=True):
            entry = str(marker).partition(".")[2] or str(marker)  # "Model.bn.x": bn.x
            prefix = "/".join(p for p in (name, entry) if p)
            for sub, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                out.append(("/".join(p for p in (prefix, path_str(sub)) if p), leaf))
    return out


def _is_eqx_state(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.nn.State)


def _part_names(tree: Any) -> list[str] | None:
    """What each member of a top-level tuple or list is, when each kind appears once."""
    if not isinstance(tree, tuple | list) or type(tree) not in (tuple, list):
        return None
    names = [_part_name(x) for x in tree]
    if None in names or len(set(names)) != len(names):
        return None
    return names  # type: ignore[return-value]


def _part_name(x: Any) -> str | None:
    eqx, nnx = sys.modules.get("equinox"), sys.modules.get("flax.nnx")
    if _is_eqx_state(x):
        return "state"
    if nnx is not None and isinstance(x, nnx.Optimizer):
        return "optimizer"
    if (eqx is not None and isinstance(x, eqx.Module)) or (
        nnx is not None and isinstance(x, nnx.Module)
    ):
        return "model"
    leaves = jax.tree.leaves(x, is_leaf=lambda n: type(n).__module__.startswith("optax"))
    if leaves and all(type(n).__module__.startswith("optax") for n in leaves):
        return "opt_state"
    return None
