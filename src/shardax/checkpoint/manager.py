"""Save and restore a train state and the data position with orbax-checkpoint.

Saves are atomic (orbax writes to a temporary directory and renames it on commit;
leftovers of an interrupted save are cleaned up), the last ``max_to_keep`` steps are
kept, and a restore places every array on the sharding of ``like``, whatever sharding
it was saved with.

>>> import shardax as sx
>>> state = {"w": jnp.ones((8, 4)), "step": jnp.int32(0)}
>>> sx.save_checkpoint("/tmp/sx_doc_ckpt", state, step=1, overwrite=True)
>>> sx.restore_checkpoint("/tmp/sx_doc_ckpt", like=state).step
1
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from shardax.checkpoint.convert import abstract_saveable, flat_paths, from_saveable, to_saveable
from shardax.checkpoint.preemption import reached_preemption


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "checkpoints need orbax-checkpoint: pip install 'shardax[checkpoint]'"
        ) from e
    return ocp


class Restored(NamedTuple):
    """What a restore gives back."""

    state: Any
    data_state: Any
    step: int


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of a run in ``directory``.

    Every process of a multi-process run must call :meth:`save` and :meth:`restore`.
    """

    def __init__(self, directory: str | os.PathLike[str], max_to_keep: int | None = 3) -> None:
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=False,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler(),
            },
        )

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first; interrupted saves are not among them."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, data_state: Any = None, overwrite: bool = False) -> None:
        """Saves ``state`` (any pytree) and the JSON-able ``data_state`` as ``step``.

        A step that exists raises ``FileExistsError`` unless ``overwrite=True``, which
        deletes that step before saving the new one: a crash in between loses the step
        (the other kept steps are untouched).
        """
        ocp = _ocp()
        step = int(step)
        if step in self.all_steps():
            if not overwrite:
                raise FileExistsError(
                    f"checkpoint step {step} already exists in {self.directory}; pass "
                    "overwrite=True to replace it"
                )
            self._manager.delete(step)
        items = {"state": ocp.args.StandardSave(to_saveable(state))}
        items["data"] = ocp.args.JsonSave({"data_state": data_state})
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        """True when the loop should save ``step`` and stop (see
        :func:`shardax.checkpoint.preemption.reached_preemption`): a SIGTERM arrived and,
        with several processes, ``step`` is the step they all agreed on. Call it after
        every step on every process; then ``save`` and raise :class:`Preempted`.
        """
        return reached_preemption(step)

    def data_state(self, step: int | None = None) -> Any:
        """The data state saved with ``step`` (default: the latest), without the arrays."""
        ocp = _ocp()
        step = self._committed(step)
        return self._manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))[
            "data"
        ]["data_state"]

    def _committed(self, step: int | None) -> int:
        """``step``, or the latest; raises ``FileNotFoundError`` when it is not committed."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"checkpoint step {step} not in {self.directory}; available steps: {steps}"
            )
        return step

    def restore(self, like: Any, step: int | None = None) -> Restored:
        """Restores ``step`` (default: the latest) onto the structure and shardings of ``like``.

        ``like`` is a concrete state, or an abstract one (ShapeDtypeStructs with
        shardings, e.g. from a plan). A tree that differs from the saved one in
        structure, shape or dtype raises ``ValueError`` naming the path.
        """
        ocp = _ocp()
        step = self._committed(step)
        target = abstract_saveable(like)
        saved = self._manager.item_metadata(step)["state"]
        check_same_tree(flat_paths(_metadata_tree(saved)), flat_paths(target), step)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
            ),
        )
        return Restored(
            from_saveable(like, restored["state"]), restored["data"]["data_state"], step
        )

    def close(self) -> None:
        """Waits for pending work and releases the manager."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _metadata_tree(metadata: Any) -> Any:
    return getattr(metadata, "tree", metadata)


def check_same_tree(saved: dict[str, Any], target: dict[str, Any], step: int) -> None:
    """Raises ``ValueError`` naming the first path whose presence, shape or dtype differ."""
    missing = sorted(set(target) - set(saved))
    extra = sorted(set(saved) - set(target))
    if missing or extra:
        raise ValueError(
            f"checkpoint step {step} does not match the tree of `like`: "
            + (f"not in the checkpoint: {missing}; " if missing else "")
            + (f"in the checkpoint but not in `like`: {extra}" if extra else "")
        )
    for path in sorted(target):
        want, got = target[path], saved[path]
        if tuple(got.shape) != tuple(np.shape(want)):
            raise ValueError(
                f"checkpoint step {step}: leaf {path!r} has shape {tuple(got.shape)} in the "
                f"checkpoint but {tuple(np.shape(want))} in `like`"
            )
        if np.dtype(got.dtype) != np.dtype(want.dtype):
            raise ValueError(
                f"checkpoint step {step}: leaf {path!r} has dtype {np.dtype(got.dtype)} in the "
                f"checkpoint but {np.dtype(want.dtype)} in `like`"
            )


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: Any,
    *,
    step: int,
    data_state: Any = None,
    max_to_keep: int | None = 3,
    overwrite: bool = False,
) -> None:
    """Saves ``state`` and ``data_state`` as ``step`` in ``directory``; see
    :class:`CheckpointManager`."""
    with CheckpointManager(directory, max_to_keep) as manager:
        manager.save(step, state, data_state, overwrite=overwrite)


def restore_checkpoint(
    directory: str | os.PathLike[str], like: Any, step: int | None = None
) -> Restored:
    """Restores ``step`` (default: latest) of ``directory`` onto ``like``'s shardings;
    returns ``Restored(state, data_state, step)``."""
    with CheckpointManager(directory, max_to_keep=None) as manager:
        return manager.restore(like, step)
