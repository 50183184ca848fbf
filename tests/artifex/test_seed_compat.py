# ruff: noqa: E501  (a table of cases, one per line)
"""The seed facades say what artifex's own implementation says.

Found by running artifex's distributed test suite and a side-by-side comparison with
its implementation (see docs/guides/artifex.md): the seed's sentences come first after the
name of the method called (``sx.DeviceMeshManager.create_device_mesh: ``), shardax's detail
after them, so code and users matching on the seed's words keep working.
"""

import re

import jax
import pytest

import shardax as sx

H100 = sx.HardwareType.H100  # min 64, critical 298, optimal 320


@pytest.mark.parametrize(
    "make,needed,method",
    [
        (lambda m: m.create_device_mesh([("data", 5)]), 5, "create_device_mesh"),
        (lambda m: m.create_device_mesh({"data": 3, "model": 2}), 6, "create_device_mesh"),
        (lambda m: m.create_data_parallel_mesh(num_devices=8), 8, "create_data_parallel_mesh"),
        (lambda m: m.create_model_parallel_mesh(num_devices=100), 100, "create_model_parallel_mesh"),
        (lambda m: m.create_hybrid_mesh(data_parallel_size=2, model_parallel_size=3), 6, "create_hybrid_mesh"),
    ],
)  # fmt: skip
def test_not_enough_devices_starts_with_the_seed_sentence(make, needed, method):
    manager = sx.DeviceMeshManager(devices=jax.devices()[:4])
    seed = f"Not enough devices: mesh requires {needed} devices but only 4 available"
    door = f"sx.DeviceMeshManager.{method}: "
    with pytest.raises(ValueError, match="^" + re.escape(door + seed) + r" \(mesh shape \{"):
        make(manager)


@pytest.mark.parametrize(
    "batch,warn,valid,message",
    [
        (8, True, False, "Batch size 8 is below minimum recommended 64 for h100. "
         "Performance will be significantly degraded."),
        (100, True, True, "Batch size 100 is below critical size 298 for h100. "
         "Consider increasing for optimal throughput."),
        (100, False, True, "Batch size 100 is acceptable for h100."),
        (300, True, True, "Batch size 300 is acceptable for h100."),
        (320, True, True, "Batch size 320 is optimal for h100."),
    ],
)  # fmt: skip
def test_validate_batch_size_gives_the_seed_messages(batch, warn, valid, message):
    assert sx.cost.validate_batch_size(batch, H100, warn_suboptimal=warn) == (valid, message)
    placement = sx.DevicePlacement()
    placement._hardware_type = H100  # as artifex's tests pin the hardware
    assert placement.validate_batch_size(batch, warn_suboptimal=warn) == (valid, message)


def test_device_info_reports_the_placements_hardware_type():
    placement = sx.DevicePlacement()
    assert placement.get_device_info()["hardware_type"] == "cpu"
    placement._hardware_type = H100
    info = placement.get_device_info()
    assert info["hardware_type"] == "h100" == placement.hardware_type.value
    assert info["num_devices"] == 8 and info["platforms"] == ["cpu"]
