"""The buffers live at a compiled program's peak, each named: which array it is, and the
user's line that made it.

XLA schedules the optimized program and simulates its heap; its ``HloLiveRange`` (dumped
beside the optimized HLO with ``xla_dump_to``) lists every buffer live at the peak by the
instruction that defines it. ``compile_dumped`` compiles a lowered step with that dump and
reads it; ``peak_buffers`` joins it with the optimized HLO (each instruction's shape,
``op_name`` and frame, ``shardax.cost.ops.HloIndex``) into ``Buffer`` rows, largest
first, covering ``coverage`` of the peak's bytes. What each is:

- ``parameter``, ``optimizer state``, ``other state``, ``batch``, ``argument``: an input
  of the step, named by its path (``state.params['up']['kernel'].value``);
- ``gradient``: made in the backward pass, shaped like a parameter;
- ``activation``: made in the forward pass and still live in the backward (saved for it);
- ``collective``: the buffer of an all-gather, all-reduce, ... (its op name says whose);
- ``temporary``: the rest (the forward's, the backward's, the update's scratch).

>>> live = '''HloLiveRange (max 3):
...   InstructionSequence:
...     0:p
...     1:d
...     2:t
...   BufferLiveRange:
...   Live ranges at 2 (peak):
...     d{}: 4096 bytes (cumulative: 4096 bytes)
...     p{}: 1024 bytes (cumulative: 5120 bytes)
... '''
>>> hlo = '''ENTRY %main (p: f32[16,16]) -> f32[32,32] {
...   %p = f32[16,16]{1,0} parameter(0), metadata={op_name="state.params['w']"}
...   %d = f32[32,32]{1,0} fusion(%p), calls=%f, metadata={op_name="jvp()/tanh"}
...   ROOT %t = f32[32,32]{1,0} fusion(%d), calls=%g, metadata={op_name="transpose(jvp())/mul"}
... }'''
>>> [(b.name, b.kind, b.bytes) for b in peak_buffers(hlo, live).buffers]
[('d', 'activation', 4096), ('p', 'parameter', 1024)]
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
import re
import tempfile
from typing import Any

from shardax.cost.hlo.collectives import OPS
from shardax.cost.hlo.program import DTYPE_BYTES, arrays
from shardax.cost.ops import HloIndex, op_name
from shardax.cost.sources import Sources

COVERAGE = 0.9
"""The share of the peak's bytes the rows cover, largest first."""
KINDS = (
    "parameter",
    "optimizer state",
    "other state",
    "batch",
    "argument",
    "gradient",
    "activation",
    "collective",
    "temporary",
)
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes")
_SEQUENCE = re.compile(r"^\s+(\d+):([\w.\-]+)\s*$")
_COLLECTIVE = {*OPS, *(f"{op}-start" for op in OPS), *(f"{op}-done" for op in OPS)}
_DUMP = {"xla_dump_to": "", "xla_dump_hlo_as_text": True}
_CALLS = itertools.count(os.getpid() * 1000)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak: bytes per device, dtype and shape (one device's),
    ``kind`` (``KINDS``), ``what`` (an input's path, else the op's name stack), the user's
    ``source`` line (``file:line``, ``""`` where none) and the HLO instruction's name."""

    name: str
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str
    what: str
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class PeakBuffers:
    """The buffers live at the peak (``buffers``: the largest, covering ``coverage`` of
    ``peak_bytes``), the heap simulation's peak in bytes, the instruction it is reached at
    and the pass it belongs to (``"forward"``, ``"backward"``, ``"optimizer"``), and how
    many smaller buffers the rows leave out (``rest``, ``rest_bytes``)."""

    buffers: tuple[Buffer, ...]
    peak_bytes: int
    at: str
    phase: str
    rest: int = 0
    rest_bytes: int = 0

    def by_kind(self) -> dict[str, int]:
        """Bytes of the listed buffers per kind."""
        out: dict[str, int] = {}
        for b in self.buffers:
            out[b.kind] = out.get(b.kind, 0) + b.bytes
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {
            "peak_bytes": self.peak_bytes,
            "at": self.at,
            "phase": self.phase,
            "rest": self.rest,
            "rest_bytes": self.rest_bytes,
            "by_kind": self.by_kind(),
            "buffers": [b.to_dict() for b in self.buffers],
        }


def compile_dumped(lowered: Any) -> tuple[Any, str]:
    """``lowered.compile()`` with XLA's dump of the optimized module: the compiled program
    and its ``HloLiveRange`` text (``""`` where the backend wrote none)."""
    with tempfile.TemporaryDirectory(prefix="shardax-explain-") as where:
        # JAX's persistent cache leaves the dump options out of its key, so a cached
        # executable would come back without a dump: a debug option of the buffer
        # assignment's printout, unique per call, keeps this compile its own.
        unique = {"xla_debug_buffer_assignment_show_max": 10**6 + next(_CALLS)}
        compiled = lowered.compile(compiler_options={**_DUMP, **unique, "xla_dump_to": where})
        found = sorted(glob.glob(os.path.join(where, "*after_optimizations-live-range.txt")))
        text = ""
        if found:
            with open(found[-1]) as f:
                text = f.read()
    return compiled, text


def phase(name_stack: str) -> str:
    """The pass an op's name stack puts it in: ``"backward"`` (under ``transpose(``),
    ``"optimizer"`` (``sx.TrainState.apply_gradients``' scope) or ``"forward"``.

    >>> phase("jit(step)/transpose(jvp())/dot_general"), phase("jit(step)/optimizer/add")
    ('backward', 'optimizer')
    """
    if "transpose(" in name_stack:
        return "backward"
    if re.search(r"(?:^|/)optimizer(?:/|$)", name_stack):
        return "optimizer"
    return "forward"


def input_kind(path: str) -> str:
    """The kind of a step's input from its path (``state.opt_state[0].mu...``).

    >>> input_kind("state.opt_state[0].mu['w']"), input_kind("batch['x']"), input_kind("w")
    ('optimizer state', 'batch', 'argument')
    """
    low = path.lower()
    if "opt_state" in low or "optimizer" in low:
        return "optimizer state"
    if low.startswith("batch"):
        return "batch"
    if "param" in low:
        return "parameter"
    if low.startswith("state"):
        return "other state"
    return "argument"


def name_stack(instr: Any) -> str:
    """An instruction's ``op_name`` (``shardax.cost.ops.op_name``) with HLO's escapes
    undone (``state.params['w']``)."""
    return op_name(instr).replace("\\'", "'").replace('\\"', '"')


def parse_live_range(text: str) -> tuple[list[str], int | None, list[tuple[str, str, int]]]:
    """The instruction sequence, the peak's index in it, and ``(instruction, shape
    index, bytes)`` of each buffer live there, from XLA's ``HloLiveRange`` dump."""
    sequence: list[str] = []
    live: list[tuple[str, str, int]] = []
    peak, section = None, ""
    for line in text.splitlines():
        found = _PEAK.search(line)
        if found:
            peak, section = int(found.group(1)), "peak"
            continue
        if line.strip().startswith(("InstructionSequence", "BufferLiveRange", "Stack trace")):
            section = line.strip().split(":")[0].split(" ")[0]
            continue
        if section == "InstructionSequence":
            m = _SEQUENCE.match(line)
            if m:
                sequence.append(m.group(2))
        elif section == "peak":
            m = _LIVE.match(line)
            if m:
                live.append((m.group(1), m.group(2), int(m.group(3))))
    return sequence, peak, live


def _param_shapes(index: HloIndex) -> set[tuple[int, ...]]:
    """The per-device shapes of the entry's parameter inputs."""
    entry = index.by_comp.get(index.entry or "", {})
    out = set()
    for instr in entry.values():
        if instr.opcode == "parameter" and input_kind(name_stack(instr)) == "parameter":
            out |= {shape for _, shape in arrays(instr.out)}
    return out


def _element(out: str, shape_index: str) -> tuple[str, tuple[int, ...]]:
    found = arrays(out)
    if not found:
        return "", ()
    i = int(shape_index.split(",")[0]) if shape_index else 0
    return found[i] if i < len(found) else found[0]


def peak_buffers(
    hlo: str,
    live_range: str,
    sources: Sources | None = None,
    coverage: float = COVERAGE,
    param_shapes: set[tuple[int, ...]] | None = None,
) -> PeakBuffers:
    """The named buffers live at the peak of the compiled ``hlo`` (``compiled.as_text()``)
    from its ``HloLiveRange`` dump, the largest first until ``coverage`` of the peak's
    bytes. ``param_shapes``: the parameters' global and per-device shapes (a backward
    buffer of one of them is a gradient; default: the entry's parameter inputs')."""
    sources = sources or Sources({})
    index = HloIndex(hlo)
    sequence, at, live = parse_live_range(live_range)
    at_name = sequence[at] if at is not None and at < len(sequence) else ""
    at_instr = index.by_name.get(at_name)
    peak_phase = phase(name_stack(at_instr)) if at_instr is not None else "forward"
    grads = _param_shapes(index) | set(param_shapes or ())
    rows = []
    for name, shape_index, size in live:
        instr = index.by_name.get(name)
        dtype, shape = _element(instr.out, shape_index) if instr else ("", ())
        stack = name_stack(instr) if instr else ""
        if instr is not None and instr.opcode == "parameter" and instr.computation == index.entry:
            kind, what = input_kind(stack), stack or name
        elif instr is not None and instr.opcode in _COLLECTIVE:
            kind, what = "collective", f"{instr.opcode}: {stack}"
        else:
            where = phase(stack)
            kind = "temporary"
            if where == "forward" and peak_phase != "forward" and stack:
                kind = "activation"
            elif where == "backward" and shape in grads:
                kind = "gradient"
            what = stack or name
        source = sources.line(instr.line) if instr else ""
        rows.append(Buffer(name, size, dtype, shape, kind, what, source))
    rows.sort(key=lambda b: -b.bytes)
    total = sum(b.bytes for b in rows)
    kept, covered = [], 0
    for b in rows:
        if covered >= coverage * total:
            break
        kept.append(b)
        covered += b.bytes
    return PeakBuffers(
        tuple(kept), total, at_name, peak_phase, len(rows) - len(kept), total - covered
    )


def array_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of an HLO array type.

    >>> array_bytes("bf16", (4, 8))
    64
    """
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
