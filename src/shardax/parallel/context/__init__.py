"""Context parallelism for the user's own attention: ``sx.attention`` over a mesh axis
that splits the sequence.

``attention(q, k, v, causal=..., segment_ids=..., window=..., bias=...)`` has
``jax.nn.dot_product_attention``'s layout (q ``(B, T, H, D)``, k and v ``(B, S, K, D)``,
``H % K == 0``). With no mesh axis ``axis`` of size > 1 it *is*
``jax.nn.dot_product_attention`` (cuDNN on a GPU where the mask allows). With a
``"context"`` axis of size C > 1 the sequence dimension is split C ways and ``impl``
picks how devices see each other's keys and values:

- ``"all_gather"``: gather K/V over the axis, keep the local queries;
- ``"ring"``: K/V blocks travel around the ring (``ppermute``, the next block sent
  before the current one is used) and combine by an online softmax; the backward pass
  runs the ring again, so memory per device stays O(len / C). A block that the causal
  mask or the window hides entirely is skipped (``lax.cond``). On a GPU each block is
  cuDNN's fused attention (no mask or causal; its log-sum-exp combines the blocks, and
  its backward is given the global output and log-sum-exp), elsewhere einsums;
- ``"ulysses"``: all-to-all from sequence-split to head-split, full-length attention
  on H / C heads, all-to-all back (needs ``H % C == 0``).

Causal load balancing: with ``layout="zigzag:C"``
([`zigzag_layout`][shardax.parallel.zigzag_layout]) device i holds sequence chunks i and 2C-1-i (of
2C); [`zigzag`][shardax.parallel.zigzag] reorders a batch that way and gives each token's true
position, which the masks use. The ring then pairs chunks, not blocks, and skips the hidden pairs,
so each device computes (2C+1)/(4C) of the full attention (contiguous: device i computes (i+1)/C of
it). The layout carries the C the batch was reordered for: a context axis of another size > 1 is
refused by name, and where the axis has size 1 (one device) the masks use C's true positions. Bare
``layout="zigzag"`` (C taken from the mesh) still works, warning once; on a mesh without the axis it
is refused, except inside ``laid_out_for`` (how ``sx.verify`` runs its one-device reference on the
distributed mesh's layout).

>>> mesh = jax.make_mesh((2, 4), ("data", "context"))
>>> q = k = v = jnp.ones((2, 16, 4, 8))
>>> with jax.set_mesh(mesh):
...     o = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, impl="ring"))(q, k, v)
>>> o.shape
(2, 16, 4, 8)
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from shardax.checks import as_bool, as_float, public
from shardax.mesh.axes import CONTEXT_AXIS
from shardax.parallel import fused
from shardax.parallel.context.blocks import ring_kernel
from shardax.parallel.context.checks import (
    check_dtypes,
    check_shapes,
    check_window,
    zigzag_context,
)
from shardax.parallel.context.choice import (
    IMPLS,
    SCORE_BYTES_LIMIT,
    choose_impl,
    pick_impl,
    sent_bytes,
)
from shardax.parallel.context.config import Config
from shardax.parallel.context.dense import dense_attention
from shardax.parallel.context.gather import all_gather_attention, ulysses_attention
from shardax.parallel.context.layout import (
    LAYOUTS,
    context_size,
    laid_out_for,
    layout_context,
    layout_positions,
    parse_layout,
    sequence_sharding,
    unzigzag,
    zigzag,
    zigzag_layout,
    zigzag_order,
)
from shardax.parallel.context.ring import ring_attention

__all__ = [
    "IMPLS",
    "LAYOUTS",
    "SCORE_BYTES_LIMIT",
    "attention",
    "choose_impl",
    "context_size",
    "laid_out_for",
    "layout_context",
    "layout_positions",
    "parse_layout",
    "sent_bytes",
    "sequence_sharding",
    "unzigzag",
    "zigzag",
    "zigzag_layout",
    "zigzag_order",
]

_SCHEMES = {
    "all_gather": all_gather_attention,
    "ring": ring_attention,
    "ulysses": ulysses_attention,
}
"""The function of each scheme of ``IMPLS`` (a test holds them equal)."""


@public("sx.attention")
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    segment_ids: jax.Array | None = None,
    window: tuple[int, int] | None = None,
    bias: jax.Array | None = None,
    scale: float | None = None,
    axis: str = CONTEXT_AXIS,
    impl: str = "auto",
    layout: str = "contiguous",
    kernel: str = "auto",
) -> jax.Array:
    """Scaled dot-product attention, split over mesh axis ``axis`` when it has size > 1.

    Args:
      q: ``(batch, q_len, heads, head_dim)``.
      k, v: ``(batch, kv_len, kv_heads, head_dim)``; ``heads % kv_heads == 0``.
      causal: each query sees keys at its own position and before.
      segment_ids: ``(batch, len)`` integers; a query sees only keys of its own segment
        (packed sequences).
      window: ``(left, right)``: a query at position p sees keys in ``[p-left, p+right]``.
      bias: added to the logits, broadcastable to ``(batch, heads, q_len, kv_len)``.
      scale: logit scale, ``1/sqrt(head_dim)`` by default.
      axis: the mesh axis splitting the sequence (of the mesh set by ``jax.set_mesh``,
        or bound by an enclosing ``shard_map``).
      impl: ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"auto"``
        ([`choose_impl`][shardax.parallel.choose_impl]).
      layout: ``"contiguous"`` or ``"zigzag:C"`` (the batch reordered by
        [`zigzag`][shardax.parallel.zigzag] for C devices,
        [`zigzag_layout`][shardax.parallel.zigzag_layout]); masks use the true positions. ``axis``
        of size C' > 1 with C' != C is refused; of size 1, the positions are C's. Bare ``"zigzag"``
        takes C from the mesh (warning once).
      kernel: ``"auto"``: the platform's fused kernel where it can compute this attention (cuDNN on
        a GPU, splash attention on a TPU;
        [`shardax.parallel.choose_kernel`][shardax.parallel.choose_kernel]), else the dense path,
        which a GPU or TPU logs once per reason; ``"dense"``, ``"cudnn"`` or ``"splash"`` force one
        (a ValueError names what it cannot do; splash off a TPU runs in Pallas' interpret mode, for
        tests). ``impl="ring"`` runs each K/V block through cuDNN on a GPU (no mask or causal; its
        log-sum-exp combines the blocks) and as einsums elsewhere.

    Every mask combines with every other and with every scheme; what a scheme cannot do
    (ulysses with heads not divisible by C) raises a ValueError naming the sizes.
    Under jit the arrays are global, ``(B, T, ...)`` with T split over ``axis``; inside
    a ``shard_map`` that binds ``axis`` they are this device's block.

    >>> q = jnp.ones((1, 8, 2, 4))
    >>> attention(q, q, q, causal=True, window=(2, 0)).shape
    (1, 8, 2, 4)
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    check_shapes(q, k, v, segment_ids, bias)
    check_dtypes(q, k, v, bias)
    causal = as_bool("causal", causal)
    window = check_window(window)
    if impl not in ("auto", *IMPLS):
        raise ValueError(f"impl must be 'auto' or one of {list(IMPLS)}, got {impl!r}")
    kind, carried = parse_layout(layout)
    if kernel not in ("auto", *fused.KERNELS):
        raise ValueError(f"kernel must be 'auto' or one of {list(fused.KERNELS)}, got {kernel!r}")
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else as_float("scale", scale, above=0)
    c, manual = context_size(axis)
    if kind == "zigzag":
        _check_zigzag(layout, carried, c, axis)
    if c == 1:
        laid = 1 if kind == "contiguous" else zigzag_context(axis, q.shape[1], k.shape[1], layout)
        pos = (
            None
            if q.shape[1] != k.shape[1]
            else jnp.asarray(layout_positions(q.shape[1], laid, kind))
        )
        return dense_attention(
            q,
            k,
            v,
            qpos=pos,
            kpos=pos,
            qseg=segment_ids,
            kseg=segment_ids,
            bias=bias,
            causal=causal,
            window=window,
            scale=scale,
            natural=laid == 1,
            kernel=kernel,
        )
    gshape = tuple(q.shape), tuple(k.shape)
    if manual:  # inside shard_map over axis: these are this device's blocks
        gshape = tuple((s[0], s[1] * c, *s[2:]) for s in gshape)
    impl = pick_impl(impl, gshape[0], gshape[1], c, q.dtype.itemsize, layout)
    if impl == "ring":
        kernel = ring_kernel(kernel, q.dtype, d, causal, window, segment_ids, bias)
    # "zigzag:C" checked equal to the axis: from here it is "zigzag" over this axis.
    cfg = Config(axis, c, bool(causal), window, kind, scale, kernel)
    scheme = functools.partial(_SCHEMES[impl], cfg)
    if manual:
        return scheme(q, k, v, segment_ids, bias)
    return _shard_mapped(scheme, impl, axis, q, k, v, segment_ids, bias)


_BARE_ZIGZAG_WARNED = False


def _check_zigzag(layout: str, carried: int | None, c: int, axis: str) -> None:
    """``"zigzag:C"`` on an ``axis`` of size ``c`` > 1 other than C is refused (its masks
    would be another batch's); bare ``"zigzag"`` takes C from the mesh (or an enclosing
    ``laid_out_for``), warning once."""
    global _BARE_ZIGZAG_WARNED
    if carried is not None:
        if c > 1 and c != carried:
            raise ValueError(
                f"layout={layout!r} says the sequence was reordered for {carried} devices "
                f"of axis {axis!r}, but it has size {c} here; reorder with "
                f"sx.parallel.zigzag(batch, {c}) and pass layout='zigzag:{c}' (or run on "
                f"a mesh whose {axis!r} axis has size {carried})"
            )
        return
    if not _BARE_ZIGZAG_WARNED and layout_context(axis) > 1:  # (else refused below)
        _BARE_ZIGZAG_WARNED = True
        warnings.warn(
            f"sx.attention: layout='zigzag' takes C from the mesh (axis {axis!r}), so a "
            "batch reordered for another C would be masked wrongly; pass "
            "layout='zigzag:C' (sx.parallel.zigzag_layout(C)), the C it was reordered for",
            FutureWarning,
            stacklevel=4,  # the caller's line (this, attention, the door)
        )


def _split_sequence(x: Any, axis: str) -> Any:
    """``x`` with dimension 1 split over ``axis`` in its type, on an Explicit ``axis``."""
    mesh = jax.sharding.get_abstract_mesh()
    if x is None or mesh.axis_types[mesh.axis_names.index(axis)] != AxisType.Explicit:
        return x
    spec = list(jax.typeof(x).sharding.spec)
    spec += [None] * (x.ndim - len(spec))
    if spec[1] == axis:
        return x
    spec[1] = axis
    return jax.sharding.reshard(x, PartitionSpec(*spec))


def _shard_mapped(scheme, impl, axis, q, k, v, segment_ids, bias):
    """``scheme`` in a shard_map manual over ``axis`` only (other axes stay with the
    compiler): q, k, v and segment ids split on the sequence, the bias on q_len
    (ulysses: on heads)."""
    seq = PartitionSpec(None, axis)
    bias_spec = None
    if bias is not None:
        if impl == "ulysses":
            bias_spec = PartitionSpec(None, axis) if bias.shape[1] > 1 else PartitionSpec()
        else:
            bias_spec = PartitionSpec(None, None, axis) if bias.shape[2] > 1 else PartitionSpec()
    seg_spec = None if segment_ids is None else seq
    # Explicit axes: an input whose type does not split the sequence over ``axis`` is
    # resharded to it (shard_map does not reshard typed inputs by itself).
    q, k, v, segment_ids = (_split_sequence(x, axis) for x in (q, k, v, segment_ids))
    return jax.shard_map(
        scheme,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(seq, seq, seq, seg_spec, bias_spec),
        out_specs=seq,
        axis_names={axis},
        check_vma=False,
    )(q, k, v, segment_ids, bias)
