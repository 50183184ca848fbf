"""The roofline-critical batch size: peak FLOP/s ÷ HBM bandwidth.

A dense layer ``y = x @ W`` with ``x`` of shape ``(B, D)`` and ``W`` of shape ``(D, F)``
does ``2·B·D·F`` FLOPs and, when ``B`` is small next to ``D`` and ``F``, reads mostly the
``p·D·F`` bytes of ``W`` (``p`` bytes per parameter). Its arithmetic intensity is
``2·B·D·F / (p·D·F) = 2·B / p`` FLOPs per byte. The step is compute-bound once that
reaches the hardware's ``peak_flops / hbm_bandwidth``, that is once

    B ≥ B* = (p / 2) · peak_flops / hbm_bandwidth      (per device; = peak ÷ bandwidth in bf16)

Below ``B*`` the device waits on memory and a larger batch is nearly free; above it,
step time grows with the batch. Under data parallelism ``B`` is the per-replica batch, so
a global batch needs ``B* × data-parallel degree``.

>>> from shardax.cost.hardware import HardwareType
>>> round(hardware_roofline(HardwareType.H100).critical_batch)
295
"""

from __future__ import annotations

import dataclasses

from shardax.cost.hardware import HARDWARE_SPECS, HardwareType, as_hardware_type


def critical_batch_size(
    peak_flops: float, hbm_bandwidth: float, bytes_per_param: float = 2.0
) -> float:
    """The per-device batch at which a dense layer turns compute-bound: ``(p/2)·peak/bw``.

    Args:
        peak_flops: FLOP/s of one device.
        hbm_bandwidth: bytes/s of one device's memory.
        bytes_per_param: bytes of one weight as the matmul reads it (2 for bf16, 4 for fp32).

    >>> critical_batch_size(1e12, 1e10)
    100.0
    """
    for name, value in (
        ("peak_flops", peak_flops),
        ("hbm_bandwidth", hbm_bandwidth),
        ("bytes_per_param", bytes_per_param),
    ):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    return bytes_per_param / 2.0 * peak_flops / hbm_bandwidth


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The figures of one device's roofline and the critical batch they give.

    Attributes:
        hardware: the hardware type.
        peak_flops: dense bf16 FLOP/s of one device (datasheet).
        hbm_bandwidth: bytes/s of one device's memory (datasheet).
        bytes_per_param: bytes per weight assumed by ``critical_batch``.
        critical_batch: per-device batch where compute time equals memory time.
    """

    hardware: HardwareType
    peak_flops: float
    hbm_bandwidth: float
    bytes_per_param: float
    critical_batch: float


def hardware_roofline(hardware: HardwareType | str, bytes_per_param: float = 2.0) -> Roofline:
    """The roofline of ``hardware`` from ``HARDWARE_SPECS``.

    Raises ``ValueError`` naming the hardware when it has no datasheet figures (CPU,
    unknown accelerators): their critical batch must be measured (``shardax tune-batch``).
    """
    hw = as_hardware_type("hardware", hardware)
    if hw not in HARDWARE_SPECS:
        known = ", ".join(h.value for h in HARDWARE_SPECS)
        raise ValueError(
            f"hardware {hw.value!r} has no peak FLOP/s and bandwidth figures (known: {known}); "
            "measure its critical batch with `shardax tune-batch`"
        )
    spec = HARDWARE_SPECS[hw]
    return Roofline(
        hardware=hw,
        peak_flops=spec.peak_flops,
        hbm_bandwidth=spec.hbm_bandwidth,
        bytes_per_param=bytes_per_param,
        critical_batch=critical_batch_size(spec.peak_flops, spec.hbm_bandwidth, bytes_per_param),
    )


def knee_batch_size(
    batch_sizes: list[int], step_seconds: list[float], tolerance: float = 0.1
) -> int:
    """The smallest batch whose throughput is within ``tolerance`` of the peak throughput.

    Throughput is ``batch / step_seconds`` (examples per second). Past the knee a larger
    batch buys little speed per example; below it the device is underused.

    >>> knee_batch_size([8, 16, 32, 64], [1.0, 1.0, 1.1, 2.0])
    32
    """
    if len(batch_sizes) != len(step_seconds) or not batch_sizes:
        raise ValueError(
            f"batch_sizes and step_seconds must be non-empty and of equal length, got "
            f"{len(batch_sizes)} and {len(step_seconds)}"
        )
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    if any(not t > 0 for t in step_seconds):
        raise ValueError(f"step_seconds must all be > 0, got {step_seconds}")
    throughput = [b / t for b, t in zip(batch_sizes, step_seconds, strict=True)]
    peak = max(throughput)
    return min(
        b for b, r in zip(batch_sizes, throughput, strict=True) if r >= (1 - tolerance) * peak
    )
