"""The ring's blocks: one query part against one part of a K/V block, forward and
backward, as einsums (every mask) or through cuDNN's fused attention (no mask or causal),
and which of the two a call runs with (``ring_kernel``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardax.parallel import fused
from shardax.parallel.context.config import Config
from shardax.parallel.context.masks import attention_mask

# The ring's blocks. A pair of functions computes one query part against one part of a
# K/V block (queries ``qg`` (B, T, K, G, D), keys and values (B, S, K, D)):
#   forward:  ``(o, lse)``, the block's normalised output (B, K, G, T, D) and the
#             log-sum-exp of its rows (B, K, G, T), both fp32;
#   backward: the block's share of (dq, (dk, dv), dbias) added to a carry, given the
#             GLOBAL output and log-sum-exp (P_block = exp(S - lse_global)).
# ``diag``: the part pair lies on the causal diagonal (the same positions: the mask is
# causal within it); other visible pairs are fully visible under causal alone.
# The ring combines the forwards by an online softmax (``_combine``) whatever the
# pair: the dense one (einsums, every mask from the true positions) or cuDNN's
# (no mask or causal, kernel="cudnn").


def _scores(cfg: Config, qg, kb, qseg, kseg, bias, qpos, kpos):
    """Masked logits ``(B, K, G, T, S)`` of queries ``qg`` at ``qpos`` against keys ``kb``
    at ``kpos`` (``bias``: their part of the bias, grouped; segment ids or Nones)."""
    s = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32)
    s = s * cfg.scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    mask = attention_mask(qpos, kpos, qseg, kseg, cfg.causal, cfg.window)
    if mask is None:
        return s
    return jnp.where(mask[:, None, None], s, _NEG)


_NEG = -0.7 * float(np.finfo(np.float32).max)


def _dense_fwd(cfg: Config, qg, kb, vb, qseg, kseg, bias, qpos, kpos, diag):
    """Dense block forward: masked logits, softmax, times V (einsums)."""
    del diag  # the masks come from the true positions
    s = _scores(cfg, qg, kb, qseg, kseg, bias, qpos, kpos)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)  # noqa: E741
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return pv / l[..., None], m + jnp.log(l)


def _dense_bwd(
    cfg: Config, carry, qg, kb, vb, qseg, kseg, bias, qpos, kpos, o, do, lse, delta, diag, where
):
    """Dense block backward, added to ``carry = (dq, (dk, dv), dbias)`` (``where``: the
    pair's first row and column in the bias)."""
    del o, diag
    dq, (dk, dv), dbias = carry
    s = _scores(cfg, qg, kb, qseg, kseg, bias, qpos, kpos)
    p = jnp.exp(s - lse[..., None])
    dv = dv + jnp.einsum("bkgts,bkgtd->bskd", p, do)
    dp = jnp.einsum("bkgtd,bskd->bkgts", do, vb, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    dq = dq + cfg.scale * jnp.einsum(
        "bkgts,bskd->btkgd", ds, kb, preferred_element_type=jnp.float32
    )
    dk = dk + cfg.scale * jnp.einsum(
        "bkgts,btkgd->bskd", ds, qg, preferred_element_type=jnp.float32
    )
    if dbias is not None:
        dbias = _add_bias_grad(dbias, ds, *where)
    return dq, (dk, dv), dbias


def _heads(x: jax.Array, dtype: Any) -> jax.Array:
    """(B, K, G, T, D) -> (B, T, K·G, D) in ``dtype``: the kernels' layout."""
    b, kh, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, d).astype(dtype)


def _flash_fwd(cfg: Config, qg, kb, vb, qseg, kseg, bias, qpos, kpos, diag):
    """A fused kernel's block forward (``_FLASH[cfg.kernel]``): no mask, or causal on
    the diagonal."""
    del qseg, kseg, bias, qpos, kpos  # none (the ring's kernel choice), or the diagonal
    b, t, kh, g, d = qg.shape
    out, lse = _FLASH[cfg.kernel][0](
        qg.reshape(b, t, kh * g, d), kb, vb, scale=cfg.scale, causal=diag
    )
    out = out.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
    return out, lse.reshape(b, t, kh, g).transpose(0, 2, 3, 1)


def _flash_bwd(
    cfg: Config, carry, qg, kb, vb, qseg, kseg, bias, qpos, kpos, o, do, lse, delta, diag, where
):
    """A fused kernel's block backward given the global output and log-sum-exp."""
    del qseg, kseg, bias, qpos, kpos, delta, where  # the kernel forms delta from o, do
    dq, (dk, dv), dbias = carry
    b, t, kh, g, d = qg.shape
    lse = lse.transpose(0, 3, 1, 2).reshape(b, t, kh * g)
    gq, gk, gv = _FLASH[cfg.kernel][1](
        qg.reshape(b, t, kh * g, d),
        kb,
        vb,
        _heads(o, qg.dtype),
        lse,
        _heads(do, qg.dtype),
        scale=cfg.scale,
        causal=diag,
    )
    dq = dq + gq.reshape(dq.shape).astype(jnp.float32)
    return dq, (dk + gk.astype(jnp.float32), dv + gv.astype(jnp.float32)), dbias


_FLASH: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "cudnn": (fused.cudnn_block, fused.cudnn_block_grads),
}
"""Fused kernels the ring runs its blocks with: forward ``(q, k, v, *, scale, causal)
-> (out, lse)`` and backward ``(q, k, v, out, lse, dout, *, scale, causal) -> (dq, dk,
dv)``, q and out ``(B, T, N, D)``, k and v ``(B, S, K, D)``, lse ``(B, T, N)`` fp32."""


def block_kernels(cfg: Config) -> tuple[Callable[..., Any], Callable[..., Any]]:
    return (_flash_fwd, _flash_bwd) if cfg.kernel in _FLASH else (_dense_fwd, _dense_bwd)


def _add_bias_grad(dbias: jax.Array, ds: jax.Array, row: int, col: Any) -> jax.Array:
    """Adds a part pair's logit gradient ``ds`` (B, K, G, T_part, S_part), summed to the
    bias' broadcast shape, into ``dbias`` (B|1, H|1, T|1, S|1) at ``row``, ``col``."""
    *_, tb, sb = dbias.shape
    b, kh, g, t, s = ds.shape
    ds = ds.reshape(b, kh * g, t, s)
    axes = tuple(i for i, n in enumerate(dbias.shape) if n == 1)
    blk = ds.sum(axes, keepdims=True) if axes else ds
    start = (0, 0, row if tb > 1 else 0, col if sb > 1 else 0)
    cur = lax.dynamic_slice(dbias, start, blk.shape)
    return lax.dynamic_update_slice(dbias, cur + blk, start)


def ring_kernel(
    kernel: str,
    dtype: Any,
    head_dim: int,
    causal: bool,
    window: tuple[int, int] | None,
    segment_ids: Any,
    bias: Any,
) -> str:
    """The kernel the ring runs its blocks with: ``"cudnn"`` (each K/V block through
    cuDNN's fused attention, ``_FLASH``) where it can compute them, else ``"dense"``
    (einsums). ``kernel="auto"`` takes cuDNN on a GPU and says once why not where it
    cannot; a kernel named that cannot is refused, naming why."""
    why = _ring_unsupported(kernel, dtype, head_dim, causal, window, segment_ids, bias)
    if kernel in ("dense", "cudnn", "splash"):
        if why is not None:
            raise ValueError(f"kernel={kernel!r} cannot compute impl='ring': {why}")
        return kernel
    where = fused.platform()
    if where in ("gpu", "cuda"):
        why = _ring_unsupported("cudnn", dtype, head_dim, causal, window, segment_ids, bias)
        if why is None:
            return "cudnn"
        fused.say_once(f"impl='ring' with cudnn unsupported: {why}")
    elif where == "tpu":
        fused.say_once(_ring_unsupported("splash", dtype, head_dim, causal, window, None, None))
    return "dense"


def _ring_unsupported(kernel, dtype, head_dim, causal, window, segment_ids, bias) -> str | None:
    """Why the ring cannot run its blocks with ``kernel`` (None: it can)."""
    if kernel == "dense":
        return None
    if kernel == "splash":
        return (
            "splash attention gives no log-sum-exp to combine the ring's blocks with (the "
            "ring runs them as einsums on a TPU); impl='all_gather' or 'ulysses' take the "
            "fused kernel"
        )
    masks = fused.masks_of(causal, window, segment_ids, bias, True)
    why = fused.unsupported("cudnn", dtype, head_dim, masks)
    if why is None and (window is not None or segment_ids is not None):
        named = " and ".join(
            n for n, x in (("a window", window), ("segment ids", segment_ids)) if x is not None
        )
        why = (
            f"{named} (the ring's cuDNN blocks take causal or no mask; impl='all_gather' "
            "or 'ulysses' take cuDNN with it)"
        )
    return why
