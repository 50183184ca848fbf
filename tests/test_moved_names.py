"""Moved names (CONTRIBUTING, "Moved names"): a name that leaves a namespace warns, naming
its home, for the minor version it moved in; the next minor version retires it, and its
``AttributeError`` names the home.

0.2.0 retired the names that moved in 0.1: every name that was ever in ``shardax``'s
top-level namespace and is no longer (found from ``git log -p -- src/shardax/__init__.py``),
and the names a layer no longer exports (internal helpers: ``sx.plan.path_str``). Each is
pinned here, in ``shardax._names.RETIRED`` and in CHANGELOG.md.
"""

import importlib
import pathlib
import re
import tomllib
import warnings

import pytest

import shardax as sx
from shardax import _names, checks

ROOT = pathlib.Path(__file__).resolve().parents[1]

RETIRED = {  # old top-level name: its home, as the user writes it
    "AgreementError": "sx.runtime.AgreementError",
    "Auto": "sx.AutoPlanOptions",
    "AutoPlan": "sx.train.AutoPlan",
    "DATA_AXIS": "sx.mesh.DATA_AXIS",
    "EvalStep": "sx.train.EvalStep",
    "LossScaling": "sx.train.LossScaling",
    "PREEMPTED_EXIT_CODE": "sx.checkpoint.PREEMPTED_EXIT_CODE",
    "Restored": "sx.checkpoint.Restored",
    "ShardingReport": "sx.plan.ShardingReport",
    "StepClock": "sx.track.StepClock",
    "TrainStep": "sx.train.TrainStep",
    "WATCHDOG_EXIT_CODE": "sx.runtime.WATCHDOG_EXIT_CODE",
    "all_gather": "sx.parallel.all_gather",
    "all_reduce": "sx.parallel.all_reduce",
    "axis_rules": "sx.plan.axis_rules",
    "check_agreement": "sx.runtime.check_agreement",
    "check_finite": "sx.train.check_finite",
    "detect_hardware_type": "sx.cost.detect_hardware_type",
    "device_info": "sx.cost.device_info",
    "example_keys": "sx.train.example_keys",
    "follow_params": "sx.plan.follow_params",
    "host_reduce": "sx.runtime.host_reduce",
    "host_value": "sx.runtime.host_value",
    "init_sharded": "sx.plan.init_sharded",
    "mesh_info": "sx.mesh.mesh_info",
    "profile_steps": "sx.track.profile_steps",
    "reached_preemption": "sx.checkpoint.reached_preemption",
    "reduce": "sx.parallel.reduce",
    "replicate_across_devices": "sx.data.replicate_across_devices",
    "shard_batch_dim": "sx.data.shard_batch_dim",
    "timed": "sx.data.timed",
    "validate": "sx.plan.validate",
    "validate_batch_size": "sx.cost.validate_batch_size",
    "weighted_mean": "sx.parallel.weighted_mean",
}


LAYER_RETIRED = {  # names that left a layer's namespace (internal now), by layer
    "cost": "BATCH_SIZE_TABLE DEVICE_KIND_SPECS GPUS_PER_HOST GPU_KINDS HARDWARE_SPECS "
    "TPU_FAMILIES GpuArch gpu_target_config gpu_target_configs hardware_type_of known_targets "
    "parse_target",
    "data": "POLICIES as_sharding batch_shardings fit_batch leaf_sharding pad_batch process_grid",
    "mesh": "MeshSpec resolve_mesh_shape",
    "parallel": "ATTENTION_KERNELS bound_axes checkpoint_policy require_bound scan_layers "
    "sequence_sharding",
    "plan": "DEFAULT_FSDP_MIN_SIZE FollowParams Row annotated_specs axis_size check_spec "
    "current_axis_rules format_bytes fsdp_spec is_array logical_to_mesh map_arrays path_str "
    "planned record spec_errors",
    "runtime": "backend_started device_put_global disable_compile_cache fingerprint "
    "resolve_coordinates",
    "track": "BACKENDS INPUT_BOUND check_writable parse_steps",
    "train": "LossScaleState MODES Program",
}
LAYER_CASES = [(layer, name) for layer, names in LAYER_RETIRED.items() for name in names.split()]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("old,new", RETIRED.items(), ids=list(RETIRED))
def test_a_retired_top_level_name_names_its_home(old, new):
    assert old not in sx.__all__ and old not in vars(sx)
    retired = rf"^sx\.{old} was retired in shardax 0\.2\.0: it is now {re.escape(new)} "
    with pytest.raises(AttributeError, match=retired):
        getattr(sx, old)
    assert f"`sx.{old}` → `{new}`" in CHANGELOG


@pytest.mark.parametrize("layer,old", LAYER_CASES, ids=[".".join(case) for case in LAYER_CASES])
def test_a_retired_layer_name_names_the_module_that_holds_it(layer, old):
    space = importlib.import_module(f"shardax.{layer}")
    assert old not in space.__all__ and old not in vars(space)
    home = _names.RETIRED[f"shardax.{layer}"][old]
    module, _, attr = home.rpartition(".")
    assert module.startswith(f"shardax.{layer}.") and hasattr(importlib.import_module(module), attr)
    with pytest.raises(AttributeError, match=rf"is internal now \({re.escape(home)}\)"):
        getattr(space, old)
    assert f"`sx.{layer}.{old}` → `{home}`" in CHANGELOG


def test_the_pins_are_the_table_and_public_names_are_silent():
    assert {k: _names.spelled(v) for k, v in _names.RETIRED["shardax"].items()} == RETIRED
    for layer in ("checkpoint", "loop", "cost", "data", "mesh", "parallel", "plan", "runtime",
                  "track", "train"):  # fmt: skip
        table = _names.RETIRED.get(f"shardax.{layer}", {})
        assert sorted(table) == sorted(LAYER_RETIRED.get(layer, "").split()), layer
    for namespace in _names.EXPORTS:
        space = importlib.import_module(namespace)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for name in space.__all__:
                getattr(space, name)
    with pytest.raises(AttributeError, match=r"^module 'shardax' has no attribute 'init_shardd'$"):
        sx.init_shardd  # noqa: B018
    with pytest.raises(ImportError, match="init_sharded"):
        from shardax import init_sharded  # noqa: F401


def test_a_moved_name_warns_at_the_users_line_and_is_the_object(monkeypatch):
    monkeypatch.setitem(_names.MOVED, "shardax.plan", {"path_str": "shardax.plan.tree.path_str"})
    monkeypatch.setitem(_names.MOVED, "shardax", {"follow_params": "shardax.plan.follow_params"})
    internal = r"^sx\.plan\.path_str is internal now \(shardax\.plan\.tree\.path_str\); the old"
    with pytest.warns(DeprecationWarning, match=internal) as seen:
        got = checks.moved("shardax.plan")("path_str")
    assert got is importlib.import_module("shardax.plan.tree").path_str
    assert seen[0].filename == __file__  # the warning points at the user's line
    public = r"^sx\.follow_params is now sx\.plan\.follow_params; the old name goes in the next"
    with pytest.warns(DeprecationWarning, match=public):
        assert checks.moved("shardax")("follow_params") is sx.plan.follow_params


def test_the_version_is_one_and_retired_names_are_of_an_earlier_one():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert sx.__version__ == pyproject["project"]["version"]
    assert f"## {_names.RETIRED_IN}" in CHANGELOG
    major, minor = (int(x) for x in sx.__version__.split(".")[:2])
    assert (major, minor) >= tuple(int(x) for x in _names.RETIRED_IN.split(".")[:2])
    assert not set(_names.MOVED) - set(_names.EXPORTS)  # a row per namespace that exists
