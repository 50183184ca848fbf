"""Checkpoint layer: orbax-backed save and restore with resharding, and preemption."""

from shardax._names import exports as _exports
from shardax.checkpoint.manager import CheckpointManager, Restored
from shardax.checkpoint.one_shot import restore_checkpoint, save_checkpoint
from shardax.checkpoint.preemption import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    reached_preemption,
    watch_preemption,
)

__all__ = _exports(__name__)
