"""Checkpoint layer: orbax-backed save and restore with resharding."""

from shardax.checkpoint.manager import (
    CheckpointManager,
    Restored,
    restore_checkpoint,
    save_checkpoint,
)

__all__ = ["CheckpointManager", "Restored", "restore_checkpoint", "save_checkpoint"]
