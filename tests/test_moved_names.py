"""Every public name that left ``shardax``'s top level, or a layer's namespace, still works
for a release.

The list is every name that was ever in ``shardax``'s top-level namespace (``__all__`` or
imported into ``src/shardax/__init__.py``) and is no longer, found from the file's git
history (``git log -p -- src/shardax/__init__.py``); each old spelling warns with
``DeprecationWarning`` naming its new home and returns the very object found there. The
names a layer no longer exports (internal helpers: ``sx.plan.path_str``) warn that they are
internal now, naming the module that holds them.
"""

import importlib
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import shardax as sx

MOVED = {  # old top-level name: its home now, as the user writes it
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


def _home(dotted: str):
    obj = sx
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("old,new", MOVED.items(), ids=list(MOVED))
def test_old_name_warns_names_its_home_and_is_the_same_object(old, new):
    assert old not in sx.__all__ and old not in vars(sx)  # not a public name any more
    with pytest.warns(DeprecationWarning, match=rf"^sx\.{old} is now {re.escape(new)};") as seen:
        got = getattr(sx, old)
    assert got is _home(new)
    assert seen[0].filename == __file__  # the warning points at the user's line


def test_from_import_of_an_old_name_warns_too():
    moved = r"^sx\.init_sharded is now sx\.plan\.init_sharded;"
    with pytest.warns(DeprecationWarning, match=moved):
        from shardax import init_sharded
    assert init_sharded is sx.plan.init_sharded


def test_the_table_is_the_module_s_and_new_names_are_silent():
    assert {k: "sx" + v.removeprefix("shardax") for k, v in sx.__getattr__.homes.items()} == MOVED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in sx.__all__:
            getattr(sx, name)
    with pytest.raises(AttributeError, match=r"^module 'shardax' has no attribute 'init_shardd'$"):
        sx.init_shardd  # noqa: B018


def test_a_script_from_last_month_runs_with_a_warning():
    script = (
        "import jax; jax.config.update('jax_num_cpu_devices', 8)\n"
        "import jax.numpy as jnp, shardax as sx\n"
        "mesh = sx.make_mesh({'data': -1})\n"
        "params = sx.init_sharded(lambda: {'w': jnp.ones((16, 4))}, sx.fsdp(mesh, min_size=0))\n"
        "sx.validate(params, sx.fsdp(mesh, min_size=0))\n"
        "print(tuple(params['w'].sharding.spec))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default::DeprecationWarning", "-c", script],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "('data', None)"
    assert "DeprecationWarning: sx.init_sharded is now sx.plan.init_sharded" in out.stderr
    assert "DeprecationWarning: sx.validate is now sx.plan.validate" in out.stderr


LAYER_MOVED = {  # names that left a layer's namespace (internal now), by layer
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
LAYER_CASES = [(layer, name) for layer, names in LAYER_MOVED.items() for name in names.split()]


@pytest.mark.parametrize("layer,old", LAYER_CASES, ids=[".".join(case) for case in LAYER_CASES])
def test_a_name_a_layer_no_longer_exports_warns_and_is_the_object_in_its_module(layer, old):
    space = importlib.import_module(f"shardax.{layer}")
    assert old not in space.__all__ and old not in vars(space)
    home = space.__getattr__.homes[old]
    module, _, attr = home.rpartition(".")
    assert module.startswith(f"shardax.{layer}.")  # a module of the layer holds it
    internal = rf"^sx\.{layer}\.{old} is internal now \({re.escape(home)}\); the old name goes"
    with pytest.warns(DeprecationWarning, match=internal) as seen:
        got = getattr(space, old)
    assert got is getattr(importlib.import_module(module), attr)
    assert seen[0].filename == __file__


def test_each_layer_s_table_is_pinned_and_its_public_names_are_silent():
    for layer in ("checkpoint", "loop", "cost", "data", "mesh", "parallel", "plan", "runtime",
                  "track", "train"):  # fmt: skip
        space = importlib.import_module(f"shardax.{layer}")
        table = getattr(space.__dict__.get("__getattr__"), "homes", {})
        assert sorted(table) == sorted(LAYER_MOVED.get(layer, "").split()), layer
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for name in space.__all__:
                getattr(space, name)
        with pytest.raises(AttributeError, match=rf"^module 'shardax\.{layer}' has no attr"):
            space.no_such_name  # noqa: B018


def test_from_import_of_a_name_a_layer_no_longer_exports_warns_too():
    with pytest.warns(DeprecationWarning, match=r"^sx\.plan\.is_array is internal now"):
        from shardax.plan import is_array
    from shardax.plan.tree import is_array as home

    assert is_array is home and is_array(np.ones(2)) and not is_array("text")
