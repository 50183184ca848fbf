"""Attention over whole blocks with every mask applied: the one-device path, and what
all_gather and ulysses run once each device holds its keys, by the kernel
``shardax.parallel.fused.pick`` takes."""

from __future__ import annotations

from typing import Any

import jax

from shardax.parallel import fused
from shardax.parallel.context.masks import attention_mask


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    qpos: Any,
    kpos: Any,
    qseg: Any,
    kseg: Any,
    bias: Any,
    causal: bool,
    window: tuple[int, int] | None,
    scale: float,
    natural: bool,
    kernel: str = "auto",
) -> jax.Array:
    """Attention over whole (or this device's) blocks with every mask applied, by the
    kernel ``shardax.parallel.fused.pick`` takes: cuDNN's fused attention, splash
    attention, or ``jax.nn.dot_product_attention``'s XLA path. The masks are its own
    ``is_causal`` / ``local_window_size`` when the positions are ``arange``
    (``natural``), else a boolean mask from the true positions."""
    masks = fused.masks_of(causal, window, qseg, bias, natural)
    chosen = fused.pick(kernel, q.dtype, q.shape[-1], masks, q.shape[1], k.shape[1])
    if chosen == "splash":  # natural positions, no bias (pick's rules)
        return fused.splash(q, k, v, qseg, causal=causal, window=window, scale=scale)
    if chosen == "cudnn" and jax.sharding.get_abstract_mesh().manual_axes:
        # Inside a context scheme's shard_map: cuDNN's partitioner takes no partly
        # manual arrays, so its call is made manual over the other axes too.
        def local(q, k, v, qseg, kseg, qpos, kpos):
            return _xla_or_cudnn(
                q, k, v, qpos, kpos, qseg, kseg, None, causal, window, scale, natural, "cudnn"
            )

        return fused.all_manual(local, (q, k, v), (qseg, kseg), (qpos, kpos))
    return _xla_or_cudnn(
        q,
        k,
        v,
        qpos,
        kpos,
        qseg,
        kseg,
        bias,
        causal,
        window,
        scale,
        natural,
        "cudnn" if chosen == "cudnn" else None,
    )


def _xla_or_cudnn(q, k, v, qpos, kpos, qseg, kseg, bias, causal, window, scale, natural, impl):
    """``jax.nn.dot_product_attention`` with ``implementation=impl`` and the masks."""
    if natural:
        mask = None if qseg is None else (qseg[:, :, None] == kseg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            bias,
            mask,
            scale=scale,
            is_causal=causal,
            local_window_size=window,
            implementation=impl,
        )
    mask = attention_mask(qpos, kpos, qseg, kseg, causal, window)
    mask = None if mask is None else mask[:, None]
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, implementation=impl)
