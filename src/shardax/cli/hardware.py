"""The hardware names ``shardax info`` and ``shardax plan --hardware`` know:
``HardwareType``'s values with datasheet figures, then the device kinds it does not name
(the H200, the B200, ...) from ``DEVICE_KIND_SPECS``, as ``--target`` knows them.

>>> "h200" in NAMES and "b200" in NAMES and "h100" in NAMES
True
>>> round(roofline("b200")["critical_batch"])
281
"""

from __future__ import annotations

from typing import Any

from shardax.cost.hardware import DEVICE_KIND_SPECS, HARDWARE_SPECS, HardwareSpec, HardwareType
from shardax.cost.roofline import critical_batch_size

KINDS: dict[str, HardwareSpec] = {
    kind.replace(" ", "-"): spec for _, kind, spec in DEVICE_KIND_SPECS
}
"""Datasheet rows of the device kinds ``HardwareType`` does not name, by a flag's spelling
(``h200``, ``h200-nvl``)."""

NAMES: tuple[str, ...] = (*(h.value for h in HardwareType), *KINDS)
"""Every name ``--hardware`` takes: ``HardwareType``'s values, then the other kinds."""


def spec_of(name: str) -> HardwareSpec | None:
    """The datasheet figures of ``name`` (one of ``NAMES``), or None (a CPU, unknown)."""
    if name in KINDS:
        return KINDS[name]
    return HARDWARE_SPECS.get(HardwareType(name))


def roofline(name: str, bytes_per_param: float = 2.0) -> dict[str, Any] | None:
    """``peak_flops``, ``hbm_bandwidth``, ``bytes_per_param`` and the roofline
    ``critical_batch`` (peak ÷ bandwidth, scaled by the bytes a weight takes) of ``name``;
    None without datasheet figures."""
    spec = spec_of(name)
    if spec is None:
        return None
    return {
        "peak_flops": spec.peak_flops,
        "hbm_bandwidth": spec.hbm_bandwidth,
        "bytes_per_param": bytes_per_param,
        "critical_batch": critical_batch_size(spec.peak_flops, spec.hbm_bandwidth, bytes_per_param),
    }
