"""A compiled program's text as shardax's cost models read it: its computations, how often
each runs, an instruction's name, calls and result arrays.

Every reader of HLO in ``shardax.cost`` (collectives, FLOPs, the per-op model, the
schedule, buffers) goes through these, so the text is split once per program.

>>> hlo = "ENTRY %main {\\n  %p = f32[8,16]{1,0} parameter(0)\\n}"
>>> bodies, entry = computations(hlo)
>>> entry, bodies[entry], runs(bodies, entry)[entry]
('main', ['  %p = f32[8,16]{1,0} parameter(0)'], 1)
>>> arrays("(f32[8,16], s32[])")
[('f32', (8, 16)), ('s32', ())]
"""

from __future__ import annotations

import functools
import re

DTYPE = r"[a-z]+\d*(?:e\d+m\d+[a-z]*)?"
"""An array type's dtype: f32, bf16, pred, and the fp8 ones (f8e4m3fn, f8e5m2, f8e4m3fnuz)."""
_SHAPE = re.compile(r"\b(" + DTYPE + r")\[([\d,]*)\]")
INSTRUCTION_NAME = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
"""An instruction line's name (group 1)."""
DEFINITION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|" + DTYPE + r"\[[\d,]*\]\S*) ")
"""An instruction line's name (group 1) and result type (group 2: an array, or a tuple)."""
CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
"""The computation a fusion or call instruction calls (group 1)."""
CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
"""A custom call's target (group 1: ``"__cublas$gemm"``)."""
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
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}


def arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each array type in ``text``, e.g. ``(f32[8,16], s32[])``."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)
    ]


class Bodies(dict):
    """``{computation: its lines}`` of one program (``_read``), with its call graph once
    ``call_graph`` has read it."""

    calls: dict[str, list[tuple[str, int]]] | None = None


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """``{computation: its lines}`` and the ENTRY computation's name (None for a bare
    list of ops, kept under ``""``). The last few programs read are kept
    (``_read``): the analyses of one compiled step (its collectives, FLOPs, schedule and
    per-op price) each ask for the same program's, and its call graph. Read-only: the
    callers share them."""
    return _read(hlo)


@functools.lru_cache(maxsize=2)
def _read(hlo: str) -> tuple[Bodies, str | None]:
    """What ``computations`` returns, for the last programs read (two: a step and,
    beside it, e.g. its DiLoCo outer step)."""
    bodies = Bodies({"": []})
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


def call_graph(bodies: dict[str, list[str]]) -> dict[str, list[tuple[str, int]]]:
    """``{computation: [(callee, times per run), ...]}`` (``line_calls`` of its lines),
    read once per program ``_read`` gave."""
    known = getattr(bodies, "calls", None)
    if known is not None:
        return known
    calls = {
        name: [c for line in lines for c in line_calls(line, bodies)]
        for name, lines in bodies.items()
    }
    if isinstance(bodies, Bodies):
        bodies.calls = calls
    return calls


def runs(
    bodies: dict[str, list[str]],
    entry: str | None,
    calls: dict[str, list[tuple[str, int]]] | None = None,
) -> dict[str, int]:
    """How many times each computation runs per execution of ``entry``: a while body
    ``known_trip_count`` times its caller's (else its condition's ``counter < N``; once
    when neither tells), every other called computation as often as its caller.
    ``calls``: the program's ``call_graph``, when the caller has it already (it reads
    every line, so one reading serves every ``entry`` asked about)."""
    if calls is None:
        calls = call_graph(bodies)
    counts = dict.fromkeys(bodies, 0 if entry else 1)
    if entry is None:
        return counts
    counts[entry] = 1
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
            if callee in counts:
                counts[callee] += counts[name] * times
    return counts
