"""shardax: take a JAX training loop from one device to many devices and many hosts.

The names here are what the guides use. Everything else is in its layer's namespace,
documented there: [`sx.mesh`][shardax.mesh], [`sx.plan`][shardax.plan],
[`sx.data`][shardax.data], [`sx.parallel`][shardax.parallel], [`sx.train`][shardax.train],
[`sx.checkpoint`][shardax.checkpoint], [`sx.runtime`][shardax.runtime],
[`sx.cost`][shardax.cost], [`sx.track`][shardax.track] and [`sx.loop`][shardax.loop]. The
artifex API of the seed documents is [`sx.artifex`][shardax.artifex], re-exported here.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> batch = sx.distribute_batch({"x": np.ones((16, 4))}, sx.batch_sharding(mesh))
"""

from shardax import (
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
from shardax._names import exports as _exports
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
    DiLoCo,
    NonFiniteLossError,
    Precision,
    SearchSpace,
    TrainState,
    auto_plan,
    explain,
    keep_plan,
    make_eval_step,
    make_train_step,
    masked_mean,
    prepare,
    search_plans,
    verify,
)

__version__ = "0.2.0"

__all__ = _exports(__name__)

# Names that left the top level keep working for a minor version (shardax/_names.py MOVED):
# a retired one (RETIRED, CHANGELOG.md) is an AttributeError naming its home.
__getattr__ = _moved(__name__)
