"""shardax: take a JAX training loop from one device to many devices and many hosts.

The names here are what the guides use. Everything else is in its layer's namespace,
documented there: :mod:`shardax.mesh`, :mod:`shardax.plan`, :mod:`shardax.data`,
:mod:`shardax.parallel`, :mod:`shardax.train`, :mod:`shardax.checkpoint`,
:mod:`shardax.runtime`, :mod:`shardax.cost`, :mod:`shardax.track` and :mod:`shardax.loop`.
The artifex API of the seed documents is :mod:`shardax.artifex`, re-exported here.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> batch = sx.distribute_batch({"x": np.ones((16, 4))}, sx.batch_sharding(mesh))
"""

from shardax import (  # noqa: F401 (the layer namespaces: sx.plan.validate, sx.cost, ...)
    cost,
    data,
    loop,
    mesh,
    parallel,
    plan,
    runtime,
    track,
    train,
)
from shardax.artifex import (
    BatchSizeRecommendation,
    DataParallel,
    DeviceMeshManager,
    DevicePlacement,
    DistributedMetrics,
    HardwareType,
    distribute_batch,
    get_batch_size_recommendation,
    place_on_device,
)
from shardax.checkpoint import (
    CheckpointManager,
    Preempted,
    restore_checkpoint,
    save_checkpoint,
    watch_preemption,
)
from shardax.checks import moved as _moved
from shardax.cost import target
from shardax.cost.estimation import estimate
from shardax.data import batch_sharding, batches, global_batch, prefetch_to_device
from shardax.mesh import make_mesh
from shardax.parallel import attention, moe, pipeline, pipeline_1f1b, remat
from shardax.plan import (
    Plan,
    constrain,
    describe,
    from_linen,
    from_nnx,
    fsdp,
    replicate,
    rules,
    shard,
    zero1,
    zero2,
)
from shardax.runtime import StepWatchdog, compile_cache, initialize, is_main_process, print0
from shardax.track import MetricWriter
from shardax.train import (
    AutoPlanOptions,
    NonFiniteLossError,
    Precision,
    SearchSpace,
    TrainState,
    auto_plan,
    keep_plan,
    make_eval_step,
    make_train_step,
    masked_mean,
    prepare,
    search_plans,
    verify,
)

__version__ = "0.1.0"

__all__ = [
    "AutoPlanOptions",
    "BatchSizeRecommendation",
    "CheckpointManager",
    "DataParallel",
    "DeviceMeshManager",
    "DevicePlacement",
    "DistributedMetrics",
    "HardwareType",
    "MetricWriter",
    "NonFiniteLossError",
    "Plan",
    "Precision",
    "Preempted",
    "StepWatchdog",
    "TrainState",
    "SearchSpace",
    "attention",
    "auto_plan",
    "batch_sharding",
    "batches",
    "compile_cache",
    "constrain",
    "describe",
    "distribute_batch",
    "estimate",
    "from_linen",
    "from_nnx",
    "fsdp",
    "get_batch_size_recommendation",
    "global_batch",
    "initialize",
    "is_main_process",
    "keep_plan",
    "make_eval_step",
    "make_mesh",
    "make_train_step",
    "masked_mean",
    "moe",
    "pipeline",
    "pipeline_1f1b",
    "place_on_device",
    "prefetch_to_device",
    "prepare",
    "print0",
    "remat",
    "replicate",
    "restore_checkpoint",
    "rules",
    "save_checkpoint",
    "search_plans",
    "shard",
    "target",
    "verify",
    "watch_preemption",
    "zero1",
    "zero2",
]

# Names that left the top level, by their new home (relative to ``shardax``). They keep
# working for a release: ``sx.init_sharded`` warns and returns ``sx.plan.init_sharded``.
_MOVED = {
    "AgreementError": "runtime.AgreementError",
    "Auto": "AutoPlanOptions",
    "AutoPlan": "train.AutoPlan",
    "DATA_AXIS": "mesh.DATA_AXIS",
    "EvalStep": "train.EvalStep",
    "LossScaling": "train.LossScaling",
    "PREEMPTED_EXIT_CODE": "checkpoint.PREEMPTED_EXIT_CODE",
    "Restored": "checkpoint.Restored",
    "ShardingReport": "plan.ShardingReport",
    "StepClock": "track.StepClock",
    "TrainStep": "train.TrainStep",
    "WATCHDOG_EXIT_CODE": "runtime.WATCHDOG_EXIT_CODE",
    "all_gather": "parallel.all_gather",
    "all_reduce": "parallel.all_reduce",
    "axis_rules": "plan.axis_rules",
    "check_agreement": "runtime.check_agreement",
    "check_finite": "train.check_finite",
    "detect_hardware_type": "cost.detect_hardware_type",
    "device_info": "cost.device_info",
    "example_keys": "train.example_keys",
    "follow_params": "plan.follow_params",
    "host_reduce": "runtime.host_reduce",
    "host_value": "runtime.host_value",
    "init_sharded": "plan.init_sharded",
    "mesh_info": "mesh.mesh_info",
    "profile_steps": "track.profile_steps",
    "reached_preemption": "checkpoint.reached_preemption",
    "reduce": "parallel.reduce",
    "replicate_across_devices": "data.replicate_across_devices",
    "shard_batch_dim": "data.shard_batch_dim",
    "timed": "data.timed",
    "validate": "plan.validate",
    "validate_batch_size": "cost.validate_batch_size",
    "weighted_mean": "parallel.weighted_mean",
}


__getattr__ = _moved(__name__, {old: f"shardax.{home}" for old, home in _MOVED.items()})
