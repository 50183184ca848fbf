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
- ``hang``: a step that never returns (sleeps in Python; ``--step-timeout`` ends it).

>>> planned("1:5:raise, 0:9:kill")
[Fault(rank=1, step=5, kind='raise'), Fault(rank=0, step=9, kind='kill')]
"""

from __future__ import annotations

import os
import signal
import time
from typing import NamedTuple

ENV_FAULT = "SHARDAX_FAULT"
KINDS = ("raise", "exit", "kill", "stop", "hang")


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
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        while fault.kind == "hang":
            time.sleep(3600)
