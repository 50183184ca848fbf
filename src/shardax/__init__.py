"""shardax: take a JAX training loop from one device to many devices and many hosts.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> batch = sx.distribute_batch({"x": np.ones((16, 4))}, sx.batch_sharding(mesh))
"""

from shardax.checkpoint import CheckpointManager, Restored, restore_checkpoint, save_checkpoint
from shardax.data import (
    DevicePlacement,
    batch_sharding,
    batches,
    distribute_batch,
    global_batch,
    place_on_device,
    prefetch_to_device,
    replicate_across_devices,
    shard_batch_dim,
)
from shardax.mesh import DATA_AXIS, DeviceMeshManager, make_mesh, mesh_info
from shardax.plan import (
    Plan,
    ShardingReport,
    axis_rules,
    constrain,
    describe,
    follow_params,
    from_nnx,
    fsdp,
    init_sharded,
    replicate,
    rules,
    shard,
    validate,
)
from shardax.runtime import (
    BatchSizeRecommendation,
    HardwareType,
    detect_hardware_type,
    device_info,
    get_batch_size_recommendation,
    validate_batch_size,
)
from shardax.train import (
    DataParallel,
    DistributedMetrics,
    TrainState,
    TrainStep,
    all_gather,
    all_reduce,
    example_keys,
    make_train_step,
    masked_mean,
    reduce,
    weighted_mean,
)
from shardax.train.guard import NonFiniteLossError, check_finite

__version__ = "0.1.0"

__all__ = [
    "DATA_AXIS",
    "BatchSizeRecommendation",
    "CheckpointManager",
    "DataParallel",
    "DeviceMeshManager",
    "DevicePlacement",
    "DistributedMetrics",
    "HardwareType",
    "NonFiniteLossError",
    "Plan",
    "Restored",
    "ShardingReport",
    "TrainState",
    "TrainStep",
    "all_gather",
    "all_reduce",
    "axis_rules",
    "batch_sharding",
    "batches",
    "check_finite",
    "constrain",
    "describe",
    "detect_hardware_type",
    "device_info",
    "distribute_batch",
    "example_keys",
    "follow_params",
    "from_nnx",
    "fsdp",
    "get_batch_size_recommendation",
    "global_batch",
    "init_sharded",
    "make_mesh",
    "make_train_step",
    "masked_mean",
    "mesh_info",
    "place_on_device",
    "prefetch_to_device",
    "reduce",
    "replicate",
    "replicate_across_devices",
    "restore_checkpoint",
    "rules",
    "save_checkpoint",
    "shard",
    "shard_batch_dim",
    "validate",
    "validate_batch_size",
    "weighted_mean",
]
