"""Collectives in compiled HLO text, and the bytes each device sends for them.

An op inside a loop body (``lax.scan``, ``sx.pipeline``'s ticks, gradient accumulation)
runs once per iteration: ``collectives`` counts it ``known_trip_count`` times.

>>> hlo = "%ag = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %p), replica_groups=[1,8]<=[8]"
>>> [(c.op, c.bytes, c.group) for c in collectives(hlo)]
[('all-gather', 4096, 8)]
>>> collective_bytes(hlo)  # a ring all-gather sends (n - 1) / n of its output
3584.0
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from shardax.cost.hlo.program import DTYPE_BYTES, arrays, computations, runs

OPS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "ragged-all-to-all",
    "all-to-all",
    "collective-permute",
)
COLLECTIVE_OP = re.compile(
    r"= (\(.*?\)|\S+) (" + "|".join(OPS) + r")(-start)?\((.*)$",
    re.MULTILINE,
)
# An array type's dtype: f32, bf16, pred, and the fp8 ones (f8e4m3fn, f8e5m2, f8e4m3fnuz)
"""A collective's line: its result type (group 1), op (2), ``-start`` (3) and the rest (4)."""
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\})")
# Newer XLA: replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_0'}
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{([^}]*)\}"
)
# One instruction's parts, shared by the modules that read compiled HLO text.
_AXIS = re.compile(r"'([^']+)'(?:=(\d+))?")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op: its name, the bytes of its result on one device, the number
    of devices in each of its groups, its result's array shapes (several when XLA
    combined ops into one), and how many times it runs per execution (its loops' trip
    counts multiplied; 1 outside loops), its groups as lists of the program's device
    indices (``mesh.devices.flat`` order; a collective-permute's source-target pairs; empty
    where the HLO's form is not parsed here), and its result arrays' dtypes (``"bf16"``)."""

    op: str
    bytes: int
    group: int
    shapes: tuple[tuple[int, ...], ...] = ()
    count: int = 1
    groups: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()

    def bytes_by_dtype(self) -> dict[str, int]:
        """Result bytes of one run per dtype (``{"bf16": ..., "f32": ...}``; a combined
        op carries several).

        >>> Collective("all-gather", 0, 8, ((4, 2), (3,)), dtypes=("bf16", "f32")).bytes_by_dtype()
        {'bf16': 16, 'f32': 12}
        """
        out: dict[str, int] = {}
        for dtype, shape in zip(self.dtypes, self.shapes, strict=True):
            out[dtype] = out.get(dtype, 0) + math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
        return out

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends over all ``count`` runs, for ring algorithms over
        ``group`` devices: all-reduce ``2(n-1)/n·S``, all-gather and all-to-all
        ``(n-1)/n·S``, reduce-scatter ``(n-1)·S`` (its input is ``n·S``),
        collective-permute ``S`` (each device sends its block to one neighbour).
        ragged-all-to-all sends as many rows as its ``send_sizes`` say, known only at
        run time: ``(n-1)/n·S`` of its output buffer here, an upper bound."""
        n, size = self.group, self.bytes
        if self.op == "collective-permute":
            return float(size) * self.count
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(self.op, (n - 1) / n)
        return factor * size * self.count


def _group(rest: str, num_devices: int | None) -> int:
    """Devices per replica group: ``[g,n]<=[...]`` (iota), ``{{0,1},...}`` (listed) or
    ``mesh[...] {axes}`` (the named axes' sizes multiplied); empty spans all devices."""
    iota, listed, mesh = (p.search(rest) for p in (_GROUPS_IOTA, _GROUPS_LIST, _GROUPS_MESH))
    if iota:
        return int(iota.group(1).split(",")[-1])
    if listed and listed.group(1) != "{}":
        return listed.group(1).count(",") + 1
    if mesh:
        sizes = {name: int(n) for name, n in _AXIS.findall(mesh.group(1))}
        return math.prod(sizes.get(name, 1) for name, _ in _AXIS.findall(mesh.group(2)))
    return num_devices or 1


_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LISTED = re.compile(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,]*\},?)*)\}")


def replica_groups(rest: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective, from the text after its op name: listed
    (``{{0,1},{2,3}}``, or a permute's ``source_target_pairs``), iota
    (``[2,4]<=[4,2]T(1,0)``), or ``mesh[...] {axes}``; empty groups span all
    ``num_devices``; ``()`` where the form is not known.

    >>> replica_groups("x), replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%add")
    ((0, 2, 4, 6), (1, 3, 5, 7))
    >>> replica_groups("x), source_target_pairs={{0,1},{1,0}}")
    ((0, 1), (1, 0))
    """
    iota, listed, mesh = (p.search(rest) for p in (_IOTA, _LISTED, _GROUPS_MESH))
    if iota:
        shape = [int(d) for d in iota.group(1).split(",")]
        dims = [int(d) for d in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(d) for d in iota.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape[0], -1))
    if listed:
        rows = re.findall(r"\{([\d,]*)\}", listed.group(1))
        groups = tuple(tuple(int(i) for i in r.split(",") if i) for r in rows)
        if groups and any(groups):
            return groups
        return (tuple(range(num_devices)),) if num_devices else ()
    if mesh and ", device_ids=" not in mesh.group(0):
        axes = _AXIS.findall(mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        chosen = [names.index(a) for a, _ in _AXIS.findall(mesh.group(2)) if a in names]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        rest_axes = [i for i in range(len(sizes)) if i not in chosen]
        ids = ids.transpose(rest_axes + chosen)
        size = math.prod(sizes[i] for i in chosen)
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(-1, size))
    return ()


_CARRY_OPERANDS = ("all-gather", "collective-permute", "reduce-scatter")
"""Async ``*-start`` ops whose output tuple is ``(operands, results)``: XLA:GPU's
``reduce-scatter-start`` too, whose operands are ``n`` times its results. (JAX 0.12's
XLA:GPU ``all-reduce-start`` may carry its operands too, as a nested tuple first:
``((f32[n]), f32[n])``.)"""


def collectives(hlo: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective of ``hlo`` (``compiled.as_text()``), in order.

    An async ``*-start`` op is counted once, by its result (the second half of its output
    tuple for all-gather, collective-permute and reduce-scatter, which carry their
    operands too). Groups left empty (``replica_groups={}``) span all ``num_devices``. An
    op in a loop body has ``count`` = the loops' trip counts (``known_trip_count``)
    multiplied.
    """
    bodies, entry = computations(hlo)
    counts = runs(bodies, entry)
    found = []
    for name, lines in bodies.items():
        # A computation the call graph does not reach (a reference form not parsed
        # here) counts once rather than not at all.
        for match in COLLECTIVE_OP.finditer("\n".join(lines)):
            found.append(collective_of(match, num_devices, counts[name] or 1))
    return found


def collective_of(match: re.Match[str], num_devices: int | None, count: int = 1) -> Collective:
    """The ``Collective`` of one ``COLLECTIVE_OP`` match (an op line of ``hlo``), run ``count``
    times per execution."""
    out, op, start, rest = match.groups()
    results = arrays(out)
    carries = op in _CARRY_OPERANDS or (op == "all-reduce" and out.startswith("(("))
    if start and carries and len(results) > 1:
        results = results[len(results) // 2 :]
    size = sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 4) for dtype, shape in results)
    shapes = tuple(shape for _, shape in results)
    dtypes = tuple(dtype for dtype, _ in results)
    groups = replica_groups(rest, num_devices)
    return Collective(op, size, _group(rest, num_devices), shapes, count, groups, dtypes)


def collective_bytes(hlo: str, num_devices: int | None = None) -> float:
    """Bytes one device sends per run of ``hlo``, summed over its collectives
    (``Collective.sent_bytes``)."""
    return sum(c.sent_bytes for c in collectives(hlo, num_devices))
