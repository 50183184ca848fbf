"""Checkpoint layer: orbax-backed save and restore with resharding, and preemption."""

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

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "CheckpointManager",
    "Preempted",
    "Restored",
    "reached_preemption",
    "restore_checkpoint",
    "save_checkpoint",
    "watch_preemption",
]
