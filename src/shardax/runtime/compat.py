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
- ``distributed_state``: ``jax.distributed``'s global state, whose ``client`` is the
  coordinator's key-value store (``key_value_set``, ``key_value_dir_get``), where each
  process publishes its step and phase for the hang report (``shardax.runtime.status``).
- ``ShardingTypeError``: the error JAX raises when an operation's output sharding does
  not follow from its inputs' types on a mesh with Explicit axes. shardax adds a note
  to it saying what to change; JAX raises it, so it can only be caught by its class.
- ``cudnn_attention_fwd`` / ``cudnn_attention_bwd``: cuDNN's fused attention from
  ``jax._src.cudnn.fused_attention_stablehlo``, the forward with its log-sum-exp
  (``return_residual``) and the backward primitive given an output and log-sum-exp of
  the caller's choice. The context ring runs each K/V block through them and gives the
  backward the GLOBAL output and log-sum-exp (the flash ring backward); the public
  ``jax.nn.dot_product_attention`` returns no log-sum-exp, and its VJP ignores one.

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
import inspect
import threading
from importlib.metadata import version
from typing import Any

import jax
import jax.numpy as jnp

JAX_VERSION = jax.__version__
SUPPORTED = "0.10.x to 0.12.x"

PRIVATE_APIS: dict[str, tuple[str, str]] = {
    "backends_are_initialized": ("jax._src.xla_bridge", "backends_are_initialized"),
    "SlurmCluster": ("jax._src.clusters", "SlurmCluster"),
    "OmpiCluster": ("jax._src.clusters", "OmpiCluster"),
    "ClusterEnv": ("jax._src.clusters", "ClusterEnv"),
    "ShardingTypeError": ("jax._src.core", "ShardingTypeError"),
    "distributed_state": ("jax._src.distributed", "global_state"),
    "cudnn_attention": ("jax._src.cudnn.fused_attention_stablehlo", "dot_product_attention"),
    "cudnn_attention_bwd_p": (
        "jax._src.cudnn.fused_attention_stablehlo",
        "_dot_product_attention_bwd_p_wrapper",
    ),
    "cudnn_attention_bwd_impl": (
        "jax._src.cudnn.fused_attention_stablehlo",
        "_dot_product_attention_bwd_impl",
    ),
    "cudnn_mask_type": ("jax._src.cudnn.fused_attention_stablehlo", "MaskType"),
    "cudnn_layout": ("jax._src.cudnn.fused_attention_stablehlo", "AttentionLayout"),
}
"""shardax's name for each private API: (module, attribute) in JAX."""


def private(name: str) -> Any:
    """The private JAX API ``name`` (a key of ``PRIVATE_APIS``); an ``ImportError``
    naming it and the installed JAX version when JAX has moved it."""
    module, attr = PRIVATE_APIS[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ImportError(
            f"shardax uses {module}.{attr}, which JAX {JAX_VERSION} does not have (shardax "
            f"supports JAX {SUPPORTED}); see shardax/runtime/compat.py"
        ) from e


ORBAX_SIGNALING_THREAD = ("orbax.checkpoint._src.futures.future", "_SignalingThread")
"""orbax-checkpoint's private thread class behind each piece of an async save."""


def _orbax_signaling() -> tuple[Any, type]:
    module, name = ORBAX_SIGNALING_THREAD
    try:
        futures = importlib.import_module(module)
        thread_class = getattr(futures, name)
        futures.set_signals  # noqa: B018 - checked here, used by orbax_release_save
    except (ImportError, AttributeError) as e:
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


def cudnn_attention_fwd(q: Any, k: Any, v: Any, *, scale: float, causal: bool) -> tuple[Any, Any]:
    """``(out, lse)``: cuDNN's fused attention of ``q`` ``(B, T, N, D)`` against ``k``,
    ``v`` ``(B, S, K, D)`` (``N % K == 0``) with no mask or a causal one (query i sees keys
    0..i), and the log-sum-exp of each row's scaled logits, ``(B, N, T)`` float32."""
    mask = private("cudnn_mask_type")
    out, lse = private("cudnn_attention")(
        q,
        k,
        v,
        scale=scale,
        mask_type=mask.CAUSAL if causal else mask.NO_MASK,
        qkv_layout="BTNH",
        return_residual=True,
    )
    return out, lse


def cudnn_attention_bwd(
    q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, *, scale: float, causal: bool
) -> tuple[Any, Any, Any]:
    """``(dq, dk, dv)`` of cuDNN's fused attention (shapes as ``cudnn_attention_fwd``)
    given the output ``out`` and log-sum-exp ``lse`` ``(B, N, T)`` to differentiate at and
    the output's cotangent ``dout``: the probabilities are ``exp(scale·q·kᵀ - lse)`` and
    the softmax's row term ``sum(dout · out)``, so a global ``out`` and ``lse`` give one
    K/V block's exact share of the gradients."""
    mask, layout = private("cudnn_mask_type"), private("cudnn_layout")
    unused = jnp.zeros(0, q.dtype)  # bias, sequence lengths and offsets, page tables
    params = {
        "scale": scale,
        "seed": 42,
        "dropout_rate": 0.0,
        "variadic_args": (False, False),
        "mask_type": mask.CAUSAL if causal else mask.NO_MASK,
        "layout": layout.BTNH.value,
        "sliding_window_length": None,
    }
    if "score_mod" in inspect.signature(private("cudnn_attention_bwd_impl")).parameters:
        params["score_mod"] = None  # JAX 0.12's flex attention
    try:
        grads = private("cudnn_attention_bwd_p").bind(
            q, k, v, *[unused] * 7, lse, out, dout, **params
        )
    except TypeError as e:
        raise ImportError(
            f"shardax binds jax._src.cudnn.fused_attention_stablehlo's backward primitive, "
            f"whose parameters JAX {JAX_VERSION} changed ({e}); shardax supports JAX "
            f"{SUPPORTED}; see shardax/runtime/compat.py"
        ) from e
    dq, dk, dv = grads[:3]
    return dq, dk, dv


def missing() -> list[str]:
    """The errors of every private API that the installed JAX or orbax-checkpoint lacks
    (empty when all are there); ``tests/runtime/test_compat.py`` asserts it is empty."""
    errors = []
    for name in PRIVATE_APIS:
        try:
            private(name)
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
