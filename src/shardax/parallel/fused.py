"""Fused attention kernels for ``sx.attention``: cuDNN's flash attention on an NVIDIA GPU,
JAX's Pallas splash attention on a TPU, the dense ``jax.nn.dot_product_attention``
(XLA: the score matrix in memory) elsewhere and for what a kernel cannot do.

The choice is made while tracing, from the platform of the mesh the arrays are on
(``jax.set_mesh``; without one, the default backend), the dtype, the head dimension and
the masks: [`choose_kernel`][shardax.parallel.choose_kernel]. A fallback to the dense path
on a GPU or TPU is logged once per distinct reason (logger ``"shardax"``, level WARNING),
naming it.

>>> choose_kernel("gpu", "bfloat16", 128, ("causal",))
('cudnn', 'cuDNN fused attention (causal)')
>>> choose_kernel("gpu", "float32", 128, ("causal",))[0]
'dense'
>>> choose_kernel("tpu", "float32", 128, ("causal", "segment_ids"), q_len=1024, kv_len=1024)[0]
'splash'
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from shardax.checks import public
from shardax.runtime import compat

KERNELS: tuple[str, ...] = ("dense", "cudnn", "splash")
"""What ``sx.attention`` computes with: the dense XLA path, cuDNN's fused attention
(GPU), JAX's Pallas splash attention (TPU)."""

MASKS: tuple[str, ...] = ("causal", "window", "window_right", "segment_ids", "bias", "positions")
"""The mask kinds [`choose_kernel`][shardax.parallel.choose_kernel] weighs: ``causal``;
``window`` (a left window, ``(left, 0)``, or any window with ``causal``); ``window_right``
(a window that looks ahead, without ``causal``); ``segment_ids``; an additive ``bias``;
``positions`` (the queries' positions are not ``0..T-1``: a context-parallel device's
block or a zig-zag layout)."""

SPLASH_BLOCK = 128
"""Splash attention's block along the sequence: q_len and kv_len must be multiples."""

_log = logging.getLogger("shardax")
_WARNED: set[str] = set()
_FUSED = {"gpu": "cudnn", "cuda": "cudnn", "tpu": "splash"}


def platform() -> str:
    """The platform the traced arrays are on: that of the current mesh's devices
    (``"gpu"`` for a CUDA mesh, compile-only targets included; ``"tpu"``; ``"cpu"``), or
    without a mesh the default backend's.

    >>> platform()
    'cpu'
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    name = getattr(device, "platform", None)
    return str(name) if name else jax.default_backend()


def unsupported(
    kernel: str,
    dtype: Any,
    head_dim: int,
    masks: Iterable[str] = (),
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> str | None:
    """Why ``kernel`` cannot compute this attention (a sentence naming the cause), or None
    when it can. ``masks``: kinds from ``MASKS``.

    >>> unsupported("cudnn", "bfloat16", 72, ())
    >>> unsupported("cudnn", "bfloat16", 100, ())
    'head_dim 100 (cuDNN takes head_dim <= 128, a multiple of 8)'
    """
    masks = set(masks)
    unknown = masks - set(MASKS)
    if unknown:
        raise ValueError(f"masks must be kinds of {list(MASKS)}, got {sorted(unknown)}")
    dtype = jnp.dtype(dtype)
    if kernel == "dense":
        return None
    if kernel == "cudnn":
        if dtype not in (jnp.bfloat16, jnp.float16):
            return f"{dtype} inputs (cuDNN's fused attention takes bfloat16 or float16)"
        if head_dim > 128 or head_dim % 8:
            return f"head_dim {head_dim} (cuDNN takes head_dim <= 128, a multiple of 8)"
        if "bias" in masks:
            return "an additive bias (the fused kernels take masks, not a bias)"
        if "window_right" in masks:
            return "a window that looks ahead without causal (cuDNN's window is left-only)"
        as_bias = masks & {"segment_ids", "positions"}
        if as_bias and any(n is not None and n % 2 for n in (q_len, kv_len)):
            return (
                f"an odd sequence length (q_len {q_len}, kv_len {kv_len}) with "
                f"{' and '.join(sorted(as_bias))} (cuDNN takes that mask as a bias, "
                "which needs even lengths)"
            )
        return None
    if kernel == "splash":
        if dtype not in (jnp.bfloat16, jnp.float32):
            return f"{dtype} inputs (splash attention takes bfloat16 or float32)"
        if head_dim % 8:
            return f"head_dim {head_dim} (splash attention takes a multiple of 8)"
        if "bias" in masks:
            return "an additive bias (the fused kernels take masks, not a bias)"
        if "positions" in masks:
            return (
                "positions offset per device (all_gather's block or a zig-zag layout; "
                "splash attention's masks are static)"
            )
        if any(n is not None and n % SPLASH_BLOCK for n in (q_len, kv_len)):
            return (
                f"q_len {q_len} / kv_len {kv_len} not multiples of {SPLASH_BLOCK} "
                "(splash attention's block)"
            )
        return None
    raise ValueError(f"kernel must be one of {list(KERNELS)}, got {kernel!r}")


@public("sx.parallel.choose_kernel")
def choose_kernel(
    platform: str,
    dtype: Any,
    head_dim: int,
    masks: Iterable[str] = (),
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> tuple[str, str]:
    """``(kernel, reason)``: the kernel ``sx.attention`` takes on ``platform`` (``"gpu"``,
    ``"tpu"``, ``"cpu"``, ...) for inputs of ``dtype`` and ``head_dim`` under ``masks``
    (kinds of ``MASKS``), and why: ``"cudnn"`` on a GPU, ``"splash"`` on a TPU, else
    ``"dense"``, also where the platform's kernel cannot do it (the reason names the
    cause).

    >>> choose_kernel("tpu", "bfloat16", 64, ("bias",), q_len=512, kv_len=512)
    ('dense', 'splash unsupported: an additive bias (the fused kernels take masks, not a bias)')
    >>> choose_kernel("cpu", "bfloat16", 64)
    ('dense', 'no fused attention kernel on cpu')
    """
    masks = tuple(masks)
    fused = _FUSED.get(platform)
    if fused is None:
        unsupported("dense", dtype, head_dim, masks)  # checks the mask kinds
        return "dense", f"no fused attention kernel on {platform}"
    why = unsupported(fused, dtype, head_dim, masks, q_len=q_len, kv_len=kv_len)
    if why is not None:
        return "dense", f"{fused} unsupported: {why}"
    named = ", ".join(m for m in MASKS if m in masks) or "no mask"
    title = "cuDNN fused attention" if fused == "cudnn" else "splash attention (Pallas)"
    if fused == "cudnn" and {"segment_ids", "positions"} & set(masks):
        named += "; the mask as a (batch, 1, q_len, kv_len) bias"
    return fused, f"{title} ({named})"


def say_once(reason: str) -> None:
    """Logs a fallback ``reason`` the first time it is seen (WARNING, logger "shardax")."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    _log.warning("sx.attention: dense attention, not a fused kernel: %s", reason)


def pick(
    kernel: str,
    dtype: Any,
    head_dim: int,
    masks: Iterable[str],
    q_len: int,
    kv_len: int,
) -> str:
    """The kernel to run: ``kernel="auto"`` is
    [`choose_kernel`][shardax.parallel.choose_kernel]'s on the current platform (a
    fallback on a GPU or TPU said once); a named kernel is refused, naming why, where it
    cannot do this attention."""
    masks = tuple(masks)
    if kernel == "auto":
        where = platform()
        chosen, reason = choose_kernel(where, dtype, head_dim, masks, q_len=q_len, kv_len=kv_len)
        if chosen == "dense" and where in _FUSED:
            say_once(reason)
        return chosen
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be 'auto' or one of {list(KERNELS)}, got {kernel!r}")
    why = unsupported(kernel, dtype, head_dim, masks, q_len=q_len, kv_len=kv_len)
    if why is not None:
        raise ValueError(f"kernel={kernel!r} cannot compute this attention: {why}")
    return kernel


# --------------------------------------------------------------------------- cudnn blocks


def cudnn_block(
    q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool
) -> tuple[jax.Array, jax.Array]:
    """``(out, lse)``: cuDNN's fused attention of a query block ``(B, T, N, D)`` against a
    K/V block ``(B, S, K, D)`` (no mask, or causal: query i sees keys 0..i) and each
    row's log-sum-exp ``(B, T, N)`` float32, in a ``shard_map`` manual over the axes not
    manual yet (``all_manual``: cuDNN's partitioner takes no partly manual arrays).
    One block of the context ring (``shardax.parallel.context``)."""

    def local(q, k, v):
        out, lse = compat.cudnn_attention_fwd(q, k, v, scale=scale, causal=causal)
        return out, lse.transpose(0, 2, 1)[..., None]  # (B, T, N, 1): split like q

    out, lse = all_manual(local, (q, k, v))
    return out, lse[..., 0]


def cudnn_block_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    scale: float,
    causal: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` of one ``cudnn_block`` given the output ``out`` ``(B, T, N, D)``
    and log-sum-exp ``lse`` ``(B, T, N)`` to differentiate at (the ring gives the global
    ones: the block's exact share of the gradients) and the output's cotangent ``dout``."""

    def local(q, k, v, out, dout, lse):
        return compat.cudnn_attention_bwd(
            q, k, v, out, lse[..., 0].transpose(0, 2, 1), dout, scale=scale, causal=causal
        )

    return all_manual(local, (q, k, v, out, dout, lse[..., None]))


# --------------------------------------------------------------------------- splash


@functools.lru_cache(maxsize=64)
def _splash_kernel(
    heads: int,
    q_len: int,
    kv_len: int,
    causal: bool,
    window: tuple[int, int] | None,
    interpret: bool,
) -> Any:
    """A splash attention kernel for ``heads`` heads under the static masks (cached: the
    mask's block structure is worked out in NumPy)."""
    # Pallas's TPU kernels, loaded when a splash kernel is built: import shardax must not load them
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (q_len, kv_len)
    if window is not None:
        left, right = window
        base = sa.LocalMask(shape, (left, 0 if causal else right), offset=0)
    elif causal:
        base = sa.CausalMask(shape)
    else:
        base = sa.FullMask(shape)
    mask = sa.MultiHeadMask([base] * heads)
    return sa.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    *,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float,
) -> jax.Array:
    """Splash attention on global (or this device's) ``(B, T, H, D)`` arrays, in a
    ``shard_map`` manual over every mesh axis (``all_manual``: Mosaic kernels are not
    partitioned by the compiler). Off a TPU it runs in Pallas' interpret mode."""
    t, s = q.shape[1], k.shape[1]
    interpret = platform() != "tpu"

    def local(q, k, v, seg):
        kernel = _splash_kernel(q.shape[2], t, s, bool(causal), window, interpret)

        def one(q, k, v, seg):
            ids = None
            if seg is not None:
                # Pallas's TPU kernels (as _splash_kernel's): not loaded by import shardax
                from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

                ids = SegmentIds(q=seg, kv=seg)
            q = (q * jnp.asarray(scale, q.dtype)).transpose(1, 0, 2)
            out = kernel(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), segment_ids=ids)
            return out.transpose(1, 0, 2)

        if seg is None:
            return jax.vmap(lambda q, k, v: one(q, k, v, None))(q, k, v)
        return jax.vmap(one)(q, k, v, seg)

    return all_manual(local, (q, k, v), (segment_ids,))


def all_manual(
    fn: Any, heads: tuple[Any, ...], rows: tuple[Any, ...] = (), whole: tuple[Any, ...] = ()
) -> jax.Array:
    """``fn(*heads, *rows, *whole)`` in a ``shard_map`` manual over every mesh axis not
    manual yet (of size > 1, or any size inside a shard_map), so that a kernel the
    compiler cannot partition sees whole per-device arrays: ``heads`` ``(B, T, H, D)``
    split on the batch over the axes that divide it and on the heads over the others that
    divide the kv heads (``heads[1]``'s), ``rows`` ``(B, ...)`` on the batch, ``whole``
    replicated; None passes through. Its result is split like ``heads[0]``. Without such
    axes, ``fn`` is called as is."""
    args = (*heads, *rows, *whole)
    mesh = jax.sharding.get_abstract_mesh()
    # Inside a shard_map, axes of size 1 too: a partly manual array is what a kernel's
    # partitioner (cuDNN's) refuses.
    free = (
        []
        if mesh.empty
        else [
            a
            for a in mesh.axis_names
            if a not in mesh.manual_axes and (mesh.shape[a] > 1 or mesh.manual_axes)
        ]
    )
    if not free:
        return fn(*args)
    b, kh = heads[0].shape[0], heads[1].shape[2]
    batch_axes, head_axes, nb, nh = [], [], 1, 1
    for a in free:
        n = mesh.shape[a]
        if b % (nb * n) == 0:
            batch_axes.append(a)
            nb *= n
        elif kh % (nh * n) == 0:
            head_axes.append(a)
            nh *= n
    bspec = tuple(batch_axes) or None
    spec = PartitionSpec(bspec, None, tuple(head_axes) or None)
    specs = (
        [spec] * len(heads)
        + [None if x is None else PartitionSpec(bspec) for x in rows]
        + [None if x is None else PartitionSpec() for x in whole]
    )
    if any(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in free):
        # typed inputs: shard_map takes them as its specs say
        args = tuple(
            x if x is None else jax.sharding.reshard(x, sp)
            for x, sp in zip(args, specs, strict=True)
        )
    return jax.shard_map(
        fn, mesh=mesh, in_specs=tuple(specs), out_specs=spec, axis_names=set(free), check_vma=False
    )(*args)


def masks_of(
    causal: bool,
    window: tuple[int, int] | None,
    segment_ids: Any,
    bias: Any,
    natural: bool,
) -> tuple[str, ...]:
    """The ``MASKS`` kinds of one ``sx.attention`` call.

    >>> masks_of(True, (4, 0), None, None, True)
    ('causal', 'window')
    """
    kinds = []
    if causal:
        kinds.append("causal")
    if window is not None:
        kinds.append("window" if causal or window[1] == 0 else "window_right")
    if segment_ids is not None:
        kinds.append("segment_ids")
    if bias is not None:
        kinds.append("bias")
    if not natural:
        kinds.append("positions")
    return tuple(kinds)


__all__ = ["KERNELS", "MASKS", "choose_kernel"]
