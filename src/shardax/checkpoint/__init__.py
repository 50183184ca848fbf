"""Checkpoint layer: orbax-backed save and restore with resharding, and preemption."""

from shardax._names import exports as _exports
from shardax.checkpoint.manager import (
    CheckpointManager,
    Restored,
    restore_checkpoint,
    save_checkpoint,
)
from shardax.checkpoint.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    reached_preemption,
    watch_preemption,
)

__all__ = _exports(__name__)
