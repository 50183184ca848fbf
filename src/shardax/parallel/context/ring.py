"""The ring: K/V blocks travel around the context axis (``ppermute``, the next block sent
before the current one is used) and combine by an online softmax; its backward runs the
ring again, dK and dV travelling with their block. Part pairs that the causal mask or the
window hides entirely are skipped (``lax.cond``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from shardax.parallel.context.blocks import block_kernels
from shardax.parallel.context.config import Config
from shardax.parallel.context.layout import block_positions
from shardax.parallel.context.masks import parts_visible


def _grouped_bias(bias: jax.Array | None, kv_heads: int, rows: slice, col: Any, width: int):
    """The bias of local query ``rows`` against the ``width`` keys from column ``col`` of
    the laid-out sequence, as ``(B|1, K|1, G|1, T_part|1, S_part|1)``."""
    if bias is None:
        return None
    if bias.shape[2] > 1:
        bias = bias[:, :, rows]
    if bias.shape[3] > 1:
        bias = lax.dynamic_slice_in_dim(bias, col, width, axis=3)
    b, h, t, s = bias.shape
    if h == 1:
        return bias.reshape(b, 1, 1, t, s)
    return bias.reshape(b, kv_heads, h // kv_heads, t, s)


def ring_parts(cfg: Config, t: int) -> list[slice]:
    """The parts of a device's block the ring pairs up, each a contiguous run of
    positions: the block itself, or under ``layout="zigzag"`` with a position mask its
    two chunks (i and 2C-1-i), so that a pair the mask hides entirely can be skipped."""
    n = 2 if cfg.layout == "zigzag" and (cfg.causal or cfg.window is not None) else 1
    sub = t // n
    return [slice(i * sub, (i + 1) * sub) for i in range(n)]


def _unless_hidden(visible: Any, fn: Callable[..., Any], carry: Any, *args: Any) -> Any:
    """``fn(carry, *args)``, or ``carry`` untouched (not computed) where ``visible`` is a
    traced False: the causal ring skips the blocks above the diagonal."""
    if visible is True:
        return fn(carry, *args)
    return lax.cond(visible, fn, lambda carry, *_: carry, carry, *args)


def _ring_setup(cfg: Config, q):
    t = q.shape[1]
    idx = lax.axis_index(cfg.axis)
    return idx, block_positions(idx, t, cfg.size, cfg.layout), ring_parts(cfg, t)


def _part(x: jax.Array | None, part: slice) -> jax.Array | None:
    return None if x is None else x[:, part]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(cfg: Config, q, k, v, seg, bias):
    return _ring_fwd(cfg, q, k, v, seg, bias)[0]


def _zeros(x: jax.Array) -> jax.Array:
    """fp32 zeros of ``x``'s shape with ``x``'s type (its Explicit sharding, and the
    manual axes it varies over inside shard_map), for a scan carry."""
    return x.astype(jnp.float32) * 0


def _combine(acc, block):
    """The online softmax: ``acc = (o, lse)`` and a block's ``(o, lse)`` combined."""
    o, lse = acc
    ob, lb = block
    new = jnp.logaddexp(lse, lb)
    return o * jnp.exp(lse - new)[..., None] + ob * jnp.exp(lb - new)[..., None], new


def _own_block_visible(cfg: Config, first: bool, i: int, j: int) -> bool | None:
    """Whether query part ``i`` sees key part ``j`` of the device's own block (step 0,
    ``first``), known while tracing under causal alone: the parts lie in increasing
    positions, so query part i sees key part j > i never, j < i wholly, j == i causally.
    None: not known (another step, or a window); ``parts_visible`` decides from the
    positions."""
    if not first or not cfg.causal or cfg.window is not None:
        return None
    return j <= i


def _ring_steps(cfg: Config, compute, acc, block):
    """``compute(acc, block, step, first)`` over the C steps of the ring, ``block`` sent
    on (ppermute) before it is used, so the transfer overlaps the step's compute. Step 0
    (the device's own block: the causal diagonal) is traced apart (``first`` True), steps
    1..C-2 in a loop (one step's scores live at a time), the last without a send."""
    perm = [(i, (i + 1) % cfg.size) for i in range(cfg.size)]

    def body(carry, step):
        acc, block = carry
        after = lax.ppermute(block, cfg.axis, perm)
        return (compute(acc, block, step, False), after), None

    after = lax.ppermute(block, cfg.axis, perm)
    acc, block = compute(acc, block, 0, True), after
    (acc, block), _ = lax.scan(body, (acc, block), jnp.arange(1, cfg.size - 1))
    return compute(acc, block, cfg.size - 1, False)


def _ring_fwd(cfg: Config, q, k, v, seg, bias):
    b, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    idx, qpos, parts = _ring_setup(cfg, q)
    block_fwd = block_kernels(cfg)[0]

    def update(acc, *args, diag):
        return _combine(acc, block_fwd(cfg, *args, diag))

    def compute(accs, block, step, first):
        kb, vb, kseg = block
        src = (idx - step) % cfg.size
        kpos = block_positions(src, t, cfg.size, cfg.layout)
        out = []
        for i, (qi, acc) in enumerate(zip(parts, accs, strict=True)):
            for j, kj in enumerate(parts):
                diag = first and i == j and cfg.causal
                seen = _own_block_visible(cfg, first, i, j)
                if seen is False:
                    continue
                bias_ij = _grouped_bias(bias, kh, qi, src * t + kj.start, kj.stop - kj.start)
                acc = _unless_hidden(
                    parts_visible(cfg, qpos[qi], kpos[kj]) if seen is None else True,
                    functools.partial(update, diag=diag),
                    acc,
                    qg[:, qi],
                    kb[:, kj],
                    vb[:, kj],
                    _part(seg, qi),
                    _part(kseg, kj),
                    bias_ij,
                    qpos[qi],
                    kpos[kj],
                )
            out.append(acc)
        return out

    accs = []
    for qi in parts:
        o = _zeros(qg[:, qi].transpose(0, 2, 3, 1, 4))
        accs.append((o, o[..., 0] - jnp.inf))
    accs = _ring_steps(cfg, compute, accs, (k, v, seg))
    o, lse = (jnp.concatenate(x, axis=3) for x in zip(*accs, strict=True))
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
    return out, (q, k, v, seg, bias, o, lse)


def _ring_bwd(cfg: Config, res, g):
    q, k, v, seg, bias, o, lse = res
    b, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    do = g.reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
    delta = (do * o).sum(-1)
    idx, qpos, parts = _ring_setup(cfg, q)
    perm = [(i, (i + 1) % cfg.size) for i in range(cfg.size)]
    block_bwd = block_kernels(cfg)[1]

    def update(carry, *args, diag, where):
        return block_bwd(cfg, carry, *args, diag, where)

    def compute(acc, block, step, first):
        (dqs, dbias), dkvs = acc
        dqs, dkvs = list(dqs), list(dkvs)
        kb, vb, kseg = block
        src = (idx - step) % cfg.size
        kpos = block_positions(src, t, cfg.size, cfg.layout)
        for i, qi in enumerate(parts):
            for j, kj in enumerate(parts):
                diag = first and i == j and cfg.causal
                seen = _own_block_visible(cfg, first, i, j)
                if seen is False:
                    continue
                col = src * t + kj.start
                dqs[i], dkvs[j], dbias = _unless_hidden(
                    parts_visible(cfg, qpos[qi], kpos[kj]) if seen is None else True,
                    functools.partial(update, diag=diag, where=(qi.start, col)),
                    (dqs[i], dkvs[j], dbias),
                    qg[:, qi],
                    kb[:, kj],
                    vb[:, kj],
                    _part(seg, qi),
                    _part(kseg, kj),
                    _grouped_bias(bias, kh, qi, col, kj.stop - kj.start),
                    qpos[qi],
                    kpos[kj],
                    o[..., qi, :],
                    do[..., qi, :],
                    lse[..., qi],
                    delta[..., qi],
                )
        # dK / dV travel with their block; after the last step one more hop takes them home.
        return (dqs, dbias), lax.ppermute(dkvs, cfg.axis, perm)

    dqs = [_zeros(qg[:, qi]) for qi in parts]
    dkvs = [(_zeros(k[:, kj]), _zeros(v[:, kj])) for kj in parts]
    acc = ((dqs, None if bias is None else _zeros(bias)), dkvs)
    (dqs, dbias), dkvs = _ring_steps(cfg, compute, acc, (k, v, seg))
    dq = jnp.concatenate(dqs, axis=1)
    dk, dv = (jnp.concatenate(x, axis=1) for x in zip(*dkvs, strict=True))
    dbias = None if bias is None else dbias.astype(bias.dtype)
    return (
        dq.reshape(q.shape).astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,
        dbias,
    )


ring_attention.defvjp(_ring_fwd, _ring_bwd)
