"""What one kernel of a compiled program costs by a calibration's tables: a GEMM's rate, a
fused attention call's time, a collective's fit, the bytes a memory-bound kernel moves.

The per-op model (``shardax.cost.opcost``) prices each instruction with these.

>>> from shardax.cost.calibration import H200
>>> round(gemm_rate(H200, 8192, 8192, 8192) / 1e12)
711
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from shardax.cost.hlo.kernels import fused_attention
from shardax.cost.hlo.program import DTYPE_BYTES, arrays
from shardax.cost.measurements import Calibration, gemm_rows
from shardax.cost.ops import FUSIONS, HloIndex, Instr

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
_BATCH = re.compile(r'lhs_batch_dim(?:s|ensions)\W+([\d,\s"]*)')


def _distance(shape: tuple[int, ...], point: list[float]) -> float:
    """Squared distance of a measured ``shape`` from ``point`` in log2 space."""
    return sum((math.log2(a) - b) ** 2 for a, b in zip(shape, point, strict=True))


def gemm_rate(
    c: Calibration, m: float, n: float, k: float, dtype: str = "bf16", cublas: bool = False
) -> float:
    """FLOP/s of an ``(m, k) @ (k, n)`` GEMM: the rate of ``c``'s measured shape nearest
    in ``(log m, log n, log k)`` (``gemm_rows``) and dtype; for fp32 operands where ``c``
    measured none, the bf16 rate times ``FP32_GEMM_FACTOR``, for fp8 operands
    (``"f8e4m3fn"``, ``"f8e5m2"``) where it measured no ``"f8"`` rows, times
    ``FP8_GEMM_FACTOR``. ``cublas``: a cuBLAS call (not a Triton GEMM fusion), priced by
    the ``"f32-cublas"`` rows (measured with Triton GEMMs off) for fp32 where ``c`` has
    them.

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


def gemm_shape(index: HloIndex, instr: Instr, flops: float) -> tuple[float, float, float, str]:
    """``(m, n, k, operand dtype)`` of a GEMM instruction (or the GEMM a fusion calls)."""
    line, comp = instr.line, instr.computation
    if instr.called and instr.opcode in FUSIONS:
        inner = [
            i
            for i in index.by_comp.get(instr.called, {}).values()
            if i.opcode in ("dot", "custom-call", "convolution")
        ]
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
