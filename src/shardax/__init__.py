"""shardax: take a JAX training loop from one device to many devices and many hosts.

The names here are what the guides use. Everything else is in its layer's namespace,
documented there: :mod:`shardax.mesh`, :mod:`shardax.plan`, :mod:`shardax.data`,
:mod:`shardax.parallel`, :mod:`shardax.train`, :mod:`shardax.checkpoint`,
:mod:`shardax.runtime`, :mod:`shardax.cost` and :mod:`shardax.track`. The artifex API
of the seed documents is :mod:`shardax.artifex`, re-exported here.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> batch = sx.distribute_batch({"x": np.ones((16, 4))}, sx.batch_sharding(mesh))
"""

from shardax import (  # noqa: F401 (the layer namespaces: sx.plan.validate, sx.cost, ...)
    cost,
    data,
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
from shardax.cost import target
from shardax.cost.estimate import estimate
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
    TrainState,
    auto_plan,
    make_eval_step,
    make_train_step,
    masked_mean,
    prepare,
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
    "shard",
    "target",
    "verify",
    "watch_preemption",
    "zero1",
    "zero2",
]
