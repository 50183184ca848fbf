"""The table of accelerators: every look-up of a kind reads it, so a new kind is one row
plus its measured tables (CONTRIBUTING: "Adding an accelerator")."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost import calibration
from shardax.cost.accelerators import (
    ACCELERATORS,
    BUDGETS,
    Accelerator,
    HardwareType,
    kind_of,
    matching,
    named,
)
from shardax.cost.datasheet import GiB, GpuArch, HardwareSpec, KiB, MiB
from shardax.cost.gpu_config import gpu_target_config
from shardax.cost.network import NETWORKS, default_network, network_of
from shardax.cost.target_names import known_targets, parse_target

ACME = SimpleNamespace(platform="gpu", device_kind="Acme X1 64GB")


@pytest.fixture
def x1(tmp_path, monkeypatch):
    """A fake kind: its row, and its table file (the H100's tables, as if measured on it)."""
    tables = json.loads((calibration.TABLES / "h100-2026-11-27.json").read_text())
    path = tmp_path / "x1-2026-12-01.json"
    path.write_text(json.dumps({**tables, "device": ACME.device_kind, "date": "2026-12-01"}))
    row = Accelerator(
        "X1", "gpu", ("x1",), ACME.device_kind,
        HardwareSpec(500e12, 2000e9, 64 * GiB, 400e9, 50e9, "a test's datasheet",
                     GpuArch((9, 0), 100, 1.5, 40 * MiB, 228 * KiB, 227 * KiB)),
        host_devices=4, network="ib-ndr", memory_budget="allocator", calibration=str(path),
    )  # fmt: skip
    monkeypatch.setitem(ACCELERATORS, row.kind, row)
    return row


def test_a_new_kind_is_one_row_plus_its_table_file(x1):
    assert kind_of(ACME.device_kind) == "X1" and named("x1") is x1
    assert sx.cost.device_spec(ACME) is x1.spec
    assert sx.cost.detect_hardware_type([ACME]) is HardwareType.UNKNOWN  # not the seed's
    tables = calibration.calibration_for(ACME.device_kind)
    assert (tables.kind, tables.date, tables.peak_flops) == ("X1", "2026-12-01", 500e12)
    assert tables.name == "calibrated: X1, JAX 0.11.2, 2026-12-01"
    parsed = parse_target("8xX1")  # hosts of its host_devices
    assert (parsed["kind"], parsed["hosts"], parsed["devices_per_host"]) == (ACME.device_kind, 2, 4)
    assert "16xX1" not in known_targets() and "8xX1" in known_targets()
    assert default_network("X1") is NETWORKS["ib-ndr"]
    assert network_of(ACME)[0] is NETWORKS["ib-ndr"]
    config = gpu_target_config(x1.device_kind, x1.spec).splitlines()
    assert (
        "  core_count: 100" in config and f'device_description_str: "{ACME.device_kind}"' in config
    )
    with pytest.raises(ValueError, match=r"holds at most 4; write '8xX1' \(2 hosts of 4\)"):
        parse_target("1x8xX1")


def test_without_its_row_the_kind_is_unknown_again(monkeypatch, x1):
    monkeypatch.delitem(ACCELERATORS, "X1")
    assert kind_of(ACME.device_kind) == ACME.device_kind
    assert sx.cost.device_spec(ACME) is None and calibration.calibration_for("Acme X1") is None
    with pytest.raises(ValueError, match=r"GPU one of \['A100-80GB', 'B200', 'H100', 'H200'\]"):
        sx.target("8xX1")


def test_every_row_is_whole_and_its_own_devices_find_it():
    spellings = [s.lower() for r in ACCELERATORS.values() for s in (r.kind, *r.aliases)]
    assert len(spellings) == len(set(spellings))  # one spelling names one kind
    for row in ACCELERATORS.values():
        assert row.platform in ("gpu", "tpu") and row.memory_budget in BUDGETS, row
        assert all(m == m.lower() for m in row.matches), row
        assert row.network is None or row.network in NETWORKS, row
        if row.calibration is not None:
            assert (calibration.TABLES / row.calibration).is_file(), row
            assert calibration.calibration_for(row.device_kind or row.kind).kind == row.kind
        if row.device_kind:
            assert matching(row.device_kind, row.platform) is row, row
        if row.host_devices:  # a GPU target: a compiler description and the allocator's rule
            assert row.spec.gpu is not None and row.memory_budget == "allocator", row
    h100 = [r for r in ACCELERATORS.values() if r.hardware_type is HardwareType.H100]
    assert sx.cost.hardware.HARDWARE_SPECS[HardwareType.H100] is h100[0].spec


@pytest.mark.compile_only("gpu")
def test_a_target_of_the_new_kind_compiles(x1):
    target = sx.target("8xX1", memory_fraction=0.9)
    assert (target.device_kind, target.hosts, target.devices_per_host) == (ACME.device_kind, 2, 4)
    assert target.spec is x1.spec and target.network is NETWORKS["ib-ndr"]
    mesh = sx.make_mesh({"data": 8}, devices=target)
    x = jax.ShapeDtypeStruct((8 * 128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    compiled = jax.jit(lambda x: (x @ x.T).sum()).lower(x).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == 128 * 256 * 2
