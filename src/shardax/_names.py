"""The public names: what each namespace of shardax exports, and the names that left one.

The public surface is spelled here and nowhere else:

- a namespace's ``__all__`` is its row of ``EXPORTS`` (``__all__ = exports(__name__)``); the
  API reference documents those names (``docs/griffe_exports.py`` hands the same rows to griffe);
- a door's errors start with a name of this table: ``@public("sx.fsdp")``
  (``shardax.checks.public``) refuses, at import, a name that is not how a user reaches the
  object it decorates (``sx.<name>`` for a top-level name, ``sx.<layer>.<name>`` for one only
  in its layer's row, ``sx.<Class>.<method>`` for a public class's method), so that no
  error names a function users cannot call;
- a name that left a namespace keeps working for a minor version: ``MOVED`` holds its home,
  and the namespace's ``__getattr__ = moved(__name__)`` (``shardax.checks.moved``) warns
  naming it; ``RETIRED`` holds the names a version bump removed, whose error names the home.

Making a name public is its line here and its import in the namespace's ``__init__``;
taking one away moves it to ``MOVED`` (and to ``tests/test_moved_names.py``'s pins); the
next minor version moves it on to ``RETIRED`` and CHANGELOG.md.
"""


def _row(names: str) -> tuple[str, ...]:
    return tuple(names.split())


EXPORTS: dict[str, tuple[str, ...]] = {  # namespace: its public names (its __all__)
    "shardax": _row(
        """
        AutoPlanOptions BatchSizeRecommendation CheckpointManager DataParallel DeviceMeshManager
        DevicePlacement DistributedMetrics HardwareType MetricWriter NonFiniteLossError Plan
        Precision Preempted StepWatchdog TrainState attention auto_plan batch_sharding batches
        compile_cache constrain describe distribute_batch estimate from_linen from_nnx fsdp
        get_batch_size_recommendation global_batch initialize is_main_process keep_plan
        make_eval_step make_mesh make_train_step masked_mean moe pipeline pipeline_1f1b
        place_on_device prefetch_to_device prepare print0 remat replicate restore_checkpoint
        rules save_checkpoint shard target verify watch_preemption zero1 zero2
        SearchSpace search_plans DiLoCo
        explain
        """
    ),
    "shardax.artifex": _row(
        """
        BatchSizeRecommendation DataParallel DeviceMeshManager DevicePlacement
        DistributedMetrics HardwareType distribute_batch get_batch_size_recommendation
        place_on_device
        """
    ),
    "shardax.loop": _row(
        """
        Checkpoints Evaluation Every Goodput Hook Logging MetricsWindow Preemption Progress
        Run Snapshots Watchdog itstime run
        """
    ),
    "shardax.checkpoint": _row(
        """
        PREEMPTED_EXIT_CODE CheckpointManager Preempted Restored reached_preemption
        restore_checkpoint save_checkpoint watch_preemption
        """
    ),
    "shardax.train": _row(
        """
        AutoPlan AutoPlanOptions AutoStep Candidate EvalStep LossScaling NonFiniteLossError
        Precision StepConfig TrainState TrainStep VerifyReport auto_plan check_finite
        combine_thresholds compiler_options dropout example_keys gpu_options keep_plan
        make_eval_step make_train_step masked_mean prepare set_gpu_environment verify
        Layout SearchSpace search_plans DiLoCo IslandStep
        Explanation explain
        """
    ),
    "shardax.data": _row(
        """
        Batches Prefetcher Timed batch_sharding batches distribute_batch global_batch
        place_on_device prefetch_to_device replicate_across_devices shard_batch_dim timed
        """
    ),
    "shardax.parallel": _row(
        """
        REMAT_POLICIES MoEAux all_gather all_reduce attention bubble capacity choose_dispatch
        choose_impl choose_kernel fp8_dot_general moe pipeline pipeline_1f1b reduce remat
        unzigzag weighted_mean zigzag zigzag_layout
        """
    ),
    "shardax.plan": _row(
        """
        Plan ShardingReport axis_rules constrain describe dtype_name follow_params from_linen
        from_nnx fsdp fsdp_over init_sharded is_key itemsize replicate rules shard validate
        zero1 zero2
        """
    ),
    "shardax.mesh": _row(
        """
        CONTEXT_AXIS DATA_AXIS EXPERT_AXIS FSDP_AXIS MODEL_AXIS REPLICA_AXIS STAGE_AXIS
        make_mesh mesh_info
        """
    ),
    "shardax.cost": _row(
        """
        BatchSizeRecommendation Estimate HardwareSpec HardwareType Network Target
        detect_hardware_type device_info device_spec estimate get_batch_size_recommendation
        named_network target validate_batch_size
        """
    ),
    "shardax.runtime": _row(
        """
        WATCHDOG_EXIT_CODE AgreementError CompileStats StepWatchdog check_agreement
        compile_cache compile_stats host_reduce host_value initialize is_main_process print0
        """
    ),
    "shardax.track": _row(
        """
        Ledger MetricWriter StepClock StepProfiler Window profile_steps
        """
    ),
}

MOVED: dict[str, dict[str, str]] = {}  # namespace: {old name: its home now}
"""The names that left a namespace in this version: each warns, naming its home, until the
next minor version retires it (CONTRIBUTING, "Moved names")."""

RETIRED_IN = "0.2.0"
"""The version that removed ``RETIRED``'s aliases (listed in CHANGELOG.md)."""

RETIRED: dict[str, dict[str, str]] = {  # namespace: {old name: its home}, moved in 0.1
    "shardax": {
        "AgreementError": "shardax.runtime.AgreementError",
        "Auto": "shardax.AutoPlanOptions",
        "AutoPlan": "shardax.train.AutoPlan",
        "DATA_AXIS": "shardax.mesh.DATA_AXIS",
        "EvalStep": "shardax.train.EvalStep",
        "LossScaling": "shardax.train.LossScaling",
        "PREEMPTED_EXIT_CODE": "shardax.checkpoint.PREEMPTED_EXIT_CODE",
        "Restored": "shardax.checkpoint.Restored",
        "ShardingReport": "shardax.plan.ShardingReport",
        "StepClock": "shardax.track.StepClock",
        "TrainStep": "shardax.train.TrainStep",
        "WATCHDOG_EXIT_CODE": "shardax.runtime.WATCHDOG_EXIT_CODE",
        "all_gather": "shardax.parallel.all_gather",
        "all_reduce": "shardax.parallel.all_reduce",
        "axis_rules": "shardax.plan.axis_rules",
        "check_agreement": "shardax.runtime.check_agreement",
        "check_finite": "shardax.train.check_finite",
        "detect_hardware_type": "shardax.cost.detect_hardware_type",
        "device_info": "shardax.cost.device_info",
        "example_keys": "shardax.train.example_keys",
        "follow_params": "shardax.plan.follow_params",
        "host_reduce": "shardax.runtime.host_reduce",
        "host_value": "shardax.runtime.host_value",
        "init_sharded": "shardax.plan.init_sharded",
        "mesh_info": "shardax.mesh.mesh_info",
        "profile_steps": "shardax.track.profile_steps",
        "reached_preemption": "shardax.checkpoint.reached_preemption",
        "reduce": "shardax.parallel.reduce",
        "replicate_across_devices": "shardax.data.replicate_across_devices",
        "shard_batch_dim": "shardax.data.shard_batch_dim",
        "timed": "shardax.data.timed",
        "validate": "shardax.plan.validate",
        "validate_batch_size": "shardax.cost.validate_batch_size",
        "weighted_mean": "shardax.parallel.weighted_mean",
    },
    "shardax.train": {
        "LossScaleState": "shardax.train.precision.LossScaleState",
        "MODES": "shardax.train.config.MODES",
        "Program": "shardax.train.program.Program",
    },
    "shardax.data": {
        "POLICIES": "shardax.data.policy.POLICIES",
        "as_sharding": "shardax.data.assembly.as_sharding",
        "batch_shardings": "shardax.data.spec.batch_shardings",
        "fit_batch": "shardax.data.policy.fit_batch",
        "leaf_sharding": "shardax.data.placement.leaf_sharding",
        "pad_batch": "shardax.data.policy.pad_batch",
        "process_grid": "shardax.data.assembly.process_grid",
    },
    "shardax.parallel": {
        "ATTENTION_KERNELS": "shardax.parallel.fused.KERNELS",
        "bound_axes": "shardax.parallel.collectives.bound_axes",
        "checkpoint_policy": "shardax.parallel.remat_policy.checkpoint_policy",
        "require_bound": "shardax.parallel.collectives.require_bound",
        "scan_layers": "shardax.parallel.gpipe.scan_layers",
        "sequence_sharding": "shardax.parallel.context.sequence_sharding",
    },
    "shardax.plan": {
        "DEFAULT_FSDP_MIN_SIZE": "shardax.plan.core.DEFAULT_FSDP_MIN_SIZE",
        "FollowParams": "shardax.plan.follow.FollowParams",
        "Row": "shardax.plan.report.Row",
        "annotated_specs": "shardax.plan.annotations.annotated_specs",
        "axis_size": "shardax.plan.core.axis_size",
        "check_spec": "shardax.plan.specs.check_spec",
        "current_axis_rules": "shardax.plan.annotations.current_axis_rules",
        "format_bytes": "shardax.plan.report.format_bytes",
        "fsdp_spec": "shardax.plan.core.fsdp_spec",
        "is_array": "shardax.plan.tree.is_array",
        "logical_to_mesh": "shardax.plan.annotations.logical_to_mesh",
        "map_arrays": "shardax.plan.tree.map_arrays",
        "path_str": "shardax.plan.tree.path_str",
        "planned": "shardax.plan.placed.planned",
        "record": "shardax.plan.placed.record",
        "spec_errors": "shardax.plan.specs.spec_errors",
    },
    "shardax.mesh": {
        "MeshSpec": "shardax.mesh.make.MeshSpec",
        "resolve_mesh_shape": "shardax.mesh.make.resolve_mesh_shape",
    },
    "shardax.cost": {
        "BATCH_SIZE_TABLE": "shardax.cost.hardware.BATCH_SIZE_TABLE",
        "DEVICE_KIND_SPECS": "shardax.cost.hardware.DEVICE_KIND_SPECS",
        "GPUS_PER_HOST": "shardax.cost.target_names.GPUS_PER_HOST",
        "GPU_KINDS": "shardax.cost.target_names.GPU_KINDS",
        "GpuArch": "shardax.cost.datasheet.GpuArch",
        "HARDWARE_SPECS": "shardax.cost.hardware.HARDWARE_SPECS",
        "TPU_FAMILIES": "shardax.cost.target_names.TPU_FAMILIES",
        "gpu_target_config": "shardax.cost.gpu_config.gpu_target_config",
        "gpu_target_configs": "shardax.cost.gpu_config.gpu_target_configs",
        "hardware_type_of": "shardax.cost.hardware.hardware_type_of",
        "known_targets": "shardax.cost.target_names.known_targets",
        "parse_target": "shardax.cost.target_names.parse_target",
    },
    "shardax.runtime": {
        "backend_started": "shardax.runtime.distributed.backend_started",
        "device_put_global": "shardax.runtime.processes.device_put_global",
        "disable_compile_cache": "shardax.runtime.cache.disable_compile_cache",
        "fingerprint": "shardax.runtime.agreement.fingerprint",
        "resolve_coordinates": "shardax.runtime.distributed.resolve_coordinates",
    },
    "shardax.track": {
        "BACKENDS": "shardax.track.sinks.BACKENDS",
        "INPUT_BOUND": "shardax.track.clock.INPUT_BOUND",
        "check_writable": "shardax.track.sinks.check_writable",
        "parse_steps": "shardax.track.profile.parse_steps",
    },
}


def exports(namespace: str) -> list[str]:
    """``namespace``'s ``__all__``: its row of ``EXPORTS``."""
    return list(EXPORTS[namespace])


def spelled(namespace: str) -> str:
    """``namespace`` as a user writes it: ``"shardax.plan"`` is ``"sx.plan"``."""
    return "sx" + namespace.removeprefix("shardax")


def door_name(module: str, name: str) -> str | None:
    """The name a user calls ``name`` of ``module`` by (``"shardax.plan.core"``, ``"fsdp"``
    is ``"sx.fsdp"``; ``"shardax.plan.init"``, ``"init_sharded"`` is
    ``"sx.plan.init_sharded"``), or None where it is not public.

    >>> door_name("shardax.plan.core", "fsdp"), door_name("shardax.plan.tree", "path_str")
    ('sx.fsdp', None)
    """
    layer = ".".join(module.split(".")[:2])
    if name not in EXPORTS.get(layer, ()):
        return None
    return f"sx.{name}" if name in EXPORTS["shardax"] else f"{spelled(layer)}.{name}"


def names() -> list[str]:
    """Every public name as a user writes it (``sx.fsdp``, ``sx.plan.validate``, ...)."""
    return [f"{spelled(space)}.{name}" for space, row in EXPORTS.items() for name in row]
