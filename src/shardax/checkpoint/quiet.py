"""orbax's noise around a failed asynchronous save (or a restore of a damaged step), kept
off the user's output while a manager that saved (or restored) is open: orbax's error logs
(one traceback per failed write and per thread), asyncio's reports of orbax's failed write
tasks, the "Event loop is closed" of writes that finish after the failed save's loop was
closed, and the unretrieved errors of a damaged step's other reads. shardax raises the
failure itself (``OSError`` naming the step, the directory and the cause).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any


class _OrbaxErrors(logging.Filter):
    """Drops the error logs of a failed orbax-checkpoint save, each with its traceback
    (tens of lines per thread, and one per write that fails after the first): orbax's
    own, and asyncio's "Task exception was never retrieved" for orbax's write tasks.
    shardax raises the failure itself, naming the step, the directory and the cause,
    with orbax's error chained to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if "/orbax/checkpoint/" in record.pathname.replace(os.sep, "/"):
            return False
        return not (record.name == "asyncio" and "/orbax/checkpoint/" in _message(record))


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage().replace(os.sep, "/")
    except Exception:  # a record whose arguments do not format: keep it
        return ""


def _late_completions(previous: Any) -> Any:
    """An unraisable hook that drops asyncio's "Event loop is closed" raised where a
    native callback (tensorstore's) reports a write finishing after the failed save's
    loop was closed: harmless, and one traceback per write. Anything else goes to
    ``previous``."""

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        late = (
            isinstance(error, RuntimeError)
            and str(error) == "Event loop is closed"
            and unraisable.object is None
        )
        if not late and not _orbax_read(unraisable.object):
            previous(unraisable)

    hook.shardax_late_completions = True  # type: ignore[attr-defined]
    return hook


def _orbax_read(thing: Any) -> bool:
    """Whether ``thing`` is one of orbax's coroutines (a read of one array of a damaged
    step, whose error nobody retrieves once the first read's error ended the restore)."""
    code = getattr(thing, "cr_code", None)
    return code is not None and "/orbax/checkpoint/" in code.co_filename.replace(os.sep, "/")


class _Quiet:
    """The filters on orbax's save-error logs (``_OrbaxErrors`` on the ``absl`` and
    ``asyncio`` loggers) and the unraisable hook (``_late_completions``), installed
    while at least one manager that saved is open, and removed (the previous hook put
    back) when the last one closes, so nothing stays on the process after; but once a
    save failed, the ``asyncio`` filter stays: orbax's failed write tasks report "Task
    exception was never retrieved" when they are garbage-collected, which can be after
    the last close (at exit). It drops only those reports of orbax's own tasks."""

    def __init__(self) -> None:
        self.users = 0
        self.failed = False  # a save failed in this process
        self.filters: list[tuple[logging.Logger, logging.Filter]] = []
        self.hook: Any = None
        self.previous: Any = None
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            self.users += 1
            if self.users > 1:
                return
            for name in ("absl", "asyncio"):  # orbax logs through absl, which logs here
                if any(logger.name == name for logger, _ in self.filters):
                    continue  # the asyncio filter a failed save left
                logger, kept = logging.getLogger(name), _OrbaxErrors()
                logger.addFilter(kept)
                self.filters.append((logger, kept))
            self.previous = sys.unraisablehook
            self.hook = sys.unraisablehook = _late_completions(self.previous)

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0:
                return
            stays = [(lg, f) for lg, f in self.filters if self.failed and lg.name == "asyncio"]
            for logger, kept in self.filters:
                if (logger, kept) not in stays:
                    logger.removeFilter(kept)
            self.filters = stays
            if sys.unraisablehook is self.hook:  # else replaced since: left to its owner
                sys.unraisablehook = self.previous
            self.hook = self.previous = None


_QUIET = _Quiet()
