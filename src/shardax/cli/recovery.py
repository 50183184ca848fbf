"""In-job recovery in ``shardax train``: host-memory snapshots, and the resume of a run that
``shardax launch --max-restarts`` restarted after a failure.

Under such a launch, the launcher owns a snapshot directory in host memory
(``$SHARDAX_SNAPSHOT_DIR``, in ``/dev/shm``: it outlives any process) and counts its restarts
(``$SHARDAX_RESTART``). ``shardax train`` then snapshots its state and data position every
``--snapshot-every`` steps (default auto: every step while that costs at most 5% of a
step) into it, asynchronously, the two newest kept. A
restarted run resumes from the newest complete one of the snapshots and the persistent
checkpoints (the snapshot when they tie), says which, and records in the launch's status
file the step restored, the steps lost and the seconds from the failure to its first
completed step; the run's summary lists every restart.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import jax

import shardax as sx
from shardax.cli.common import UsageError
from shardax.runtime.launcher import (
    ENV_LAUNCH_DIR,
    ENV_RESTART,
    ENV_SNAPSHOT_DIR,
    read_status,
    update_status,
)

KEEP = 2
"""Snapshots kept: the newest, and the one before it while the newest is written."""


def restart() -> int:
    """How many times the launcher restarted this run's processes (0: the first start)."""
    raw = os.environ.get(ENV_RESTART) or "0"
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"${ENV_RESTART} must be an integer, got {raw!r}") from None


def snapshot_interval(text: str) -> int | str:
    """An argparse type: ``auto`` or a number of steps >= 0.

    >>> snapshot_interval("auto"), snapshot_interval("3")
    ('auto', 3)
    """
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 0, got {text!r}")
    return int(text)


def snapshot_every(args: argparse.Namespace) -> int | None:
    """``--snapshot-every`` as ``Snapshots`` takes it (None: auto), or its default: auto
    where a launcher owns a snapshot directory, else 0 (none). Refused where there is no
    directory to keep them."""
    every = args.snapshot_every
    directory = os.environ.get(ENV_SNAPSHOT_DIR)
    if every is None:
        return None if directory else 0
    if every and not directory:
        raise UsageError(
            f"--snapshot-every {every}: snapshots live in host memory that a launcher owns, "
            f"and ${ENV_SNAPSHOT_DIR} is unset; run under shardax launch --max-restarts K (it "
            "keeps them in /dev/shm), or use --checkpoint-dir with --save-every for "
            "persistent checkpoints"
        )
    return None if every == "auto" else every


def snapshot_manager(args: argparse.Namespace) -> Any:
    """The snapshots' ``CheckpointManager`` (asynchronous, ``KEEP`` kept), or None."""
    if snapshot_every(args) == 0:
        return None
    return sx.CheckpointManager(
        Path(os.environ[ENV_SNAPSHOT_DIR]) / "train", async_save=True, max_to_keep=KEEP
    )


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
