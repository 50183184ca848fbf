"""``shardax launch -n N [--cpu-devices K] [--port P] -- CMD ...``: N local processes.

Each process gets the environment that [`shardax.initialize`][shardax.initialize] reads (coordinator
on
127.0.0.1, the process count, its rank, its CPU device count), so the program joins the
run with one call, and ``CUDA_DEVICE_MAX_CONNECTIONS=1`` where the environment does not
set it (CUDA reads it when JAX starts the GPU; it lets the GPU settings of
``shardax.train.compiler`` overlap collectives with compute). The processes' stdout
goes to launch's stdout, and their stderr (tracebacks, logs) and runtime chatter
(``RUNTIME_CHATTER``, which gloo writes to stdout) to launch's stderr, each line
prefixed with the rank; when the command has ``--json``, stdout lines are passed on
unprefixed, so stdout stays pure JSON. When a process fails, the others are stopped and
launch exits with that first non-zero code; Ctrl-C stops them all. A SIGTERM (a
scheduler's preemption notice) is forwarded to every process, which save and exit with
code 75 ([`PREEMPTED_EXIT_CODE`][shardax.checkpoint.PREEMPTED_EXIT_CODE]): a process that exits with
75 does not stop the
others, and launch exits with 75 once all have ended. Launch itself never starts JAX.

    $ shardax launch -n 2 --cpu-devices 4 -- python train.py
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

from shardax.checkpoint.preemption import PREEMPTED_EXIT_CODE
from shardax.cli.common import UsageError, nonneg_float, positive_int, tcp_port
from shardax.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_HEARTBEAT,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
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
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` (default ``os.environ``) plus the
    variables [`shardax.initialize`][shardax.initialize] reads, and those the GPU compiler settings
    need
    before JAX starts (``shardax.train.compiler.ENVIRONMENT``:
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``) where ``base`` does not set them.

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
            "PYTHONUNBUFFERED": "1",
        }
    )
    if cpu_devices is not None:
        env[ENV_CPU_DEVICES] = str(cpu_devices)
    if heartbeat_timeout is not None:
        env[ENV_HEARTBEAT] = str(heartbeat_timeout)
    return env


def start_processes(
    cmd: Sequence[str], envs: Sequence[Mapping[str, str]], *, merge_stderr: bool = True
) -> list[subprocess.Popen[bytes]]:
    """Starts ``cmd`` once per environment, each in its own session (process group),
    with stdout and stderr piped: merged into one pipe, or two with ``merge_stderr=False``."""
    return [
        subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            start_new_session=True,
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
) -> None:
    """Copies ``pipe``'s lines to ``out`` (after ``[rank] `` if ``prefix``); runtime chatter
    goes to ``err``, always prefixed."""
    if pipe is None:
        return
    pending = 0  # gloo's messages begun and not yet ended (see runtime_chatter)
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        chatter, pending = runtime_chatter(line, pending)
        stream = err if chatter else out
        if raised is not None and line.startswith(_TRACEBACK):
            raised.setdefault(rank, time.monotonic())
        with lock:
            stream.write(f"[{rank}] {line}\n" if prefix or chatter else f"{line}\n")
            stream.flush()
    pipe.close()


_TRACEBACK = "Traceback (most recent call last):"


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGINT to every running process group, then SIGKILL to those still alive after
    ``grace`` seconds. Not SIGTERM: JAX turns it into a preemption notice and goes on."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGINT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.05)
    for p in running:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in running:
        p.wait()


@contextlib.contextmanager
def forward_signals(
    procs: Sequence[subprocess.Popen[bytes]], signals: Sequence[int] = (signal.SIGTERM,)
) -> Iterator[None]:
    """Within the block, ``signals`` sent to this process go to every running process
    group instead (the previous handlers come back afterwards). Main thread only."""

    def forward(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        yield
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
) -> int:
    """Forwards each process's stdout to ``out`` and stderr to ``err`` (default: this
    process's), lines prefixed with the rank (stdout's only if ``prefix_stdout``), until
    every process has ended.

    Returns the first non-zero exit code (in time), after stopping the other
    processes; 0 when all succeed; 130 after Ctrl-C, once all are stopped. A process
    that exits with [`PREEMPTED_EXIT_CODE`][shardax.checkpoint.PREEMPTED_EXIT_CODE] saved on a
    preemption notice, as the
    others are doing: they are left to finish, and the code is returned at the end.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    lock = threading.Lock()
    raised: dict[int, float] = {}  # rank -> when it printed its first Python traceback
    readers = [
        threading.Thread(
            target=_forward,
            args=(r, p.stdout, out, err, lock),
            kwargs={"prefix": prefix_stdout, "raised": raised},
        )
        for r, p in enumerate(procs)
    ]
    readers += [
        threading.Thread(target=_forward, args=(r, p.stderr, err, err, lock),
                         kwargs={"raised": raised})
        for r, p in enumerate(procs)
    ]  # fmt: skip
    for t in readers:
        t.daemon = True
    started: list[threading.Thread] = []
    first_failure = 0
    try:  # Ctrl-C may come as soon as a process has printed, before every reader runs
        for t in readers:
            t.start()
            started.append(t)
        while [p.poll() for p in procs].count(None):  # polls every process
            first = _first_failed(procs, (None, 0, PREEMPTED_EXIT_CODE), raised)
            if first is not None:
                first_failure = _say_failed(procs, first, raised, err, lock, "stopping the others")
                stop(procs, grace)
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        stop(procs, grace)
        first_failure = 130
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
        first = _first_failed(procs, (None, 0), raised)
        if first is not None and first.returncode == PREEMPTED_EXIT_CODE:
            first_failure = PREEMPTED_EXIT_CODE
        elif first is not None:  # every process ended between two polls: said here
            first_failure = _say_failed(procs, first, raised, err, lock, "all have ended")
    return first_failure


def _say_failed(
    procs: Sequence[subprocess.Popen[bytes]],
    first: subprocess.Popen[bytes],
    raised: dict[int, float],
    err: IO[str],
    lock: threading.Lock,
    then: str,
) -> int:
    """Writes which process failed first (and which raised first, if another) and
    returns its exit code."""
    code, failed_rank = exit_code(first.returncode), procs.index(first)
    cause = min(raised, key=raised.__getitem__) if raised else failed_rank
    after = (
        "" if cause == failed_rank else f" after process {cause} raised (its traceback is above)"
    )
    with lock:
        err.write(f"shardax launch: process {failed_rank} exited with code {code}{after}; {then}\n")
        err.flush()
    return code


def _first_failed(
    procs: Sequence[subprocess.Popen[bytes]], ok: tuple, raised: dict[int, float] | None = None
) -> subprocess.Popen[bytes] | None:
    """The failed process to report among those seen ended at once (None if none): one
    that exited on its own (an exception) before one killed by a signal, usually the
    consequence (gloo aborts when its peer is gone); then the one that printed a Python
    traceback first (its peers' collectives fail after it, and they may all end at once,
    waiting for each other in the runtime's shutdown); then the lowest rank."""
    raised = raised or {}
    failed = [(r, p) for r, p in enumerate(procs) if p.returncode not in ok]
    if not failed:
        return None
    key = lambda rp: (rp[1].returncode < 0, raised.get(rp[0], math.inf), rp[0])  # noqa: E731
    return min(failed, key=key)[1]


def run(args: argparse.Namespace) -> int:
    """Starts the processes and supervises them; returns launch's exit code."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("give the command after --, e.g. -- python t.py")
    port = args.port or free_port()
    envs = [
        process_env(
            r,
            args.num_processes,
            port,
            cpu_devices=args.cpu_devices,
            heartbeat_timeout=args.heartbeat_timeout,
        )
        for r in range(args.num_processes)
    ]
    try:
        procs = start_processes(cmd, envs, merge_stderr=False)
    except OSError as e:  # not found, not executable
        raise UsageError(f"cannot run {cmd[0]!r}: {e.strerror}") from None
    with forward_signals(procs), interruptible():
        return supervise(procs, grace=args.grace, prefix_stdout="--json" not in cmd)
