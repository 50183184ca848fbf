"""One save or one restore, each with a manager of its own, opened and closed.

>>> import shardax as sx
>>> state = {"w": jnp.ones((8, 4)), "step": jnp.int32(0)}
>>> sx.save_checkpoint(tmp_path / "ckpt", state, step=1)
>>> sx.restore_checkpoint(tmp_path / "ckpt", like=state).step
1
"""

from __future__ import annotations

import os
from typing import Any

from shardax.checkpoint.manager import CheckpointManager, Restored
from shardax.checks import public


@public("sx.save_checkpoint")
def save_checkpoint(
    directory: str | os.PathLike[str],
    state: Any,
    *,
    step: int,
    data_state: Any = None,
    max_to_keep: int | None = None,
    overwrite: bool = False,
) -> None:
    """Saves ``state`` and ``data_state`` as ``step`` in ``directory``; see
    [`CheckpointManager`][shardax.CheckpointManager]. It deletes no step unless ``max_to_keep`` asks
    it to (keeping that many of the highest steps, as
    [`CheckpointManager.save`][shardax.CheckpointManager.save])."""
    with CheckpointManager(directory, max_to_keep) as manager:
        manager.save(step, state, data_state, overwrite=overwrite)


@public("sx.restore_checkpoint")
def restore_checkpoint(
    directory: str | os.PathLike[str], like: Any, step: int | None = None
) -> Restored:
    """Restores ``step`` (default: latest) of ``directory`` onto ``like``'s shardings;
    returns ``Restored(state, data_state, step)``."""
    with CheckpointManager(directory, max_to_keep=None, create=False) as manager:
        return manager.restore(like, step)
