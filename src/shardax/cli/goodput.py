"""``shardax goodput RUN_OR_CHECKPOINT_DIR``: where a run's wall time went.

Reads the goodput ledger (``shardax.track.goodput``) that ``shardax train`` keeps
beside its checkpoints (``CHECKPOINT_DIR/goodput.json``, or ``RUN_DIR/goodput.json``
without checkpoints), over every session of the run (preemptions and resumes included),
and prints the seconds per bucket, their shares and the goodput fraction; ``--json``
prints one JSON object, ``--png PATH`` draws the buckets.
"""

from __future__ import annotations

import argparse
import json
import os

from shardax.cli.common import UsageError, path_arg, required_path
from shardax.track import goodput
from shardax.track.goodput import FILE

STARTS_JAX = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", type=required_path, help="a run directory or a checkpoint directory"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--png", type=path_arg, default=None, metavar="PATH", help="also draw the buckets here"
    )


def find_ledger(directory: str) -> str:
    """The ledger file of ``directory``: its own ``goodput.json``, or one directory down
    (a run directory whose checkpoints are in a subdirectory)."""
    if os.path.isfile(directory):
        return directory
    here = os.path.join(directory, FILE)
    if os.path.isfile(here):
        return here
    below = sorted(
        os.path.join(directory, d, FILE)
        for d in (os.listdir(directory) if os.path.isdir(directory) else [])
        if os.path.isfile(os.path.join(directory, d, FILE))
    )
    if not below:
        raise UsageError(
            f"no goodput ledger ({FILE}) in {directory} or its subdirectories; shardax train "
            "writes it to --checkpoint-dir (or the run directory)"
        )
    return below[0]


def run(args: argparse.Namespace) -> int:
    path = find_ledger(args.directory)
    try:
        sessions = goodput.load(path)["sessions"]
    except ValueError as e:
        raise UsageError(str(e)) from None
    buckets = goodput.totals(sessions)
    wall = sum(buckets.values())
    if args.png:
        goodput.plot(buckets, args.png, title=f"{path}: goodput {goodput.fraction(buckets):.1%}")
    if args.json:
        record = {
            "ledger": path,
            "sessions": len(sessions),
            "wall_s": wall,
            "goodput": goodput.fraction(buckets),
            "buckets_s": buckets,
            "last_step": max((s["last_step"] or 0 for s in sessions), default=0),
        }
        print(json.dumps(record))
        return 0
    print(f"{path}")
    print(goodput.table(buckets, sessions=len(sessions)))
    if args.png:
        print(f"plot: {args.png}")
    return 0
