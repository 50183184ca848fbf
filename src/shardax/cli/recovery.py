"""In-job recovery in ``shardax train``: its ``--snapshot-every`` (``shardax.loop.recovery``
holds the rest: where snapshots go, which step a restarted run resumes from).

Under ``shardax launch --max-restarts``, ``shardax train`` snapshots its state and data
position every ``--snapshot-every`` steps (default auto: every step while that costs at
most 5% of a step) into the launcher's host-memory directory; the run's summary lists
every restart.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from shardax.cli.common import UsageError
from shardax.loop.recovery import snapshot_manager as _manager
from shardax.runtime.launcher import ENV_SNAPSHOT_DIR


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
    """The snapshots' ``CheckpointManager`` (asynchronous, two kept), or None."""
    if snapshot_every(args) == 0:
        return None
    return _manager("train")
