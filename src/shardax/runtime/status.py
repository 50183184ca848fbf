"""Where each process is: its last completed step and its current phase, readable by all.

Each process records, in this module's ``STATUS``, the step it runs, its last
completed step and its phase (``PHASES``: waiting for data, dispatching the step,
waiting on the device, saving, evaluating). In a multi-process run a background thread
publishes it, when it changes and at most every ``interval`` seconds, to JAX's
distributed key-value store (the coordinator's, which ``sx.initialize`` starts), so a
process stuck in Python, in I/O or in a collective still has an up-to-date entry. When
a watchdog fires, ``hang_line`` reads every entry and names the processes that are
behind: those with the fewest completed steps, among them those in the earliest step,
and among those the ones not waiting on the device (the others wait in a collective for
them).

>>> STATUS.set(DATA, step=3)       # or watchdog.phase(DATA)
>>> batch = next(batches)
>>> STATUS.set(DEVICE)
>>> STATUS.completed(3)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import jax

from shardax.runtime import compat
from shardax.runtime.launcher import ENV_LAUNCH_DIR

DATA = "waiting for data"
DISPATCH = "dispatching"
DEVICE = "waiting on device"
SAVE = "saving"
EVAL = "evaluating"
PHASES = (DATA, DISPATCH, DEVICE, SAVE, EVAL)

_PREFIX = "shardax/status/"


def _client() -> Any:
    """JAX's distributed runtime client, or None outside a multi-process run."""
    if not jax.distributed.is_initialized():
        return None
    return compat.private("distributed_state").client


def _call(fn: Any, timeout: float) -> Any:
    """``fn()`` in a thread, its result, or None when it raises or takes over ``timeout``
    seconds (a coordinator that is gone must not hang the watchdog that reports it)."""
    box: list[Any] = [None]

    def target() -> None:
        with contextlib.suppress(Exception):
            box[0] = fn()

    thread = threading.Thread(target=target, daemon=True, name="shardax-status-read")
    thread.start()
    thread.join(timeout)
    return box[0]


MIN_GAP = 0.05
"""Seconds between two publications at least: steps of a millisecond do not each cost a
write and a call to the coordinator."""


class RankStatus:
    """This process's step and phase; published to the other processes when there are any."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.step: int | None = None
        self.last_completed: int | None = None
        self.phase: str | None = None
        self.since = time.time()
        self.probe: Any = None
        """``() -> step | None``: a later step than ``last_completed`` whose result
        is ready though nothing waited for it yet (a loop that waits one step behind),
        read whenever the record is; None: none."""
        self._version = 0
        self._published: tuple[int, int | None] = (-1, None)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._written_at = -MIN_GAP  # when the status file was last written (monotonic)
        self._file_completed: int | None = None  # the last completed step written there
        self._stop = threading.Event()
        self._wake = threading.Event()

    def set(self, phase: str, step: int | None = None) -> None:
        """Enters ``phase`` (one of ``PHASES``), in ``step`` when given."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")
        if step is not None:
            self.step = step
        if phase != self.phase:
            self.phase, self.since = phase, time.time()
        self._version += 1
        self._start()

    def completed(self, step: int) -> None:
        """Step ``step`` completed: published at once (the launcher counts the steps a
        failure lost from it), not at the next ``interval``: under ``shardax launch``
        the status file is written in this thread before it returns (a kill right after
        the step still finds it there), unless it was less than ``MIN_GAP`` ago (steps of
        a millisecond), and the key-value store by the publishing thread."""
        self.last_completed = step
        self._version += 1
        if time.monotonic() - self._written_at >= MIN_GAP:
            self._write_file()
        self._start()
        self._wake.set()

    def flush(self) -> None:
        """Writes the status file now if its last completed step is behind this one's
        (``completed`` leaves a step of a millisecond to the publishing thread): called
        before a snapshot, where a kill must find the step it cuts counted as lost."""
        if self._file_completed != self._completed():
            self._write_file()

    def _write_file(self) -> None:
        """This process's record to ``rank<r>.status`` in the launch directory, if any
        (one writer at a time: a record computed earlier never lands after a later one)."""
        directory = _launch_dir()
        if directory is None:
            return
        with self._file_lock, contextlib.suppress(OSError):
            record = self.record()
            write_record(directory, jax.process_index(), record)
            self._written_at, self._file_completed = time.monotonic(), record["completed"]

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "completed": self._completed(),
            "phase": self.phase,
            "since": self.since,
        }

    def _completed(self) -> int | None:
        """The last completed step: ``last_completed``, or the ``probe``'s."""
        done, probe = self.last_completed, self.probe
        if probe is not None:
            ready = None
            with contextlib.suppress(Exception):  # e.g. a result donated meanwhile
                ready = probe()
            if ready is not None and (done is None or ready > done):
                return int(ready)
        return done

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None and (_client() is not None or _launch_dir() is not None):
                self._thread = threading.Thread(
                    target=self._publish_loop, daemon=True, name="shardax-status"
                )
                self._thread.start()
                # Registered after JAX's own exit handler, so it runs first: the thread
                # is joined before the distributed runtime shuts down. A daemon thread
                # still inside a runtime call when the interpreter finalizes is killed
                # there, and that aborts the process (exit 134, not its own code).
                atexit.register(self.stop)

    def publish(self) -> None:
        """Writes this process's record to the key-value store now, and under ``shardax
        launch`` to ``rank<r>.status`` in the launch directory, where the launcher reads
        the step of a process that fails."""
        client = _client()
        version, record = self._version, self.record()
        self._write_file()
        if client is not None:
            client.key_value_set(
                f"{_PREFIX}{jax.process_index()}", json.dumps(record), allow_overwrite=True
            )
        self._published = (version, record["completed"])

    def _publish_loop(self) -> None:
        while not self._stop.is_set():
            if self._published != (self._version, self._completed()):
                try:
                    self.publish()
                except Exception:  # the coordinator is gone: nothing left to tell
                    return
            self._wake.wait(self.interval)
            self._wake.clear()
            self._stop.wait(MIN_GAP)  # a step completed: published soon, not per fast step

    def stop(self, timeout: float = 5.0) -> None:
        """Stops publishing and joins the thread (at most ``timeout`` seconds); at exit
        this runs by itself."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def gather(self, timeout: float = 5.0) -> dict[int, dict[str, Any]] | None:
        """Every process's last published record, by rank (this one's current record
        for itself); None outside a multi-process run or when the store does not answer."""
        client = _client()
        if client is None:
            return None
        _call(self.publish, timeout)
        entries = _call(lambda: client.key_value_dir_get(_PREFIX), timeout)
        if entries is None:
            return None
        out = {}
        for key, value in entries:
            with contextlib.suppress(ValueError):
                out[int(key.rsplit("/", 1)[-1])] = json.loads(value)
        out[jax.process_index()] = self.record()
        return out


def _launch_dir() -> Path | None:
    directory = os.environ.get(ENV_LAUNCH_DIR)
    return Path(directory) if directory else None


def record_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where process ``rank`` keeps its record in a launch directory: ``rank<rank>.status``."""
    return Path(directory) / f"rank{rank}.status"


def write_record(directory: Path, rank: int, record: dict[str, Any]) -> None:
    """Writes ``record`` as ``rank<rank>.status`` in ``directory``, whole (renamed into
    place)."""
    tmp = directory / f".rank{rank}.status.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, record_path(directory, rank))


def read_record(directory: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    """Process ``rank``'s last record in a launch directory, or None."""
    try:
        return json.loads(record_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None


def behind(records: dict[int, dict[str, Any]], processes: int) -> list[int]:
    """The ranks the others wait for: those with no record, else those with the fewest
    completed steps, among them those in the earliest step (a process that waits one
    step behind is in the next step before the one it waits for completes), and among
    those the ones not waiting on the device (if any are).

    >>> behind({0: {"step": 4, "completed": 2, "phase": DISPATCH},
    ...         1: {"step": 3, "completed": 2, "phase": DISPATCH}}, 2)
    [1]
    """

    def number(rank: int, key: str) -> int:
        value = records[rank].get(key)
        return -1 if value is None else int(value)

    missing = [r for r in range(processes) if r not in records]
    if missing:
        return missing
    slowest = sorted(records)
    for key in ("completed", "step"):
        least = min(number(r, key) for r in slowest)
        slowest = [r for r in slowest if number(r, key) == least]
    working = [r for r in slowest if records[r].get("phase") != DEVICE]
    return working or slowest


def describe(rank: int, record: dict[str, Any] | None, now: float | None = None) -> str:
    """``process 1 (step 3, last completed 2): waiting for data for 5.2 s``."""
    if record is None:
        return f"process {rank}: no status (it never reported, or it is gone)"
    now = time.time() if now is None else now
    phase = record.get("phase") or "starting"
    for_s = f" for {now - record['since']:.1f} s" if record.get("since") else ""
    return (
        f"process {rank} (step {record.get('step')}, last completed {record.get('completed')}): "
        f"{phase}{for_s}"
    )


def hang_line(status: RankStatus | None = None, timeout: float = 5.0) -> str | None:
    """One line naming the processes that are behind, with their step and phase; None
    outside a multi-process run or when the store does not answer."""
    status = status or STATUS
    records = status.gather(timeout)
    if records is None:
        return None
    ranks = behind(records, jax.process_count())
    now = time.time()
    named = "; ".join(describe(r, records.get(r), now) for r in ranks)
    others = [r for r in sorted(records) if r not in ranks]
    rest = ""
    if others:
        rest = " | the others: " + "; ".join(describe(r, records[r], now) for r in others)
    return f"shardax: hang watchdog: behind: {named}{rest}"


_REPORTED = "shardax/reported/"
_LEAVING = "shardax/leaving/"
_LAST_PAUSE = 0.3
"""Seconds process 0 still waits once every other process said it leaves (it says so
just before it exits)."""


def leave_last(grace: float) -> None:
    """Marks this process's hang report as written, then waits up to ``grace`` seconds
    for every process's mark: a process that exits breaks the collectives the others are
    waiting in, so they would fail with a runtime error instead of writing their own
    report (a process whose watchdog fires later, e.g. on a loaded machine). Process 0,
    which hosts JAX's coordination service (when it ends, the others abort at once),
    leaves last: it also waits, within the same ``grace``, for the others to say they
    leave. A no-op outside a multi-process run; never raises and never waits past
    ``grace``."""
    client = _client()
    if client is None:
        return
    rank, count = jax.process_index(), jax.process_count()
    deadline = time.monotonic() + grace
    _call(lambda: client.key_value_set(f"{_REPORTED}{rank}", "1", allow_overwrite=True), grace)
    _await_marks(client, _REPORTED, count, deadline)
    if rank != 0:
        left = max(0.0, deadline - time.monotonic())
        _call(lambda: client.key_value_set(f"{_LEAVING}{rank}", "1", allow_overwrite=True), left)
        return
    if count > 1 and _await_marks(client, _LEAVING, count - 1, deadline):
        time.sleep(max(0.0, min(_LAST_PAUSE, deadline - time.monotonic())))


def _await_marks(client: Any, prefix: str, count: int, deadline: float) -> bool:
    """Waits until the store holds ``count`` keys under ``prefix`` (True), or until
    ``deadline`` (a ``time.monotonic()``; False)."""
    while True:
        left = deadline - time.monotonic()
        entries = _call(lambda: client.key_value_dir_get(prefix), min(1.0, max(left, 0.0)))
        if entries is not None and len(entries) >= count:
            return True
        if deadline - time.monotonic() <= 0:
            return False
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


STATUS = RankStatus()
"""This process's status (one per process)."""
