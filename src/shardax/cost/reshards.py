"""The collectives a compiled step runs, each with the user's line, split into those its
plan implies and those the partitioner added to reshard something (the surprises).

``collectives_explained`` reads every collective of the optimized HLO
(``shardax.cost.hlo.collective_of`` for its bytes, groups and runs; ``shardax.cost.ops.
HloIndex`` for its operand, dimensions and metadata; ``shardax.cost.sources.Sources`` for
the line) and sorts it:

- implied, with the reason: a collective the model calls itself (``psum``, ``ppermute``,
  ``all_to_all``... inside ``shard_map``); a reduction to a scalar (the loss, a metric, a
  norm); a gather, reduction or scatter of a parameter-shaped array (FSDP's gathers, the
  gradients' reductions, ZeRO's gather of the updated parameters); an all-reduce of a
  contraction's partial sums over an axis that splits parameters (tensor parallelism); a
  gather of the activation a matmul meets a split weight with (``split_shapes``): the
  batch and the weight split over one axis, one side must be gathered, and XLA may gather
  the smaller, the activation, in place of FSDP's gather of the weight;
- unasked: every other one, with the two layouts (from the op: the dimension an all-gather
  joins, an all-to-all's moved split, a permute's shift), its bytes per step, and a
  suggested ``sx.constrain``.

>>> import numpy as np
>>> from types import SimpleNamespace as NS
>>> mesh = NS(shape={"data": 8}, axis_names=("data",))
>>> hlo = '''ENTRY %main (p: f32[8,256]) -> f32[64,256] {
...   %p = f32[8,256]{1,0} parameter(0), metadata={op_name="batch['x']"}
...   ROOT %ag = f32[64,256]{1,0} all-gather(%p), replica_groups=[1,8]<=[8], dimensions={0}
... }'''
>>> [(c.op, c.implied, c.before, c.after) for c in collectives_explained(hlo, mesh)]
[('all-gather', '', "P('data', None)", 'P(None, None)')]
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from shardax.cost.hlo.collectives import COLLECTIVE_OP, collective_of
from shardax.cost.hlo.program import arrays
from shardax.cost.ops import HloIndex, op_name
from shardax.cost.sources import Sources, nearest

_DIMENSIONS = re.compile(r"\bdimensions=\{([\d,]*)\}")
_CALLED = re.compile(
    r"(?:^|/)(psum|pmean|pmax|pmin|all_gather|ppermute|all_to_all|psum_scatter|"
    r"reduce_scatter|pshuffle|ragged_all_to_all)(?:\b|/|$)"
)
_LOOKUP = re.compile(r"(?:^|/)(?:gather|scatter-add|scatter_add)$|jit\(_take\)")
_REDUCTION = re.compile(r"dot_general|(?:^|/)reduce_\w+(?:$|[:)])")  # a fused op's list too
_MOVES = ("all-to-all", "ragged-all-to-all")  # a move of the split: what a constraint asks
_PLAIN = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)


@dataclasses.dataclass(frozen=True)
class Reshard:
    """One collective of the compiled step: op, the mesh axes its groups span, bytes its
    result holds on one device and bytes one device sends per step (over its ``runs``),
    the user's ``source`` line, the op's name stack (``what``), the layouts before and
    after (``PartitionSpec``-like text over the array's dimensions), ``implied`` (why the
    plan or the model asks for it; ``""``: unasked), a ``suggestion``, the HLO ``name``,
    and ``made``: the line of the op whose value moves, where ``source`` names the
    ``sx.constrain`` that asked for the move instead (``""``: ``source`` is the op's)."""

    op: str
    axes: tuple[str, ...]
    bytes: int
    sent_bytes: float
    runs: int
    shape: tuple[int, ...]
    dtype: str
    source: str
    what: str
    before: str
    after: str
    implied: str = ""
    suggestion: str = ""
    name: str = ""
    made: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {**dataclasses.asdict(self), "axes": list(self.axes), "shape": list(self.shape)}


def group_axes(groups: tuple[tuple[int, ...], ...], mesh: Any) -> tuple[str, ...]:
    """The mesh axes along which a collective's first group varies (device indices in
    ``mesh.devices.flat`` order; a permute's pairs: any of them); all axes where the
    groups are not known.

    >>> from types import SimpleNamespace as NS
    >>> group_axes(((0, 2, 4, 6),), NS(shape={"data": 4, "model": 2}, axis_names=("data", "model")))
    ('data',)
    """
    names = tuple(mesh.axis_names)
    sizes = [int(mesh.shape[a]) for a in names]
    if not groups or not groups[0]:
        return tuple(a for a, n in zip(names, sizes, strict=True) if n > 1)
    varies: set[int] = set()
    for group in groups if len(groups[0]) == 2 else groups[:1]:  # a permute: every pair
        coords = np.array(np.unravel_index(np.array(group), sizes)).T
        varies |= {i for i in range(len(names)) if len(set(coords[:, i])) > 1}
    return tuple(a for i, a in enumerate(names) if i in varies)


def _spec(rank: int, dim: int | None, axes: tuple[str, ...]) -> str:
    entries = ["None"] * rank
    if dim is not None and 0 <= dim < rank:
        entries[dim] = repr(axes[0]) if len(axes) == 1 else repr(axes)
    return f"P({', '.join(entries)})"


def _layouts(op: str, rank: int, dims: list[int], axes: tuple[str, ...]) -> tuple[str, str]:
    """The layouts before and after a collective over ``axes`` of a rank-``rank`` array."""
    over = "/".join(axes) or "all devices"
    d = dims[0] if dims else None
    if op == "all-gather":
        return _spec(rank, d, axes), _spec(rank, None, axes)
    if op == "reduce-scatter":
        return f"partial sums over {over}", _spec(rank, d, axes)
    if op == "all-reduce":
        return f"partial sums over {over}", f"replicated over {over}"
    if op in ("all-to-all", "ragged-all-to-all"):
        return f"another dimension over {over}", _spec(rank, d, axes)
    return f"shards along {over}", f"the same shards shifted along {over}"


def _suggest(c: Reshard, dims: list[int]) -> str:
    at = f"at {c.made or c.source}" if c.source else f"made by {c.what or c.name}"
    if c.op in ("all-to-all", "all-gather") and c.what.endswith("concatenate"):
        return (
            f"the concatenation {at} joins a piece built whole (a jnp.ones or jnp.zeros "
            "row, a constant) to a split array, so its rows no longer line up with "
            "the shards: shift with jnp.pad instead (jnp.pad(x[:-1], ((1, 0), (0, 0)), "
            "constant_values=1.0) for a row of ones first), which moves only the rows at "
            "the shard boundaries, or build the piece split as the array is"
        )
    if c.op == "all-gather":
        return (
            f"keep the split: sx.constrain(x, {c.before}) on the value {at} and on what "
            "uses it (a reshape that keeps the split dimension whole and leading, a rule "
            "that splits the weight it meets the same way)"
        )
    if c.op in ("all-to-all", "ragged-all-to-all"):
        pinned = f" (the sx.constrain at {c.source} asks for it)" if c.made else ""
        return (
            f"the op {at} moves which dimension is split (a transpose, a reshape that "
            f"merges the split dimension){pinned}: sx.constrain its input and output to one "
            f"layout, e.g. {c.after}, or reorder it after the reduction over {'/'.join(c.axes)}"
        )
    if c.op == "all-reduce":
        return (
            f"the op {at} sums over a dimension split over {'/'.join(c.axes)}; if that "
            "is not meant, sx.constrain its input so the dimension is whole"
        )
    if c.op == "reduce-scatter":
        return f"sx.constrain the value {at} to {c.after} before it is summed"
    return (
        f"the op {at} reads across shard boundaries (a shift, a pad, a window): keep "
        "its dimension whole with sx.constrain, or split another"
    )


def _implied(
    op: str,
    stack: str,
    shapes: tuple[tuple[int, ...], ...],
    axes: tuple[str, ...],
    param_shapes: set[tuple[int, ...]],
    param_axes: set[str],
) -> str:
    """Why the plan or the model asks for this collective, ``""`` where nothing does."""
    called = _CALLED.search(stack)
    if called:
        return f"the model calls {called.group(1)}"
    if op == "all-reduce" and all(math.prod(s) <= 1 for s in shapes):
        return "a reduction to a scalar (the loss, a metric, a norm)"
    weights = {
        "all-gather": "the plan's gather of a sharded parameter (FSDP, ZeRO's update)",
        "reduce-scatter": "the gradients' reduction onto their shards",
        "all-reduce": "the gradients' reduction over the data axes",
    }
    if op in weights and shapes and all(s in param_shapes for s in shapes if math.prod(s) > 1):
        return weights[op]
    split = bool(axes) and set(axes) <= param_axes
    if split and _LOOKUP.search(stack):
        return f"the lookup of a table the plan splits over {'/'.join(axes)} (an embedding)"
    if op == "all-reduce" and split and _REDUCTION.search(stack):
        return (
            f"the partial sums of a contraction or reduction over a dimension the plan "
            f"splits over {'/'.join(axes)}"
        )
    return ""


_PASS = {
    "bitcast",
    "copy",
    "transpose",
    "reshape",
    "get-tuple-element",
    "convert",
    "all-gather-done",
}


def users_of(index: HloIndex) -> dict[str, list[Any]]:
    """``{instruction name: the instructions that read it}`` of one program."""
    out: dict[str, list[Any]] = {}
    for instr in index.by_name.values():
        for name in instr.operands:
            out.setdefault(name, []).append(instr)
    return out


def _matmul(instr: Any) -> bool:
    ops = {instr.opcode} | {op for op, _, _ in instr.fused}
    return bool(ops & {"dot", "convolution"}) or "gemm" in instr.target.lower()


def meets_split_weight(
    index: HloIndex,
    name: str,
    split_shapes: set[tuple[int, ...]],
    users: dict[str, list[Any]],
    hops: int = 3,
) -> bool:
    """Whether the value of instruction ``name`` reaches, through copies and reshapes
    (``hops`` at most), a matmul (a dot, or a fusion or GEMM call with one) whose other
    operand has a shape of ``split_shapes`` (a weight as the plan splits it)."""
    frontier, seen = [name], {name}
    for _ in range(hops):
        following = []
        for current in frontier:
            for user in users.get(current, []):
                if _matmul(user):
                    others = [index.by_name.get(o) for o in user.operands if o != current]
                    if any(
                        o is not None and {s for _, s in arrays(o.out)} & split_shapes
                        for o in others
                    ):
                        return True
                elif user.opcode in _PASS and user.name not in seen:
                    seen.add(user.name)
                    following.append(user.name)
        frontier = following
    return False


def collectives_explained(
    hlo: str,
    mesh: Any,
    sources: Sources | None = None,
    param_shapes: set[tuple[int, ...]] | None = None,
    param_axes: set[str] | None = None,
    constraints: list[tuple[str, int, str]] | None = None,
    split_shapes: set[tuple[int, ...]] | None = None,
) -> list[Reshard]:
    """Every collective of the compiled ``hlo`` on ``mesh``, implied (with the reason) or
    not (with the layouts and a suggestion); see the module. ``param_shapes``: the
    parameters' global and per-device shapes (a scanned stack's layer shape too);
    ``param_axes``: the mesh axes that split some parameter; ``constraints``: the user's
    sharding constraints' frames (``shardax.cost.sources.Lowered.constraints``): an unasked
    all-to-all in a function with one is named at the nearest, where the layout that
    moves the split was asked for (XLA gives the all-to-all the moved value's line, kept
    in ``made``); ``split_shapes``: the per-device shapes of the parameters the plan
    splits (an all-gather whose value meets one in a matmul is the plan's)."""
    sources = sources or Sources({})
    index = HloIndex(hlo)
    shapes_known = set(param_shapes or ())
    axes_known = set(param_axes or ())
    devices = math.prod(int(n) for n in mesh.shape.values())
    users = users_of(index)
    out = []
    for instr in index.by_name.values():
        base = instr.opcode.removesuffix("-start")
        if base not in _PLAIN:
            continue
        match = COLLECTIVE_OP.search(instr.line)
        if not match:
            continue
        c = collective_of(match, devices, index.runs_of(instr))
        axes = group_axes(c.groups, mesh)
        dims_found = _DIMENSIONS.search(instr.line)
        dims = [int(d) for d in dims_found.group(1).split(",") if d] if dims_found else []
        shape = c.shapes[0] if c.shapes else ()
        stack = op_name(instr).replace("\\'", "'")
        before, after = _layouts(base, len(shape), dims, axes)
        reason = _implied(base, stack, c.shapes, axes, shapes_known, axes_known)
        meets = base == "all-gather" and bool(split_shapes) and not reason
        if meets and meets_split_weight(index, instr.name, split_shapes or set(), users):
            reason = (
                f"a matmul's operand gathered in place of the weight the plan splits "
                f"over {'/'.join(axes)} (FSDP's gather, of the smaller side)"
            )
        row = Reshard(
            base,
            axes,
            c.bytes,
            c.sent_bytes,
            c.count,
            shape,
            c.dtypes[0] if c.dtypes else "",
            sources.line(instr.line),
            stack,
            before,
            after,
            reason,
            name=instr.name,
        )
        asked = (
            ""
            if reason or base not in _MOVES
            else nearest(sources.frame(instr.line), constraints or [])
        )
        if asked and asked != row.source:
            row = dataclasses.replace(row, source=asked, made=row.source)
        if not reason:
            row = dataclasses.replace(row, suggestion=_suggest(row, dims))
        out.append(row)
    return out
