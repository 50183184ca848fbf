"""Loop layer: what ``shardax train`` does around its steps, for the user's own loop.

[`run`][shardax.loop.run] wraps a loop the user keeps (an ``nnx.Optimizer`` loop kept with
``sx.prepare``, or a ``sx.make_train_step`` loop) with hooks (``shardax.loop.hooks``),
each owning one concern: checkpoints with the data position, preemption, the hang
watchdog, the goodput ledger, the metrics window and NaN guard, evaluation, progress and
logging. One predicate, [`itstime`][shardax.loop.itstime], schedules them all.
"""

from shardax._names import exports as _exports
from shardax.loop.driver import Run, run
from shardax.loop.hooks import (
    Checkpoints,
    Evaluation,
    Every,
    Goodput,
    Hook,
    Logging,
    MetricsWindow,
    Preemption,
    Progress,
    Snapshots,
    Watchdog,
)
from shardax.loop.schedule import itstime

__all__ = _exports(__name__)
