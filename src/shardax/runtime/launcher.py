"""A process and the ``shardax launch`` that started it: the launch's status file, and a
watch that stops the process when its launcher is gone, however it went.

``shardax launch`` gives each process its own pid (``ENV_LAUNCHER_PID``) and its launch
directory (``ENV_LAUNCH_DIR``: ``status.json`` and one ``rank<r>.log`` per process). When
a process joins ([`sx.initialize`][shardax.initialize]), ``watch_launcher`` starts a thread
that waits on the launcher (a pidfd on Linux: woken the moment it exits, a kill -9
included; elsewhere a poll every ``POLL`` seconds). When the launcher is gone:

1. the process's stdout and stderr, pipes to the dead launcher that would fail every
   later ``print``, are sent to its ``rank<r>.log`` (appended after what the launcher
   copied there);
2. one line on stderr and the status file say that the launcher was lost, and when;
3. the process sends itself SIGTERM: the preemption path. A loop over
   [`sx.loop.run`][shardax.loop.run] or ``shardax train`` saves at a step every process agrees
   on and exits with code 75; a program that ignores SIGTERM is ended;
4. at the latest ``grace`` seconds (``LAUNCHER_GRACE``, or ``$SHARDAX_LAUNCHER_GRACE``)
   after the loss was seen, the process exits with ``LAUNCHER_LOST_EXIT_CODE``. A save
   cut short there leaves no half-written step: orbax commits a step by renaming it
   into place, so every committed step still restores.

Outside ``shardax launch`` (a process started by hand, SLURM's ``srun``, a Kubernetes
pod) there is no launcher to watch: the scheduler ends the processes and signals them
(see the checkpoints guide).

>>> update_status(tmp_path, lambda s: s.update(launcher={"state": "running"}))["launcher"]
{'state': 'running'}
>>> read_status(tmp_path)["launcher"]["state"]
'running'
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ENV_LAUNCHER_PID = "SHARDAX_LAUNCHER_PID"
"""The pid of the ``shardax launch`` that started this process (on this host)."""
ENV_LAUNCH_DIR = "SHARDAX_LAUNCH_DIR"
"""The launch directory: ``status.json`` and the processes' logs."""
ENV_LAUNCHER_GRACE = "SHARDAX_LAUNCHER_GRACE"
"""Seconds a process may take, once its launcher is gone, to save and exit."""
ENV_RESTART = "SHARDAX_RESTART"
"""How many times ``shardax launch --max-restarts`` restarted the processes (unset: 0)."""
ENV_SNAPSHOT_DIR = "SHARDAX_SNAPSHOT_DIR"
ENV_SNAPSHOT_PEERS = "SHARDAX_SNAPSHOT_PEERS"
"""``1``: each process keeps its own snapshot, and one whose copy is gone fetches it from
a peer (``shardax launch --snapshot-peers``; ``shardax.checkpoint.peers``)."""
"""Where the processes keep host-memory snapshots (``/dev/shm``, owned by the launcher)."""
ENV_SLOT = "SHARDAX_SLOT"
"""The place this process holds among the ``-n`` that ``shardax launch`` was asked for (its
rank in the first start; a run that shrank gives the places left new ranks)."""
ENV_PLANNED = "SHARDAX_PLANNED_PROCESSES"
"""The process count ``shardax launch -n`` asked for: more than ``jax.process_count()``
once the run has shrunk (``--min-processes``)."""
STATUS_FILE = "status.json"
LAUNCHER_GRACE = 30.0
"""Default seconds from seeing the launcher gone to the exit, whatever the process does."""
POLL = 0.5
"""Seconds between two looks at the launcher where no pidfd can wait on it."""
LAUNCHER_LOST_EXIT_CODE = 143
"""The exit code of a process that had not stopped ``grace`` seconds after its launcher
was lost (128 + SIGTERM, as if the SIGTERM it sent itself had ended it)."""


def rank_log(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where process ``rank``'s output is kept in a launch directory."""
    return Path(directory) / f"rank{rank}.log"


def read_status(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The launch's status file as a dict (empty when there is none yet)."""
    path = Path(directory) / STATUS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def update_status(
    directory: str | os.PathLike[str], change: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Applies ``change`` to the status file under a lock and writes it whole (a reader
    never sees half a file: it is written beside and renamed into place). The launcher and
    its processes all write it, one at a time. Returns the new status."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATUS_FILE
    with open(directory / f".{STATUS_FILE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        status = read_status(directory)
        change(status)
        tmp = directory / f".{STATUS_FILE}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    return status


class _Lost:
    """This process's record of its launcher's loss (None while it lives)."""

    info: dict[str, Any] | None = None
    watching: threading.Thread | None = None
    pid: int | None = None  # the launcher watched
    recorded = threading.Event()  # set once the loss is in the status file (or failed to be)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` is gone: no such process, or one that exited and waits to
    be reaped (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def launcher_lost(wait: float = 0.0) -> dict[str, Any] | None:
    """``{"pid", "at", "rank"}`` once this process saw its launcher gone; else None.

    With ``wait`` seconds, where the launcher is gone but the watching thread has not yet
    recorded it, waits up to ``wait`` for that record: the SIGTERM ``shardax launch``'s
    ``PR_SET_PDEATHSIG`` sends as the launcher dies can reach the process first."""
    if wait > 0 and _Lost.pid is not None and not _Lost.recorded.is_set() and _gone(_Lost.pid):
        _Lost.recorded.wait(wait)
    return _Lost.info


def _wait_gone(pid: int, stop: threading.Event) -> bool:
    """Blocks until process ``pid`` is gone (True) or ``stop`` is set (False)."""
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    if fd is None:
        while not stop.is_set():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass  # alive, another user's
            stop.wait(POLL)
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not stop.is_set():
            if poller.poll(POLL * 1000):
                return True
        return False
    finally:
        os.close(fd)


def _broken(fd: int) -> bool:
    """Whether ``fd`` is a pipe whose reading end is closed (writes to it would fail)."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except OSError:
        return False


def _redirect_broken_output(log: Path | None) -> None:
    """Points this process's stdout and stderr, where they are pipes nobody reads any
    more, at ``log`` (appended), else at /dev/null."""
    broken = [fd for fd in (1, 2) if _broken(fd)]
    if not broken:
        return
    target = os.devnull
    if log is not None:
        with contextlib.suppress(OSError):
            log.parent.mkdir(parents=True, exist_ok=True)
            target = str(log)
    fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for old in broken:
        os.dup2(fd, old)
    os.close(fd)


def _on_lost(pid: int, rank: int, directory: Path | None, grace: float) -> None:
    """What a process does once its launcher is gone (see the module's steps 1-4)."""
    now = time.time()
    _redirect_broken_output(rank_log(directory, rank) if directory is not None else None)
    _Lost.info = {"pid": pid, "at": now, "rank": rank}
    line = (
        f"shardax: process {rank}: the launcher (pid {pid}) is gone; stopping as on a "
        f"preemption notice (save at an agreed step, exit 75), at most {grace:g} s from now"
    )
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)
    if directory is not None:
        host = socket.gethostname()

        def lost(status: dict[str, Any]) -> None:
            launcher = status.setdefault("launcher", {})
            if launcher.get("state") != "lost":
                launcher.update(state="lost", lost_at=now, seen_by=rank)
                status["message"] = f"the launcher (pid {pid}, host {host}) was lost"
            entry = status.setdefault("ranks", {}).setdefault(str(rank), {})
            entry.update(state="stopping: launcher lost", last_line=line)

        with contextlib.suppress(Exception):
            update_status(directory, lost)
    _Lost.recorded.set()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    with contextlib.suppress(Exception):
        print(
            f"shardax: process {rank}: still running {grace:g} s after its launcher was "
            f"lost; exiting with code {LAUNCHER_LOST_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        sys.stderr.flush()
    os._exit(LAUNCHER_LOST_EXIT_CODE)


def note_exit(message: str) -> None:
    """Records ``message`` as this process's last line in the launch's status file, once
    its launcher was lost (nobody else can then: the launcher wrote it). A no-op otherwise.

    Waits (up to 5 s) for the watching thread's own record of the loss, so that the
    status file says the launcher was lost even where the process got to its exit first."""
    info, directory = launcher_lost(wait=5.0), os.environ.get(ENV_LAUNCH_DIR)
    if info is None or not directory:
        return

    def last(status: dict[str, Any]) -> None:
        entry = status.setdefault("ranks", {}).setdefault(str(info["rank"]), {})
        entry.update(state="exited after the launcher was lost", last_line=message)

    with contextlib.suppress(Exception):
        update_status(directory, last)


def watch_launcher(
    env: Mapping[str, str] | None = None, *, rank: int | None = None
) -> threading.Thread | None:
    """Starts the thread that stops this process when its ``shardax launch`` is gone
    (the module's steps); [`sx.initialize`][shardax.initialize] calls it. Returns the thread, or
    None when no launcher started this process (``env``, default ``os.environ``, has no
    ``ENV_LAUNCHER_PID``). Calling it again returns the running thread.

    Raises:
        ValueError: ``$SHARDAX_LAUNCHER_PID`` or ``$SHARDAX_LAUNCHER_GRACE`` is not a
            number.
    """
    env = os.environ if env is None else env
    if _Lost.watching is not None:
        return _Lost.watching
    raw = env.get(ENV_LAUNCHER_PID)
    if not raw:
        return None
    try:
        pid = int(raw)
    except ValueError:
        raise ValueError(f"${ENV_LAUNCHER_PID} must be a process id, got {raw!r}") from None
    raw_grace = env.get(ENV_LAUNCHER_GRACE) or str(LAUNCHER_GRACE)
    try:
        grace = float(raw_grace)
    except ValueError:
        raise ValueError(
            f"${ENV_LAUNCHER_GRACE} must be a number of seconds, got {raw_grace!r}"
        ) from None
    if rank is None:
        rank = int(env.get("SHARDAX_PROCESS_ID") or 0)
    directory = Path(env[ENV_LAUNCH_DIR]) if env.get(ENV_LAUNCH_DIR) else None
    stop = threading.Event()

    def watch() -> None:
        if _wait_gone(pid, stop):
            _on_lost(pid, rank, directory, grace)

    thread = threading.Thread(target=watch, daemon=True, name="shardax-launcher-watch")
    _Lost.pid = pid
    thread.start()
    _Lost.watching = thread
    return thread
