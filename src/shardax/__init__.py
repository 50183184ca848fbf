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
from shardax.plan import Plan, fsdp, replicate, shard
from shardax.runtime import (
    AgreementError,
    BatchSizeRecommendation,
    HardwareType,
    check_agreement,
    detect_hardware_type,
    device_info,
    get_batch_size_recommendation,
    host_reduce,
    host_value,
    initialize,
    is_main_process,
    print0,
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
    "AgreementError",
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
    "TrainState",
    "TrainStep",
    "all_gather",
    "all_reduce",
    "batch_sharding",
    "batches",
    "check_agreement",
    "check_finite",
    "detect_hardware_type",
    "device_info",
    "distribute_batch",
    "example_keys",
    "fsdp",
    "get_batch_size_recommendation",
    "global_batch",
    "host_reduce",
    "host_value",
    "initialize",
    "is_main_process",
    "make_mesh",
    "make_train_step",
    "masked_mean",
    "mesh_info",
    "place_on_device",
    "prefetch_to_device",
    "print0",
    "reduce",
    "replicate",
    "replicate_across_devices",
    "restore_checkpoint",
    "save_checkpoint",
    "shard",
    "shard_batch_dim",
    "validate_batch_size",
    "weighted_mean",
]
