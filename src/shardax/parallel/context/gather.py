"""The gathering schemes: all_gather (K/V gathered over the axis, the local queries
kept) and ulysses (all-to-all from sequence-split to head-split and back)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from shardax.parallel.context.config import Config
from shardax.parallel.context.dense import dense_attention
from shardax.parallel.context.layout import block_positions, layout_positions


def all_gather_attention(cfg: Config, q, k, v, seg, bias):
    c, axis = cfg.size, cfg.axis
    t = q.shape[1]
    qpos = block_positions(lax.axis_index(axis), t, c, cfg.layout)
    kpos = jnp.asarray(layout_positions(t * c, c, cfg.layout))
    k, v = _gather_seq(k, axis), _gather_seq(v, axis)
    kseg = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
    return dense_attention(
        q,
        k,
        v,
        qpos=qpos,
        kpos=kpos,
        qseg=seg,
        kseg=kseg,
        bias=bias,
        causal=cfg.causal,
        window=cfg.window,
        scale=cfg.scale,
        natural=False,
        kernel=cfg.kernel,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_seq(x: jax.Array, axis: str) -> jax.Array:
    """All-gather along the sequence (dim 1); its transpose sums each device's slice.

    Written out because JAX 0.10 cannot lower ``psum_scatter`` (all_gather's own
    transpose) of an array typed with Explicit axes inside a shard_map manual over
    ``axis`` only; there the sum goes by all-to-all, the same bytes per device."""
    return lax.all_gather(x, axis, axis=1, tiled=True)


def _gather_seq_fwd(x, axis):
    return _gather_seq(x, axis), None


def _gather_seq_bwd(axis, _, g):
    if all(s is None for s in jax.typeof(g).sharding.spec):
        return (lax.psum_scatter(g, axis, scatter_dimension=1, tiled=True),)
    c = lax.axis_size(axis)
    parts = lax.all_to_all(g, axis, split_axis=1, concat_axis=1, tiled=True)
    parts = parts.reshape(g.shape[0], c, g.shape[1] // c, *g.shape[2:])
    return (parts.sum(axis=1),)


_gather_seq.defvjp(_gather_seq_fwd, _gather_seq_bwd)


def ulysses_attention(cfg: Config, q, k, v, seg, bias):
    c, axis = cfg.size, cfg.axis
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads % c:  # MQA / few kv heads: give every query head its own copy
        k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))

    def to_heads(x):
        return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    length = q.shape[1]
    pos = jnp.asarray(layout_positions(length, c, cfg.layout))
    seg = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
    out = dense_attention(
        q,
        k,
        v,
        qpos=pos,
        kpos=pos,
        qseg=seg,
        kseg=seg,
        bias=bias,
        causal=cfg.causal,
        window=cfg.window,
        scale=cfg.scale,
        natural=cfg.layout == "contiguous",
        kernel=cfg.kernel,
    )
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)
