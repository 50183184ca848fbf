"""Device inventory: what the process can see, as plain data."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from shardax.runtime.hardware import detect_hardware_type


def device_info(devices: Sequence[Any] | None = None) -> dict[str, Any]:
    """Describes ``devices`` (default: all devices of all processes).

    Returns a dict with ``num_devices``, ``hardware_type``, ``platforms``,
    ``device_kinds``, ``process_count`` and ``devices`` (one dict per device with
    ``id``, ``platform``, ``device_kind`` and ``process_index``).

    >>> device_info()["num_devices"] >= 1
    True
    """
    devices = list(jax.devices() if devices is None else devices)
    return {
        "num_devices": len(devices),
        "hardware_type": detect_hardware_type(devices).value,
        "platforms": sorted({d.platform for d in devices}),
        "device_kinds": sorted({str(d.device_kind) for d in devices}),
        "process_count": len({d.process_index for d in devices}),
        "devices": [
            {
                "id": d.id,
                "platform": d.platform,
                "device_kind": str(d.device_kind),
                "process_index": d.process_index,
            }
            for d in devices
        ],
    }
