r"""A per-op cost model of a compiled per-device program, priced by a calibration's tables.

Model ``per-op`` (every figure a prediction). Each instruction of the computations that
run (loop bodies by their trips; not the bodies of fusions) is classed
(``shardax.cost.ops.classify``) and priced:

- **GEMMs** (``dot``, cuBLAS calls, Triton or address-computing GEMM fusions): FLOPs at the
  rate of the calibration's measured shape nearest in ``(log m, log n, log k)``
  (``gemm_rate``), or their bytes at the stream bandwidth where that is slower; an
  fp32 GEMM at the calibration's measured fp32 rate (the H100 measured 0.50-0.56× bf16's),
  or half the bf16 rate where it measured none;
- **attention** (cuDNN's ``__cudnn$fmha*``): the measured kernel nearest in (seq, heads,
  head_dim) with the same mask and pass, scaled by FLOPs (``attention_seconds``);
- **memory-bound** work (elementwise fusions, the optimizer update, copies, other
  kernels): operand + output bytes at the calibration's median stream bandwidth, or its
  median reduction bandwidth for a kernel that reduces (a norm, a softmax, a loss) where
  it measured reductions;
- **launch**: every kernel (all of the above) ``launch_us``;
- **collectives**: per op ``latency + bytes / link bandwidth``: the calibration's fit
  where it measured that op over that many devices of one host (``collective_fit``),
  else ``LATENCY_S`` and the datasheet's links; a group that spans GPU hosts level by
  level as NCCL runs it, priced by the caller (``seconds_of``:
  ``shardax.cost.nccl.price_collective``, on the target's network); and the time left
  exposed by the compiled schedule (``shardax.cost.schedule.exposed_seconds``, with the
  matmuls under each at the calibrated GEMM rate), across hosts on a line of its own.

The step is the kernels in sequence (one stream) plus the exposed collectives. Its
interval: low with GEMMs at the table's best rate, attention 20% faster, memory-bound at
the fastest stream pass and the collectives hidden entirely (the step no shorter than
their time on the wire): a compile-only schedule's exposure is itself an estimate, as
XLA's latency-hiding scheduler on the device may hide more; high with GEMMs 15% under
the nearest shape's rate, attention 20% slower, memory-bound at the slowest stream pass,
launches at twice ``launch_us`` and the collectives not overlapped at all. Tables not
measured on the device kind widen it: by 10% each side for a derived calibration (scaled
from another kind's; none ships now), by 25% for another kind's (an uncalibrated device).

>>> from shardax.cost.calibration import H200
>>> hlo = '''ENTRY %main {
...   %a = bf16[8192,2048]{1,0} parameter(0)
...   %b = bf16[2048,8192]{1,0} parameter(1)
...   %d = bf16[8192,8192]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   ROOT %e = bf16[8192,8192]{1,0} fusion(%d), kind=kLoop, calls=%f
... }'''
>>> cost = price_hlo(hlo, H200)
>>> round(cost.classes["gemm"].seconds * 1e3, 3), round(cost.classes["elementwise"].seconds * 1e6)
(0.417, 68)
>>> cost.low_s < cost.step_s < cost.high_s
True
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from shardax.cost.hlo.kernels import fused_attention
from shardax.cost.hlo.program import DTYPE_BYTES, arrays
from shardax.cost.measurements import Calibration, gemm_rows
from shardax.cost.ops import FUSIONS, HloIndex, Instr, classify
from shardax.cost.predict import wire_seconds
from shardax.cost.schedule import Scheduled, exposed_seconds, schedule

MODEL_NAME = "per-op"
PRICED = ("gemm", "attention", "elementwise", "optimizer", "copies", "other")
"""The classes of kernels priced one by one (collectives are priced from the schedule)."""
LATENCY_S = {"intra-host": 10e-6, "inter-host": 25e-6, "inter-slice": 50e-6}
"""Assumed (not calibrated) latency of one collective per link: NCCL's small-message
times within an NVLink host and over InfiniBand are of this order."""
FP32_GEMM_FACTOR = 0.5
"""An fp32 GEMM's rate against bf16's where a calibration measured no fp32 GEMM: the H100
measured 0.50-0.56 (median 0.53) at five shapes, JAX's default precision."""
FP8_GEMM_FACTOR = 2.0
"""An fp8 GEMM's rate against bf16's where a calibration measured no fp8 GEMM: the
datasheets' dense fp8 peak over their dense bf16 peak, 2 on every fp8 GPU of
``shardax.cost.hardware`` (H100 SXM 1,979 vs 989 TFLOP/s; H200 the same; B200 4.5 vs 2.25
PFLOP/s), applied to the measured bf16 rate of the nearest shape, as fp32's factor is. A
datasheet figure, not a measurement: ``StepCost.fp8_datasheet_flops`` says how many FLOPs
were priced so."""
_NO_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "while", "call",
    "conditional", "async-start", "async-update", "async-done", "copy-done",
})  # fmt: skip
_BATCH = re.compile(r'lhs_batch_dim(?:s|ensions)\W+([\d,\s"]*)')


@dataclasses.dataclass
class ClassCost:
    """One class of kernels: how many per step, their seconds (point, low, high), the
    FLOPs and bytes they were priced by."""

    kernels: float = 0.0
    seconds: float = 0.0
    low: float = 0.0
    high: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0

    def add(self, runs: float, point: float, low: float, high: float, flops: float = 0.0,
            nbytes: float = 0.0) -> None:  # fmt: skip
        self.kernels += runs
        self.seconds += runs * point
        self.low += runs * low
        self.high += runs * high
        self.flops += runs * flops
        self.bytes += runs * nbytes


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A compiled step priced op by op (see the module): seconds per class, launches,
    collectives (their wire time and the part the schedule leaves exposed), the interval.

    Attributes:
        calibration: the name of the tables (``"calibrated: H200, JAX 0.11.2, ..."``),
            or ``"uncalibrated: ..."`` with how far the nearest calibrated kind is.
        classes: ``ClassCost`` per class of ``PRICED``.
        launch_s: kernels × the calibrated launch cost (point; high at twice).
        collective_s: the collectives' time on the wire (latency + bytes / bandwidth).
        exposed_s: the part of it the compiled schedule leaves exposed.
        unpriced: custom calls the model has no table for, by target, with their count
            per step (priced by their bytes, as memory-bound work).
        widen: the share the interval is widened by on each side (tables not measured
            on this kind).
        inter_host_s: the part of ``collective_s`` of collectives whose groups span
            hosts (priced level by level, ``shardax.cost.nccl``).
        exposed_inter_host_s: the part of ``exposed_s`` those leave exposed.
        fp8_datasheet_flops: FLOPs of fp8 GEMMs priced at ``FP8_GEMM_FACTOR`` times the
            bf16 rates (the tables have no fp8 rows: the datasheet's peak ratio).
    """

    calibration: str
    classes: dict[str, ClassCost]
    launch_s: float
    collective_s: float
    exposed_s: float
    unpriced: dict[str, float]
    widen: float = 0.0
    inter_host_s: float = 0.0
    exposed_inter_host_s: float = 0.0
    fp8_datasheet_flops: float = 0.0

    @property
    def kernels(self) -> float:
        return sum(c.kernels for c in self.classes.values())

    @property
    def compute_s(self) -> float:
        """The kernels' time in sequence, launches included."""
        return sum(c.seconds for c in self.classes.values()) + self.launch_s

    @property
    def step_s(self) -> float:
        """The point prediction: kernels in sequence + exposed collectives."""
        return self.compute_s + self.exposed_s

    @property
    def low_s(self) -> float:
        low = max(sum(c.low for c in self.classes.values()) + self.launch_s, self.collective_s)
        low = min(low, self.step_s)  # collectives in flight together overlap each other too
        return low * (1 - self.widen)

    @property
    def high_s(self) -> float:
        high = sum(c.high for c in self.classes.values()) + 2 * self.launch_s + self.collective_s
        return high * (1 + self.widen)

    @property
    def executed_flops(self) -> float:
        """Matmul FLOPs priced (GEMMs and attention) per step."""
        return self.classes["gemm"].flops + self.classes["attention"].flops

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {"model": MODEL_NAME, "calibration": self.calibration,
                "step_s": self.step_s, "low_s": self.low_s, "high_s": self.high_s,
                "classes": {k: dataclasses.asdict(v) for k, v in self.classes.items()},
                "launch_s": self.launch_s, "collective_s": self.collective_s,
                "exposed_s": self.exposed_s, "unpriced": dict(self.unpriced), "widen": self.widen,
                "inter_host_s": self.inter_host_s,
                "exposed_inter_host_s": self.exposed_inter_host_s,
                "fp8_datasheet_flops": self.fp8_datasheet_flops,
                "kernels": self.kernels, "executed_flops": self.executed_flops}  # fmt: skip


def _distance(shape: tuple[int, ...], point: list[float]) -> float:
    """Squared distance of a measured ``shape`` from ``point`` in log2 space."""
    return sum((math.log2(a) - b) ** 2 for a, b in zip(shape, point, strict=True))


def gemm_rate(
    c: Calibration, m: float, n: float, k: float, dtype: str = "bf16", cublas: bool = False
) -> float:
    """FLOP/s of an ``(m, k) @ (k, n)`` GEMM: the rate of ``c``'s measured shape nearest in
    ``(log m, log n, log k)`` (``gemm_rows``) and dtype;
    for fp32 operands where ``c`` measured none, the bf16 rate times
    ``FP32_GEMM_FACTOR``, for fp8 operands (``"f8e4m3fn"``, ``"f8e5m2"``) where it
    measured no ``"f8"`` rows, times ``FP8_GEMM_FACTOR``. ``cublas``: a cuBLAS call
    (not a Triton GEMM fusion), priced by the ``"f32-cublas"`` rows (measured with Triton
    GEMMs off) for fp32 where ``c`` has them.

    >>> from shardax.cost.calibration import H200
    >>> round(gemm_rate(H200, 8192, 8192, 2048) / 1e12)
    659
    >>> round(gemm_rate(H200, 8000, 2000, 8100) / 1e12)  # two measurements' mean
    738
    >>> gemm_rate(H200, 8192, 8192, 2048, "f8e4m3fn") / gemm_rate(H200, 8192, 8192, 2048)
    2.0
    """
    wide, fp8 = dtype in ("f32", "f64"), dtype.startswith("f8")
    rows = gemm_rows(c)
    library = [r for r in rows if r[3] == "f32-cublas"] if wide and cublas else []
    measured = library or ([r for r in rows if r[3] == "f32"] if wide else [])
    measured = measured or ([r for r in rows if r[3] == "f8"] if fp8 else [])
    factor = FP32_GEMM_FACTOR if wide and not measured else 1.0
    factor = FP8_GEMM_FACTOR if fp8 and not measured else factor
    point = [math.log2(max(x, 1.0)) for x in (m, n, k)]
    best = min(
        measured or [r for r in rows if r[3] == "bf16"], key=lambda r: _distance(r[:3], point)
    )
    return best[4] * 1e12 * factor


def collective_fit(
    c: Calibration, op: str, group: int, wire_bytes: Mapping[str, float]
) -> tuple[float, float] | None:
    """``(latency s, bytes/s)`` of ``op`` over ``group`` devices from ``c``'s fitted
    collectives (measured over one host's devices), for a collective whose bytes all stay
    within a host; None where ``c`` measured no such op at that group size.

    >>> import dataclasses
    >>> from shardax.cost.calibration import H100
    >>> mine = dataclasses.replace(H100, collectives=(("all-gather", 8, 2e-5, 3.5e11),))
    >>> collective_fit(mine, "all-gather", 8, {"intra-host": 1e6})
    (2e-05, 350000000000.0)
    >>> collective_fit(mine, "all-gather", 8, {"inter-host": 1e6}) is None  # not one host
    True
    """
    if any(v for k, v in wire_bytes.items() if k != "intra-host"):
        return None
    for fop, n, latency, bandwidth in c.collectives:
        if fop == op and n == group:
            return latency, bandwidth
    return None


def attention_seconds(c: Calibration, line: str) -> float | None:
    """Seconds of one cuDNN fused attention call (its HLO ``line``): the measured kernel
    of ``c`` nearest in (seq, heads, head_dim) with the same mask and pass (a backward
    call: the table's forward + backward less its forward), scaled by the FLOPs of the
    call over the kernel's. None for a line that is not one."""
    call = fused_attention(line)
    if call is None or not call.flops:
        return None
    flops, t, s, heads, dim = call.flops, call.seq_q, call.seq_kv, call.heads, call.head_dim
    causal, backward = call.causal, call.backward
    table: dict[tuple[int, int, int, int, bool], dict[str, float]] = {}
    for b, seq, h, d, cz, which, ms in c.attention:
        table.setdefault((b, seq, h, d, cz), {})[which] = ms
    keys = [key for key, v in table.items() if key[4] == causal and {"fwd", "fwd+bwd"} <= set(v)]
    if not keys:
        return None
    point = [math.log2(max(x, 1)) for x in (max(t, s), heads, dim)]
    key = min(keys, key=lambda r: _distance(r[1:4], point))
    b, seq, h, d, _ = key
    fwd_ms = table[key]["fwd"]
    ms = table[key]["fwd+bwd"] - fwd_ms if backward else fwd_ms
    ref = 4.0 * b * seq * seq * h * d * (2.5 if backward else 1.0) / (2 if causal else 1)
    return ms * 1e-3 * flops / ref


def _gemm_shape(index: HloIndex, instr: Instr, flops: float) -> tuple[float, float, float, str]:
    """``(m, n, k, operand dtype)`` of a GEMM instruction (or the GEMM a fusion calls)."""
    line, comp = instr.line, instr.computation
    if instr.called and instr.opcode in FUSIONS:
        inner = [i for i in index.by_comp.get(instr.called, {}).values()
                 if i.opcode in ("dot", "custom-call", "convolution")]  # fmt: skip
        if inner:
            line, comp, instr = inner[0].line, inner[0].computation, inner[0]
    out = arrays(instr.out)
    dims = out[0][1] if out else ()
    elems = math.prod(dims) if dims else 1
    batch_found = _BATCH.search(line)
    batch_axes = [int(x) for x in re.findall(r"\d+", batch_found.group(1))] if batch_found else []
    batch = math.prod(dims[i] for i in batch_axes if i < len(dims)) if dims else 1
    n = dims[-1] if dims else 1
    m = max(elems / max(batch, 1) / max(n, 1), 1.0)
    k = flops / (2.0 * elems) if elems else 1.0
    operand = instr.operands[0] if instr.operands else ""
    found = index.by_comp.get(comp, {}).get(operand) or index.by_name.get(operand)
    types = arrays(found.out) if found else []
    dtype = types[0][0] if types else (out[0][0] if out else "bf16")
    return m, n, k, dtype


def _size(text: str) -> float:
    return float(sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 4) for dtype, shape in arrays(text)))


_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
_ALIASES = frozenset({"bitcast", "reshape", "get-tuple-element"})


def moved_bytes(index: HloIndex, instr: Instr) -> float:
    """Bytes ``instr`` moves through memory: what it reads and writes. A plain op: its
    operands' and output's sizes. A fusion, from its body: a parameter read only by
    slices (``slice``, ``dynamic-slice``, ``gather``) counts the slices' bytes (a scan's
    step reads one layer of the stacked weights), one only updated in place
    (``dynamic-update-slice``'s buffer) counts nothing, and an in-place update writes
    its update, not the buffer.

    >>> index = HloIndex("ENTRY %m {\\n  %p = bf16[24,64]{1,0} parameter(0)\\n"
    ...     "  %s = bf16[1,64]{1,0} fusion(%p), kind=kLoop, calls=%f\\n}\\n%f {\\n"
    ...     "  %q = bf16[24,64]{1,0} parameter(0)\\n  ROOT %r = bf16[1,64]{1,0} slice(%q)\\n}")
    >>> index.bytes(index.by_name["s"]), moved_bytes(index, index.by_name["s"])
    (3200.0, 256.0)
    """
    body = index.by_comp.get(instr.called) if instr.called else None
    if not body:
        if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
            return 2.0 * _size(index._type(instr.computation, instr.operands[1]))
        if instr.opcode in _SLICES:
            return 2.0 * _size(instr.out)
        if instr.opcode == "copy-start" and instr.operands:  # out: (copy, source, context)
            return 2.0 * _size(index._type(instr.computation, instr.operands[0]))
        return index.bytes(instr)
    users: dict[str, list[tuple[Instr, int]]] = {}
    for op in body.values():
        for pos, name in enumerate(op.operands):
            users.setdefault(name, []).append((op, pos))

    def reads(name: str, seen: int = 0) -> float | None:  # bytes read through slices only
        total = 0.0
        for op, pos in users.get(name, []):
            if op.opcode in _ALIASES and seen < 8:
                inner = reads(op.name, seen + 1)
                if inner is None:
                    return None
                total += inner
            elif op.opcode in _SLICES and pos == 0:
                total += _size(op.out)
            elif op.opcode == "dynamic-update-slice" and pos == 0:
                continue
            else:
                return None
        return total

    read = 0.0
    for op in body.values():
        if op.opcode == "parameter":
            sliced = reads(op.name)
            read += _size(op.out) if sliced is None else sliced
    roots = [op for op in body.values() if op.line.lstrip().startswith("ROOT")]
    outs = roots[-1:] if roots else list(body.values())[-1:]
    if outs and outs[0].opcode == "tuple":
        outs = [body[o] for o in outs[0].operands if o in body]
    written = 0.0
    for op in outs:
        while op.opcode in _ALIASES and op.operands and op.operands[0] in body:
            op = body[op.operands[0]]
        if op.opcode == "dynamic-update-slice" and len(op.operands) > 1:
            written += _size(index._type(op.computation, op.operands[1]))
        else:
            written += _size(op.out)
    return read + written


def price_hlo(
    hlo: str,
    calibration: Calibration,
    *,
    name: str | None = None,
    num_devices: int | None = None,
    wire_of: Callable[[Scheduled], Mapping[str, float]] | None = None,
    link_bandwidth: Mapping[str, float | None] | None = None,
    scheduled: list[Scheduled] | None = None,
    widen: float | None = None,
    seconds_of: Callable[[Scheduled], float | None] | None = None,
) -> StepCost:
    """Prices the compiled per-device program ``hlo`` (``compiled.as_text()``) with
    ``calibration``'s tables (see the module). ``wire_of`` gives the bytes per step each
    collective moves over each link (default: all it sends, ``"intra-host"``; see
    ``shardax.cost.predict.host_share`` for a group across hosts), ``link_bandwidth``
    their bytes/s (a link without one: its collectives are left out, as in the roofline's
    prediction);
    ``name``: the calibration's name in the report (default: its own); ``scheduled``:
    ``schedule`` of ``hlo`` where the caller has it;
    ``widen``: the interval's widening (default 0.1 for a derived calibration, else 0);
    ``seconds_of``: one run's seconds of a collective where the caller priced it (a group
    across GPU hosts, level by level: ``shardax.cost.nccl.price_collective``), None
    to price it here."""
    index = HloIndex(hlo)
    c = calibration
    rows = gemm_rows(c)
    best_rate = max(r[4] for r in rows) * 1e12
    # bytes/s of memory-bound kernels, (point, fast, slow): streams, and those that reduce
    by_stream, by_reduce = (
        tuple(f(rates) * 1e9 for f in (statistics.median, max, min))
        for rates in (c.stream, c.reduce or c.stream)
    )
    skipped = {i.called for i in index.by_name.values() if i.called and i.opcode in FUSIONS}
    skipped |= set(re.findall(r"\bto_apply=%?([\w.\-]+)", hlo))
    classes = {k: ClassCost() for k in PRICED}
    unpriced: dict[str, float] = {}
    fp8_datasheet = 0.0
    fp8_measured = any(r[3] == "f8" for r in rows)
    for comp, instrs in index.by_comp.items():
        if comp in skipped:
            continue
        for instr in instrs.values():
            if instr.opcode in _NO_KERNEL or instr.opcode.endswith(("-done", "-update")):
                continue
            cls = classify(instr)
            if cls == "collectives":
                continue
            runs = float(index.runs_of(instr))
            nbytes = moved_bytes(index, instr)
            reduces = instr.opcode == "reduce" or any(op == "reduce" for op, _, _ in instr.fused)
            rates = by_reduce if reduces and cls != "gemm" else by_stream
            mem = (nbytes / rates[0], nbytes / rates[1], nbytes / rates[2])
            if cls == "attention":
                t = attention_seconds(c, instr.line)
                call = fused_attention(instr.line)
                flops = call.flops if call is not None else 0.0
                if t is None:
                    unpriced[instr.target or instr.opcode] = unpriced.get(instr.target, 0) + runs
                    classes[cls].add(runs, *mem, nbytes=nbytes)
                else:
                    classes[cls].add(runs, t, 0.8 * t, 1.2 * t, flops, nbytes)
                continue
            if cls == "gemm":
                flops = index.flops(instr)
                if flops:
                    m, n, k, dtype = _gemm_shape(index, instr, flops)
                    targets = [instr.target, *(t for _, t, _ in instr.fused)]
                    cublas = any((t or "").startswith("__cublas") for t in targets)
                    rate = gemm_rate(c, m, n, k, dtype, cublas)
                    if dtype.startswith("f8") and not fp8_measured:
                        fp8_datasheet += runs * flops
                    scale = rate / (gemm_rate(c, m, n, k) or rate)
                    classes[cls].add(runs, max(flops / rate, mem[0]),
                                     max(flops / (best_rate * scale), mem[1]),
                                     max(flops / (0.85 * rate), mem[2]), flops, nbytes)  # fmt: skip
                    continue
            if cls == "other" and instr.opcode == "custom-call":
                unpriced[instr.target] = unpriced.get(instr.target, 0.0) + runs
            classes[cls if cls in classes else "other"].add(runs, *mem, nbytes=nbytes)
    launch = sum(v.kernels for v in classes.values()) * c.launch_us * 1e-6
    wire = exposed = inter_wire = inter_exposed = 0.0
    bandwidths = link_bandwidth or {}
    for s in schedule(hlo, num_devices) if scheduled is None else scheduled:
        runs = s.collective.count
        if not runs:
            continue
        wire_bytes = wire_of(s) if wire_of is not None else {"intra-host": s.sent_bytes}
        fit = collective_fit(c, s.collective.op, s.collective.group, wire_bytes)
        given = seconds_of(s) if seconds_of is not None else None
        if given is not None:  # priced by the caller, level by level
            one = given
        elif fit is not None:  # measured on this kind's host: its latency and bandwidth
            one = fit[0] + sum(wire_bytes.values()) / runs / fit[1]
        else:
            moving = wire_seconds({k: v / runs for k, v in wire_bytes.items()}, bandwidths)
            if moving is None:  # a link it uses has no bandwidth: left out, as the roofline
                continue
            one = max((LATENCY_S.get(k, 0.0) for k, v in wire_bytes.items() if v), default=0.0)
            one += moving
        wire += one * s.collective.count
        left = exposed_seconds(s, one, best_rate)
        exposed += left
        if wire_bytes.get("inter-host"):
            inter_wire += one * s.collective.count
            inter_exposed += left
    if widen is None:
        widen = 0.1 if c.derived else 0.0
    return StepCost(calibration=name or c.name, classes=classes, launch_s=launch,
                    collective_s=wire, exposed_s=exposed, unpriced=unpriced,
                    widen=widen, inter_host_s=inter_wire,
                    exposed_inter_host_s=inter_exposed,
                    fp8_datasheet_flops=fp8_datasheet)  # fmt: skip


LABELS = {
    "gemm": "GEMMs", "attention": "attention (fused)", "elementwise": "elementwise fusions",
    "optimizer": "optimizer update", "copies": "copies and converts", "other": "other kernels",
}  # fmt: skip


def breakdown(cost: StepCost, model_flops: float | None = None) -> list[tuple[str, float, str]]:
    """The report's rows ``(label, seconds, what it was priced by)``: one per class,
    the GEMMs split into model work and the executed FLOPs beyond ``model_flops`` (per
    device: remat's recomputation and other work beyond the model's), launches,
    collectives (on the wire, and exposed).

    >>> from shardax.cost.calibration import H200
    >>> rows = breakdown(price_hlo("%d = bf16[64,64]{1,0} dot(%a, %b)", H200))
    >>> [r[0] for r in rows][-3:]
    ['kernel launches', 'collectives on the wire', 'collectives exposed (in the step)']
    """
    out = []
    for name in PRICED:
        k = cost.classes[name]
        if name == "gemm" and model_flops and cost.executed_flops > model_flops and k.flops:
            extra = min(cost.executed_flops - model_flops, k.flops) / k.flops
            out.append(("GEMMs: model work", k.seconds * (1 - extra),
                        f"{k.flops * (1 - extra):.3g} FLOPs, {k.kernels:.0f} kernels"))  # fmt: skip
            out.append(("GEMMs: beyond model FLOPs (remat, recompute)", k.seconds * extra,
                        f"{k.flops * extra:.3g} executed FLOPs"))  # fmt: skip
            continue
        basis = f"{k.flops:.3g} FLOPs" if k.flops else f"{k.bytes:.3g} B"
        out.append((LABELS[name], k.seconds, f"{basis}, {k.kernels:.0f} kernels"))
    out.append(("kernel launches", cost.launch_s, f"{cost.kernels:.0f} kernels"))
    out.append(("collectives on the wire", cost.collective_s, "latency + bytes / link"))
    out.append(("collectives exposed (in the step)", cost.exposed_s, "from the schedule"))
    if cost.inter_host_s:
        out.append(("of which across hosts, exposed", cost.exposed_inter_host_s,
                    f"from the schedule; {cost.inter_host_s * 1e3:.2f} ms on the wire, "
                    "priced level by level"))  # fmt: skip
    return out


def format_cost(cost: StepCost, model_flops: float | None = None,
                tokens: float | None = None) -> str:  # fmt: skip
    """The breakdown as text: one line per row, then the step with its interval."""
    lines = [f"{label}: {s * 1e3:.2f} ms ({basis})" for label, s, basis in
             breakdown(cost, model_flops)]  # fmt: skip
    step = (f"step {cost.step_s * 1e3:.1f} ms, interval {cost.low_s * 1e3:.1f}–"
            f"{cost.high_s * 1e3:.1f} ms ({cost.calibration})")  # fmt: skip
    if tokens:
        step += f"; {tokens / cost.step_s:,.0f} tokens/s"
    if cost.unpriced:
        names = ", ".join(f"{k} × {v:.0f}" for k, v in cost.unpriced.items())
        lines.append(f"not in the tables (priced by their bytes): {names}")
    if cost.fp8_datasheet_flops:
        lines.append(f"fp8 GEMMs ({cost.fp8_datasheet_flops:.3g} FLOPs) priced at the "
                     f"datasheet's fp8 peak, {FP8_GEMM_FACTOR:g}x the measured bf16 rates: the "
                     "tables have no fp8 rows")  # fmt: skip
    return "\n".join([*lines, step])


__all__ = ["FP8_GEMM_FACTOR", "LATENCY_S", "MODEL_NAME", "ClassCost", "StepCost",
           "attention_seconds", "breakdown", "format_cost", "gemm_rate", "price_hlo"]  # fmt: skip
