"""In-job recovery in ``shardax train``: its ``--snapshot-every`` (``shardax.loop.recovery``
holds the rest: where snapshots go, which step a restarted run resumes from).

Under ``shardax launch --max-restarts``, ``shardax train`` snapshots its state and data
position every ``--snapshot-every`` steps (default auto: every step while that costs at
most 5% of a step) into the launcher's host-memory directory; the run's summary lists
every restart.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import jax

from shardax.cli.common import UsageError
from shardax.loop.recovery import planned_processes
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


def snapshot_manager(args: argparse.Namespace, like: Any = None) -> Any:
    """The snapshots' manager for the state ``like`` (asynchronous, two kept), or None."""
    if snapshot_every(args) == 0:
        return None
    try:
        return _manager("train", like)
    except ValueError as e:  # peer snapshots on a state with no second copy
        raise UsageError(f"--snapshot-peers: {e}") from None


def shrink(args: argparse.Namespace) -> str | None:
    """Fits ``args`` to a run that shrank (``shardax launch --min-processes``): ``k`` times
    fewer processes than planned give ``k`` times the microbatches (``--accumulate``), so
    the global batch and each microbatch keep their sizes, and an explicit ``--mesh``'s
    data axis ``k`` times smaller. Returns the line that says so; None when the run has
    the processes it planned."""
    planned, now = planned_processes(), jax.process_count()
    if planned <= now:
        return None
    factor = planned // now
    before, mesh = args.accumulate, dict(args.mesh or {})
    data = mesh.get("data", -1)
    others = math.prod(v for k, v in mesh.items() if k != "data" and v != -1)
    if (data != -1 and data % factor) or jax.device_count() % others:
        raise UsageError(
            f"--mesh {args.mesh}: the run shrank from {planned} to {now} processes "
            f"({jax.device_count()} devices), and this mesh does not fit them with a data "
            f"axis {factor}x smaller; give a --mesh whose other axes divide the devices left "
            "and a data axis of -1 (every device left) to let a run shrink"
        )
    args.accumulate = before * factor
    if data != -1:
        args.mesh = [(k, v // factor if k == "data" else v) for k, v in args.mesh]
    return (
        f"shardax train: the run shrank from {planned} to {now} processes: --accumulate "
        f"{before} -> {args.accumulate} keeps the global batch of {args.batch_size} and its "
        f"microbatches' size on a {factor}x smaller data axis"
    )
