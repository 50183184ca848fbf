"""FLOPs of a compiled step, achieved FLOP/s and model FLOPs utilisation (MFU).

XLA's ``cost_analysis()`` of a compiled SPMD program counts the FLOPs of one device's
partitioned program, so the step's total is that times the number of devices. It counts
every operation XLA emits (elementwise ops, the optimizer update, recomputation under
remat) and not only the matmuls of a ``6·N·tokens`` estimate.

>>> compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 8)), jnp.ones((8, 2))).compile()
>>> compiled_flops(compiled)
128.0
>>> utilization(1e12, 0.5, devices=8, hardware="cpu")["mfu"]
'n/a'

Where the backend gives no cost analysis (compiling for a GPU target: ``cost_analysis()``
is None), ``hlo_flops`` counts the matmul FLOPs of the compiled HLO text itself, and
``transformer_flops_per_token`` gives the model FLOPs to compare them with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardax.cost.hardware import HARDWARE_SPECS, HardwareType, as_hardware_type, device_spec
from shardax.cost.hlo.kernels import fused_attention
from shardax.cost.hlo.program import CALL_TARGET, DEFINITION, DTYPE, call_graph, computations, runs

# The matmuls' instruction forms, and the branches of a conditional.
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
_ARRAY = re.compile(DTYPE + r"\[[\d,]*\]")


def _window(line: str) -> list[dict[str, int]]:
    """The window of a convolution ``line``, one dict per spatial dimension: ``size``,
    ``stride``, ``low`` (padding), ``base`` (lhs dilation), ``dilation`` (rhs)."""
    found = _WINDOW.search(line)
    fields = dict(f.split("=", 1) for f in found.group(1).split() if "=" in f) if found else {}
    sizes = [int(v) for v in fields.get("size", "").split("x") if v]

    def each(key: str, default: str) -> list[str]:
        parts = fields.get(key, "").split("x") if key in fields else []
        return [parts[i] if i < len(parts) else default for i in range(len(sizes))]

    return [
        {
            "size": size,
            "stride": int(stride),
            "low": int(pad.split("_")[0]),
            "base": int(base),
            "dilation": int(dilation),
        }
        for size, stride, pad, base, dilation in zip(
            sizes,
            each("stride", "1"),
            each("pad", "0_0"),
            each("lhs_dilate", "1"),
            each("rhs_dilate", "1"),
            strict=True,
        )
    ]


def _valid_positions(inputs: int, kernel: int, outputs: int, w: dict[str, int]) -> int:
    """The (output, kernel) position pairs of one spatial dimension that read an input
    element (not padding, not a hole of the lhs dilation): XLA's ``HloCostAnalysis``."""
    o = np.arange(outputs)
    count = 0
    for k in range(kernel):
        at = o * w["stride"] - w["low"] + k * w["dilation"]
        if w["base"] > 1:
            at = np.where(at % w["base"] == 0, at // w["base"], -1)
        count += int(np.count_nonzero((at >= 0) & (at < inputs)))
    return count


def conv_flops(
    lhs: tuple[int, ...],
    rhs: tuple[int, ...],
    out: tuple[int, ...],
    labels: tuple[str, str, str],
    window: list[dict[str, int]],
    feature_groups: int = 1,
    batch_groups: int = 1,
) -> float:
    """FLOPs of a convolution of input ``lhs``, kernel ``rhs`` and output ``out`` (shapes)
    laid out by ``labels`` (``dim_labels``: ``("b01f", "01io", "b01f")``), as XLA's own
    count: ``2 · input features / feature groups · output features · batch / batch groups``
    times, per spatial dimension, the (output, kernel) pairs that read an input element.
    XLA:TPU's batched matmuls written as convolutions (a batch dimension as a window
    whose every output reads one kernel position) count that dimension's size.

    >>> conv_flops((8, 16, 16, 32), (3, 3, 32, 64), (8, 16, 16, 64), ("b01f", "01io", "b01f"),
    ...            _window("window={size=3x3 pad=1_1x1_1}"))  # 'SAME': 14·3 + 2·2 per dim
    69337088.0
    """
    lhs_l, rhs_l, out_l = labels
    spatial = sorted(c for c in lhs_l if c.isdigit())
    valid = 1
    for i, c in enumerate(spatial):
        w = window[i] if i < len(window) else {"stride": 1, "low": 0, "base": 1, "dilation": 1}
        valid *= _valid_positions(lhs[lhs_l.index(c)], rhs[rhs_l.index(c)], out[out_l.index(c)], w)
    features = lhs[lhs_l.index("f")] // max(feature_groups, 1)
    batch = lhs[lhs_l.index("b")] // max(batch_groups, 1)
    return 2.0 * features * out[out_l.index("f")] * batch * valid


def _conv_line_flops(line: str, shapes: dict[str, tuple[int, ...]]) -> tuple[str, float] | None:
    """``(kind, FLOPs)`` of a ``convolution`` (kind ``"conv"``) or a cuDNN convolution
    custom call (``"cudnn-conv"``: forward, fused bias-activation, backward input or
    filter, each the forward convolution its window and labels describe: the input is
    the result of a backward-input call, the kernel that of a backward-filter call);
    None for another line or operands of unknown shape."""
    found = _CONV.search(line)
    kind = "conv"
    if found is None:
        found, kind = _CUDNN_CONV.search(line), "cudnn-conv"
    labels = _LABELS.search(line) if found else None
    if found is None or labels is None:
        return None
    out = _dims(_ARRAY.search(found.group(1)).group(0))
    names = [op.split()[-1].lstrip("%") for op in found.group(2).split(", ") if op]
    operands = [shapes.get(name) for name in names[:2]]
    lhs, rhs = operands + [None] * (2 - len(operands))
    direction = found.group(3) if kind == "cudnn-conv" else ""
    if direction == "BackwardInput":  # (output gradient, kernel) -> input gradient
        lhs, rhs, out = out, rhs, lhs
    elif direction == "BackwardFilter":  # (input, output gradient) -> kernel gradient
        lhs, rhs, out = lhs, out, rhs
    if lhs is None or rhs is None or out is None:
        return None
    groups = {k: int(v) for k, v in _GROUP_COUNT.findall(line)}
    lhs_l, rhs_l, out_l = labels.groups()
    if (len(lhs), len(rhs), len(out)) != (len(lhs_l), len(rhs_l), len(out_l)):
        return None
    flops = conv_flops(
        lhs,
        rhs,
        out,
        (lhs_l, rhs_l, out_l),
        _window(line),
        groups.get("feature", 1),
        groups.get("batch", 1),
    )
    return kind, flops


def _dims(shape: str) -> tuple[int, ...]:
    inner = shape[shape.index("[") + 1 : shape.index("]")]
    return tuple(int(d) for d in inner.split(",") if d)


def hlo_flops(hlo: str) -> float:
    """Matmul FLOPs of one device's program per run of ``hlo`` (``compiled.as_text()``):
    ``2 · output elements · contracted size`` for every ``dot`` and cuBLAS GEMM custom
    call; every ``convolution`` and cuDNN convolution call (forward, fused
    bias-activation, backward input and filter) as XLA counts a convolution
    (``conv_flops``); cuDNN's fused attention (``FusedAttention.flops`` of
    ``shardax.cost.hlo.kernels``); an op in a loop body counted its trip count times.
    Elementwise ops, reductions and custom calls of other kernels (TPU Pallas' splash
    attention: ``unpriced_calls`` names them) are not counted. A ``conditional`` counts its
    costliest branch, as XLA's own count does: an upper bound where the branch is skipped
    at run time (a context ring's blocks that a causal mask hides).

    >>> hlo_flops("%a = f32[4,8]{1,0} parameter(0)\\n%b = f32[8,2]{1,0} parameter(1)\\n"
    ...           "%d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}")
    128.0
    """
    return sum((flops * times for _, flops, times in _matmuls(hlo)), 0.0)


def library_call_flops(hlo: str) -> float:
    """The FLOPs of ``hlo``'s matmuls that are library calls (cuBLAS GEMMs, cuDNN's
    convolutions and fused attention), which XLA:GPU's ``cost_analysis()`` counts as zero;
    0 for a CPU or TPU program.

    >>> library_call_flops("%a = bf16[4,8]{1,0} parameter(0)\\n%g = (bf16[4,2]{1,0}, s8[0]{0}) "
    ...     'custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config='
    ...     '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}')
    128.0
    >>> library_call_flops("%d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}")
    0.0
    """
    return _beyond_cost_analysis(hlo)[0]


LIBRARY_KINDS = ("gemm", "cudnn-conv", "fmha")
"""The matmul kinds of ``line_matmuls`` that are library calls (custom calls)."""

# Custom calls that do no matmul work: data movement, RNG, sharding and layout markers,
# host transfers and callbacks.
NO_MATMUL_CALLS = re.compile(
    r"cu_threefry2x32|Sharding|SPMD\w+|LayoutConstraint|AllocateBuffer|PadToStatic|"
    r"SliceToDynamic|MoveTo(?:Host|Device)|annotate_device_placement|\w*python\w*callback|"
    r"__cudnn\$norm\w*|X64\w+|InspectSharding|local_sharding_constraint"
)


def unpriced_calls(hlo: str) -> dict[str, int]:
    """``{custom call target: calls}`` of ``hlo``'s custom calls whose FLOPs the count
    (``hlo_flops``) cannot price: not a cuBLAS GEMM, cuDNN convolution or attention
    call it read, nor a call known to do no matmul (``NO_MATMUL_CALLS``), e.g. a
    Pallas or Mosaic kernel (``tpu_custom_call``, ``__gpu$xla.gpu.triton``). Calls in a
    loop body count once per trip.

    >>> unpriced_calls('%k = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call"\\n'
    ...                '%r = u32[8]{0} custom-call(%a), custom_call_target="cu_threefry2x32"')
    {'tpu_custom_call': 1}
    """
    bodies, entry = computations(hlo)
    counts = runs(bodies, entry)
    found: dict[str, int] = {}
    for name, lines in bodies.items():
        priced = {index for index, _, _ in line_matmuls(lines)}
        for index, line in enumerate(lines):
            target = CALL_TARGET.search(line)
            if target is None or index in priced or NO_MATMUL_CALLS.fullmatch(target.group(1)):
                continue
            found[target.group(1)] = found.get(target.group(1), 0) + max(counts.get(name) or 1, 1)
    return found


def format_unpriced(calls: dict[str, int]) -> str:
    """The report's note for ``unpriced_calls`` (empty when there are none).

    >>> format_unpriced({"tpu_custom_call": 48})
    'FLOPs not counted: 48 custom calls the count cannot price (tpu_custom_call × 48)'
    """
    if not calls:
        return ""
    listed = ", ".join(f"{k} × {v}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]))
    return (
        f"FLOPs not counted: {sum(calls.values())} custom calls the count cannot price ({listed})"
    )


def loop_matmul_flops(hlo: str) -> float:
    """The FLOPs of ``hlo``'s XLA matmuls (``dot``, ``convolution``) in loop bodies beyond
    their first trip, which XLA's ``cost_analysis()`` leaves out: it counts a ``while``
    body once (a ``lax.scan`` of 24 layers counts one layer).

    >>> loop_matmul_flops("%a = f32[4,8]{1,0} parameter(0)\\n"
    ...                   "%d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}")
    0.0
    """
    return _beyond_cost_analysis(hlo)[1]


def _beyond_cost_analysis(hlo: str) -> tuple[float, float]:
    """``(library_call_flops, loop_matmul_flops)`` of ``hlo`` in one reading of it."""
    library = loops = 0.0
    for kind, flops, times in _matmuls(hlo):
        if kind in LIBRARY_KINDS:
            library += flops * times
        else:
            loops += flops * max(times - 1, 0)
    return library, loops


def _matmuls(hlo: str) -> Iterator[tuple[str, float, int]]:
    """``(kind, FLOPs of one run, runs)`` of each matmul of ``hlo``: kinds ``"dot"``,
    ``"conv"`` (XLA:CPU's and XLA:TPU's ``convolution``), ``"gemm"`` (a cuBLAS custom
    call), ``"cudnn-conv"`` (a cuDNN convolution), ``"fmha"`` (cuDNN's attention);
    runs: how often its computation runs per run of the program (loop trips; of a
    ``conditional``'s branches only the costliest, as XLA counts them)."""
    bodies, entry = computations(hlo)
    own = {name: list(own_matmuls(lines)) for name, lines in bodies.items()}
    calls = call_graph(bodies)  # read once, for the entry and every branch
    base = runs(bodies, entry, calls)
    counts = dict(base)
    for name, lines in bodies.items():
        for line in lines:
            found = _BRANCHES.search(line)
            if not found or not base.get(name):
                continue
            names = re.findall(r"%?([\w.\-]+)", found.group(1) or "") or found.group(2, 3)
            under = {b: runs(bodies, b, calls) for b in names if b in bodies}
            cost = {
                b: sum(f * n for c, n in r.items() for _, f in own[c]) for b, r in under.items()
            }
            keep = max(cost, key=cost.__getitem__, default=None)
            for branch, reached in under.items():
                if branch != keep:  # not run as counted: off its computations' runs
                    for c, n in reached.items():
                        counts[c] -= base[name] * n
    for name, found in own.items():
        times = max(counts[name], 0) if base.get(name) else 1  # unreached by the graph: once
        for kind, flops in found:
            yield kind, flops, times


def own_matmuls(lines: list[str]) -> Iterator[tuple[str, float]]:
    """``(kind, FLOPs)`` of each matmul written in one computation's ``lines``."""
    return ((kind, flops) for _, kind, flops in line_matmuls(lines))


def line_matmuls(lines: list[str]) -> Iterator[tuple[int, str, float]]:
    """``(line index, kind, FLOPs)`` of each matmul written in one computation's ``lines``
    (kinds as ``_matmuls``'s; a fusion's matmuls are in the computation it calls)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for line in lines:
        found = DEFINITION.match(line)
        if found and not found.group(2).startswith("("):
            shapes[found.group(1)] = _dims(found.group(2))
    for index, line in enumerate(lines):
        conv = _conv_line_flops(line, shapes)
        if conv is not None:
            yield index, *conv
            continue
        fmha = fused_attention(line)
        if fmha is not None:
            yield index, "fmha", fmha.flops
            continue
        dot, gemm = _DOT.search(line), _GEMM.search(line)
        if not (dot or gemm):
            continue
        out = _dims(dot.group(1) if dot else gemm.group(1))
        lhs = shapes.get(dot.group(2) if dot else gemm.group(2))
        contract = _CONTRACT.search(line)
        if lhs is None or contract is None:
            continue
        axes = [int(d) for d in re.findall(r"\d+", contract.group(1))]
        k = math.prod(lhs[a] for a in axes if a < len(lhs))
        yield index, ("dot" if dot else "gemm"), 2.0 * math.prod(out) * k


def transformer_flops_per_token(
    non_embedding_params: float,
    layers: int,
    seq_len: int,
    d_model: int,
    causal: bool = True,
) -> float:
    """Model training FLOPs per token of a dense decoder, by the convention MaxText, PaLM
    and Megatron count MFU with (``shardax.cost.model_flops.CONVENTION``): ``6·N``
    for the matmuls over ``N`` parameters without the embedding lookup (a gather), the LM
    head included (forward 2·N, backward 4·N), plus attention's scores and weighted
    values, ``3 · 4·layers·seq_len·d_model``, halved when ``causal`` (the masked half is
    not model work, though a dense kernel computes it).

    >>> transformer_flops_per_token(100, layers=1, seq_len=4, d_model=8, causal=False)
    984.0
    >>> transformer_flops_per_token(100, layers=1, seq_len=4, d_model=8)
    792.0
    """
    attention = 3.0 * 4 * layers * seq_len * d_model
    return 6.0 * non_embedding_params + (attention / 2 if causal else attention)


def compiled_flops(compiled: Any, hlo: str | None = None) -> float | None:
    """FLOPs of one device's program in ``compiled`` (a ``jax.stages.Compiled``): XLA's
    ``cost_analysis()``, plus the matmuls it counts as zero, cuBLAS GEMMs and cuDNN's
    attention on a GPU (``library_call_flops``; on an H200 with JAX 0.11.2, XLA's
    count alone was 0.08% of a 90-layer MLP step's 6·N·batch), and the loop trips of
    matmuls it counts once (``loop_matmul_flops``). None when the backend gives no
    cost analysis (a compile-only GPU target: use ``hlo_flops``). ``hlo``: the
    program's ``compiled.as_text()``, when the caller read it already (it is read once)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    text = compiled.as_text() if hlo is None else hlo
    return float(analysis["flops"]) + sum(_beyond_cost_analysis(text))


def utilization(
    flops_per_step: float | None,
    step_seconds: float,
    devices: int,
    hardware: HardwareType | str | None = None,
) -> dict[str, Any]:
    """Achieved TFLOP/s per device and MFU of a step of ``flops_per_step`` FLOPs (over all
    ``devices``) that takes ``step_seconds``.

    MFU is achieved FLOP/s over the dense bf16 peak of ``hardware``
    (``HARDWARE_SPECS``) or, by default, of the first device
    ([`device_spec`][shardax.cost.device_spec], which also knows kinds such as the H200);
    ``"n/a"`` where the peak is not known (CPU, unknown accelerators). Returns
    ``flops_per_step``, ``tflops_per_s_per_device``, ``peak_tflops_per_device`` (or
    "n/a") and ``mfu``.
    """
    spec = (
        device_spec()
        if hardware is None
        else HARDWARE_SPECS.get(as_hardware_type("hardware", hardware))
    )
    if flops_per_step is None or not step_seconds > 0:
        achieved = None
    else:
        achieved = flops_per_step / devices / step_seconds
    return {
        "flops_per_step": flops_per_step,
        "tflops_per_s_per_device": None if achieved is None else achieved / 1e12,
        "peak_tflops_per_device": "n/a" if spec is None else spec.peak_flops / 1e12,
        "mfu": "n/a" if spec is None or achieved is None else achieved / spec.peak_flops,
    }


def format_utilization(u: dict[str, Any]) -> str:
    """One line: FLOPs per step, TFLOP/s per device, MFU."""
    if u["flops_per_step"] is None:
        return "FLOPs: not reported by this backend"
    mfu = u["mfu"] if isinstance(u["mfu"], str) else f"{u['mfu']:.1%}"
    return (
        f"{u['flops_per_step']:.3g} FLOPs/step (compiled), "
        f"{u['tflops_per_s_per_device']:.3g} TFLOP/s per device, MFU {mfu}"
    )
