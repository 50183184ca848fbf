"""A profiler trace of a compiled training step, read into a table of time per op class.

:func:`capture` runs a few steps under ``jax.profiler.trace``; :func:`op_table` reads the
trace (``jax.profiler.ProfileData``), maps each kernel to its instruction of the compiled
HLO (``compiled.as_text()``) and sums its time into one of these classes:

- ``gemm``: ``dot``/``convolution``, cuBLAS(Lt) custom calls, fusions with a matmul inside
  (Triton GEMMs, XLA:CPU's YNNPACK dots), kernels named like a GEMM (``nvjet``, ``xmma``);
- ``attention``: cuDNN's fused attention (``__cudnn$fmha*``), kernels named flash/fmha/sdpa;
- ``optimizer``: ops whose metadata ``op_name`` holds the ``optimizer`` scope
  (``sx.TrainState.apply_gradients`` runs the update under ``jax.named_scope("optimizer")``);
- ``copies``: copies and converts: copy, transpose, fusions of only converts, bitcasts,
  broadcasts, slices and other data movement, memcpy and memset;
- ``collectives``: all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all,
  NCCL kernels;
- ``elementwise``: the other fusions and plain ops (loop, input, reduction);
- ``other``: control flow, unknown custom calls, kernels mapped to nothing;
- ``idle``: the traced window (first kernel's start to last kernel's end) less the union
  of the kernels' intervals.

The classes' sum is then the traced window per step (plus the time kernels overlap on
several streams): ``sum_over_step`` sets it against the step time measured without the
profiler, a check that the trace shows the step as it runs.

Each class's time stands beside its floor: FLOPs ÷ ``matmul_tflops`` for ``gemm`` and
``attention`` (the HLO's matmul FLOPs, ``shardax.cost.flops``; cuDNN attention from its
shapes, halved when causal), bytes ÷ ``bandwidth_gbs`` for the others (each instruction's
operands and outputs, from the HLO's shapes: an upper bound on what an in-place update or
a fusion reading a slice must move, so its floor can exceed its time).

Where the kernels run: on a GPU, the plane ``/device:GPU:<n>`` has one line per CUDA
stream (``Stream #<id>(<kinds>)``), one event per kernel or memcpy/memset, each with the
stats ``hlo_op``, ``hlo_module``, ``program_id`` (XLA's thunk annotation parsed by the CUPTI
collector). On the CPU the ops are events of the ``/host:CPU`` plane's XLA threads (lines
``tf_XLAEigen/...``, ``tf_XLAPjRtCpuClient/...``), named as their instruction, with the
stats ``hlo_op``, ``hlo_module``, ``device_ordinal``, ``run_id``.

    xplane = capture(lambda: run_three_steps(), "runs/trace")
    table = op_table(xplane, compiled.as_text(), steps=3, step_seconds=0.41,
                     matmul_tflops=700.0, bandwidth_gbs=4000.0)
    print(markdown(table))
"""

from __future__ import annotations

import math
import re
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardax.cost.ops import (
    CLASSES,
    FLOP_CLASSES,
    LABELS,
    HloIndex,
    Instr,
    classify,
    op_name,
    program_flops,
)

_GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm\d+_.*_tn|wgmma", re.I)
_ATTENTION_KERNEL = re.compile(r"flash|fmha|sdpa|attention", re.IGNORECASE)
_COLLECTIVE_KERNEL = re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter", re.I)
_COPY_KERNEL = re.compile(r"^(memcpy|memset)|^cuda(memcpy|memset)", re.IGNORECASE)
_STREAM_LINE = re.compile(r"^Stream #")
_DERIVED_LINES = {
    "XLA Modules", "XLA Ops", "Steps", "Framework Ops", "Framework Name Scope",
    "Source code", "XLA TraceMe", "_counters_", "CUPTI overhead", "Launch Stats",
    "Async XLA Ops", "TensorFlow Name Scope", "TensorFlow Ops",
}  # fmt: skip


def capture(run_steps: Callable[[], None], logdir: str | Path) -> Path:
    """Runs ``run_steps()`` (which runs N steps and blocks until they are ready) under
    ``jax.profiler`` tracing into ``logdir``; returns the ``.xplane.pb`` it wrote.

    The Python tracer is off (``python_tracer_level=0``: less host overhead, a smaller
    file), the host's tracer at its default (XLA:CPU's op events are host events). Raises
    ``RuntimeError`` when the profiler wrote no ``.xplane.pb``."""
    import jax

    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    began = time.time()
    options = None
    try:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
    except Exception:  # an older JAX: its defaults
        options = None
    try:
        jax.profiler.start_trace(str(logdir), profiler_options=options)
    except TypeError:  # no profiler_options argument
        jax.profiler.start_trace(str(logdir))
    try:
        run_steps()
    finally:
        jax.profiler.stop_trace()
    found = [p for p in logdir.glob("plugins/profile/*/*.xplane.pb")]
    fresh = [p for p in found if p.stat().st_mtime >= began - 1] or found
    if not fresh:
        raise RuntimeError(f"the profiler wrote no .xplane.pb under {logdir}")
    return max(fresh, key=lambda p: p.stat().st_mtime)


def classify_kernel(name: str) -> str:
    """The class of a kernel no HLO instruction names, by its name."""
    if _COPY_KERNEL.search(name):
        return "copies"
    if _COLLECTIVE_KERNEL.search(name):
        return "collectives"
    if _ATTENTION_KERNEL.search(name):
        return "attention"
    if _GEMM_KERNEL.search(name):
        return "gemm"
    if "fusion" in name or name.startswith(("loop_", "input_", "wrapped_")):
        return "elementwise"
    return "other"


# -------------------------------------------------------------------------- the trace


@dataclass
class Event:
    """One kernel (or XLA:CPU op) of the trace."""

    name: str
    start: float  # ns
    end: float
    hlo_op: str
    module: str
    line: int
    self_ns: float = 0.0


def _stats(event: Any) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():  # Python 3.12 on the trace's pybind type, harmless:
            warnings.simplefilter("ignore", DeprecationWarning)  # "has no __module__"
            return dict(event.stats)
    except Exception:
        return {}


_NOT_KERNELS = ("memalloc_details", "memfree_details", "memory_residency_details")
_NOT_KERNEL_NAMES = re.compile(
    r"^(NVTX:|Memory(Alloc|Free|Residency)$|Overhead$|UnifiedMemory$|Host(Un)?[Rr]egister$)"
)


def _events_of(line: Any, index: int, keep: Callable[[dict[str, Any]], bool]) -> list[Event]:
    """The events of ``line`` that ``keep`` keeps, less CUPTI's records of allocations,
    NVTX ranges and overhead (not kernels), and instants."""
    out = []
    for e in line.events:
        stats = _stats(e)
        if not keep(stats) or _NOT_KERNEL_NAMES.match(e.name):
            continue
        if any(k in stats for k in _NOT_KERNELS):
            continue
        start, duration = float(e.start_ns), float(e.duration_ns)
        if duration <= 0:
            continue
        out.append(Event(e.name, start, start + duration, str(stats.get("hlo_op", "") or ""),
                         str(stats.get("hlo_module", "") or ""), index))  # fmt: skip
    return out


def _set_self_times(events: list[Event]) -> None:
    """Each event's own time: its duration less that of the events nested in it on the
    same line (XLA:CPU's ``while`` holds its body's ops; GPU kernels do not nest)."""
    by_line: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_line[e.line].append(e)
    for line in by_line.values():
        line.sort(key=lambda e: (e.start, -e.end))
        stack: list[Event] = []
        for e in line:
            e.self_ns = e.end - e.start
            while stack and stack[-1].end <= e.start:
                stack.pop()
            if stack and e.end <= stack[-1].end:
                stack[-1].self_ns -= e.end - e.start
            stack.append(e)
        for e in line:
            e.self_ns = max(e.self_ns, 0.0)


def _union_ns(events: list[Event]) -> float:
    spans = sorted((e.start, e.end) for e in events)
    total, cur_start, cur_end = 0.0, None, None
    for s, t in spans:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def read_events(xplane: str | Path, device: int = 0) -> tuple[list[Event], str, list[str]]:
    """The kernels of one device in the trace: ``(events, where, notes)``.

    A GPU (or other accelerator) plane ``/device:<KIND>:<device>``: its stream lines
    (``Stream #...``), else its ``XLA Ops`` line, else every line not derived by the
    profile's viewers. No device plane with events: the ``/host:CPU`` plane's events
    with an ``hlo_op`` stat and ``device_ordinal == device`` (XLA:CPU)."""
    from jax.profiler import ProfileData

    notes: list[str] = []
    data = ProfileData.from_file(str(xplane))
    planes = list(data.planes)
    devices = [p for p in planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
    wanted = [p for p in devices if re.search(rf":{device}$", p.name)]
    for plane in wanted + [p for p in devices if p not in wanted]:
        lines = list(plane.lines)
        chosen = [ln for ln in lines if _STREAM_LINE.match(ln.name)]
        if not chosen:
            chosen = [ln for ln in lines if ln.name == "XLA Ops"]
        if not chosen:
            chosen = [ln for ln in lines if ln.name not in _DERIVED_LINES]
        events = [e for i, ln in enumerate(chosen) for e in _events_of(ln, i, lambda s: True)]
        if events:
            if plane not in wanted:
                notes.append(f"no events on device {device}: read {plane.name}")
            where = f"{plane.name}: lines " + ", ".join(sorted({ln.name for ln in chosen}))
            return events, where, notes
    for plane in planes:
        if plane.name != "/host:CPU":
            continue

        def keep(stats: dict[str, Any]) -> bool:
            try:
                return "hlo_op" in stats and int(stats.get("device_ordinal", device)) == device
            except (TypeError, ValueError):
                return "hlo_op" in stats

        lines = list(plane.lines)
        events = [e for i, ln in enumerate(lines) for e in _events_of(ln, i, keep)]
        if events:
            return events, "/host:CPU: XLA ops on host threads", notes
    names = ", ".join(p.name for p in planes)
    notes.append(f"no kernel events found (planes: {names})")
    return [], "", notes


# -------------------------------------------------------------------------- the table


def _short(op_name: str, width: int = 90) -> str:
    """``jit(whole)/jit(main)/transpose(jvp(blocks))/dot_general`` without its leading
    ``jit(...)`` segments, cut to ``width`` from the left."""
    parts = op_name.split("/")
    while len(parts) > 1 and re.fullmatch(r"(pjit|jit)\([^/]*\)", parts[0]):
        parts = parts[1:]
    text = "/".join(parts)
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def op_table(
    xplane: str | Path,
    hlo_text: str,
    *,
    steps: int,
    step_seconds: float,
    matmul_tflops: float | None = None,
    bandwidth_gbs: float | None = None,
    device: int = 0,
    top: int = 15,
) -> dict[str, Any]:
    """The time per op class of ``steps`` steps traced in ``xplane`` (from
    :func:`capture`) of the program ``hlo_text`` (``compiled.as_text()``), per step,
    beside each class's floor; see the module docstring.

    Returns a JSON-serialisable dict: ``classes`` (per class: ``ms_per_step``, ``share``
    of their sum, ``kernels_per_step``, ``flops_per_step``, ``bytes_per_step``,
    ``floor_ms_per_step``, ``floor_basis``, ``time_over_floor``), ``sum_ms`` (the
    classes, idle included) and ``sum_over_step`` (over ``step_seconds``: 1 when the
    traced steps took the time measured without the profiler; above by the time
    kernels overlap on several streams; ``adds_up``: within 10%),
    ``busy_ms_per_step`` (the union of kernel intervals), ``overlap_ms_per_step``,
    ``traced_step_ms`` (the traced window over ``steps``), ``top_ops`` (the ``top`` ops
    by time: ``name`` (the HLO instruction), ``class``, ``ms_per_step``,
    ``floor_ms_per_step``, ``kernels_per_step``, ``kernel`` (a kernel's name),
    ``op_name`` (its metadata, shortened)) and ``notes``.
    Never raises: what went wrong is in ``notes``, with what could be read."""
    notes: list[str] = []
    step_ms = float(step_seconds) * 1e3 if step_seconds and step_seconds > 0 else None
    out: dict[str, Any] = {
        "trace": str(xplane), "device": "", "module": "", "steps": steps, "step_ms": step_ms,
        "matmul_tflops": matmul_tflops, "bandwidth_gbs": bandwidth_gbs,
        "classes": {c: _empty_row() for c in CLASSES}, "top_ops": [], "notes": notes,
    }  # fmt: skip
    try:
        if not steps or steps < 1:
            notes.append(f"steps={steps!r}: per-step figures use 1")
            steps = 1
        try:
            index = HloIndex(hlo_text or "")
            out["module"] = index.module
            if not index.by_name:
                notes.append("no instructions parsed from hlo_text: classes from kernel names")
        except Exception as e:
            notes.append(f"HLO not parsed ({type(e).__name__}: {e}); classes from kernel names")
            index = HloIndex("")
        events, where, read_notes = read_events(xplane, device)
        notes.extend(read_notes)
        out["device"] = where
        if not events:
            return out
        _fill(out, index, events, steps, step_ms, matmul_tflops, bandwidth_gbs, top)
    except Exception as e:
        notes.append(f"{type(e).__name__}: {e} at {traceback.format_exc(limit=-2)[-600:]}")
    return out


def _empty_row() -> dict[str, Any]:
    return {"ms_per_step": 0.0, "share": 0.0, "kernels_per_step": 0.0, "flops_per_step": 0.0,
            "bytes_per_step": 0.0, "floor_ms_per_step": None, "floor_basis": None,
            "time_over_floor": None}  # fmt: skip


def _fill(
    out: dict[str, Any],
    index: HloIndex,
    events: list[Event],
    steps: int,
    step_ms: float | None,
    matmul_tflops: float | None,
    bandwidth_gbs: float | None,
    top: int,
) -> None:
    notes: list[str] = out["notes"]
    _set_self_times(events)
    window = max(e.end for e in events) - min(e.start for e in events)
    busy = _union_ns(events)
    total_self = sum(e.self_ns for e in events)
    per = 1e-6 / steps  # ns over the window -> ms per step
    classes = out["classes"]
    ops: dict[str, dict[str, Any]] = {}
    instr_class: dict[str, tuple[Instr, str]] = {}
    modules: dict[str, float] = defaultdict(float)
    unmapped = 0.0
    for e in events:
        instr = index.lookup(e.hlo_op, e.name)
        if _COPY_KERNEL.search(e.name):
            cls = "copies"
        elif instr is not None:
            cls = classify(instr)
            instr_class.setdefault(instr.name, (instr, cls))
        else:
            cls = classify_kernel(e.name)
            unmapped += e.self_ns
        if e.module and index.module and e.module != index.module:
            modules[e.module] += e.self_ns
        row = classes[cls]
        row["ms_per_step"] += e.self_ns * per
        row["kernels_per_step"] += 1 / steps
        key = instr.name if instr is not None else e.name
        op = ops.setdefault(key, {"name": key, "class": cls, "ms_per_step": 0.0,
                                  "kernels_per_step": 0.0, "kernel": e.name[:80],
                                  "op_name": _short(op_name(instr)) if instr else ""})  # fmt: skip
        op["ms_per_step"] += e.self_ns * per
        op["kernels_per_step"] += 1 / steps
    for instr, cls in instr_class.values():
        runs = index.runs_of(instr)
        try:
            classes[cls]["bytes_per_step"] += index.bytes(instr) * runs
        except Exception as e:  # one op's price, not the table
            notes.append(f"{instr.name} not priced: {type(e).__name__}: {e}")
    # The matmul classes' floors are the whole program's work, whether or not the trace
    # names each kernel's instruction (XLA:GPU's command buffers run cuBLAS and cuDNN
    # kernels under the command buffer's name).
    for cls, flops in program_flops(index).items():
        classes[cls]["flops_per_step"] = flops
    busy_ms, traced = busy * per, window * per
    if step_ms is None or not step_ms > 0:
        notes.append("no step time given: the traced window's is used")
        step_ms = out["step_ms"] = traced
    classes["idle"]["ms_per_step"] = traced - busy_ms
    sum_ms = sum(row["ms_per_step"] for row in classes.values())
    for name, row in classes.items():
        row["share"] = row["ms_per_step"] / sum_ms if sum_ms > 0 else None
        if name == "idle":
            continue
        if name in FLOP_CLASSES:
            rate, amount, basis = matmul_tflops, row["flops_per_step"], "flops"
            floor = amount / (rate * 1e12) * 1e3 if rate else None
        else:
            rate, amount, basis = bandwidth_gbs, row["bytes_per_step"], "bytes"
            floor = amount / (rate * 1e9) * 1e3 if rate else None
        row["floor_basis"] = basis
        row["floor_ms_per_step"] = floor
        if floor:
            row["time_over_floor"] = row["ms_per_step"] / floor
    if "collectives" in classes and classes["collectives"]["ms_per_step"]:
        notes.append("collectives' floor is bytes ÷ the copy bandwidth, not the interconnect's")
    out.update(
        events=len(events),
        traced_step_ms=traced,
        busy_ms_per_step=busy_ms,
        overlap_ms_per_step=(total_self - busy) * per,
        unmapped_ms_per_step=unmapped * per,
        sum_ms=sum_ms,
        sum_over_step=sum_ms / step_ms if step_ms > 0 else None,
        adds_up=bool(step_ms > 0 and abs(sum_ms / step_ms - 1) <= 0.1),
        other_modules={k: v * per for k, v in sorted(modules.items())},
    )
    ranked = sorted(ops.values(), key=lambda o: -o["ms_per_step"])[:top]
    for op in ranked:
        op["floor_ms_per_step"] = None
        found = instr_class.get(op["name"])
        if found is None:
            continue
        try:
            instr, cls = found
            if cls in FLOP_CLASSES and matmul_tflops:
                amount = index.flops(instr) * index.runs_of(instr)
                op["floor_ms_per_step"] = amount / (matmul_tflops * 1e12) * 1e3
            elif cls not in FLOP_CLASSES and bandwidth_gbs:
                amount = index.bytes(instr) * index.runs_of(instr)
                op["floor_ms_per_step"] = amount / (bandwidth_gbs * 1e9) * 1e3
        except Exception:  # one op's floor, not the table
            pass
    out["top_ops"] = ranked
    if abs(sum_ms / step_ms - 1) > 0.1:
        notes.append(
            f"the classes sum to {sum_ms:.3f} ms per step against the {step_ms:.3f} ms step "
            f"time given: the traced window is {traced:.3f} ms per step (tracing overhead, "
            f"or gaps around the steps), kernels overlap {(total_self - busy) * per:.3f} ms"
        )
    if unmapped > 0.05 * total_self:
        notes.append(
            f"{unmapped * per:.3f} ms per step of kernels map to no HLO instruction: "
            "classed by kernel name"
        )


# ---------------------------------------------------------------------------- markdown


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, spec) if isinstance(x, int | float) else str(x)


def markdown(table: dict[str, Any]) -> str:
    """``table`` (from :func:`op_table`) as markdown: the classes beside their floors,
    the top ops, the notes."""
    try:
        lines = [
            f"Device: {table.get('device') or '?'}; module {table.get('module') or '?'}; "
            f"{table.get('steps')} steps traced, step {_fmt(table.get('step_ms'))} ms "
            f"(traced window {_fmt(table.get('traced_step_ms'))} ms per step); classes sum "
            f"to {_fmt(table.get('sum_over_step'), '.1%')} of the step (kernels overlap "
            f"{_fmt(table.get('overlap_ms_per_step'))} ms per step).",
            "",
            "| class | ms/step | share | kernels/step | floor ms | floor from | time/floor |",
            "|---|---:|---:|---:|---:|---|---:|",
        ]
        rates = {"flops": table.get("matmul_tflops"), "bytes": table.get("bandwidth_gbs")}
        for name in CLASSES:
            row = table.get("classes", {}).get(name)
            if row is None:
                continue
            basis = row.get("floor_basis")
            if basis == "flops":
                source = f"{row['flops_per_step']:.3g} FLOP ÷ {_fmt(rates['flops'], '.4g')} TF/s"
            elif basis == "bytes":
                source = f"{row['bytes_per_step']:.3g} B ÷ {_fmt(rates['bytes'], '.4g')} GB/s"
            else:
                source = ""
            lines.append(
                f"| {LABELS.get(name, name)} | {_fmt(row.get('ms_per_step'))} | "
                f"{_fmt(row.get('share'), '.1%')} | {_fmt(row.get('kernels_per_step'), '.1f')} | "
                f"{_fmt(row.get('floor_ms_per_step'))} | {source} | "
                f"{_fmt(row.get('time_over_floor'), '.2f')} |"
            )
        lines.append(
            f"| **sum** | {_fmt(table.get('sum_ms'))} | {_fmt(table.get('sum_over_step'), '.1%')}"
            " | | | | |"
        )
        if table.get("top_ops"):
            lines += ["", "| op | class | ms/step | floor ms | kernels/step | op_name |",
                      "|---|---|---:|---:|---:|---|"]  # fmt: skip
            for op in table["top_ops"]:
                name = str(op.get("name", "")).replace("|", "\\|")[:60]
                op_name = str(op.get("op_name", "")).replace("|", "\\|")
                lines.append(
                    f"| `{name}` | {op.get('class')} | {_fmt(op.get('ms_per_step'))} | "
                    f"{_fmt(op.get('floor_ms_per_step'))} | "
                    f"{_fmt(op.get('kernels_per_step'), '.1f')} | {op_name} |"
                )
        if table.get("notes"):
            lines += ["", *(f"- {n}" for n in table["notes"])]
        return "\n".join(lines)
    except Exception as e:  # a table from elsewhere, or an older one
        return f"(op table not rendered: {type(e).__name__}: {e})"
