"""A hang watchdog: a step that does not complete in time ends the process, loudly.

A process that stays alive but stops entering collectives (a deadlock, a stuck data
reader, a peer stuck in I/O) leaves the others waiting inside their next collective
forever: the coordinator's heartbeat only notices processes that died. A
[`StepWatchdog`][shardax.StepWatchdog] runs a thread that waits for each armed step to
complete. When ``timeout`` seconds pass first, it dumps every thread's Python stack
(``faulthandler``) to stderr, prints one line naming the step and the timeout, and ends
the process with [`WATCHDOG_EXIT_CODE`][shardax.runtime.WATCHDOG_EXIT_CODE]. In a
multi-process run it first prints one line naming the processes that are behind, with
their step and phase (``shardax.runtime.status``: every process publishes its last
completed step and its phase, which the loop sets with
[`StepWatchdog.phase`][shardax.StepWatchdog.phase]). No process exits before every process
has written its
report (or ``LEAVE_GRACE`` has passed): one that ends breaks the collective the
others wait in, which then fail with a runtime error instead of their own report; and
process 0 exits last. Under ``shardax launch`` (or a scheduler
that ends a job when one task fails) the other processes are then stopped too; those
stuck in a collective with the hung one time out on their own watchdog anyway.

Arm it around the work of a step, and wait for the step's result inside, since JAX
dispatches asynchronously and a hang shows only when the host waits:

>>> import shardax as sx
>>> from shardax.runtime import status
>>> with sx.StepWatchdog(timeout=600) as watchdog:
...     for step in range(1, 4):
...         with watchdog.step(step):
...             watchdog.phase(status.DATA)
...             batch = next(batches)
...             watchdog.phase(status.DISPATCH)
...             state, metrics = train_step(state, batch)
...             watchdog.phase(status.DEVICE)
...             _ = jax.block_until_ready(metrics["loss"])
>>> int(state.step)
3

Off by default: nothing is watched unless a loop creates one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

import jax

from shardax.checks import as_count, as_float, public
from shardax.runtime import status

WATCHDOG_EXIT_CODE = 124
"""The exit code of a process the watchdog ended (as ``timeout(1)`` uses)."""

ON_FIRE_GRACE = 10.0
"""Seconds the watchdog gives ``on_fire`` before it ends the process without it (a
callback stuck on a hung filesystem or collective must not keep a hung process alive)."""

FIRING = threading.Event()
"""Set once a watchdog of this process fired: it reports and ends the process, so an
error its main thread meets meanwhile (a collective broken by a peer that left after its
own report) waits for that exit instead of ending the process first with another code."""

LEAVE_GRACE = 10.0
"""Seconds a process waits, after its own report, for the others' before it exits (see
``shardax.runtime.status.leave_last``)."""


@public("sx.StepWatchdog")
class StepWatchdog:
    """Ends the process when an armed step takes longer than ``timeout`` seconds.

    Args:
        timeout: seconds a step may take, > 0.
        exit_code: the process's exit code when a step times out.
        file: where the stack dump and the message go (default: ``sys.stderr``).
        on_fire: called with the step before the process exits (e.g. to save the goodput
            ledger with the step's time as ``hang``), on a thread of its own; given
            ``ON_FIRE_GRACE`` seconds, after which the process exits without it. It
            must not call this watchdog's methods (their lock is held meanwhile).

    Use [`step`][shardax.StepWatchdog.step] as a context manager around each step, or
    [`arm`][shardax.StepWatchdog.arm] and [`disarm`][shardax.StepWatchdog.disarm];
    [`close`][shardax.StepWatchdog.close] (or leaving the ``with`` block) stops the
    thread.
    """

    def __init__(
        self,
        timeout: float,
        *,
        exit_code: int = WATCHDOG_EXIT_CODE,
        file: IO[str] | None = None,
        on_fire: Callable[[int | None], None] | None = None,
    ) -> None:
        self.timeout = as_float("timeout (seconds)", timeout, above=0)
        self.exit_code = as_count("exit_code", exit_code, minimum=0, maximum=255)
        self._file = file
        self.on_fire = on_fire
        self._cond = threading.Condition()
        self._step: int | None = None
        self._earlier: Callable[[], int | None] | None = None
        self._deadline: float | None = None
        self._closed = False
        self._where = ""
        self._thread: threading.Thread | None = None

    def arm(self, step: int, earlier: Callable[[], int | None] | None = None) -> None:
        """Starts the clock: ``step`` must complete
        ([`disarm`][shardax.StepWatchdog.disarm]) within ``timeout``. ``earlier``:
        ``() -> step | None``, an earlier step still running on the device (a loop that
        waits one step behind), named instead of ``step`` at a hang."""
        if self._thread is None:
            self._where = _process_label()
            self._thread = threading.Thread(
                target=self._watch, name="shardax-step-watchdog", daemon=True
            )
            self._thread.start()
        with self._cond:
            if self._closed:
                raise RuntimeError("arm() after close()")
            self._step, self._deadline = step, time.monotonic() + self.timeout
            self._earlier = earlier
            self._cond.notify()
        status.STATUS.step = step

    def disarm(self, completed: bool = True) -> None:
        """Stops the clock: the armed step completed. ``completed=False``: only the clock
        stops, the step is not recorded as completed for the hang report (a loop that
        waits one step behind records the steps it waited for itself)."""
        with self._cond:
            step, self._step, self._deadline = self._step, None, None
            self._cond.notify()
        if step is not None and completed:
            status.STATUS.completed(step)

    @staticmethod
    def phase(phase: str, step: int | None = None) -> None:
        """This process enters ``phase`` (``shardax.runtime.status.PHASES``), for the
        hang report."""
        status.STATUS.set(phase, step)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Watches the block as step ``step``."""
        self.arm(step)
        try:
            yield
        finally:
            self.disarm()

    def close(self) -> None:
        """Stops watching and ends the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StepWatchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self._fire(self._named())
                self._cond.wait(left)

    def _named(self) -> int | None:
        """The step a hang names: the earlier one still running, else the armed one."""
        earlier = None
        if self._earlier is not None:
            with contextlib.suppress(Exception):
                earlier = self._earlier()
        return self._step if earlier is None else earlier

    def _fire(self, step: int | None) -> None:
        """Reports the hang and ends the process. Whatever fails on the way (a closed
        ``file``, an unusable exit code), the process still ends: the failure is written
        to the process's own stderr and the exit code falls back to
        [`WATCHDOG_EXIT_CODE`][shardax.runtime.WATCHDOG_EXIT_CODE]."""
        code = self.exit_code
        FIRING.set()  # the process ends here: an error of its main thread waits for it
        try:
            out = self._file or sys.stderr
            _flush(sys.stdout)
            line = status.hang_line()
            if line:
                out.write(line + "\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            mine = status.STATUS
            doing = f"{mine.phase} for step {mine.step}; " if mine.phase else ""
            out.write(
                f"shardax: hang watchdog: {self._where}step {step} did not complete within "
                f"{self.timeout:g} s ({doing}--step-timeout); stacks of every thread above; "
                f"exiting with code {code}\n"
            )
            out.flush()
        except BaseException as e:  # the report failed: say so where it can still be seen
            _last_words(
                f"shardax: hang watchdog: {self._where}step {step} did not complete within "
                f"{self.timeout:g} s; reporting it failed ({e!r}); exiting with code {code}"
            )
        if self.on_fire is not None:  # the process ends whatever it does, or if it hangs
            with contextlib.suppress(BaseException):
                _call_within(self.on_fire, step, ON_FIRE_GRACE)
        with contextlib.suppress(BaseException):  # after every process's report, 0 last
            status.leave_last(LEAVE_GRACE)
        try:
            os._exit(code)
        except BaseException as e:
            _last_words(
                f"shardax: hang watchdog: exit code {code!r} failed ({e!r}); exiting with "
                f"code {WATCHDOG_EXIT_CODE}"
            )
            os._exit(WATCHDOG_EXIT_CODE)


def _call_within(fn: Callable[[int | None], None], step: int | None, seconds: float) -> None:
    """Runs ``fn(step)`` on a daemon thread for at most ``seconds``; says so on stderr
    when it raised or did not return in time."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn(step)
        except BaseException as e:
            failed.append(e)

    thread = threading.Thread(target=run, name="shardax-watchdog-on-fire", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _last_words(
            f"shardax: hang watchdog: on_fire did not return within {seconds:g} s; exiting "
            "without it"
        )
    elif failed:
        _last_words(f"shardax: hang watchdog: on_fire raised {failed[0]!r}; exiting anyway")


def _flush(stream: IO[str] | None) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):  # closed or broken
        stream.flush()  # type: ignore[union-attr]


def _last_words(line: str) -> None:
    """``line`` on the process's original stderr (file descriptor 2), whatever
    ``sys.stderr`` has become; never raises."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


def _process_label() -> str:
    """``"process 1 of 2: "`` in a multi-process run, else empty."""
    if not jax.distributed.is_initialized():
        return ""
    return f"process {jax.process_index()} of {jax.process_count()}: "
