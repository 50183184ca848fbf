import dataclasses
from types import SimpleNamespace

import jax
import pytest

import shardax as sx
from shardax.cost import detect_hardware_type
from shardax.cost.flops import utilization
from shardax.cost.hardware import BATCH_SIZE_TABLE

SEED_TABLE = {  # seed 000, verbatim
    "TPU_V5E": (64, 256, 240),
    "TPU_V5P": (128, 512, 480),
    "TPU_V4": (64, 256, 192),
    "H100": (64, 320, 298),
    "A100": (32, 256, 240),
    "V100": (16, 128, 96),
    "CPU": (1, 32, 16),
}


def test_hardware_type_has_all_eight_values():
    assert {h.value for h in sx.HardwareType} == {
        "tpu_v5e",
        "tpu_v5p",
        "tpu_v4",
        "h100",
        "a100",
        "v100",
        "cpu",
        "unknown",
    }


def test_recommendation_is_a_frozen_dataclass_with_seed_defaults():
    rec = sx.BatchSizeRecommendation(1, 2, 3)
    assert rec.max_memory_batch_size is None and rec.notes == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.min_batch_size = 5  # type: ignore[misc]


@pytest.mark.parametrize("name,values", SEED_TABLE.items())
def test_table_matches_seed(name, values):
    rec = sx.get_batch_size_recommendation(sx.HardwareType[name])
    assert (rec.min_batch_size, rec.optimal_batch_size, rec.critical_batch_size) == values
    assert rec.notes
    assert BATCH_SIZE_TABLE[sx.HardwareType[name]] is rec


def test_cpu_is_detected_as_cpu():
    assert detect_hardware_type() is sx.HardwareType.CPU
    assert sx.DevicePlacement().hardware_type is sx.HardwareType.CPU
    assert sx.get_batch_size_recommendation().critical_batch_size == 16


@pytest.mark.parametrize(
    "platform,kind,expected",
    [
        ("gpu", "NVIDIA H100 80GB HBM3", "H100"),
        ("gpu", "NVIDIA A100-SXM4-80GB", "A100"),
        ("gpu", "Tesla V100-SXM2-16GB", "V100"),
        ("tpu", "TPU v4", "TPU_V4"),
        ("tpu", "TPU v5 lite", "TPU_V5E"),
        ("tpu", "TPU v5p", "TPU_V5P"),
        ("gpu", "NVIDIA GeForce RTX 4090", "UNKNOWN"),
        ("gpu", "NVIDIA B200", "UNKNOWN"),
        ("tpu", "TPU v6 lite", "UNKNOWN"),
        ("tpu", "TPU v3", "UNKNOWN"),
    ],
)
def test_unlisted_accelerators_are_unknown_never_a_neighbour(platform, kind, expected):
    device = SimpleNamespace(platform=platform, device_kind=kind)
    assert detect_hardware_type([device]) is sx.HardwareType[expected]


@pytest.mark.parametrize(
    "platform,kind,tflops,memory_gb",
    [
        ("gpu", "NVIDIA H200", 989, 150.76),  # not in the seed's enum; 143,771 MiB (nvidia-smi)
        ("cuda", "NVIDIA H100 80GB HBM3", 989, 85.52),  # the enum's H100: 81,559 MiB (nvidia-smi)
        ("gpu", "NVIDIA H100 PCIe", 756, 85.90),  # an H100, but not the SXM part's peak
        ("gpu", "NVIDIA H200 NVL", 835, 141),  # not the H200 SXM's
        ("gpu", "NVIDIA GH200 480GB", 989, 96),
        ("gpu", "NVIDIA B200", 2250, 180),
        ("gpu", "NVIDIA GB200", 2500, 186),  # not the B200's
        ("tpu", "TPU v6 lite", 918, 34.36),
    ],
)
def test_device_spec_knows_kinds_beyond_the_enum(platform, kind, tflops, memory_gb, monkeypatch):
    device = SimpleNamespace(platform=platform, device_kind=kind)
    spec = sx.cost.device_spec(device)
    assert spec.peak_flops == tflops * 1e12
    assert spec.memory_bytes / 1e9 == pytest.approx(memory_gb, rel=1e-3)
    # MFU on 8 of them (as the first of jax.devices() there): half the peak is 50%.
    monkeypatch.setattr(jax, "devices", lambda *backend: [device])
    use = utilization(tflops * 1e12 * 8 / 2, 1.0, devices=8)
    assert use["peak_tflops_per_device"] == tflops and use["mfu"] == pytest.approx(0.5)


def test_device_spec_of_a_cpu_or_an_unlisted_accelerator_is_none():
    assert sx.cost.device_spec(jax.devices()[0]) is None
    assert sx.cost.device_spec(SimpleNamespace(platform="gpu", device_kind="RTX 4090")) is None
    assert utilization(1e12, 1.0, devices=8)["mfu"] == "n/a"


def test_unknown_recommendation_says_so():
    rec = sx.get_batch_size_recommendation(sx.HardwareType.UNKNOWN)
    assert "unknown" in rec.notes.lower() and "not in the" in rec.notes


@pytest.mark.parametrize(
    "batch,valid,phrase",
    [
        (8, False, "below minimum"),
        (100, True, "below critical"),
        (320, True, "optimal"),
        (300, True, "acceptable"),
    ],
)
def test_validate_batch_size_messages(batch, valid, phrase):
    ok, msg = sx.cost.validate_batch_size(batch, sx.HardwareType.H100)
    assert ok is valid and phrase in msg and str(batch) in msg


def test_validate_batch_size_without_warning_is_acceptable():
    ok, msg = sx.cost.validate_batch_size(100, sx.HardwareType.H100, warn_suboptimal=False)
    assert ok and "acceptable" in msg


def test_device_placement_validate_uses_detected_cpu():
    ok, msg = sx.DevicePlacement().validate_batch_size(64)
    assert ok and "optimal" in msg and "cpu" in msg


def test_device_info():
    info = sx.DevicePlacement().get_device_info()
    assert info["num_devices"] == 8 and info["hardware_type"] == "cpu"
    assert info["platforms"] == ["cpu"]
    assert [d["id"] for d in info["devices"]] == list(range(8))
    assert {"id", "platform", "device_kind", "process_index"} <= set(info["devices"][0])
    assert sx.DevicePlacement().num_devices == 8
