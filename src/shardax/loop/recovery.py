"""In-job recovery seen from a loop: where its snapshots go, which step a restarted run
resumes from, and what the launch's status file records of each restart.

Under ``shardax launch --max-restarts K`` the launcher owns a snapshot directory in host
memory (``$SHARDAX_SNAPSHOT_DIR``, in ``/dev/shm``: it outlives any process) and counts its
restarts (``$SHARDAX_RESTART``). A loop snapshots its state and data position into it
(``Snapshots``: asynchronously, the two newest kept). A restarted run resumes from the
newest complete one of the snapshots and the persistent checkpoints (the snapshot when
they tie), says which, and records in the launch's status file the step restored, the
steps lost and the seconds from the failure to its first completed step.

>>> newest(None, None) is None
True
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import jax

from shardax.checkpoint import CheckpointManager
from shardax.checkpoint.peers import PeerSnapshots
from shardax.runtime.launcher import (
    ENV_LAUNCH_DIR,
    ENV_PLANNED,
    ENV_RESTART,
    ENV_SNAPSHOT_DIR,
    ENV_SNAPSHOT_PEERS,
    read_status,
    update_status,
)

KEEP = 2
"""Snapshots kept: the newest, and the one before it while the newest is written."""


def _env_int(name: str) -> int | None:
    """The integer the launcher set in ``$name`` (None: unset); ``ValueError`` naming it."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None


def restart() -> int:
    """How many times the launcher restarted this run's processes (0: the first start)."""
    return _env_int(ENV_RESTART) or 0


def planned_processes() -> int:
    """The process count the launch planned (``shardax launch -n``): more than
    ``jax.process_count()`` once the run has shrunk (``--min-processes``), when a loop
    keeps its global batch with that many times the microbatches. Outside ``shardax
    launch``, ``jax.process_count()``."""
    planned = _env_int(ENV_PLANNED)
    return jax.process_count() if planned is None else planned


def snapshot_directory() -> Path | None:
    """The launcher's snapshot directory (``$SHARDAX_SNAPSHOT_DIR``), or None."""
    directory = os.environ.get(ENV_SNAPSHOT_DIR)
    return Path(directory) if directory else None


def snapshot_manager(name: str, like: Any = None) -> Any:
    """The snapshots' manager, ``name`` under the launcher's directory: asynchronous,
    ``KEEP`` kept. ``ValueError`` when no launcher owns one. With
    ``$SHARDAX_SNAPSHOT_PEERS`` (``shardax launch --snapshot-peers``), a
    ``shardax.checkpoint.peers.PeerSnapshots`` for the state ``like``: each
    process's copy its own, a lost one fetched from a peer."""
    directory = snapshot_directory()
    if directory is None:
        raise ValueError(
            f"snapshots live in host memory that a launcher owns, and ${ENV_SNAPSHOT_DIR} is "
            "unset; run under shardax launch --max-restarts K (it keeps them in /dev/shm), or "
            "use persistent checkpoints"
        )
    if os.environ.get(ENV_SNAPSHOT_PEERS) == "1":
        if like is None:
            raise ValueError(f"${ENV_SNAPSHOT_PEERS}: peer snapshots need the state (like=)")
        return PeerSnapshots(directory / name, like, max_to_keep=KEEP)
    return CheckpointManager(directory / name, async_save=True, max_to_keep=KEEP)


def newest(manager: Any, snapshots: Any) -> tuple[Any, str] | None:
    """The manager holding the newest committed step, and its words (``the host-memory
    snapshot`` wins a tie); None when neither holds a step."""
    found = []
    for priority, (source, words) in enumerate(
        ((snapshots, "the host-memory snapshot"), (manager, "the persistent checkpoint"))
    ):
        step = source.latest_step() if source is not None else None
        if step is not None:
            found.append((step, -priority, source, words))
    if not found:
        return None
    _, _, source, words = max(found, key=lambda f: f[:2])
    return source, f"{words} in {source.directory}"


class Recovery:
    """This process's part in a restart: what it restored, and when its first step
    completed (process 0 writes both into the launch's status file)."""

    def __init__(self) -> None:
        self.restart = restart()
        self.restored_step: int | None = None
        self.source: str | None = None

    def restored(self, step: int | None, source: str | None) -> None:
        self.restored_step, self.source = step, source

    def first_step_done(self, step: int) -> None:
        """Called once the first step after a restart has completed."""
        directory = os.environ.get(ENV_LAUNCH_DIR)
        if not self.restart or not directory or jax.process_index() != 0:
            return
        now = time.time()

        def change(status: dict[str, Any]) -> None:
            restarts = status.get("restarts") or [{}]
            last = restarts[-1]
            lost = None
            if last.get("last_completed") is not None and self.restored_step is not None:
                lost = max(int(last["last_completed"]) - self.restored_step, 0)
            last.update(
                restored_step=self.restored_step,
                restored_from=self.source,
                steps_lost=lost,
                first_step=step,
                seconds_to_next_step=now - last["at"] if "at" in last else None,
            )
            status["restarts"] = restarts

        update_status(directory, change)


def history() -> list[dict[str, Any]]:
    """Every restart of this launch so far, as its status file records them (empty
    outside ``shardax launch`` or before any restart)."""
    directory = os.environ.get(ENV_LAUNCH_DIR)
    if not restart() or not directory:
        return []
    return list(read_status(directory).get("restarts", []))
