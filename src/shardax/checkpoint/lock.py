"""One writer per checkpoint directory: an exclusive lock on the directory itself.

Two managers saving into one directory (two runs, or two managers of one script) race
on the same step directories: orbax's renames fail in both, the step is lost, and the
save threads wait for each other; worse, a manager that opens the directory deletes the
unfinished (``*.orbax-checkpoint-tmp``) step directories it finds, which are the other
writer's saves in flight. So a [`CheckpointManager`][shardax.CheckpointManager] takes the
directory's lock (an exclusive ``flock`` of the directory) at its first save (``sx.loop.run``:
when the run starts) and gives it back at ``close()``, and only the holder of the lock tidies
the directory (a manager that opens it while another writes it only reads). The operating
system gives the lock back when the process dies, so a crash leaves no stale lock, and no
file is added to the directory. Only process 0 of a multi-process run takes it (the
processes of one run save together). A refusal names the holder: its pid, its host and its
command line.

>>> lock = DirectoryLock(str(tmp_path))
>>> DirectoryLock(str(tmp_path))
Traceback (most recent call last):
...
RuntimeError: checkpoint directory ... written by another CheckpointManager of this process ...
>>> lock.release()
"""

from __future__ import annotations

import fcntl
import os
import socket

_HELD: dict[tuple[int, int], int] = {}
"""(device, inode) of each directory this process holds, to name the holder."""


class DirectoryLock:
    """Holds the writer's lock of ``directory`` until ``release``; raises
    ``RuntimeError`` naming the process that holds it, and ``OSError`` naming the
    directory when it cannot be created or opened."""

    def __init__(self, directory: str) -> None:
        self._fd: int | None = None
        try:
            os.makedirs(directory, exist_ok=True)
            self._fd = os.open(directory, os.O_RDONLY)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot save in checkpoint directory {directory}: {e.strerror}"
            ) from e
        stat = os.fstat(self._fd)
        self._key = (stat.st_dev, stat.st_ino)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise RuntimeError(
                f"checkpoint directory {directory} is being written by "
                f"{_who(self._key, stat.st_ino)}; two writers "
                "in one directory lose steps. Close that manager (or let that run end), or "
                "save into another directory"
            ) from None
        _HELD[self._key] = os.getpid()

    @classmethod
    def attempt(cls, directory: str) -> DirectoryLock | None:
        """The lock when no one holds it, else None (it raises only ``OSError``)."""
        try:
            return cls(directory)
        except RuntimeError:
            return None

    def release(self) -> None:
        """Gives the lock back."""
        if getattr(self, "_fd", None) is not None:  # (None when __init__ failed)
            _HELD.pop(self._key, None)
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __del__(self) -> None:  # a manager dropped without close()
        self.release()


def _who(key: tuple[int, int], inode: int) -> str:
    """The holder of the lock on ``inode``, in words: this process, or a process of this
    host with its pid and command line, or a process of another host (a lock on a shared
    file system that no process here holds)."""
    if key in _HELD:
        return f"another CheckpointManager of this process (pid {os.getpid()})"
    host = socket.gethostname()
    pid = _holder(inode)
    if pid is None and not os.path.exists("/proc/locks"):
        return "another process"  # (no /proc/locks to read its pid from)
    if pid is None:
        return f"a process of another host than {host} (no process of this host holds its lock)"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        command = " ".join(a.decode(errors="replace") for a in argv if a)
    except OSError:
        command = ""
    return f"process {pid} on {host}" + (f" ({command:.200})" if command else "")


def _holder(inode: int) -> str | None:
    """The pid holding a ``flock`` on ``inode``, from ``/proc/locks`` (Linux), or None."""
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].endswith(f":{inode}"):
            return fields[4]
    return None
