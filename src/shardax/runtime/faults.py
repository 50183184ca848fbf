"""Faults injected on purpose, to see a run recover: ``$SHARDAX_FAULT``.

``SHARDAX_FAULT="1:5:raise,0:9:kill"`` makes process 1 raise after its step 5 and process
0 kill itself with SIGKILL after its step 9, in the run's first start only (a run that
``shardax launch --max-restarts`` restarted does not fail again at the same place).
``shardax train`` calls ``inject`` after every step; the fault
benchmark (``benchmarks/faults.py``) and the recovery tests use it. The kinds:

- ``raise``: a ``RuntimeError`` naming the fault, as a bug in the step would;
- ``exit``: ``os._exit(1)``, with no traceback;
- ``kill``: SIGKILL to itself, as the out-of-memory killer does;
- ``stop``: SIGSTOP to itself, as a process that hangs outside Python;
- ``hang``: a step that never returns (sleeps in Python; ``--step-timeout`` ends it);
- ``snapshot-kill``: SIGKILL to itself while the host-memory snapshot of that step is
  being written (``kill_while_saving``): the snapshot before it must be the one restored;
- ``lost``: SIGKILL to itself, and its place never comes back: every later start of the
  process in that place (``$SHARDAX_SLOT``, its rank in the first start) exits with code 1
  before its first step (``at_start``), as a lost host would (``shardax launch
  --min-processes`` then shrinks the run);
- ``host``: SIGKILL to itself, and its host is replaced: the restarted process in that
  place finds its snapshots in host memory gone (``at_start`` removes them), so under
  ``shardax launch --snapshot-peers`` its shards come from a peer's copy.

>>> planned("1:5:raise, 0:9:kill")
[Fault(rank=1, step=5, kind='raise'), Fault(rank=0, step=9, kind='kill')]
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

from shardax.runtime.launcher import ENV_SLOT, ENV_SNAPSHOT_DIR

ENV_FAULT = "SHARDAX_FAULT"
KINDS = ("raise", "exit", "kill", "stop", "hang", "snapshot-kill", "lost", "host")
IN_FLIGHT = ".orbax-checkpoint-tmp"
"""The suffix of a step orbax is still writing: it commits the step by renaming it."""


class Fault(NamedTuple):
    rank: int
    step: int
    kind: str


def planned(spec: str | None) -> list[Fault]:
    """The faults of a ``RANK:STEP:KIND[,...]`` spec; ``ValueError`` naming a bad one."""
    faults = []
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        words = part.strip().split(":")
        if len(words) != 3 or not (words[0] + words[1]).isdigit() or words[2] not in KINDS:
            raise ValueError(
                f"${ENV_FAULT}: each fault is RANK:STEP:KIND with KIND one of {list(KINDS)}, "
                f"got {part.strip()!r}"
            )
        faults.append(Fault(int(words[0]), int(words[1]), words[2]))
    return faults


def inject(step: int, rank: int, restart: int = 0) -> None:
    """Carries out the fault ``$SHARDAX_FAULT`` plans for process ``rank`` after ``step``,
    if any, in the first start (``restart`` 0) only."""
    if restart:
        return
    for fault in planned(os.environ.get(ENV_FAULT)):
        if (fault.rank, fault.step) != (rank, step):
            continue
        if fault.kind == "raise":
            raise RuntimeError(f"injected fault ({ENV_FAULT}): process {rank} after step {step}")
        if fault.kind == "exit":
            os._exit(1)
        if fault.kind in ("kill", "lost", "host"):
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault.kind == "snapshot-kill":
            kill_while_saving(os.environ.get(ENV_SNAPSHOT_DIR), step)
        while fault.kind == "hang":
            time.sleep(3600)


def at_start(restart: int) -> None:
    """Ends a restarted process (``restart`` > 0) whose place a ``lost`` fault took, with
    code 1 and a line saying so; in the first restart after a ``host`` fault, removes the
    snapshots its place kept in host memory (``process<slot>`` under
    ``$SHARDAX_SNAPSHOT_DIR``: the replaced host's memory is empty). Call it before the
    snapshots' manager is made; nothing happens otherwise."""
    slot = os.environ.get(ENV_SLOT)
    if not restart or slot is None:
        return
    for fault in planned(os.environ.get(ENV_FAULT)):
        if fault.kind == "host" and str(fault.rank) == slot and restart == 1:
            root = Path(os.environ.get(ENV_SNAPSHOT_DIR) or "/nonexistent")
            gone = sorted(root.glob(f"*/process{slot}"))
            for directory in gone:
                shutil.rmtree(directory, ignore_errors=True)
            print(
                f"injected fault ({ENV_FAULT}): the host of place {slot} was replaced after "
                f"step {fault.step}; its snapshots in host memory are gone "
                f"({', '.join(map(str, gone)) or 'none kept'})",
                file=sys.stderr,
                flush=True,
            )
        if fault.kind == "lost" and str(fault.rank) == slot:
            print(
                f"injected fault ({ENV_FAULT}): place {slot} was lost after step {fault.step}; "
                "a process started there cannot come back",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)


def kill_while_saving(
    directory: str | os.PathLike[str] | None, step: int, timeout: float = 60.0
) -> None:
    """SIGKILLs this process the moment a save of ``step`` is in flight in a manager under
    ``directory`` (its ``<step>.orbax-checkpoint-tmp*`` exists, and no committed ``<step>``),
    watching for up to ``timeout`` seconds; says on stderr what it saw first. Blocks: call
    it after the save began, or from a thread of its own."""
    if directory is None:
        raise ValueError(
            f"a snapshot-kill fault needs ${ENV_SNAPSHOT_DIR}: run under "
            "shardax launch --max-restarts K with snapshots on"
        )
    root, deadline = Path(directory), time.monotonic() + timeout
    while time.monotonic() < deadline:
        for manager in root.glob("*"):
            in_flight = any(manager.glob(f"{step}{IN_FLIGHT}*"))  # orbax may add -<time>
            if in_flight and not (manager / str(step)).exists():
                print(
                    f"injected fault ({ENV_FAULT}): SIGKILL while the snapshot of step "
                    f"{step} is written",
                    file=sys.stderr,
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            if (manager / str(step)).exists():
                raise RuntimeError(
                    f"injected fault ({ENV_FAULT}): the snapshot of step {step} "
                    "committed before the fault could land in it"
                )
        time.sleep(0.0005)
    raise RuntimeError(
        f"injected fault ({ENV_FAULT}): no snapshot of step {step} began within "
        f"{timeout:g} s under {root}"
    )
