"""The collectives of a compiled schedule: which overlap compute, and the time left exposed.

A compiled module lists each computation's instructions in the order XLA scheduled them
(``compiled.as_text()``). An asynchronous collective is a ``*-start`` / ``*-done`` pair (or
an ``async-start`` / ``async-done`` or ``fusion-start`` / ``fusion-done`` pair wrapping
one): what is scheduled between the two runs while its bytes move. A synchronous one (a
plain ``all-gather(...)``) holds the stream until it is done. ``schedule`` reads, for each
collective, its kind, dtypes and bytes (``shardax.cost.hlo.collective_of``), where it starts
and ends in its computation, the compute ops and matmul FLOPs scheduled in between, and
where its result is first used. ``exposed_seconds`` turns one into the time a step waits
for it.

>>> hlo = '''ENTRY %main (p: bf16[8,16], x: bf16[4,64]) -> bf16[4,16] {
...   %p = bf16[8,16]{1,0} parameter(0)
...   %x = bf16[4,64]{1,0} parameter(1)
...   %ag = (bf16[8,16]{1,0}, bf16[64,16]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8]
...   %y = bf16[4,64]{1,0} fusion(%x), kind=kLoop, calls=%f
...   %w = bf16[64,16]{1,0} all-gather-done(%ag)
...   ROOT %d = bf16[4,16]{1,0} dot(%y, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
... }'''
>>> (c,) = schedule(hlo, 8)
>>> c.op, c.dtypes, c.bytes, c.ops_between, c.synchronous, c.first_use > c.done
('all-gather', ('bf16',), 2048, 1, False, True)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from shardax.cost.flops import line_matmuls
from shardax.cost.hlo.collectives import COLLECTIVE_OP as _OP
from shardax.cost.hlo.collectives import Collective, collective_of
from shardax.cost.hlo.program import CALLS as _CALLS
from shardax.cost.hlo.program import INSTRUCTION_NAME as _NAME
from shardax.cost.hlo.program import computations, line_calls, runs

_OPCODE = re.compile(r" = .*? ([a-z][\w\-]*)\(")
_OPERANDS = re.compile(r"%([\w.\-]+)")
FREE = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "copy-start",
        "copy-done",
    }
)
"""Ops that launch no kernel (or only start or end one): not counted as compute."""
_PLUMBING = frozenset({"get-tuple-element", "tuple", "bitcast", "opt-barrier"})
_WRAPPERS = frozenset({"async-start", "fusion-start"})
"""Ops that run a called computation asynchronously, until their ``*-done``: a collective
in it is async; an async fusion's kernel (``fusion-start``) computes meanwhile."""


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """One collective where the schedule put it.

    Attributes:
        collective: what it moves (``Collective``: op, result
            bytes per device, group, shapes, runs per step, dtypes).
        name: its (start) instruction's name; computation: the computation scheduling it.
        start, done: their positions in that computation's schedule (equal for a
            synchronous collective).
        synchronous: a plain op, not an async pair: nothing overlaps it.
        ops_between: compute ops (fusions, library calls, matmuls, loops; not tuple or
            bitcast plumbing) scheduled strictly between start and done.
        flops_between: the matmul FLOPs of those ops, per run (loops inside counted by
            their trips).
        first_use: the position of the first compute op or collective reading its result
            (None: none in its computation, e.g. the computation's output).
    """

    collective: Collective
    name: str
    computation: str
    start: int
    done: int
    synchronous: bool
    ops_between: int
    flops_between: float
    first_use: int | None

    @property
    def overlapped(self) -> bool:
        """Matmuls run while it moves: async, with matmul FLOPs between start and done."""
        return not self.synchronous and self.flops_between > 0

    @property
    def op(self) -> str:
        return self.collective.op

    @property
    def dtypes(self) -> tuple[str, ...]:
        return self.collective.dtypes

    @property
    def bytes(self) -> int:
        """Result bytes per device of one run."""
        return self.collective.bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per step (all runs: ``Collective.sent_bytes``)."""
        return self.collective.sent_bytes

    def to_dict(self) -> dict[str, object]:
        """Plain data (JSON-able)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "collective"}
        c = self.collective
        return {
            **out,
            "op": c.op,
            "dtypes": list(c.dtypes),
            "bytes": c.bytes,
            "runs": c.count,
            "group": c.group,
            "sent_bytes": c.sent_bytes,
        }


def _operands(line: str) -> list[str]:
    """The instruction names ``line`` reads (after its ``=``)."""
    return _OPERANDS.findall(line.split("=", 1)[-1])


def _opcode(line: str) -> str | None:
    found = _OPCODE.search(line)
    return found.group(1) if found else None


def _async_callees(bodies: dict[str, list[str]]) -> set[str]:
    """Computations an ``async-start`` or ``fusion-start`` wraps (their ops run
    asynchronously)."""
    out = set()
    for lines in bodies.values():
        for line in lines:
            if _opcode(line) in _WRAPPERS:
                out.update(_CALLS.findall(line))
    return out


def schedule(hlo: str, num_devices: int | None = None) -> list[Scheduled]:
    """Every collective of the scheduled module ``hlo`` (``compiled.as_text()``), in
    schedule order within each computation: async pairs with what overlaps them, and
    synchronous ops. Groups left empty span ``num_devices`` (as
    ``collectives``). The order is XLA's only in a scheduled module
    (a compiled one); the FLOPs between are matmuls only (elementwise fusions count as
    ops, not FLOPs), so the overlap they promise is a lower bound."""
    bodies, entry = computations(hlo)
    counts = runs(bodies, entry)
    wrapped = _async_callees(bodies)
    own = {name: sum(f for _, _, f in line_matmuls(lines)) for name, lines in bodies.items()}
    per_call: dict[str, float] = {}

    def flops_per_call(name: str) -> float:  # its matmuls and those of what it calls
        if name not in per_call:
            per_call[name] = 0.0  # HLO's call graph is a DAG; this only guards a cycle
            called = [c for line in bodies[name] for c in line_calls(line, bodies)]
            per_call[name] = own[name] + sum(
                n * flops_per_call(c) for c, n in called if c in bodies
            )
        return per_call[name]

    found: list[Scheduled] = []
    for comp, lines in bodies.items():
        if comp not in wrapped:
            found += _scheduled(comp, lines, bodies, flops_per_call, counts[comp] or 1, num_devices)
    return found


def _scheduled(
    comp: str,
    lines: list[str],
    bodies: dict[str, list[str]],
    flops_per_call: Callable[[str], float],
    count: int,
    num_devices: int | None,
) -> list[Scheduled]:
    """The collectives of one computation's ``lines`` (its schedule); ``flops_per_call``:
    the matmul FLOPs of one call of a computation, with all it calls."""
    names = [m.group(1) if (m := _NAME.match(line)) else "" for line in lines]
    codes = [_opcode(line) or "" for line in lines]
    own: dict[int, float] = {}
    for index, _, flops in line_matmuls(lines):
        own[index] = own.get(index, 0.0) + flops

    def flops_at(i: int) -> float:  # the line's matmuls and those of what it calls
        called = line_calls(lines[i], bodies)
        return own.get(i, 0.0) + sum(n * flops_per_call(c) for c, n in called if c in bodies)

    def collective_in(i: int) -> re.Match[str] | None:  # the collective a wrapper runs
        inner = ("\n".join(bodies.get(c, [])) for c in _CALLS.findall(lines[i]))
        return next((m for text in inner if (m := _OP.search(text))), None)

    def kernel(i: int) -> bool:  # compute: an async wrapper's too, unless a collective's
        code = codes[i]
        if code in _WRAPPERS:
            return collective_in(i) is None
        return bool(code) and code not in FREE and not code.endswith(("-start", "-done"))

    computes = [kernel(i) for i in range(len(lines))]

    def first_use(after: int, result: str) -> int | None:
        aliases = {result}
        for j in range(after + 1, len(lines)):
            if not aliases & set(_operands(lines[j])):
                continue
            if codes[j] in _PLUMBING:
                aliases.add(names[j])
            elif computes[j] or codes[j].endswith("-start"):  # a kernel or a collective
                return j
        return None

    out = []
    for i, line in enumerate(lines):
        match, code = _OP.search(line), codes[i]
        if code in _WRAPPERS:
            match = collective_in(i)
        elif match is None or code.endswith("-done"):
            continue
        if match is None:
            continue
        collective = collective_of(match, num_devices, count)
        synchronous = not code.endswith("-start")
        done = i
        if not synchronous:
            done_op = code[: -len("start")] + "done"
            ends = (j for j in range(i + 1, len(lines)) if codes[j] == done_op)
            done = next((j for j in ends if names[i] in _operands(lines[j])), i)
        between = [j for j in range(i + 1, done) if computes[j]]
        out.append(
            Scheduled(
                collective=collective,
                name=names[i],
                computation=comp,
                start=i,
                done=done,
                synchronous=synchronous,
                ops_between=len(between),
                flops_between=sum(flops_at(j) for j in between),
                first_use=first_use(done, names[done]),
            )
        )
    return out


def exposed_seconds(op: Scheduled, wire_seconds: float, flop_rate: float) -> float:
    """Seconds per step a device waits for ``op``: each run's time on the wire
    (``wire_seconds``: its sent bytes over its link's bandwidth) less the time of the
    matmuls scheduled between its start and done at ``flop_rate`` FLOP/s, clamped at 0,
    times its runs; all of it for a synchronous op.

    >>> c = Scheduled(Collective("all-gather", 1024, 8), "ag", "main", 0, 2, False, 1, 2e9, 3)
    >>> exposed_seconds(c, wire_seconds=0.003, flop_rate=1e12)
    0.001
    """
    hidden = 0.0 if op.synchronous or flop_rate <= 0 else op.flops_between / flop_rate
    return max(0.0, wire_seconds - hidden) * op.collective.count
