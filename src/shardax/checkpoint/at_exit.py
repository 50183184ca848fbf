"""Asynchronous saves still in flight when the script ends: each is finished before the
process exits or, where that cannot be (Python 3.12+ starts no thread once the script
has ended, and orbax needs new ones), reported on stderr, never silently dropped.
"""

from __future__ import annotations

import sys
from typing import Any

from shardax.checkpoint.quiet import _QUIET
from shardax.runtime import compat

_UNFINISHED: dict[Any, int] = {}
"""The async managers with a save in flight, and its step: finished at exit."""


def finish_at_exit(manager: Any, step: int) -> None:
    """Finishes ``manager``'s save of ``step`` (``manager.close()``) when the script ends,
    unless ``finished`` says it was waited for before."""
    # Registered at the first async save, after the executors orbax's save uses, so that
    # it runs before they stop taking work (the hooks run last registered, first).
    if not getattr(finish_at_exit, "registered", False):
        compat.before_thread_shutdown(_finish_saves_at_exit)
        finish_at_exit.registered = True  # type: ignore[attr-defined]
    _UNFINISHED[manager] = step


def finished(manager: Any) -> None:
    """``manager`` has no save in flight any more: nothing to finish at exit."""
    _UNFINISHED.pop(manager, None)


def _finish_saves_at_exit() -> None:
    if not _UNFINISHED:
        return
    # orbax's filters and the late-completion hook stay on to the end: a save that
    # cannot finish here leaves writes whose callbacks reach a closed loop after the
    # last manager's close would have removed them (one traceback each on stderr).
    _QUIET.acquire()
    for manager, step in list(_UNFINISHED.items()):
        _finish(manager, step)


def _finish(manager: Any, step: int) -> None:
    try:
        manager.close()
    except Exception as e:
        # Python 3.12+ starts no thread once the script has ended, and orbax needs new
        # ones to finish a save: then the save is reported, never silently dropped.
        print(
            f"shardax: {e}. The script ended with this asynchronous save in flight: "
            "call CheckpointManager.wait() or close() (or use a with block) before it ends",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(
            f"shardax: finished saving checkpoint step {step} in {manager.directory} at exit "
            "(call CheckpointManager.close() or wait() to finish it yourself)",
            file=sys.stderr,
            flush=True,
        )
