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

import re
import statistics
from collections.abc import Callable, Mapping

from shardax.cost.hlo.kernels import fused_attention
from shardax.cost.kernel_prices import (
    LATENCY_S,
    attention_seconds,
    collective_fit,
    gemm_rate,
    gemm_shape,
    moved_bytes,
)
from shardax.cost.measurements import Calibration, gemm_rows
from shardax.cost.ops import FUSIONS, HloIndex, classify
from shardax.cost.predict import wire_seconds
from shardax.cost.schedule import FREE, Scheduled, exposed_seconds, schedule
from shardax.cost.step_cost import PRICED, ClassCost, StepCost

# schedule.FREE's ops, and the control flow and async wrappers whose bodies are priced op by op
_NO_KERNEL = (FREE - {"copy-start"}) | {
    "while",
    "call",
    "conditional",
    "async-start",
    "async-update",
    "async-done",
}


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
    prediction); ``name``: the calibration's name in the report (default: its own);
    ``scheduled``: ``schedule`` of ``hlo`` where the caller has it; ``widen``: the
    interval's widening (default 0.1 for a derived calibration, else 0); ``seconds_of``:
    one run's seconds of a collective where the caller priced it (a group across GPU
    hosts, level by level: ``shardax.cost.nccl.price_collective``), None to price it
    here."""
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
    fp8_datasheet = fp8_priced = 0.0  # fp8 GEMM FLOPs at the datasheet's ratio, by fp8 rows
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
                    m, n, k, dtype = gemm_shape(index, instr, flops)
                    targets = [instr.target, *(t for _, t, _ in instr.fused)]
                    cublas = any((t or "").startswith("__cublas") for t in targets)
                    rate = gemm_rate(c, m, n, k, dtype, cublas)
                    if dtype.startswith("f8") and fp8_measured:
                        fp8_priced += runs * flops
                    elif dtype.startswith("f8"):
                        fp8_datasheet += runs * flops
                    scale = rate / (gemm_rate(c, m, n, k) or rate)
                    classes[cls].add(
                        runs,
                        max(flops / rate, mem[0]),
                        max(flops / (best_rate * scale), mem[1]),
                        max(flops / (0.85 * rate), mem[2]),
                        flops,
                        nbytes,
                    )
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
    return StepCost(
        calibration=name or c.name,
        classes=classes,
        launch_s=launch,
        collective_s=wire,
        exposed_s=exposed,
        unpriced=unpriced,
        widen=widen,
        inter_host_s=inter_wire,
        exposed_inter_host_s=inter_exposed,
        fp8_datasheet_flops=fp8_datasheet,
        fp8_measured_flops=fp8_priced,
    )
