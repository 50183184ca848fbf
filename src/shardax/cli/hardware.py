"""The hardware names ``shardax info`` and ``shardax plan --hardware`` know:
``HardwareType``'s values with datasheet figures, then the kinds of the table of accelerators
it does not name (the H200, the B200, ...), spelled in lower case.

>>> "h200" in NAMES and "b200" in NAMES and "h100" in NAMES
True
>>> round(roofline("b200")["critical_batch"])
281
"""

from __future__ import annotations

from typing import Any

from shardax.cost.accelerators import ACCELERATORS, HardwareType
from shardax.cost.datasheet import HardwareSpec
from shardax.cost.hardware import HARDWARE_SPECS
from shardax.cost.roofline import critical_batch_size

_TYPES = {h.value for h in HardwareType}
KINDS: dict[str, HardwareSpec] = {
    row.kind.lower(): row.spec
    for row in ACCELERATORS.values()
    if row.spec is not None and row.kind.lower() not in _TYPES
}
"""Datasheet rows of the table's kinds whose spelling is no ``HardwareType`` value, by a
flag's spelling (``h200``, ``h200-nvl``, ``a100-80gb``)."""

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
