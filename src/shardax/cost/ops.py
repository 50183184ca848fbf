r"""The instructions of a compiled program and the class of each: what a step's time is spent on.

``HloIndex`` reads compiled HLO text (``compiled.as_text()``) into its instructions by
name, each with its computation's runs per execution (loop trips), its matmul FLOPs and
its bytes. ``classify`` puts an instruction in one of ``CLASSES``:

- ``gemm``: ``dot``/``convolution``, cuBLAS(Lt) custom calls, fusions with a matmul inside
  (Triton GEMMs, XLA:CPU's YNNPACK dots);
- ``attention``: cuDNN's fused attention (``__cudnn$fmha*``) and other flash/sdpa calls;
- ``optimizer``: ops whose metadata ``op_name`` holds the ``optimizer`` scope
  (``sx.TrainState.apply_gradients`` runs the update under ``jax.named_scope("optimizer")``);
- ``copies``: copies and converts: copy, transpose, fusions of only converts, bitcasts,
  broadcasts, slices and other data movement;
- ``collectives``: all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all;
- ``elementwise``: the other fusions and plain ops (loop, input, reduction);
- ``other``: control flow and unknown custom calls (``idle`` is a profile's class only).

The cost model (``shardax.cost.opcost``) prices each class; the GPU profile reader
(``benchmarks/gpu/op_profile.py``) sums a trace's kernel times into the same classes.

>>> index = HloIndex("ENTRY %main {\n  %a = bf16[64,32]{1,0} parameter(0)\n"
...                  "  %c = f32[64,32]{1,0} convert(%a)\n}")
>>> [(i.name, classify(i), index.bytes(i)) for i in index.by_comp["main"].values()][1]
('c', 'copies', 12288.0)
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from shardax.cost.flops import own_matmuls
from shardax.cost.hlo.collectives import OPS
from shardax.cost.hlo.program import CALL_TARGET as _TARGET
from shardax.cost.hlo.program import CALLS as _CALLS
from shardax.cost.hlo.program import DTYPE_BYTES, arrays, computations, runs
from shardax.cost.hlo.program import INSTRUCTION_NAME as _INSTR

CLASSES = (
    "gemm",
    "attention",
    "elementwise",
    "optimizer",
    "copies",
    "collectives",
    "other",
    "idle",
)
LABELS = {
    "gemm": "GEMMs",
    "attention": "attention",
    "elementwise": "elementwise fusions",
    "optimizer": "optimizer update",
    "copies": "copies and converts",
    "collectives": "collectives",
    "other": "other",
    "idle": "idle",
}
FLOP_CLASSES = ("gemm", "attention")
SCOPE = "optimizer"

# Ops that only move or reinterpret data: a fusion of these alone is a copy.
_MOVES = {
    "convert",
    "copy",
    "transpose",
    "reshape",
    "bitcast",
    "bitcast-convert",
    "broadcast",
    "slice",
    "concatenate",
    "pad",
    "reverse",
    "dynamic-slice",
    "dynamic-update-slice",
    "copy-start",
    "copy-done",
}
FUSIONS = frozenset({"fusion", "fusion-start"})
"""Ops that run the computation they call as one kernel: a fusion, and an async fusion's
start (XLA's asynchronous dynamic-slice fusions of a scan's stacked operands). Their
bodies are priced through them, never as kernels of their own."""
_RUN_APART = frozenset({"async-start", "call"})
"""Ops whose called computation runs as instructions of its own (each priced there)."""
_NEUTRAL = {"parameter", "constant", "tuple", "get-tuple-element", "iota"}
_CONTROL = {
    "while",
    "conditional",
    "call",
    "custom-call",
    "sort",
    "rng",
    "rng-bit-generator",
    "rng-get-and-update-state",
    "infeed",
    "outfeed",
    "send",
    "send-done",
    "recv",
    "recv-done",
    "after-all",
    "partition-id",
    "replica-id",
    "cholesky",
    "triangular-solve",
    "fft",
    "async-start",
    "async-update",
    "async-done",
}
_COLLECTIVE_OPS = {*OPS, *(f"{op}-start" for op in OPS), *(f"{op}-done" for op in OPS)}

# cuDNN convolutions are GEMMs too (implicit GEMM: M = N·Ho·Wo, N = Cout, K = Cin·kh·kw).
_GEMM_TARGET = re.compile(
    r"__cublas\$|__cublasLt|\$gemm|\$matmul|__cudnn\$fusion|__cudnn\$conv|__triton_gemm"
)
_ATTENTION_TARGET = re.compile(r"__cudnn\$fmha|flash|fmha|sdpa", re.IGNORECASE)
_SCOPE = re.compile(r"(?:^|[/(])" + SCOPE + r"(?:[/)]|$)")

_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
_KIND = re.compile(r"\bkind=(k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"([^"]+)"')
_MODULE = re.compile(r"^\s*HloModule\s+([\w.\-]+)", re.MULTILINE)


@dataclass
class Instr:
    """One HLO instruction: what classifying and pricing it takes."""

    name: str
    opcode: str
    computation: str
    out: str
    operands: list[str]
    line: str
    op_name: str = ""
    target: str = ""
    kind: str = ""
    called: str = ""
    fused: list[tuple[str, str, str]] = field(default_factory=list)  # (opcode, target, op_name)


def _close(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_line(line: str, computation: str) -> Instr | None:
    """``%name = type opcode(operands), attributes`` -> an ``Instr``, else None."""
    head = _INSTR.match(line)
    if not head:
        return None
    rest = line[head.end() :]
    if rest.startswith("("):  # a tuple type
        end = _close(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    out, tail = rest[:end], rest[end:]
    found = _OPCODE.match(tail)
    if not found:
        return None
    args_start = found.end() - 1
    args_end = _close(tail, args_start)
    args = tail[args_start + 1 : args_end - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    if not operands and args.strip():
        operands = [a.strip().split(" ")[-1] for a in args.split(",") if a.strip()]
    attrs = tail[args_end:]
    name_op = _OP_NAME.search(attrs)
    target, kind, called = _TARGET.search(attrs), _KIND.search(attrs), _CALLS.search(attrs)
    return Instr(
        name=head.group(1),
        opcode=found.group(1),
        computation=computation,
        out=out,
        operands=operands,
        line=line,
        op_name=name_op.group(1) if name_op else "",
        target=target.group(1) if target else "",
        kind=kind.group(1) if kind else "",
        called=called.group(1) if called else "",
    )


class HloIndex:
    """The instructions of compiled HLO text by name, with their computations' runs per
    execution (loop trip counts) and their FLOPs and bytes."""

    def __init__(self, hlo: str) -> None:
        module = _MODULE.search(hlo)
        self.module = module.group(1) if module else ""
        self.bodies, self.entry = computations(hlo)
        try:
            self.runs = runs(self.bodies, self.entry)
        except Exception:  # a call graph not parsed: every computation once
            self.runs = dict.fromkeys(self.bodies, 1)
        self.by_name: dict[str, Instr] = {}
        self.by_comp: dict[str, dict[str, Instr]] = {}
        for comp, lines in self.bodies.items():
            own: dict[str, Instr] = {}
            for line in lines:
                instr = _parse_line(line, comp)
                if instr is not None:
                    own[instr.name] = instr
                    self.by_name.setdefault(instr.name, instr)
            self.by_comp[comp] = own
        self.sanitized = {re.sub(r"[.\-]", "_", n): n for n in self.by_name}
        for instr in self.by_name.values():
            if instr.called:
                instr.fused = list(self._fused_ops(instr.called, set()))

    def _fused_ops(self, comp: str, seen: set[str]) -> Iterable[tuple[str, str, str]]:
        """(opcode, custom-call target, op_name) of every op in ``comp`` and the
        computations its ops call (``calls=``), recursively."""
        if comp in seen or comp not in self.by_comp:
            return
        seen.add(comp)
        for instr in self.by_comp[comp].values():
            yield instr.opcode, instr.target, instr.op_name
            if instr.called:
                yield from self._fused_ops(instr.called, seen)

    def lookup(self, hlo_op: str, kernel: str) -> Instr | None:
        """The instruction an event names: its ``hlo_op`` stat, else the event's own name
        (XLA:CPU), else the kernel name as XLA:GPU sanitizes an instruction's name."""
        for name in (hlo_op, kernel):
            if name and name in self.by_name:
                return self.by_name[name]
        for name in (hlo_op, kernel):
            if name:
                key = re.sub(r"[.\-]", "_", name)
                if key in self.sanitized:
                    return self.by_name[self.sanitized[key]]
        return None

    def runs_of(self, instr: Instr) -> int:
        """Runs of ``instr`` per execution of the program (1 where not known)."""
        return max(int(self.runs.get(instr.computation, 1) or 1), 1)

    def _type(self, comp: str, name: str) -> str:
        found = self.by_comp.get(comp, {}).get(name) or self.by_name.get(name)
        return found.out if found else ""

    def flops(self, instr: Instr) -> float:
        """Matmul FLOPs of one run of ``instr`` (``shardax.cost.flops``' counting): a
        dot, cuBLAS call or cuDNN attention by its own line, a fusion by its body."""
        if instr.called and (instr.opcode in FUSIONS or instr.opcode in _RUN_APART):
            total, seen, todo = 0.0, set(), [instr.called]
            while todo:
                comp = todo.pop()
                if comp in seen or comp not in self.bodies:
                    continue
                seen.add(comp)
                total += sum(f for _, f in own_matmuls(self.bodies[comp]))
                todo += [i.called for i in self.by_comp.get(comp, {}).values() if i.called]
            return total
        defs = []
        for op in instr.operands:
            shape = self._type(instr.computation, op)
            if shape and not shape.startswith("("):
                defs.append(f"  %{op} = {shape} parameter(0)")
        found = list(own_matmuls([*defs, instr.line]))
        return found[-1][1] if found else 0.0

    def bytes(self, instr: Instr) -> float:
        """Bytes ``instr`` reads and writes: its operands' and output's sizes."""
        types = [instr.out] + [self._type(instr.computation, op) for op in instr.operands]
        return float(
            sum(
                math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
                for t in types
                for dtype, shape in arrays(t)
            )
        )


def program_flops(index: HloIndex) -> dict[str, float]:
    """Matmul FLOPs of one run of the program per class (``FLOP_CLASSES``): every
    instruction of the computations that run (not the bodies fusions call), classified
    and priced, times its computation's runs."""
    fused = {i.called for i in index.by_name.values() if i.called and i.opcode in FUSIONS}
    totals = dict.fromkeys(FLOP_CLASSES, 0.0)
    for comp, instrs in index.by_comp.items():
        if comp in fused:
            continue
        for instr in instrs.values():
            if instr.opcode in _RUN_APART:  # its body's instructions count themselves
                continue
            cls = classify(instr)
            if cls in totals:
                totals[cls] += index.flops(instr) * index.runs_of(instr)
    return totals


def op_name(instr: Instr) -> str:
    """``instr``'s metadata ``op_name``, else that of the last op it fuses which has one
    (the fusion's root, or the nearest op to it: what XLA names a fusion after)."""
    if instr.op_name:
        return instr.op_name
    named = [n for _, _, n in instr.fused if n]
    return named[-1] if named else ""


def _in_scope(op_name: str) -> bool:
    return bool(_SCOPE.search(op_name))


def classify(instr: Instr) -> str:
    """The class of an instruction (see the module docstring)."""
    ops = [instr.opcode] + [op for op, _, _ in instr.fused]
    targets = [instr.target] + [t for _, t, _ in instr.fused if t]
    backend = _BACKEND_KIND.search(instr.line)
    backend_kind = backend.group(1) if backend else ""
    if any(op in _COLLECTIVE_OPS for op in ops):
        return "collectives"
    if any(t and _ATTENTION_TARGET.search(t) for t in targets):
        return "attention"
    if (
        instr.opcode in ("dot", "convolution")
        or any(t and _GEMM_TARGET.search(t) for t in targets)
        or _GEMM_TARGET.search(backend_kind)
        or any(op in ("dot", "convolution", "ragged-dot") for op in ops[1:])
    ):
        return "gemm"
    if instr.op_name:
        if _in_scope(instr.op_name):
            return "optimizer"
    else:
        named = [n for _, _, n in instr.fused if n]
        if named and sum(map(_in_scope, named)) * 2 > len(named):
            return "optimizer"
    fusion = instr.opcode in FUSIONS
    inner = [op for op in ops[1:] if op not in _NEUTRAL] if fusion else []
    if instr.opcode in _MOVES or (fusion and inner and set(inner) <= _MOVES):
        return "copies"
    if instr.opcode in _CONTROL:
        return "other"
    return "elementwise"
