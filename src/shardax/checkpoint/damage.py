"""A committed step that cannot be read: named as damaged, the newest intact step used.

A step is committed once orbax renamed it into place, but a disk can still lose part of it
afterwards (a truncated file, a copy cut short, a bad sector). Reading it then fails deep in
tensorstore (``OUT_OF_RANGE: Error reading "w/0" ...``, a page of its spec) or in a JSON
parser. [`CheckpointManager.restore`][shardax.CheckpointManager.restore] names such a step
as damaged, with the one line of the cause that says what went wrong, and for the latest
step goes back to the newest step that reads, with a warning naming both; the damaged step
is moved aside (``.damaged-<step>``, kept for inspection, never listed or deleted), so the
run resumed from the older step can save that step number again.

>>> try:
...     try:
...         raise ValueError('OUT_OF_RANGE: Error reading "w/0": byte range [0, 10) of 5')
...     except ValueError as e:
...         raise RuntimeError("Encountered error while reading array index ...") from e
... except RuntimeError as e:
...     cause_line(e)
'OUT_OF_RANGE: Error reading "w/0": byte range [0, 10) of 5'
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np
from jax.experimental import multihost_utils

DAMAGED = ".damaged-"
"""Prefix of a damaged step moved aside by the directory's writer."""

_STATUS = re.compile(
    r"\b(OUT_OF_RANGE|DATA_LOSS|NOT_FOUND|INVALID_ARGUMENT|FAILED_PRECONDITION"
    r"|UNKNOWN|INTERNAL|PERMISSION_DENIED|UNAVAILABLE):"
)


_OS_ERROR = re.compile(r'"(?P<path>[^"]+)": [^"]*: (?P<why>[^:\[]+?) \[os_error_code')


class Unreadable(Exception):
    """Reading ``step`` failed in orbax or tensorstore (not in shardax's tree check)."""

    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(step, error)
        self.step, self.error = step, error

    @property
    def cause(self) -> str:
        return cause_line(self.error)


def cause_line(error: BaseException) -> str:
    """The one line of ``error``'s chain that says what failed: the system's error and the
    file where tensorstore names one (``File too large (/ck/2.orbax-checkpoint-tmp/...)``),
    else a tensorstore status line (``OUT_OF_RANGE: ...``), else the innermost error's
    first line as ``Type: message``; at most 300 characters."""
    chain: list[BaseException] = []
    seen = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        for line in str(e).splitlines():
            system = _OS_ERROR.search(line)
            if system:  # a full disk: "No space left on device (the file)"
                return f"{system['why']} ({system['path']})"
            if _STATUS.search(line):
                return f"{line.strip()[:300]}"
    inner = chain[-1]
    first = (str(inner).splitlines() or [""])[0].strip()
    return f"{type(inner).__name__}: {first}"[:300]


def everywhere(ok: bool) -> bool:
    """True when ``ok`` holds on every process (each reads its own shards, so one may fail
    where another reads), so that every process takes the same step."""
    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))) == 1)


def move_aside(directory: str, step: int) -> str | None:
    """Renames step ``step`` to ``.damaged-<step>`` (process 0; the caller holds the
    directory's writer lock); returns the new path, or None when it could not."""
    aside = os.path.join(directory, f"{DAMAGED}{step}")
    if jax.process_index() == 0:
        try:
            if os.path.exists(aside):
                aside = f"{aside}-{os.getpid()}"
            os.rename(os.path.join(directory, str(step)), aside)
        except OSError:
            return None
    return aside
