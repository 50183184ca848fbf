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
"""

from __future__ import annotations

from typing import Any

from shardax.cost.hardware import HARDWARE_SPECS, HardwareType, as_hardware_type, device_spec


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs of one device's program in ``compiled`` (a ``jax.stages.Compiled``), or
    None when the backend gives no cost analysis."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


def utilization(
    flops_per_step: float | None,
    step_seconds: float,
    devices: int,
    hardware: HardwareType | str | None = None,
) -> dict[str, Any]:
    """Achieved TFLOP/s per device and MFU of a step of ``flops_per_step`` FLOPs (over all
    ``devices``) that takes ``step_seconds``.

    MFU is achieved FLOP/s over the dense bf16 peak of ``hardware``
    (:data:`~shardax.cost.HARDWARE_SPECS`) or, by default, of the first device
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
