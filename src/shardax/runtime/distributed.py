"""Joining a multi-process run: ``initialize`` over ``jax.distributed``.

Where the coordinates come from, first match wins:

1. explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``);
2. the environment set by ``shardax launch`` (``ENV_COORDINATOR``, ...);
3. the plain JAX environment a Kubernetes JobSet (or any launcher) can set:
   ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0, which JAX reads too),
   ``JAX_NUM_PROCESSES``, and ``JAX_PROCESS_ID`` or else ``JOB_COMPLETION_INDEX``
   (set by Kubernetes in every pod of an Indexed Job, so in every JobSet job);
4. JAX's own cluster detection: SLURM (``srun``) and Open MPI (``mpirun``) are
   recognised here; any other JAX method is used when named in
   ``cluster_detection_method``.

With none of these, there is nothing to join: the process runs alone and
``initialize`` only applies ``cpu_devices``. It must run before any JAX backend starts.

>>> import shardax as sx
>>> sx.initialize()  # doctest: +SKIP
False
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

from shardax.checks import as_count, parse_address, public
from shardax.runtime import compat, watchdog
from shardax.runtime.launcher import watch_launcher
from shardax.runtime.rendezvous import roll_call

ENV_COORDINATOR = "SHARDAX_COORDINATOR"
"""``host:port`` of the coordinator (process 0), set by ``shardax launch``."""
ENV_NUM_PROCESSES = "SHARDAX_NUM_PROCESSES"
"""Number of processes in the run, set by ``shardax launch``."""
ENV_PROCESS_ID = "SHARDAX_PROCESS_ID"
"""This process's rank, ``0 .. num_processes - 1``, set by ``shardax launch``."""
ENV_CPU_DEVICES = "SHARDAX_CPU_DEVICES"
"""Simulated CPU devices per process (``shardax launch --cpu-devices``)."""
ENV_HEARTBEAT = "SHARDAX_HEARTBEAT_TIMEOUT"
"""Seconds without a heartbeat after which a process is declared dead."""
ENV_JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
"""``host:port`` of process 0 in the plain JAX environment (e.g. a Kubernetes JobSet)."""
ENV_JAX_NUM_PROCESSES = "JAX_NUM_PROCESSES"
"""Number of processes in the plain JAX environment."""
ENV_JAX_PROCESS_ID = "JAX_PROCESS_ID"
"""This process's rank in the plain JAX environment."""
ENV_JOB_INDEX = "JOB_COMPLETION_INDEX"
"""The pod's index in a Kubernetes Indexed Job: the rank when ``JAX_PROCESS_ID`` is unset."""


class ProcessCoordinates(NamedTuple):
    """How this process joins: where from (``source``) and, when known, the coordinates."""

    source: str  # "arguments", "shardax launch", "jax environment", or a JAX cluster method
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None


class _State:
    done: bool = False  # initialize() has run to completion once in this process
    joined: bool = False  # ... and joined a multi-process run


_state = _State()


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def resolve_coordinates(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cluster_detection_method: str | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessCoordinates | None:
    """Where this process's coordinates come from; None when there is nothing to join.

    Starts nothing. The launch variables (``shardax launch``'s and ``JAX_COORDINATOR_ADDRESS``
    with its companions) are read from ``env`` (default ``os.environ``). SLURM and Open MPI
    are detected by JAX's own cluster classes, which read ``os.environ`` whatever ``env``
    is: that is where ``jax.distributed.initialize`` reads them next.

    >>> resolve_coordinates(env={}) is None
    True
    >>> resolve_coordinates("10.0.0.1:1234", 2, 1, env={}).source
    'arguments'
    """
    env = os.environ if env is None else env
    given = (coordinator_address, num_processes, process_id)
    from_env = (
        env.get(ENV_COORDINATOR) or None,
        _env_int(env, ENV_NUM_PROCESSES),
        _env_int(env, ENV_PROCESS_ID),
    )
    names = ("coordinator_address", "num_processes", "process_id")
    if all(v is not None for v in given):
        return checked_coordinates(ProcessCoordinates("arguments", *given))  # type: ignore[arg-type]
    if any(v is not None for v in from_env):
        merged = tuple(g if g is not None else e for g, e in zip(given, from_env, strict=True))
        missing = [
            f"{n} (or ${e})"
            for n, e, v in zip(
                names, (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID), merged, strict=True
            )
            if v is None
        ]
        if missing:
            raise ValueError(f"the shardax launch environment is incomplete; missing {missing}")
        return checked_coordinates(ProcessCoordinates("shardax launch", *merged))  # type: ignore[arg-type]
    if env.get(ENV_JAX_COORDINATOR):
        return checked_coordinates(_jax_environment(given, env))
    if cluster_detection_method is not None:
        return checked_coordinates(ProcessCoordinates(cluster_detection_method, *given))
    # The cluster environments recognised without being named: environment-only checks.
    for method in compat.CLUSTER_METHODS:
        if compat.cluster_env(method).is_env_present():
            return checked_coordinates(ProcessCoordinates(method, *given))
    if any(v is not None for v in given):
        missing = [n for n, v in zip(names, given, strict=True) if v is None]
        raise ValueError(
            f"got {dict(zip(names, given, strict=True))} but no cluster environment "
            f"(SLURM, Open MPI, shardax launch) supplies the missing {missing}; pass all three"
        )
    return None


def _jax_environment(
    given: tuple[str | None, int | None, int | None], env: Mapping[str, str]
) -> ProcessCoordinates:
    """Coordinates from ``JAX_COORDINATOR_ADDRESS`` and its companions (arguments win)."""
    rank_var = ENV_JAX_PROCESS_ID if env.get(ENV_JAX_PROCESS_ID) else ENV_JOB_INDEX
    from_env = (
        env[ENV_JAX_COORDINATOR],
        _env_int(env, ENV_JAX_NUM_PROCESSES),
        _env_int(env, rank_var),
    )
    merged = tuple(g if g is not None else e for g, e in zip(given, from_env, strict=True))
    wanted = (
        f"${ENV_JAX_COORDINATOR}",
        f"num_processes (or ${ENV_JAX_NUM_PROCESSES})",
        f"process_id (or ${ENV_JAX_PROCESS_ID}, or ${ENV_JOB_INDEX} in a Kubernetes Indexed Job)",
    )
    missing = [w for w, v in zip(wanted, merged, strict=True) if v is None]
    if missing:
        raise ValueError(
            f"${ENV_JAX_COORDINATOR} is set ({env[ENV_JAX_COORDINATOR]!r}) but "
            f"the environment lacks {missing}"
        )
    return ProcessCoordinates("jax environment", *merged)  # type: ignore[arg-type]


def checked_coordinates(coords: ProcessCoordinates) -> ProcessCoordinates:
    """``coords`` with every given value checked, before JAX sees any: the address is
    ``host:port`` with a port in 1..65535, ``num_processes >= 1`` and ``0 <= process_id <
    num_processes``. Raises ``ValueError`` naming the value (and its environment variable
    under ``shardax launch``)."""
    env = coords.source == "shardax launch"
    names = [
        f"{n}" + (f" (${e})" if env else "")
        for n, e in (
            ("coordinator_address", ENV_COORDINATOR),
            ("num_processes", ENV_NUM_PROCESSES),
            ("process_id", ENV_PROCESS_ID),
        )
    ]
    address, count, rank = coords.coordinator_address, coords.num_processes, coords.process_id
    if address is not None:
        parse_address(names[0], address)
    if count is not None:
        count = as_count(names[1], count)
    if rank is not None:
        rank = as_count(names[2], rank, minimum=0)
        if count is not None and rank >= count:
            raise ValueError(f"{names[2]} must be in [0, num_processes={count}), got {rank}")
    return coords._replace(num_processes=count, process_id=rank)


def backend_started() -> bool:
    """True once any JAX backend (CPU, GPU, TPU) has been created in this process."""
    return compat.backends_are_initialized()


def _hard_exit_on_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
    """Prints the traceback, then exits at once: without this, a process that raises
    waits in jax.distributed's shutdown barrier for peers that wait on it in a collective.
    While this process's hang watchdog reports (it ends the process with its own code),
    waits for it instead."""
    while watchdog.FIRING.is_set():
        time.sleep(1.0)  # the watchdog's os._exit ends the process
    sys.__excepthook__(exc_type, exc, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


def exit_on_error(kind: type[BaseException] | None, error: Any, tb: Any) -> None:
    """Ends the process at once, as an uncaught exception would (traceback, exit 1), when
    ``error`` leaves a block of a multi-process run that ``initialize`` joined with
    ``exit_on_uncaught_exception``: the block's clean-up (waiting for an asynchronous save
    to commit, closing the checkpoint manager) waits on the other processes, which wait in
    a collective for this one, so it would hang both. A no-op otherwise (one process, no
    error, or a ``SystemExit``/``KeyboardInterrupt``)."""
    if kind is None or not issubclass(kind, Exception):
        return
    if sys.excepthook is _hard_exit_on_uncaught and jax.process_count() > 1:
        _hard_exit_on_uncaught(kind, error, tb)


@public("sx.initialize")
def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_devices: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    cluster_detection_method: str | None = None,
    heartbeat_timeout_seconds: int | None = None,
    initialization_timeout: int = 300,
    shutdown_timeout_seconds: int = 300,
    exit_on_uncaught_exception: bool = True,
) -> bool:
    """Joins the multi-process run this process belongs to, if any.

    Call it first, before any JAX computation (and before ``jax.devices()``).

    Args:
        coordinator_address, num_processes, process_id: explicit coordinates; by
            default from ``shardax launch``'s environment, ``JAX_COORDINATOR_ADDRESS``
            and its companions, or SLURM / Open MPI.
        cpu_devices: simulated CPU devices for this process (default:
            ``$SHARDAX_CPU_DEVICES`` when set, else JAX's default).
        local_device_ids: the accelerators this process drives (default: JAX's choice).
        cluster_detection_method: a JAX cluster detection method to use, for example
            ``"mpi4py"`` or ``"gke"``; by default only SLURM and Open MPI are tried.
        heartbeat_timeout_seconds: seconds of silence after which a process is declared
            dead and every other process stops (default: ``$SHARDAX_HEARTBEAT_TIMEOUT``,
            else JAX's 100).
        initialization_timeout: seconds to wait for every process to connect.
        shutdown_timeout_seconds: seconds a finished process waits for the others.
        exit_on_uncaught_exception: in a multi-process run, an uncaught exception prints
            its traceback and ends the process at once (exit code 1), so that the others
            fail promptly instead of waiting on it.

    Returns:
        True when this process is part of a multi-process run; False when it runs alone.

    Raises:
        RuntimeError: a JAX backend has already started (call ``initialize`` first).
        ValueError: incomplete or malformed coordinates (address, port, process
            count, rank), or a count below 1; all checked before JAX sees them.
        TimeoutError: a process did not join within ``initialization_timeout``; the
            message names the coordinator address, the timeout and who is missing.

    Calling it again is harmless and returns the first answer.
    """
    if _state.done or jax.distributed.is_initialized():
        joined = _state.joined or jax.process_count() > 1
        asked = {"num_processes": num_processes, "process_id": process_id}
        have = {"num_processes": jax.process_count(), "process_id": jax.process_index()}
        wrong = {k: v for k, v in asked.items() if v is not None and v != have[k]}
        if wrong:
            raise ValueError(
                f"called again with {wrong}, but this process already runs as "
                f"{have}; a process joins one run, once"
            )
        return joined
    if backend_started():
        raise RuntimeError(
            "shardax.initialize() must be called before any JAX computation: a JAX backend "
            "has already started (jax.devices(), jax.numpy, device_put and jit all start "
            "one). Call sx.initialize() first thing in your program."
        )
    if cpu_devices is None:
        cpu_devices = _env_int(os.environ, ENV_CPU_DEVICES)
    if cpu_devices is not None:
        cpu_devices = as_count(f"cpu_devices (or ${ENV_CPU_DEVICES})", cpu_devices)
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    coords = resolve_coordinates(
        coordinator_address,
        num_processes,
        process_id,
        cluster_detection_method=cluster_detection_method,
    )
    # Under shardax launch: stop (on the preemption path) when the launcher is gone.
    watch_launcher(rank=coords.process_id if coords is not None else None)
    if coords is None:
        _state.done = True
        return False
    if heartbeat_timeout_seconds is None:
        heartbeat_timeout_seconds = _env_int(os.environ, ENV_HEARTBEAT)
    if heartbeat_timeout_seconds is None:
        heartbeat_timeout_seconds = 100  # JAX's default
    heartbeat_timeout_seconds = as_count(
        f"heartbeat_timeout_seconds (or ${ENV_HEARTBEAT}, seconds)",
        heartbeat_timeout_seconds,
    )
    initialization_timeout = as_count("initialization_timeout (seconds)", initialization_timeout)
    if jax.config.jax_cpu_collectives_implementation is None:
        # Cross-process collectives between CPU devices; gloo needs no extra install.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    explicit = coords.source in ("arguments", "shardax launch", "jax environment")
    if explicit:
        # Every process is there before JAX's join, whose failure is an abort from C++.
        host, port = parse_address("coordinator_address", coords.coordinator_address)
        roll_call(
            coords.coordinator_address,  # type: ignore[arg-type]
            host,
            port,
            coords.process_id,  # type: ignore[arg-type]
            coords.num_processes,  # type: ignore[arg-type]
            initialization_timeout,
        )
    jax.distributed.initialize(
        coordinator_address=coords.coordinator_address,
        num_processes=coords.num_processes,
        process_id=coords.process_id,
        local_device_ids=local_device_ids,
        # Coordinates we resolved ourselves must not be overridden by a cluster
        # environment (for example shardax launch inside a SLURM allocation).
        cluster_detection_method="deactivate" if explicit else cluster_detection_method,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
    )
    _state.done = True
    _state.joined = True
    if exit_on_uncaught_exception:
        sys.excepthook = _hard_exit_on_uncaught
    uneven = uneven_devices([d.process_index for d in jax.devices()], jax.process_count())
    if uneven:
        raise RuntimeError(uneven)
    return True


def uneven_devices(owners: Sequence[int], processes: int) -> str:
    """The sentence naming the processes that drive another number of devices than the
    others (``owners``: the process of each device of the run), or "" when all drive as
    many: a process left with one device of its host's 8 (a wrong ``local_device_ids``
    or ``CUDA_VISIBLE_DEVICES``) would make every mesh and batch split wrong.

    >>> uneven_devices([0, 0, 1, 1], 2)
    ''
    >>> uneven_devices([0, 0, 0, 0, 1], 2)
    'process 1 drives 1 device(s), the others 4; ...'
    """
    counts = Counter(owners)
    per = [counts.get(p, 0) for p in range(processes)]
    usual = Counter(per).most_common(1)[0][0]
    odd = [p for p, n in enumerate(per) if n != usual]
    if not odd:
        return ""
    named = ", ".join(f"process {p} drives {per[p]} device(s)" for p in odd)
    return (
        f"{named}, the others {usual}; {len(owners)} devices in all, not {usual} x "
        f"{processes} processes. Every process must drive as many devices: check "
        "local_device_ids, CUDA_VISIBLE_DEVICES and the CPU device count of each process"
    )
