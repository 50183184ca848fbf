"""The checks of [`attention`][shardax.attention]'s inputs: shapes, dtypes, the
window, and a sequence length that the layout's chunks divide."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from shardax.checks import as_count
from shardax.parallel.context.layout import layout_context, parse_layout


def check_window(window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    try:
        if isinstance(window, tuple | list) and len(window) == 2:
            return as_count("left", window[0], minimum=0), as_count("right", window[1], minimum=0)
    except ValueError:
        pass
    raise ValueError(
        f"window must be (left, right), two integers >= 0 (tokens each query "
        f"sees before and after itself), got {window!r}"
    )


def check_shapes(q: Any, k: Any, v: Any, segment_ids: Any, bias: Any) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"q must be (batch, q_len, heads, head_dim) and k, v (batch, kv_len, "
            f"kv_heads, head_dim) with equal shapes, got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    (b, t, h, d), (bk, s, kh, dk) = q.shape, k.shape
    if b != bk or d != dk or h % kh:
        raise ValueError(
            f"q {q.shape} and k {k.shape} must share batch and head_dim, and heads "
            f"{h} must be a multiple of kv_heads {kh} (GQA / MQA)"
        )
    if segment_ids is not None and not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(
            f"segment_ids must be integers (one id per token; a query sees the keys of its "
            f"own id), got dtype {segment_ids.dtype}; cast them with .astype(jnp.int32)"
        )
    if segment_ids is not None and (tuple(segment_ids.shape) != (b, t) or t != s):
        raise ValueError(
            f"segment_ids must be (batch, len) = {(b, t)} with q_len == kv_len, "
            f"got {tuple(segment_ids.shape)} (q_len {t}, kv_len {s})"
        )
    if bias is not None:
        full = (b, h, t, s)
        if bias.ndim != 4 or any(n not in (1, f) for n, f in zip(bias.shape, full, strict=True)):
            raise ValueError(
                f"bias must be 4-D and broadcastable to (batch, heads, q_len, "
                f"kv_len) = {full}, got {tuple(bias.shape)}"
            )


def check_dtypes(q: jax.Array, k: jax.Array, v: jax.Array, bias: Any) -> None:
    """q, k and v floating and of one dtype (no silent promotion: under a context mesh
    the blocks would travel in one dtype and combine in another); a bias floating (a
    boolean "bias" would be added as 0/1: a mask goes in ``segment_ids``, ``causal``
    or ``window``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{name} must be a floating array (attention's softmax is computed in "
                f"floating point), got dtype {x.dtype}; cast it, e.g. {name}.astype(jnp.float32)"
            )
    if not q.dtype == k.dtype == v.dtype:
        common = jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype)
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; "
            f"cast them to one (e.g. all to {common}, what they would promote to)"
        )
    if bias is not None and not jnp.issubdtype(jnp.asarray(bias).dtype, jnp.floating):
        raise TypeError(
            f"bias must be a floating array added to the logits, got dtype "
            f"{jnp.asarray(bias).dtype}; a boolean mask is not a bias (it would be added "
            "as 0/1): pass segment_ids=, causal=True or window= for masks, or a bias of "
            "0 and -inf (jnp.where(mask, 0.0, -jnp.inf))"
        )


def zigzag_context(axis: str, t: int, s: int, layout: str = "zigzag") -> int:
    """The C of a zig-zag sequence run where ``axis`` has size 1: the layout's own
    (``"zigzag:C"``), else an enclosing ``laid_out_for``'s; refused when it cannot be
    known: a guess would give the wrong causal mask."""
    c = layout_context(axis, layout)
    if c == 1 and parse_layout(layout)[1] is None:
        raise ValueError(
            f"layout='zigzag' needs the context axis: the rows were reordered for "
            f"C devices, and axis {axis!r} has size 1 here, so C is unknown. Pass "
            f"layout='zigzag:C' (sx.parallel.zigzag_layout(C)) with the C it was reordered "
            f"for, or layout='contiguous' with the batch in sequence order "
            f"(sx.parallel.unzigzag), or run on a mesh whose {axis!r} axis has size > 1"
        )
    check_length(t, s, c, layout)
    return c


def check_length(t: int, s: int, c: int, layout: str) -> None:
    """One sequence (q_len == kv_len), divisible into the layout's chunks."""
    if t != s:
        raise ValueError(
            f"context parallelism splits one sequence, so q_len must equal kv_len; "
            f"got q_len {t}, kv_len {s} over axis of size C={c}"
        )
    zig = parse_layout(layout)[0] == "zigzag"
    chunks = 2 * c if zig else c
    if t % chunks:
        raise ValueError(
            f"sequence length {t} is not divisible by {chunks} "
            f"({'2 × ' if zig else ''}C={c}, layout={layout!r}); pad it"
        )
