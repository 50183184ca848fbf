"""Every private JAX API shardax uses, in one place (JAX 0.10.x to 0.12.x).

Each has no public equivalent in the supported versions:

- ``backends_are_initialized()``: whether a JAX backend has started. ``sx.initialize``
  must run before that (``jax.distributed.initialize`` says so only by failing later);
  ``jax.devices()`` would itself start a backend.
- ``cluster_env(method)``: JAX's cluster detection classes (SLURM, Open MPI), whose
  ``is_env_present()`` tells ``sx.initialize`` which cluster it runs in, by the same
  rules ``jax.distributed.initialize`` then applies.
- ``ClusterEnv``: the base of those classes; the tests check through it that JAX's
  SLURM detection fills in what ``sx.initialize`` leaves to it.
- ``orbax_await_tmp_cleanup(manager)``: orbax-checkpoint's private
  ``CheckpointManager._maybe_await_cleanup_tmp_directory``, which waits for the background
  deletion of unfinished ``*.orbax-checkpoint-tmp`` directories (only orbax's own ``save``
  awaits it; a manager closed without saving could delete the next save in progress).
- ``distributed_state``: ``jax.distributed``'s global state, whose ``client`` is the
  coordinator's key-value store (``key_value_set``, ``key_value_dir_get``), where each
  process publishes its step and phase for the hang report (:mod:`shardax.runtime.status`).
- ``ShardingTypeError``: the error JAX raises when an operation's output sharding does
  not follow from its inputs' types on a mesh with Explicit axes. shardax adds a note
  to it saying what to change; JAX raises it, so it can only be caught by its class.

``tests/runtime/test_compat.py`` checks each against the installed JAX and fails naming the
JAX version when one moves.

>>> from shardax.runtime import compat
>>> compat.cluster_env("slurm").__name__
'SlurmCluster'
>>> compat.missing()
[]
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

import jax

JAX_VERSION = jax.__version__
SUPPORTED = "0.10.x to 0.12.x"

PRIVATE_APIS: dict[str, tuple[str, str]] = {
    "backends_are_initialized": ("jax._src.xla_bridge", "backends_are_initialized"),
    "SlurmCluster": ("jax._src.clusters", "SlurmCluster"),
    "OmpiCluster": ("jax._src.clusters", "OmpiCluster"),
    "ClusterEnv": ("jax._src.clusters", "ClusterEnv"),
    "ShardingTypeError": ("jax._src.core", "ShardingTypeError"),
    "distributed_state": ("jax._src.distributed", "global_state"),
}
"""shardax's name for each private API: (module, attribute) in JAX."""


def private(name: str) -> Any:
    """The private JAX API ``name`` (a key of :data:`PRIVATE_APIS`); an ``ImportError``
    naming it and the installed JAX version when JAX has moved it."""
    module, attr = PRIVATE_APIS[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"shardax uses {module}.{attr}, which JAX {JAX_VERSION} does not have (shardax "
            f"supports JAX {SUPPORTED}); see shardax/runtime/compat.py"
        ) from e


ORBAX_TMP_CLEANUP = "_maybe_await_cleanup_tmp_directory"
"""The private ``orbax.checkpoint.CheckpointManager`` method :func:`orbax_await_tmp_cleanup`
calls."""


def _orbax_tmp_cleanup(manager_class: type) -> Any:
    method = getattr(manager_class, ORBAX_TMP_CLEANUP, None)
    if method is None:
        from importlib.metadata import version

        raise ImportError(
            f"shardax uses orbax.checkpoint.CheckpointManager.{ORBAX_TMP_CLEANUP}, which "
            f"orbax-checkpoint {version('orbax-checkpoint')} does not have; see "
            "shardax/runtime/compat.py"
        )
    return method


def orbax_await_tmp_cleanup(manager: Any) -> None:
    """Waits until ``manager`` (an ``orbax.checkpoint.CheckpointManager``) has deleted the
    unfinished tmp directories it found when it opened."""
    _orbax_tmp_cleanup(type(manager))(manager)


ORBAX_SIGNALING_THREAD = ("orbax.checkpoint._src.futures.future", "_SignalingThread")
"""orbax-checkpoint's private thread class behind each piece of an async save."""


def _orbax_signaling() -> tuple[Any, type]:
    module, name = ORBAX_SIGNALING_THREAD
    try:
        futures = importlib.import_module(module)
        thread_class = getattr(futures, name)
        futures.set_signals  # noqa: B018 - checked here, used by orbax_release_save
    except (ImportError, AttributeError) as e:
        from importlib.metadata import version

        raise ImportError(
            f"shardax uses {module}.{name} and set_signals, which orbax-checkpoint "
            f"{version('orbax-checkpoint')} does not have; see shardax/runtime/compat.py"
        ) from e
    return futures, thread_class


def orbax_save_operations() -> set[str]:
    """The operation ids of orbax's save threads alive now (an async save's pieces share
    one id); none where orbax-checkpoint lacks its signaling thread (a save then works,
    and only the release of a failed save's threads is lost; tests/runtime/test_compat.py
    fails naming the version)."""
    try:
        _, thread_class = _orbax_signaling()
    except ImportError:
        return set()
    return {
        str(t._operation_id)
        for t in threading.enumerate()
        if isinstance(t, thread_class) and t.is_alive()
    }


def orbax_release_save(operations: set[str], timeout: float = 10.0) -> None:
    """Cancels orbax's save threads of ``operations`` (a failed save) and sends the signals
    they wait for, so they end instead of blocking the process's exit for 300 s."""
    futures, thread_class = _orbax_signaling()
    threads = [
        t
        for t in threading.enumerate()
        if isinstance(t, thread_class) and str(t._operation_id) in operations
    ]
    for t in threads:
        t._cancelled = True
        futures.set_signals(t._receive_signals, operation_id=t._operation_id)
    for t in threads:
        threading.Thread.join(t, timeout)  # orbax's own join raises the saved error


def before_thread_shutdown(fn: Any) -> None:
    """Runs ``fn()`` at exit, before the interpreter joins its non-daemon threads and
    while orbax's executors still take work (Python's ``threading._register_atexit``)."""
    import concurrent.futures.thread  # noqa: F401 - its hook, registered first, runs last

    threading._register_atexit(fn)


def missing() -> list[str]:
    """The errors of every private API that the installed JAX or orbax-checkpoint lacks
    (empty when all are there); ``tests/runtime/test_compat.py`` asserts it is empty."""
    import orbax.checkpoint as ocp

    errors = []
    for name in PRIVATE_APIS:
        try:
            private(name)
        except ImportError as e:
            errors.append(str(e))
    try:
        _orbax_tmp_cleanup(ocp.CheckpointManager)
    except ImportError as e:
        errors.append(str(e))
    try:
        _orbax_signaling()
    except ImportError as e:
        errors.append(str(e))
    if not callable(getattr(threading, "_register_atexit", None)):
        errors.append("shardax uses threading._register_atexit, which this Python lacks")
    return errors


_CLUSTERS = {"slurm": "SlurmCluster", "ompi": "OmpiCluster"}
CLUSTER_METHODS: tuple[str, ...] = tuple(_CLUSTERS)
"""The cluster environments ``sx.initialize`` recognises without being told."""


def backends_are_initialized() -> bool:
    """True once any JAX backend (CPU, GPU, TPU) has been created in this process."""
    return private("backends_are_initialized")()


def cluster_env(method: str) -> Any:
    """JAX's cluster-detection class for ``method`` (``"slurm"`` or ``"ompi"``)."""
    if method not in _CLUSTERS:
        raise ValueError(f"cluster_env: method must be one of {list(_CLUSTERS)}, got {method!r}")
    return private(_CLUSTERS[method])


def is_sharding_type_error(error: BaseException) -> bool:
    """True for JAX's error on an operation whose output sharding does not follow from
    its inputs' types (Explicit axes)."""
    return isinstance(error, private("ShardingTypeError"))
