"""Preemption: a SIGTERM makes every process save at the same step, then exit for a requeue.

Schedulers send SIGTERM before they kill a job (SLURM with ``--signal=TERM@60``,
Kubernetes at pod deletion, ``terminationGracePeriodSeconds`` later). A loop that calls
[`reached_preemption`][shardax.checkpoint.reached_preemption] after every step learns at a
step boundary that it should save and stop:

- in a multi-process run (``jax.distributed`` is initialized) JAX's preemption service
  catches the SIGTERM of any process, tells the others through the coordinator, and
  every process agrees on the same step, the largest step any process had reached plus
  one (``multihost_utils.reached_preemption_sync_point``). Saving at different steps
  cannot happen, whichever process got the signal;
- in a single process, a Python SIGTERM handler (installed by the first call, or by
  [`watch_preemption`][shardax.watch_preemption]) sets a flag that the next call reports.

This is the one preemption API ([`shardax.loop.run`][shardax.loop.run] calls it after every step,
saves and exits 75 by itself). The loop then saves and exits with
[`PREEMPTED_EXIT_CODE`][shardax.checkpoint.PREEMPTED_EXIT_CODE] (75, ``EX_TEMPFAIL``:
"temporary failure, try again"), which a scheduler can tell from success (0) and from
failure (1), and requeue on. A SIGTERM that arrives during a save only sets the flag: the
save completes first.

>>> import shardax as sx
>>> manager = sx.CheckpointManager(tmp_path / "ckpt")
>>> with sx.watch_preemption():  # listen from the first step; the old handler back after
...     for step in range(1, 4):
...         state, metrics = train_step(state, next(batches))
...         if sx.checkpoint.reached_preemption(step):
...             manager.save(step, state, data_state=batches.get_state())
...             raise sx.Preempted(step, manager.directory)  # exit code 75
>>> manager.close()
"""

from __future__ import annotations

import signal
import threading
from typing import Any, ClassVar

import jax
from jax.experimental import multihost_utils

from shardax.checks import public
from shardax.runtime.launcher import launcher_lost, note_exit

PREEMPTED_EXIT_CODE = 75
"""The exit code of a run that saved and stopped on a preemption notice (``EX_TEMPFAIL``)."""


class Preempted(Exception):
    """A preemption notice stopped training after ``step`` was saved to ``directory``.

    ``resume``: how the loop that raised it continues from the saved step (``shardax
    train``: ``"continue it with --resume"``; [`shardax.loop.run`][shardax.loop.run] says its own);
    default: restore the checkpoint. ``shardax train`` turns it into one line on stderr
    and [`PREEMPTED_EXIT_CODE`][shardax.checkpoint.PREEMPTED_EXIT_CODE].
    """

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, step: int, directory: str | None, resume: str | None = None) -> None:
        if directory:
            what = f"saved step {step} to {directory}"
            then = resume or "restore it to continue (sx.restore_checkpoint)"
        else:
            what, then = f"stopped after step {step}, saving nothing", "no checkpoint directory"
        # Its arguments are its args (a notice, not an error a door prefixes), its text
        # the message.
        super().__init__(step, directory)
        lost = launcher_lost(wait=2.0)  # the launcher's death may signal before it is seen
        why = "SIGTERM" if lost is None else f"SIGTERM: the launcher, pid {lost['pid']}, was lost"
        self.message = (
            f"preempted ({why}): {what}; exiting with code {PREEMPTED_EXIT_CODE} so the "
            f"scheduler requeues the job; {then}"
        )
        self.step, self.directory = step, directory
        note_exit(self.message)  # into the launch's status file once its launcher is lost

    def __str__(self) -> str:
        return self.message


_SERVICE_OFF = (
    "JAX's preemption service is off, so the processes cannot agree on a step to save at; "
    "call jax.config.update('jax_enable_preemption_service', True) before sx.initialize()"
)


class _Notice:
    """The single-process notice: set by the signal handler, read by the loop."""

    event = threading.Event()
    installed: ClassVar[set[int]] = set()
    reached = False  # reached_preemption said True (any process count)


def _multi_process() -> bool:
    return jax.distributed.is_initialized()


@public("sx.watch_preemption")
def watch_preemption(signals: tuple[int, ...] = (signal.SIGTERM,)) -> PreemptionWatch:
    """Starts listening for preemption notices;
    [`reached_preemption`][shardax.checkpoint.reached_preemption] does it on its
    first call, so call this to listen from before the first step, or to stop listening
    afterwards: the result is a context manager that puts the previous handlers back.

    In a multi-process run JAX's preemption service already listens for SIGTERM (it is
    set up by ``jax.distributed.initialize``); a Python handler would replace its own, so
    none is installed and ``signals`` other than SIGTERM are refused. In a single
    process, a handler for ``signals`` is installed (from the main thread only).

    Raises:
        RuntimeError: JAX's preemption service is off (``jax_enable_preemption_service``),
            or a single process calls this from a thread other than the main one.
        ValueError: a signal other than SIGTERM in a multi-process run.
    """
    if _multi_process():
        if tuple(signals) != (signal.SIGTERM,):
            raise ValueError(
                f"in a multi-process run JAX's preemption service listens "
                f"for SIGTERM only, got signals={signals}"
            )
        if not jax.config.jax_enable_preemption_service:
            raise RuntimeError(_SERVICE_OFF)
        return PreemptionWatch({})
    previous = {}
    for sig in signals:
        if sig in _Notice.installed:
            continue
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "signal handlers can only be installed from the main "
                "thread; call sx.watch_preemption() there before starting the loop"
            )
        previous[sig] = signal.signal(sig, _on_signal)
        _Notice.installed.add(sig)
    return PreemptionWatch(previous)


class PreemptionWatch:
    """What [`watch_preemption`][shardax.watch_preemption] returns: ``close()`` (or
    leaving a ``with`` block) puts back the handlers it replaced and forgets a notice that
    was not acted on."""

    def __init__(self, previous: dict[int, Any]) -> None:
        self._previous = previous

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
            _Notice.installed.discard(sig)
        if self._previous:
            _Notice.event.clear()
            _Notice.reached = False
        self._previous = {}

    def __enter__(self) -> PreemptionWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_signal(signum: int, frame: Any) -> None:
    _Notice.event.set()


@public("sx.checkpoint.reached_preemption")
def reached_preemption(step: int) -> bool:
    """True when the loop should save ``step`` and stop: a preemption notice arrived and,
    with several processes, ``step`` is the step every process agreed on.

    Call it after every step, with the number of steps done, on every process (all
    processes must make the same calls from the same first step). It is cheap: no
    collective runs until a notice arrives.
    """
    if _multi_process():
        try:
            reached = bool(multihost_utils.reached_preemption_sync_point(int(step)))
        except RuntimeError as e:
            raise RuntimeError(_SERVICE_OFF) from e
    else:
        watch_preemption()
        reached = _Notice.event.is_set()
    _Notice.reached = _Notice.reached or reached
    return reached


def preemption_requested() -> bool:
    """True once a preemption notice was seen (a single process's SIGTERM, or a
    [`reached_preemption`][shardax.checkpoint.reached_preemption] that said True): an
    asynchronous save then waits for its commit before returning, so the process can exit
    right after it."""
    return _Notice.event.is_set() or _Notice.reached
