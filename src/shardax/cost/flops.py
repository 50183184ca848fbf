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
is None), :func:`hlo_flops` counts the matmul FLOPs of the compiled HLO text itself, and
:func:`transformer_flops_per_token` gives the model FLOPs to compare them with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

from shardax.cost.hardware import HARDWARE_SPECS, HardwareType, as_hardware_type, device_spec
from shardax.cost.hlo import _computations, _runs

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|[a-z]+\d*\[[\d,]*\]\S*) ")
_DOT = re.compile(r"= (\S+) dot\(%?([\w.\-]+), %?([\w.\-]+)\)(.*)$")
# A cuBLAS call's result is a tuple (the product, a workspace): the first shape is its.
_GEMM = re.compile(
    r"= \(?(\w+\[[\d,]*\])[^=]*? custom-call\(%?([\w.\-]+), .*__cublas\$(?:\w*gemm|lt\$matmul)"
)
_CONV = re.compile(r"= (\S+) convolution\(%?([\w.\-]+), %?([\w.\-]+)\).*?dim_labels=(\w+)_")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_BRANCHES = re.compile(
    r"\bbranch_computations=\{([^}]*)\}"
    r"|\btrue_computation=%?([\w.\-]+), false_computation=%?([\w.\-]+)"
)


def _window_taps(line: str) -> int:
    """The window positions a TPU ``convolution`` really sums over: its size in each
    spatial dimension that is a plain contraction; a dimension with padding, dilation,
    stride or reversal is XLA:TPU's way of writing a batch dimension (one tap)."""
    found = _WINDOW.search(line)
    if not found:
        return 1
    fields = dict(f.split("=", 1) for f in found.group(1).split() if "=" in f)
    sizes = [int(v) for v in fields.get("size", "1").split("x")]
    taps = 1
    plain = {"pad": "0_0", "lhs_dilate": "1", "rhs_dilate": "1", "stride": "1",
             "rhs_reversal": "0"}  # fmt: skip
    for i, size in enumerate(sizes):
        for key, ok in plain.items():
            parts = fields.get(key, ok).split("x")
            if (parts[i] if i < len(parts) else ok) != ok:
                break
        else:
            taps *= size
    return taps


_CONTRACT = re.compile(r"lhs_contracting_dim(?:s|ensions)\W+([\d,\s\"]*)")


def _dims(shape: str) -> tuple[int, ...]:
    inner = shape[shape.index("[") + 1 : shape.index("]")]
    return tuple(int(d) for d in inner.split(",") if d)


_FMHA = re.compile(
    r'custom_call_target="__cudnn\$fmha(\w*)".*?operand_layout_constraints=\{(.*?\})\}'
)
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _fmha_flops(line: str) -> float:
    """cuDNN flash attention's matmul FLOPs (``__cudnn$fmha*`` custom call, BTNH layout):
    ``2·B·N·T·S·H`` per matmul, 2 forward (scores, weighted values) and 5 backward (the
    scores recomputed, then dV, dP, dQ, dK); halved for a causal mask, whose masked
    blocks the kernel skips. 0 for a line that is not one."""
    found = _FMHA.search(line)
    if not found:
        return 0.0
    shapes = [tuple(int(d) for d in m.split(",") if d) for m in _SHAPE.findall(found.group(2))]
    if len(shapes) < 2 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        return 0.0
    (b, t, n, h), s = shapes[0], shapes[1][1]
    matmuls = 5 if "Backward" in found.group(1) else 2
    causal = 0.5 if "CAUSAL" in line.upper() else 1.0
    return 2.0 * b * n * t * s * h * matmuls * causal


def hlo_flops(hlo: str) -> float:
    """Matmul FLOPs of one device's program per run of ``hlo`` (``compiled.as_text()``):
    ``2 · output elements · contracted size`` for every ``dot`` (and cuBLAS GEMM custom
    call, and XLA:TPU's ``convolution``: ``2 · output · lhs features · window taps``), and
    cuDNN's fused attention (:func:`_fmha_flops`), an op in a loop body counted its trip
    count times. Elementwise ops, reductions and TPU Pallas kernels (splash attention) are
    not counted. A ``conditional`` counts its costliest branch, as XLA's own count does: an
    upper bound where the branch is skipped at run time (a context ring's blocks that a
    causal mask hides).

    >>> hlo_flops("%a = f32[4,8]{1,0} parameter(0)\\n%b = f32[8,2]{1,0} parameter(1)\\n"
    ...           "%d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}")
    128.0
    """
    return sum((flops * times for _, flops, times in _matmuls(hlo)), 0.0)


def library_call_flops(hlo: str) -> float:
    """The FLOPs of ``hlo``'s matmuls that are library calls (cuBLAS GEMMs, cuDNN's fused
    attention), which XLA:GPU's ``cost_analysis()`` counts as zero; 0 for a CPU or TPU
    program.

    >>> library_call_flops("%a = bf16[4,8]{1,0} parameter(0)\\n%g = (bf16[4,2]{1,0}, s8[0]{0}) "
    ...     'custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config='
    ...     '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}')
    128.0
    >>> library_call_flops("%d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}")
    0.0
    """
    return _beyond_cost_analysis(hlo)[0]


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
        if kind in ("gemm", "fmha"):
            library += flops * times
        else:
            loops += flops * max(times - 1, 0)
    return library, loops


def _matmuls(hlo: str) -> Iterator[tuple[str, float, int]]:
    """``(kind, FLOPs of one run, runs)`` of each matmul of ``hlo``: kinds ``"dot"``,
    ``"conv"`` (XLA:TPU), ``"gemm"`` (a cuBLAS custom call), ``"fmha"`` (cuDNN's
    attention); runs: how often its computation runs per run of the program (loop
    trips; of a ``conditional``'s branches only the costliest, as XLA counts them)."""
    bodies, entry = _computations(hlo)
    own = {name: list(_own_matmuls(lines)) for name, lines in bodies.items()}
    base = _runs(bodies, entry)
    runs = dict(base)
    for name, lines in bodies.items():
        for line in lines:
            found = _BRANCHES.search(line)
            if not found or not base.get(name):
                continue
            names = re.findall(r"%?([\w.\-]+)", found.group(1) or "") or found.group(2, 3)
            under = {b: _runs(bodies, b) for b in names if b in bodies}
            cost = {
                b: sum(f * n for c, n in r.items() for _, f in own[c]) for b, r in under.items()
            }
            keep = max(cost, key=cost.__getitem__, default=None)
            for branch, reached in under.items():
                if branch != keep:  # not run as counted: off its computations' runs
                    for c, n in reached.items():
                        runs[c] -= base[name] * n
    for name, found in own.items():
        times = max(runs[name], 0) if base.get(name) else 1  # unreached by the graph: once
        for kind, flops in found:
            yield kind, flops, times


def _own_matmuls(lines: list[str]) -> Iterator[tuple[str, float]]:
    """``(kind, FLOPs)`` of each matmul written in one computation's ``lines``."""
    return ((kind, flops) for _, kind, flops in line_matmuls(lines))


def line_matmuls(lines: list[str]) -> Iterator[tuple[int, str, float]]:
    """``(line index, kind, FLOPs)`` of each matmul written in one computation's ``lines``
    (kinds as :func:`_matmuls`'s; a fusion's matmuls are in the computation it calls)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for line in lines:
        found = _DEF.match(line)
        if found and not found.group(2).startswith("("):
            shapes[found.group(1)] = _dims(found.group(2))
    for index, line in enumerate(lines):
        conv = _CONV.search(line)
        if conv:  # XLA:TPU's matmuls: 2 · output · lhs features · window
            lhs = shapes.get(conv.group(2))
            labels = conv.group(4)
            if lhs is None or "f" not in labels or len(labels) != len(lhs):
                continue
            taps = _window_taps(line)
            flops = 2.0 * math.prod(_dims(conv.group(1))) * lhs[labels.index("f")] * taps
            yield index, "conv", flops
            continue
        fmha = _fmha_flops(line)
        if fmha:
            yield index, "fmha", fmha
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
    """Model training FLOPs per token of a dense decoder: ``6·N`` for the matmuls over
    ``N`` non-embedding parameters (forward 2·N, backward 4·N), plus attention's scores
    and weighted values, ``3 · 4·layers·seq_len·d_model``, halved when ``causal`` (the
    masked half is not model work; MaxText and PaLM's MFU count it so).

    >>> transformer_flops_per_token(100, layers=1, seq_len=4, d_model=8, causal=False)
    984.0
    >>> transformer_flops_per_token(100, layers=1, seq_len=4, d_model=8)
    792.0
    """
    attention = 3.0 * 4 * layers * seq_len * d_model
    return 6.0 * non_embedding_params + (attention / 2 if causal else attention)


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs of one device's program in ``compiled`` (a ``jax.stages.Compiled``): XLA's
    ``cost_analysis()``, plus the matmuls it counts as zero, cuBLAS GEMMs and cuDNN's
    attention on a GPU (:func:`library_call_flops`; on an H200 with JAX 0.11.2, XLA's
    count alone was 0.08% of a 90-layer MLP step's 6·N·batch), and the loop trips of
    matmuls it counts once (:func:`loop_matmul_flops`). None when the backend gives no
    cost analysis (a compile-only GPU target: use :func:`hlo_flops`)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"]) + sum(_beyond_cost_analysis(compiled.as_text()))


def utilization(
    flops_per_step: float | None,
    step_seconds: float,
    devices: int,
    hardware: HardwareType | str | None = None,
) -> dict[str, Any]:
    """Achieved TFLOP/s per device and MFU of a step of ``flops_per_step`` FLOPs (over all
    ``devices``) that takes ``step_seconds``.

    MFU is achieved FLOP/s over the dense bf16 peak of ``hardware``
    (:data:`~shardax.cost.hardware.HARDWARE_SPECS`) or, by default, of the first device
    (:func:`~shardax.cost.device_spec`, which also knows kinds such as the H200);
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
