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
import functools
import math
import re

import numpy as np

OPS = (
    "all-reduce", "all-gather", "reduce-scatter", "ragged-all-to-all", "all-to-all",
    "collective-permute",
)  # fmt: skip
_OP = re.compile(
    r"= (\(.*?\)|\S+) (" + "|".join(OPS) + r")(-start)?\((.*)$",
    re.MULTILINE,
)
# An array type's dtype: f32, bf16, pred, and the fp8 ones (f8e4m3fn, f8e5m2, f8e4m3fnuz)
_DTYPE = r"[a-z]+\d*(?:e\d+m\d+[a-z]*)?"
_SHAPE = re.compile(r"\b(" + _DTYPE + r")\[([\d,]*)\]")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\})")
# Newer XLA: replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=(...) {'axis_0'}
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((?:[^()]|\([^()]*\))*\))? \{([^}]*)\}"
)
# One instruction's parts, shared by the modules that read compiled HLO text.
_INSTR_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_AXIS = re.compile(r"'([^']+)'(?:=(\d+))?")
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_WHILE = re.compile(r"\bwhile\(.*?\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = [su]\d+\[\]\S* constant\((\d+)\)")
_LESS_THAN = re.compile(r"compare\(%?[\w.\-]+, %?([\w.\-]+)\), direction=LT")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|true_computation|false_computation|condition)=%?([\w.\-]+)"
    r"|\b(?:branch_computations|called_computations)=\{([^}]*)\}"
)
# A matmul's parts, and the branches of a conditional (shardax.cost.flops counts them).
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|" + _DTYPE + r"\[[\d,]*\]\S*) ")
_DOT = re.compile(r"= (\S+) dot\(%?([\w.\-]+), %?([\w.\-]+)\)(.*)$")
# A cuBLAS call's result is a tuple (the product, a workspace): the first shape is its.
_GEMM = re.compile(
    r"= \(?(\w+\[[\d,]*\])[^=]*? custom-call\(%?([\w.\-]+), .*__cublas\$(?:\w*gemm|lt\$matmul)"
)
_CONV = re.compile(r"= (\S+) convolution\(([^)]*)\)")
# cuDNN's convolutions: (result, workspace) = custom-call(operands), the forward conv's
# window and dim_labels on the line whichever direction the call computes.
_CUDNN_CONV = re.compile(
    r'= (\(.*?\)|\S+) custom-call\(([^)]*)\).*custom_call_target="__cudnn\$conv(\w*)"'
)
_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
_GROUP_COUNT = re.compile(r"\b(feature|batch)_group_count=(\d+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_BRANCHES = re.compile(
    r"\bbranch_computations=\{([^}]*)\}"
    r"|\btrue_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)"
)
_CONTRACT = re.compile(r"lhs_contracting_dim(?:s|ensions)\W+([\d,\s\"]*)")
# cuDNN's attention: the kind (Backward, ...) and the operands' shapes (_DIMS: their dims).
_FMHA = re.compile(
    r'custom_call_target="__cudnn\$fmha(\w*)".*?operand_layout_constraints=\{(.*?\})\}'
)
_DIMS = re.compile(r"\w+\[([\d,]*)\]")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip


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


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each array type in ``text``, e.g. ``(f32[8,16], s32[])``."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)
    ]


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


class _Bodies(dict):
    """``{computation: its lines}`` of one program (``_read``), with its call graph once
    ``_call_graph`` has read it."""

    calls: dict[str, list[tuple[str, int]]] | None = None


def _computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """``{computation: its lines}`` and the ENTRY computation's name (None for a bare
    list of ops, kept under ``""``). The last few programs read are kept
    (``_read``): the analyses of one compiled step (its collectives, FLOPs, schedule and
    per-op price) each ask for the same program's, and its call graph. Read-only: the
    callers share them."""
    return _read(hlo)


@functools.lru_cache(maxsize=2)
def _read(hlo: str) -> tuple[_Bodies, str | None]:
    """What ``_computations`` returns, for the last programs read (two: a step and,
    beside it, e.g. its DiLoCo outer step)."""
    bodies = _Bodies({"": []})
    current, entry = "", None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            bodies[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = ""
        else:
            bodies[current].append(line)
    return bodies, entry


def _condition_trips(lines: list[str]) -> int | None:
    """A while condition's ``counter < N`` with ``N`` a constant of it (XLA:TPU's
    compiled loops carry no ``known_trip_count``): ``N``, the trips of a loop counting
    from 0 as ``lax.scan`` and ``fori_loop`` do; else None."""
    constants = dict(m.groups() for m in map(_CONSTANT.match, lines) if m)
    for line in lines:
        found = _LESS_THAN.search(line)
        if found and found.group(1) in constants:
            return int(constants[found.group(1)])
    return None


def line_calls(line: str, bodies: dict[str, list[str]]) -> list[tuple[str, int]]:
    """``(computation, times)`` that one instruction ``line`` calls per run: a while body
    its ``known_trip_count`` times (else its condition's ``counter < N``; once when
    neither tells), every other called computation once."""
    calls = []
    loop, trips = _WHILE.search(line), _TRIP_COUNT.search(line)
    if loop:
        n = int(trips.group(1)) if trips else None
        if n is None:
            cond = _CONDITION.search(line)
            n = _condition_trips(bodies.get(cond.group(1), [])) if cond else None
        calls.append((loop.group(1), n or 1))
    for single, several in _CALLED.findall(line):
        for callee in [single] if single else re.findall(r"%?([\w.\-]+)", several):
            calls.append((callee, 1))
    return calls


def _call_graph(bodies: dict[str, list[str]]) -> dict[str, list[tuple[str, int]]]:
    """``{computation: [(callee, times per run), ...]}`` (``line_calls`` of its lines),
    read once per program ``_read`` gave."""
    known = getattr(bodies, "calls", None)
    if known is not None:
        return known
    calls = {name: [c for line in lines for c in line_calls(line, bodies)]
             for name, lines in bodies.items()}  # fmt: skip
    if isinstance(bodies, _Bodies):
        bodies.calls = calls
    return calls


def _runs(
    bodies: dict[str, list[str]],
    entry: str | None,
    calls: dict[str, list[tuple[str, int]]] | None = None,
) -> dict[str, int]:
    """How many times each computation runs per execution of ``entry``: a while body
    ``known_trip_count`` times its caller's (else its condition's ``counter < N``; once
    when neither tells), every other called computation as often as its caller.
    ``calls``: the program's ``_call_graph``, when the caller has it already (it reads
    every line, so one reading serves every ``entry`` asked about)."""
    if calls is None:
        calls = _call_graph(bodies)
    runs = dict.fromkeys(bodies, 0 if entry else 1)
    if entry is None:
        return runs
    runs[entry] = 1
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:  # callers before callees (HLO's call graph is a DAG)
        seen.add(name)
        for callee, _ in calls.get(name, []):
            if callee not in seen and callee in bodies:
                visit(callee)
        order.append(name)

    visit(entry)
    for name in reversed(order):
        for callee, times in calls[name]:
            if callee in runs:
                runs[callee] += runs[name] * times
    return runs


_CARRY_OPERANDS = ("all-gather", "collective-permute", "reduce-scatter")
"""Async ``*-start`` ops whose output tuple is ``(operands, results)``: XLA:GPU's
``reduce-scatter-start`` too, whose operands are ``n`` times its results. (JAX 0.12's
XLA:GPU ``all-reduce-start`` may carry its operands too, as a nested tuple first:
``((f32[n]), f32[n])``.)"""


def collectives(hlo: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective of ``hlo`` (``compiled.as_text()``), in order.

    An async ``*-start`` op is counted once, by its result (the second half of its
    output tuple for all-gather, collective-permute and reduce-scatter, which carry their
    operands too).
    Groups left empty (``replica_groups={}``) span all ``num_devices``. An op in a
    loop body has ``count`` = the loops' trip counts (``known_trip_count``) multiplied.
    """
    bodies, entry = _computations(hlo)
    runs = _runs(bodies, entry)
    found = []
    for name, lines in bodies.items():
        # A computation the call graph does not reach (a reference form not parsed
        # here) counts once rather than not at all.
        for match in _OP.finditer("\n".join(lines)):
            found.append(collective_of(match, num_devices, runs[name] or 1))
    return found


def collective_of(match: re.Match[str], num_devices: int | None, count: int = 1) -> Collective:
    """The ``Collective`` of one ``_OP`` match (an op line of ``hlo``), run ``count``
    times per execution."""
    out, op, start, rest = match.groups()
    arrays = _arrays(out)
    carries = op in _CARRY_OPERANDS or (op == "all-reduce" and out.startswith("(("))
    if start and carries and len(arrays) > 1:
        arrays = arrays[len(arrays) // 2 :]
    size = sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 4) for dtype, shape in arrays)
    shapes = tuple(shape for _, shape in arrays)
    dtypes = tuple(dtype for dtype, _ in arrays)
    groups = replica_groups(rest, num_devices)
    return Collective(op, size, _group(rest, num_devices), shapes, count, groups, dtypes)


def collective_bytes(hlo: str, num_devices: int | None = None) -> float:
    """Bytes one device sends per run of ``hlo``, summed over its collectives
    (``Collective.sent_bytes``)."""
    return sum(c.sent_bytes for c in collectives(hlo, num_devices))


# HLO (custom_call_target="...") and StableHLO (stablehlo.custom_call @...) text
_CUSTOM_CALL = re.compile(
    r'^.*(?:custom_call_target="([^"]*)"|custom_call @([\w$.\-]+)).*$', re.MULTILINE
)


def attention_kernels(hlo: str) -> dict[str, int]:
    """How many fused attention kernel calls HLO text holds (compiled, or the lowered
    StableHLO: the kernel is chosen while tracing): ``"cudnn"``
    (cuDNN's ``__cudnn$fmha*`` custom calls, forward and backward) and ``"splash"``
    (Mosaic ``tpu_custom_call``s of Pallas' splash attention). Neither: attention, if
    any, is dense (``attention_kernel``).

    >>> attention_kernels('%c = bf16[2] custom-call(), custom_call_target="__cudnn$fmhaSoftmax"')
    {'cudnn': 1, 'splash': 0}
    """
    found = {"cudnn": 0, "splash": 0}
    for line in _CUSTOM_CALL.finditer(hlo):
        target = line.group(1) or line.group(2)
        if target.startswith("__cudnn$fmha"):
            found["cudnn"] += 1
        elif target == "tpu_custom_call" and "splash" in line.group(0):
            found["splash"] += 1
    return found


def attention_kernel(hlo: str) -> str:
    """The attention kernel compiled HLO text uses: ``"cudnn"``, ``"splash"`` or
    ``"dense"`` (no fused attention call).

    >>> attention_kernel("%d = f32[8,8]{1,0} dot(f32[8,4]{1,0} %a, f32[4,8]{1,0} %b)")
    'dense'
    """
    counts = attention_kernels(hlo)
    return max(counts, key=counts.__getitem__) if any(counts.values()) else "dense"
