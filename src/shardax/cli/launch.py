"""``shardax launch -n N [--cpu-devices K] [--port P] -- CMD ...``: N local processes.

Each process gets the environment that [`shardax.initialize`][shardax.initialize] reads
(coordinator on 127.0.0.1, the process count, its rank, its CPU device count), so the
program joins the run with one call, and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where the
environment does not set it (CUDA reads it when JAX starts the GPU; it lets the GPU
settings of ``shardax.train.compiler`` overlap collectives with compute). The processes'
stdout goes to launch's stdout, and their stderr (tracebacks, logs) and runtime chatter
(``RUNTIME_CHATTER``, which gloo writes to stdout) to launch's stderr, each line prefixed
with the rank; when the command has ``--json``, stdout lines are passed on unprefixed, so
stdout stays pure JSON. When a process fails, the others are stopped and launch exits with
that first non-zero code; Ctrl-C stops them all. A SIGTERM (a scheduler's preemption
notice) is forwarded to every process, which save and exit with code 75
([`PREEMPTED_EXIT_CODE`][shardax.checkpoint.PREEMPTED_EXIT_CODE]): a process that exits
with 75 does not stop the others, and launch exits with 75 once all have ended; a SIGHUP
(the terminal closed) is forwarded as a SIGTERM. Launch itself never starts JAX.

With ``--max-restarts K``, a failure (a process that dies, raises, is stopped for
``STOPPED_AFTER`` seconds, or ends on its hang watchdog) restarts every process, up to K
times, with a fresh coordinator port: they resume from their newest host-memory
snapshot (in ``/dev/shm``, which launch owns and removes at the end) or checkpoint. One
line names the first failing process (rank, pid, host, cause, step), and ``status.json``
lists every restart.

Launch keeps a directory (``--launch-dir``, default ``runs/launch-<time>-<pid>``):
``status.json`` (each process's pid, state and exit code, the launcher's state, one line
on how the run ended) and ``rank<r>.log``, each process's output. The processes end with
their launcher, however it ends (``shardax.runtime.launcher``): killed with -9 too, they
save at an agreed step and exit 75 within ``SHARDAX_LAUNCHER_GRACE`` seconds (30), their
last line and the status file saying that the launcher was lost.

    $ shardax launch -n 2 --cpu-devices 4 -- python train.py
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from shardax.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardax.cli.common import (
    UsageError,
    check_writable_dir,
    nonneg_float,
    nonneg_int,
    path_arg,
    positive_int,
    tcp_port,
)
from shardax.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from shardax.runtime.launcher import (
    ENV_LAUNCH_DIR,
    ENV_LAUNCHER_PID,
    ENV_PLANNED,
    ENV_RESTART,
    ENV_SLOT,
    ENV_SNAPSHOT_DIR,
    ENV_SNAPSHOT_PEERS,
    rank_log,
    read_status,
    update_status,
)
from shardax.runtime.status import read_record, record_path
from shardax.train.compiler import set_gpu_environment

RUNTIME_CHATTER = re.compile(r"\[Gloo\] |peer ranks\. Expected number of connected peer ranks is")
"""Lines that the runtime's native code writes to stdout; launch sends them to stderr, so a
program's stdout (``--json``) stays its own. gloo writes from several threads at once, so
one message can start inside another's line: its tail is matched too."""
GLOO_MESSAGE = (
    "[Gloo] Rank # is connected to # peer ranks. Expected number of connected peer ranks is : #"
)
"""gloo's message, its numbers as ``#``: a line that ends one begun on an earlier line is
one of its tails."""


def runtime_chatter(line: str, pending: int) -> tuple[bool, int]:
    """Whether ``line``, of one process's stdout, is the runtime's chatter, and how many
    of gloo's messages are unfinished after it (``pending``: before it).

    gloo's threads each write ``[Gloo] Rank r is connected to n peer ranks. Expected
    number of connected peer ranks is : n`` and a newline, in pieces. Where one thread's
    message lands inside another's line, its rest follows on a later line: any tail of
    the message (``GLOO_MESSAGE``), down to the final number alone. Such a tail is
    chatter only while a message is unfinished; any other line is the program's own.

    >>> expected = "peer ranks. Expected number of connected peer ranks is : "
    >>> runtime_chatter(f"[Gloo] Rank 2 is connected to 3 {expected}[Gloo] Rank 3 "
    ...                 f"is connected to 3 {expected}3", 0)
    (True, 1)
    >>> runtime_chatter('{"ok": 1}', 1), runtime_chatter("3", 1), runtime_chatter("3", 0)
    ((False, 1), (True, 0), (False, 0))
    >>> runtime_chatter("Expected number of connected peer ranks is : 1", 1)
    (True, 0)
    """
    starts = line.count("[Gloo] ")
    if starts or RUNTIME_CHATTER.search(line):  # each such line ends one message
        return True, max(pending + starts - 1, 0)
    if pending and line and GLOO_MESSAGE.endswith(_NUMBER.sub("#", line)):
        return True, pending - 1
    return False, pending


_NUMBER = re.compile(r"\d+")  # gloo's numbers (a JSON number of the program is indented)

STARTS_JAX = False
"""Read by ``shardax.cli.main``: launch sets no JAX option in its own process."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardax launch``."""
    parser.add_argument(
        "-n", "--num-processes", type=positive_int, required=True, help="processes to start"
    )
    parser.add_argument(
        "--cpu-devices",
        type=positive_int,
        default=None,
        help="simulated CPU devices per process (default: the program's own choice)",
    )
    parser.add_argument(
        "--port",
        type=tcp_port,
        default=0,
        help="coordinator port on 127.0.0.1 (default: a free one)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=positive_int,
        default=None,
        help="seconds without a heartbeat before a process counts as dead (default: JAX's 100)",
    )
    parser.add_argument(
        "--grace",
        type=nonneg_float,
        default=3.0,
        help="seconds between SIGINT and SIGKILL when stopping processes (default: 3)",
    )
    parser.add_argument(
        "--max-restarts",
        type=nonneg_int,
        default=0,
        help="after a process fails (dies, raises, hangs past its watchdog, is stopped), "
        "start every process again, up to K times; the processes resume from their newest "
        "snapshot (shardax train --snapshot-every) or checkpoint (default: 0, none)",
    )
    parser.add_argument(
        "--snapshot-peers",
        action="store_true",
        help="with --max-restarts: each process keeps its own snapshot, and one whose copy is "
        "gone (a replaced host) fetches its shards from a peer that holds them in another "
        "replica along the data axis (orbax's peer-to-peer manager)",
    )
    parser.add_argument(
        "--min-processes",
        type=positive_int,
        default=None,
        help="with --max-restarts: when a process cannot come back (it fails again before "
        "the restarted run's first step), go on with fewer processes, down to this many: the "
        "largest count that divides -n, so the data axis shrinks and shardax train keeps the "
        "global batch by accumulating more microbatches (default: -n, never shrink)",
    )
    parser.add_argument(
        "--launch-dir",
        type=path_arg,
        default=None,
        help="where to write status.json and each process's log, rank<r>.log (default: "
        "runs/launch-<time>)",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    rank: int,
    num_processes: int,
    port: int,
    *,
    cpu_devices: int | None = None,
    heartbeat_timeout: int | None = None,
    launch_dir: str | os.PathLike[str] | None = None,
    restart: int = 0,
    snapshot_dir: str | os.PathLike[str] | None = None,
    snapshot_peers: bool = False,
    slot: int | None = None,
    planned: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` (default ``os.environ``) plus the
    variables [`shardax.initialize`][shardax.initialize] reads, and those the GPU compiler
    settings need before JAX starts (``shardax.train.compiler.ENVIRONMENT``:
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``) where ``base`` does not set them. With a
    ``launch_dir``, also this launcher's pid and that directory, by which the process
    stops when the launcher is gone (``shardax.runtime.launcher``); after a failure the
    number of the ``restart`` and, for in-job recovery, the ``snapshot_dir`` (and
    ``snapshot_peers``: each process's snapshot its own, a lost one fetched from a peer); the
    process's ``slot`` (default: ``rank``) and the ``planned`` count (default:
    ``num_processes``), which differ from them once a run has shrunk.

    >>> env = process_env(1, 2, 1234, base={})
    >>> env[ENV_PROCESS_ID], env["CUDA_DEVICE_MAX_CONNECTIONS"]
    ('1', '1')
    """
    env = dict(os.environ if base is None else base)
    set_gpu_environment(env)
    env.update(
        {
            ENV_COORDINATOR: f"127.0.0.1:{port}",
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(rank),
            ENV_SLOT: str(rank if slot is None else slot),
            ENV_PLANNED: str(num_processes if planned is None else planned),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cpu_devices is not None:
        env[ENV_CPU_DEVICES] = str(cpu_devices)
    if heartbeat_timeout is not None:
        env[ENV_HEARTBEAT] = str(heartbeat_timeout)
    if launch_dir is not None:
        env[ENV_LAUNCHER_PID] = str(os.getpid())
        env[ENV_LAUNCH_DIR] = str(launch_dir)
    if restart:
        env[ENV_RESTART] = str(restart)
    if snapshot_dir is not None:
        env[ENV_SNAPSHOT_DIR] = str(snapshot_dir)
        if snapshot_peers:
            env[ENV_SNAPSHOT_PEERS] = "1"
    return env


def _die_with_launcher(launcher: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to send the child SIGTERM when the launcher
    dies (``PR_SET_PDEATHSIG``): a program that never calls ``sx.initialize`` (so never
    watches its launcher) ends too. None where there is no ``prctl``."""
    if _PRCTL is None:
        return None

    def preexec() -> None:  # in the child, between fork and exec: the prctl call only
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # the launcher died before the call
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1
_PRCTL = _prctl()  # resolved here: the child must not load a library between fork and exec


def start_processes(
    cmd: Sequence[str], envs: Sequence[Mapping[str, str]], *, merge_stderr: bool = True
) -> list[subprocess.Popen[bytes]]:
    """Starts ``cmd`` once per environment, each in its own session (process group),
    with stdout and stderr piped: merged into one pipe, or two with ``merge_stderr=False``.
    On Linux each gets SIGTERM when this process dies (``_die_with_launcher``)."""
    return [
        subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_launcher(os.getpid()),
        )
        for env in envs
    ]


def _forward(
    rank: int,
    pipe: IO[bytes] | None,
    out: IO[str],
    err: IO[str],
    lock: threading.Lock,
    *,
    prefix: bool = True,
    raised: dict[int, float] | None = None,
    log: IO[str] | None = None,
    lost: set[int] | None = None,
    errors: dict[int, str] | None = None,
    tail: dict[int, str] | None = None,
) -> None:
    """Copies ``pipe``'s lines to ``out`` (after ``[rank] `` if ``prefix``), and to ``log``
    unprefixed; runtime chatter goes to ``err``, always prefixed. A stream that fails
    (a closed terminal) is left out from then on, its ``id`` added to ``lost``: the pipe
    is still read to its end, so the process never blocks on a full pipe. ``errors``
    keeps the last line of a traceback (the exception), ``tail`` the last line, by rank."""
    if pipe is None:
        return
    lost = set() if lost is None else lost
    pending = 0  # gloo's messages begun and not yet ended (see runtime_chatter)
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        chatter, pending = runtime_chatter(line, pending)
        stream = err if chatter else out
        if raised is not None and line.startswith(_TRACEBACK):
            raised.setdefault(rank, time.monotonic())
        if errors is not None and line.strip() and not chatter and rank in (raised or {}):
            errors[rank] = line.strip()  # a traceback's last line: the exception
        if tail is not None and line.strip() and not chatter:
            tail[rank] = line.strip()
        with lock:
            text = f"[{rank}] {line}\n" if prefix or chatter else f"{line}\n"
            for target, what in ((stream, text), (log, f"{line}\n")):
                if target is None or id(target) in lost:
                    continue
                try:
                    target.write(what)
                    target.flush()
                except (OSError, ValueError):  # EIO, EPIPE, or closed
                    lost.add(id(target))
    pipe.close()


_TRACEBACK = "Traceback (most recent call last):"


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGINT to every running process group, then SIGKILL to each of those groups after
    ``grace`` seconds (or once their leaders have ended: a wrapper such as ``uv run`` may
    end alone, its child still running). Not SIGTERM: JAX turns it into a preemption notice
    and goes on."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGINT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.05)
    for p in running:  # the whole group: a wrapper (uv run, bash -c) may have ended alone
        _signal_group(p, signal.SIGKILL)
    for p in running:
        p.wait()


@contextlib.contextmanager
def forward_signals(
    procs: Sequence[subprocess.Popen[bytes]], signals: Sequence[int] = (signal.SIGTERM,)
) -> Iterator[list[int]]:
    """Within the block, ``signals`` sent to this process go to every running process
    group instead (the previous handlers come back afterwards); SIGHUP (the terminal
    closed) goes as SIGTERM, the preemption notice, so the processes save and exit 75.
    Yields the list of the signals received so far. Main thread only."""

    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        sent = signal.SIGTERM if signum == signal.SIGHUP else signum
        for p in procs:
            if p.poll() is None:
                _signal_group(p, sent)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, SIGINT (Ctrl-C) raises KeyboardInterrupt, also where this process
    was started with SIGINT ignored (as a non-interactive shell starts a background job,
    and its children inherit): ``shardax launch`` promises that SIGINT stops every
    process. The previous handler comes back afterwards. Main thread only."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_code(returncode: int) -> int:
    """A shell-style exit code: a process killed by signal N gives 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def exited(code: int) -> str:
    """``exited with code N``, naming the signal of a shell-style 128 + N (a wrapper such
    as ``uv run`` or a shell exits so when the process under it is killed).

    >>> exited(1), exited(137)
    ('exited with code 1', 'exited with code 137 (128 + SIGKILL)')
    """
    try:
        name = f" (128 + {signal.Signals(code - 128).name})" if code > 128 else ""
    except ValueError:
        name = ""
    return f"exited with code {code}{name}"


class LaunchRecord:
    """The launch directory as the launcher keeps it: ``status.json`` (through
    ``shardax.runtime.launcher.update_status``, which the processes also write once the
    launcher is gone) and each process's log. Nothing when ``directory`` is None. A
    status that cannot be written (a full disk) is said once on ``err``; the run goes on."""

    def __init__(self, directory: str | os.PathLike[str] | None, err: IO[str]) -> None:
        self.directory = None if directory is None else Path(directory)
        self.err, self._said = err, False
        self._exited: set[int] = set()
        self.failure: dict[str, Any] | None = None

    def write(self, change: Callable[[dict], None]) -> None:
        if self.directory is None:
            return
        try:
            update_status(self.directory, change)
        except OSError as e:
            if not self._said:
                self._said = True
                with contextlib.suppress(OSError, ValueError):
                    self.err.write(f"shardax launch: cannot write {self.directory}: {e}\n")

    def log(self, rank: int) -> IO[str] | None:
        """Process ``rank``'s log, open for appending (None without a directory)."""
        if self.directory is None:
            return None
        try:
            return rank_log(self.directory, rank).open("a", encoding="utf-8")
        except OSError:
            return None

    def started(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        self._exited = set()

        def change(status: dict) -> None:
            status.setdefault("launcher", {}).update(
                pid=os.getpid(), host=socket.gethostname(), state="running", started=time.time()
            )
            status["ranks"] = {
                str(r): {"pid": p.pid, "state": "running", "log": str(rank_log(".", r))}
                for r, p in enumerate(procs)
            }
            status.pop("message", None)

        self.write(change)

    def ended(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """Records the processes that have ended since the last call."""
        new = [r for r, p in enumerate(procs) if p.returncode is not None and r not in self._exited]
        if not new:
            return
        self._exited.update(new)

        def change(status: dict) -> None:
            for r in new:
                code = exit_code(procs[r].returncode)  # type: ignore[arg-type]
                status.setdefault("ranks", {}).setdefault(str(r), {}).update(
                    state="exited", exit_code=code
                )

        self.write(change)

    def failed(self, failure: dict[str, Any]) -> None:
        self.failure = failure
        self.write(lambda s: s.update(failure=failure, message=failure["line"]))

    def restarting(self, failure: dict[str, Any], restart: int, most: int, count: int) -> None:
        """Says and records that every process (``count`` of them) restarts after
        ``failure``."""
        line = (
            f"shardax launch: restart {restart} of {most}: every process starts again, with a "
            f"fresh coordinator port, after {describe_failure(failure)}"
        )
        self.say(line)
        entry = {**failure, "restart": restart, "processes": count}
        self.write(lambda s: s.setdefault("restarts", []).append(entry))

    def shrinking(self, failure: dict[str, Any], slot: int, planned: int, count: int) -> None:
        """Says that the run goes on with ``count`` of its ``planned`` processes, the
        place ``slot`` left out."""
        self.say(
            f"shardax launch: process {failure['rank']} (place {slot} of the {planned}) could "
            f"not come back: it failed again before the restarted run's first step; the run "
            f"shrinks to {count} of {planned} processes (the largest count >= --min-processes "
            f"that divides {planned}): the data axis is {planned // count}x smaller, and "
            f"shardax train keeps the global batch with {planned // count}x the microbatches"
        )
        failure["shrunk_to"] = count

    def gave_up(
        self, failure: dict[str, Any], most: int, shrink: tuple[int, int, int] | None = None
    ) -> None:
        history = f"{most} restart(s) spent" if most else "no restart allowed (--max-restarts 0)"
        if shrink is not None:
            slot, count, least = shrink
            history = (
                f"place {slot} could not come back, and fewer than --min-processes {least} of "
                f"the {count} processes would be left"
            )
        line = f"shardax launch: giving up after {describe_failure(failure)}: {history}"
        self.say(line)
        self.write(lambda s: s.update(message=line))

    def say(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.err.write(line + "\n")
            self.err.flush()

    def note(self, line: str) -> None:
        self.write(lambda s: s.update(message=line))

    def finished(self, procs: Sequence[subprocess.Popen[bytes]], code: int) -> None:
        self.ended(procs)

        def change(status: dict) -> None:
            status.setdefault("launcher", {}).update(state="finished", exit_code=code)
            if "message" not in status:
                status["message"] = (
                    "every process saved on a preemption notice and exited 75"
                    if code == PREEMPTED_EXIT_CODE
                    else "every process exited 0"
                    if code == 0
                    else f"ended with code {code}"
                )

        self.write(change)


USAGE_EXIT_CODE = 2
"""A usage error's exit code (shardax's and argparse's): the same command would fail the
same way, so it is not restarted."""
READER_TIMEOUT = 60.0
"""Seconds ``supervise`` waits, after every process has ended, for their output to drain."""


def supervise(
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    grace: float = 3.0,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
    prefix_stdout: bool = True,
    poll: float = 0.05,
    launch_dir: str | os.PathLike[str] | None = None,
    record: LaunchRecord | None = None,
) -> int:
    """Forwards each process's stdout to ``out`` and stderr to ``err`` (default: this
    process's), lines prefixed with the rank (stdout's only if ``prefix_stdout``), until
    every process has ended. With a ``launch_dir``, each process's output is also kept
    in its ``rank<r>.log`` there, and ``status.json`` follows the run: each process's
    pid, state and exit code, the launcher's state, and one line on how it ended.

    Returns the first non-zero exit code (in time), after stopping the other processes; 0
    when all succeed; 130 after Ctrl-C, once all are stopped. A process that exits with
    [`PREEMPTED_EXIT_CODE`][shardax.checkpoint.PREEMPTED_EXIT_CODE] saved on a preemption
    notice, as the others are doing: they are left to finish, and the code is returned at
    the end.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    lock = threading.Lock()
    raised: dict[int, float] = {}  # rank -> when it printed its first Python traceback
    record = LaunchRecord(launch_dir, err) if record is None else record
    logs = [record.log(r) for r in range(len(procs))]
    lost: set[int] = set()  # the ids of streams that failed (a closed terminal)
    errors: dict[int, str] = {}  # rank -> the last line of its traceback
    common = {"raised": raised, "lost": lost, "errors": errors}
    readers = [
        threading.Thread(
            target=_forward,
            args=(r, p.stdout, out, err, lock),
            kwargs={"prefix": prefix_stdout, "log": logs[r], **common},
        )
        for r, p in enumerate(procs)
    ]
    tail: dict[int, str] = {}  # rank -> the last line on its stderr
    readers += [
        threading.Thread(
            target=_forward,
            args=(r, p.stderr, err, err, lock),
            kwargs={"log": logs[r], "tail": tail, **common},
        )
        for r, p in enumerate(procs)
    ]
    for t in readers:
        t.daemon = True
    started: list[threading.Thread] = []
    first_failure = 0
    record.started(procs)
    try:  # Ctrl-C may come as soon as a process has printed, before every reader runs
        for t in readers:
            t.start()
            started.append(t)
        stopped: dict[int, float] = {}  # rank -> since when it is seen stopped
        ok = (None, 0, PREEMPTED_EXIT_CODE)  # running, or ended well
        while [p.poll() for p in procs].count(None):  # polls every process
            record.ended(procs)
            first = _first_failed(procs, ok, raised, errors)
            halted = _halted(procs, stopped)
            if first is not None or halted is not None:
                if first is not None:  # their last lines: read once their pipes reach the end
                    ended = [r for r, p in enumerate(procs) if p.returncode not in ok]
                    for rank in ended:  # every process seen ended: which only lost a peer
                        for t in (readers[rank], readers[len(procs) + rank]):
                            if t in started:
                                t.join(timeout=1.0)
                    first = _first_failed(procs, ok, raised, errors)
                failure = _failure(procs, first, halted, raised, errors, record.directory, tail)
                first_failure = _say_failed(failure, err, lock, "stopping the others")
                record.failed(failure)
                stop(procs, grace)
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        stop(procs, grace)
        first_failure = 130
        record.note("stopped by Ctrl-C (SIGINT)")
    # The processes have ended; their pipes close once a process's own children have too.
    deadline = time.monotonic() + READER_TIMEOUT
    for t in started:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    open_pipes = sorted({rank for rank, t in enumerate(readers) if t.is_alive()})
    if open_pipes:
        err.write(
            f"shardax launch: the output of process(es) {[r % len(procs) for r in open_pipes]} "
            f"may be cut short: a pipe is still open {READER_TIMEOUT:.0f} s after the processes "
            "ended (a child process of theirs holds it)\n"
        )
        err.flush()
    if not first_failure:
        first = _first_failed(procs, (None, 0), raised, errors)
        if first is not None and first.returncode == PREEMPTED_EXIT_CODE:
            first_failure = PREEMPTED_EXIT_CODE
        elif first is not None:  # every process ended between two polls: said here
            failure = _failure(procs, first, None, raised, errors, record.directory, tail)
            first_failure = _say_failed(failure, err, lock, "all have ended")
            record.failed(failure)
    record.finished(procs, first_failure)
    for log in logs:
        if log is not None:
            log.close()
    return first_failure


STOPPED_AFTER = 5.0
"""Seconds a process may stay stopped (SIGSTOP, SIGTSTP) before it counts as failed."""


def _halted(procs: Sequence[subprocess.Popen[bytes]], stopped: dict[int, float]) -> int | None:
    """The rank of a process seen stopped for ``STOPPED_AFTER`` seconds, else None
    (``stopped``: since when each one is; a process that went on is forgotten)."""
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if p.returncode is None and _state(p.pid) in ("T", "t"):
            if now - stopped.setdefault(rank, now) >= STOPPED_AFTER:
                return rank
        else:
            stopped.pop(rank, None)
    return None


def _state(pid: int) -> str | None:
    """A process's state letter from ``/proc`` (``T``: stopped), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _failure(
    procs: Sequence[subprocess.Popen[bytes]],
    first: subprocess.Popen[bytes] | None,
    halted: int | None,
    raised: dict[int, float],
    errors: dict[int, str],
    directory: Path | None,
    tail: dict[int, str] | None = None,
) -> dict[str, Any]:
    """What failed first: its rank, pid, host, exit code, cause (the signal that killed
    it, its exception's line, its exit code with its last line on stderr where it printed
    no traceback, or how long it is stopped) and the step it was in, as its last status
    record in ``directory`` says."""
    if first is not None:
        rank, code = procs.index(first), exit_code(first.returncode)  # type: ignore[arg-type]
        if first.returncode < 0:  # type: ignore[operator]
            cause = f"killed by {signal.Signals(-first.returncode).name}"  # type: ignore[operator]
        else:
            said = errors.get(rank) or (tail or {}).get(rank)
            cause = exited(code) + (f": {said}" if said else "")
    else:
        rank, code = halted, None  # type: ignore[assignment]
        cause = f"stopped (SIGSTOP) for {STOPPED_AFTER:g} s"
    causes = {r: t for r, t in raised.items() if not PEER_LOST.search(errors.get(r, ""))}
    raiser = min(causes, key=causes.__getitem__) if causes else rank  # not one that lost a peer
    if first is None or (first.returncode < 0 and -first.returncode != signal.SIGABRT):  # type: ignore[operator]
        raiser = rank  # stopped or killed from outside: the cause, whoever raised after it
    failure: dict[str, Any] = {
        "rank": rank,
        "pid": procs[rank].pid,
        "host": socket.gethostname(),  # type: ignore[index]
        "exit_code": code,
        "cause": cause,
        "at": time.time(),
    }
    if raiser != rank:
        failure["after"] = f"after process {raiser} raised (its traceback is above)"
    where = read_record(directory, rank) if directory is not None else None  # type: ignore[arg-type]
    if where is not None:
        failure.update(step=where.get("step"), last_completed=where.get("completed"))
    return failure


def describe_failure(failure: dict[str, Any]) -> str:
    """``process 1 (pid 42, host h) killed by SIGKILL in step 7 (last completed 6)``."""
    where = ""
    if failure.get("step") is not None or failure.get("last_completed") is not None:
        where = f" in step {failure.get('step')} (last completed {failure.get('last_completed')})"
    after = f" {failure['after']}" if failure.get("after") else ""
    return (
        f"process {failure['rank']} (pid {failure['pid']}, host {failure['host']}) "
        f"{failure['cause']}{where}{after}"
    )


def _say_failed(failure: dict[str, Any], err: IO[str], lock: threading.Lock, then: str) -> int:
    """Writes which process failed first (and which raised first, if another); returns the
    launch's exit code for it (137 for a process stopped and so killed)."""
    line = f"shardax launch: {describe_failure(failure)}; {then}"
    failure["line"] = line
    with lock, contextlib.suppress(OSError, ValueError):
        err.write(line + "\n")
        err.flush()
    code = failure["exit_code"]
    return 128 + signal.SIGKILL if code is None else code


PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Gloo \w+ failed|CoordinationService|"
    r"heartbeat|DEADLINE_EXCEEDED|UNAVAILABLE"
)
"""An exception's line that says the process only lost a peer (a collective or the
coordination service failed under it): the consequence of another's failure."""


def _first_failed(
    procs: Sequence[subprocess.Popen[bytes]],
    ok: tuple,
    raised: dict[int, float] | None = None,
    errors: dict[int, str] | None = None,
) -> subprocess.Popen[bytes] | None:
    """The failed process to report among those seen ended at once (None if none): one
    killed from outside (SIGKILL, SIGTERM, ...: the out-of-memory killer, a lost node)
    first, since its peers' collectives fail after it and they exit at once; then one that
    exited on its own (an exception, an exit code) before one that aborted (SIGABRT) or
    whose exception (its line in ``errors``) says it lost a peer (``PEER_LOST``), usually
    the consequence (gloo aborts when its peer is gone); then the one that printed a
    Python traceback first (its peers' collectives fail after it, and they may all end at
    once, waiting for each other in the runtime's shutdown); then the lowest rank."""
    raised, errors = raised or {}, errors or {}
    failed = [(r, p) for r, p in enumerate(procs) if p.returncode not in ok]
    if not failed:
        return None

    def order(rank: int, code: int) -> int:  # 0: killed from outside, 1: exited, 2: after
        if code < 0:
            return 2 if -code == signal.SIGABRT else 0
        return 2 if PEER_LOST.search(errors.get(rank, "")) else 1

    def key(rp: tuple[int, subprocess.Popen[bytes]]) -> tuple:
        rank, proc = rp
        return order(rank, proc.returncode), raised.get(rank, math.inf), rank  # type: ignore[arg-type]

    return min(failed, key=key)[1]


def refuse_two_counts(cpu_devices: int | None, cmd: list[str], processes: int) -> None:
    """A usage error when launch's ``--cpu-devices`` and the command's own (a shardax
    command's option, which wins over ``$SHARDAX_CPU_DEVICES``) differ.

    >>> refuse_two_counts(4, ["shardax", "train", "--cpu-devices=4"], 2)
    >>> refuse_two_counts(4, ["shardax", "train", "--cpu-devices", "8"], 2)
    Traceback (most recent call last):
    shardax.cli.common.UsageError: --cpu-devices 4: the command's own --cpu-devices 8 wins ...
    """
    if cpu_devices is None:
        return
    for i, word in enumerate(cmd):
        if word == "--":
            return
        own = word.partition("=")[2] if word.startswith("--cpu-devices=") else None
        if word == "--cpu-devices" and i + 1 < len(cmd):
            own = cmd[i + 1]
        if own is not None and own != str(cpu_devices):
            total = f" = {processes * int(own)}" if own.isdigit() else ""
            raise UsageError(
                f"--cpu-devices {cpu_devices}: the command's own --cpu-devices {own} wins in "
                f"each process, so the {processes} processes would drive {processes} x "
                f"{own}{total} devices; give the count once"
            )


def run(args: argparse.Namespace) -> int:
    """Starts the processes and supervises them, restarting them all after a failure up to
    ``--max-restarts`` times; returns launch's exit code."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("give the command after --, e.g. -- python t.py")
    refuse_two_counts(args.cpu_devices, cmd, args.num_processes)
    planned, least = args.num_processes, args.min_processes or args.num_processes
    if least > planned:
        raise UsageError(
            f"--min-processes {least}: a run cannot shrink to more than the -n "
            f"{planned} processes it starts with; give at most {planned}"
        )
    if args.min_processes is not None and args.max_restarts < 2:
        raise UsageError(
            f"--min-processes {args.min_processes} needs --max-restarts 2 or more (got "
            f"{args.max_restarts}): one restart to see a place fail again before the first "
            "step, one more to go on with fewer processes"
        )
    if args.snapshot_peers and not args.max_restarts:
        raise UsageError(
            "--snapshot-peers needs --max-restarts 1 or more (got 0): snapshots are taken "
            "for a restart inside the job"
        )
    launch_dir = Path(args.launch_dir or default_launch_dir())
    check_writable_dir("--launch-dir", str(launch_dir))
    launch_dir.mkdir(parents=True, exist_ok=True)
    snapshots = snapshot_dir(launch_dir) if args.max_restarts else None
    slots = list(range(planned))  # the places still in the run; a rank indexes them
    before: tuple[int | None, bool] = (None, False)  # the last failure's place, and whether
    # that start recorded its steps
    record = LaunchRecord(launch_dir, sys.stderr)
    if snapshots is not None:
        record.write(lambda s: s.update(snapshots=str(snapshots), max_restarts=args.max_restarts))
    procs: list[subprocess.Popen[bytes]] = []  # the running attempt's, for the signals
    sys.stderr.write(f"shardax launch: status and logs in {launch_dir}\n")
    try:
        with forward_signals(procs, (signal.SIGTERM, signal.SIGHUP)) as received, interruptible():
            for attempt in range(args.max_restarts + 1):
                port = args.port if args.port and not attempt else free_port()  # a fresh one
                envs = [
                    process_env(
                        r,
                        len(slots),
                        port,
                        cpu_devices=args.cpu_devices,
                        heartbeat_timeout=args.heartbeat_timeout,
                        launch_dir=launch_dir.resolve(),
                        restart=attempt,
                        snapshot_dir=snapshots,
                        snapshot_peers=args.snapshot_peers,
                        slot=slot,
                        planned=planned,
                    )
                    for r, slot in enumerate(slots)
                ]
                clear_records(launch_dir, planned)  # this start's steps only
                try:
                    procs[:] = start_processes(cmd, envs, merge_stderr=False)
                except OSError as e:  # not found, not executable
                    raise UsageError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
                code = supervise(
                    procs, grace=args.grace, prefix_stdout="--json" not in cmd, record=record
                )
                failure, record.failure = record.failure, None
                if code in (0, PREEMPTED_EXIT_CODE, 130) or failure is None or received:
                    return code
                if attempt == args.max_restarts or failure.get("exit_code") == USAGE_EXIT_CODE:
                    record.gave_up(failure, args.max_restarts)
                    return code
                slot, recorded = slots[failure["rank"]], published(launch_dir, len(slots))
                # A place that failed again, before the restarted run's first step, in a
                # run that records its steps (shardax's loops do): it cannot come back.
                again = slot == before[0] and before[1] and not came_back(launch_dir)
                if again and least < planned:
                    kept = shrink_to(planned, len(slots) - 1, least)
                    if kept is None:
                        record.gave_up(failure, args.max_restarts, shrink=(slot, len(slots), least))
                        return code
                    slots = [s for s in slots if s != slot][:kept]
                    record.shrinking(failure, slot, planned, kept)
                before = (slot, recorded)
                record.restarting(failure, attempt + 1, args.max_restarts, len(slots))
    finally:
        if snapshots is not None:
            shutil.rmtree(snapshots, ignore_errors=True)
    return 0  # unreachable: the last attempt returns


def shrink_to(planned: int, left: int, least: int) -> int | None:
    """The process count a run of ``planned`` goes on with when ``left`` places are left:
    the largest that divides ``planned`` (so a global batch the planned data axis divides,
    the smaller one divides too, and the microbatches keep their size), at least ``least``;
    None when there is none.

    >>> shrink_to(4, 3, 1), shrink_to(8, 7, 2), shrink_to(2, 1, 1), shrink_to(4, 3, 3)
    (2, 4, 1, None)
    """
    fits = [n for n in range(min(left, planned), least - 1, -1) if n and planned % n == 0]
    return fits[0] if fits else None


def published(launch_dir: Path, count: int) -> bool:
    """Whether any of ``count`` processes wrote a step record (``rank<r>.status``) in this
    start: shardax's loops do; a command that does not is never shrunk."""
    return any(record_path(launch_dir, rank).exists() for rank in range(count))


def came_back(launch_dir: Path) -> bool:
    """Whether the run restarted last completed a step (its process 0 records the first
    step of each restart in ``status.json``): a process that fails again before that could
    not come back."""
    restarts = read_status(launch_dir).get("restarts") or [{}]
    return restarts[-1].get("first_step") is not None


def clear_records(launch_dir: Path, count: int) -> None:
    """Removes the processes' step records (``rank<r>.status``) of an earlier start."""
    for rank in range(count):
        with contextlib.suppress(FileNotFoundError):
            record_path(launch_dir, rank).unlink()


def snapshot_dir(launch_dir: Path) -> Path:
    """Where the processes keep their snapshots: in host memory (``/dev/shm``), owned by
    this launcher (removed when it ends), so a process's death loses none; in the launch
    directory where there is no ``/dev/shm``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix=f"shardax-{os.getpid()}-", dir=shm))
    path = launch_dir / "snapshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_launch_dir() -> Path:
    """``runs/launch-<UTC time>-<pid>``: a new directory for each launch."""
    return Path("runs") / f"launch-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"
