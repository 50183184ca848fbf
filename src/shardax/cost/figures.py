"""A device's figures for a prediction: its datasheet's, else those its kind's calibration
measured.

>>> from types import SimpleNamespace
>>> device_figures(SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")).peak_flops
989000000000000.0
"""

from __future__ import annotations

from typing import Any

from shardax.cost.budget import device_memory
from shardax.cost.calibration import calibration_for
from shardax.cost.datasheet import HardwareSpec
from shardax.cost.hardware import device_spec, is_gpu


def measured_spec(device: Any) -> HardwareSpec | None:
    """Figures of a GPU with no datasheet row, from its kind's calibration (``shardax
    calibrate``'s, ``register``ed): the best measured GEMM rate as its peak, the fastest
    measured stream as its memory bandwidth, its allocator's limit as its memory
    (``shardax.cost.budget.device_memory``), and the collectives fitted over one
    host's devices as its link within a host (none between hosts). None where the kind has
    no calibration, or no memory figure is known. ``sx.estimate`` prices such a GPU with
    these (MFU then counts against the measured peak, not a datasheet's; the memory is the
    allocator's budget, not the card's; the link within a host is the median of the fitted
    collectives' bandwidths).

    >>> import dataclasses
    >>> from types import SimpleNamespace
    >>> from shardax.cost.calibration import H100, using
    >>> l4 = dataclasses.replace(H100, kind="NVIDIA L4", device="NVIDIA L4", peak_flops=1.2e14)
    >>> gpu = SimpleNamespace(platform="gpu", device_kind="NVIDIA L4",
    ...                       memory_stats=lambda: {"bytes_limit": 2e10})
    >>> with using(l4):
    ...     spec = measured_spec(gpu)
    >>> spec.peak_flops, spec.memory_bytes, spec.source
    (120000000000000.0, 20000000000.0, 'measured: calibrated: NVIDIA L4, JAX 0.11.2, 2026-11-27')
    >>> measured_spec(gpu) is None  # no calibration registered for the kind
    True
    """
    c = calibration_for(str(device.device_kind)) if is_gpu(device) else None
    # the allocator's limit (another process's device: this process's of the kind, so
    # every process plans alike); a kind with no datasheet has no other figure
    memory = device_memory(device) if c is not None else None
    if c is None or memory is None:
        return None
    links = sorted(bandwidth for _, _, _, bandwidth in c.collectives)
    return HardwareSpec(
        peak_flops=c.peak_flops,
        hbm_bandwidth=max(c.stream) * 1e9,
        memory_bytes=memory[0],
        ici_bandwidth=links[len(links) // 2] if links else None,
        source=MEASURED + c.name,
    )


def device_figures(device: Any) -> HardwareSpec | None:
    """``device``'s figures for a prediction: its datasheet row (``device_spec``), else
    those its kind's calibration measured (``measured_spec``), else None."""
    return device_spec(device) or measured_spec(device)


MEASURED = "measured: "
"""How ``measured_spec``'s figures name their source (then the calibration's name)."""
