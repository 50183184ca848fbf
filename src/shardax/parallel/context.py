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

Causal load balancing: with ``layout="zigzag:C"`` (:func:`zigzag_layout`) device i holds
sequence chunks i and 2C-1-i (of 2C); :func:`zigzag` reorders a batch that way and gives
each token's true position, which the masks use. The ring then pairs chunks, not blocks,
and skips the hidden pairs, so each device computes (2C+1)/(4C) of the full attention
(contiguous: device i computes (i+1)/C of it). The layout carries the C the batch was
reordered for: a context axis of another size > 1 is refused by name, and where the axis
has size 1 (one device) the masks use C's true positions. Bare ``layout="zigzag"`` (C
taken from the mesh) still works, warning once; on a mesh without the axis it is
refused, except inside :func:`laid_out_for` (how ``sx.verify`` runs its one-device
reference on the distributed mesh's layout).

>>> mesh = jax.make_mesh((2, 4), ("data", "context"))
>>> q = k = v = jnp.ones((2, 16, 4, 8))
>>> with jax.set_mesh(mesh):
...     o = jax.jit(lambda q, k, v: attention(q, k, v, causal=True, impl="ring"))(q, k, v)
>>> o.shape
(2, 16, 4, 8)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from shardax.checks import as_bool, as_count, as_float, public
from shardax.mesh.axes import CONTEXT_AXIS
from shardax.parallel import fused

IMPLS: tuple[str, ...] = ("all_gather", "ring", "ulysses")
"""The context-parallel schemes; ``impl="auto"`` picks one with :func:`choose_impl`."""

LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
"""How the sequence is laid out over the context axis: a layout is one of these, or
``"zigzag:C"`` (:func:`zigzag_layout`: reordered by :func:`zigzag` for C devices), read by
:func:`parse_layout`."""

SCORE_BYTES_LIMIT = 1 << 30
"""``impl="auto"`` takes the ring when the scores of all_gather / ulysses would exceed
this many bytes per device (they materialise ``H · T/C · S`` scores; the ring
``H · (T/C)²``)."""

_log = logging.getLogger("shardax")
_NAME = "sx.attention"


class _Config(NamedTuple):
    """The static part of one context-parallel call (hashable: custom_vjp's nondiff arg)."""

    axis: str
    size: int  # C, devices on the context axis
    causal: bool
    window: tuple[int, int] | None
    layout: str
    scale: float
    kernel: str = "auto"  # sx.attention's kernel= (shardax.parallel.fused)


# --------------------------------------------------------------------------- layout


def zigzag_order(length: int, context: int) -> np.ndarray:
    """The original position of each token after the zig-zag reorder: the sequence cut
    into 2C chunks, device i holding chunks i and 2C-1-i.

    >>> zigzag_order(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    context = as_count("context", context)
    if length % (2 * context):
        raise ValueError(
            f"length {length} is not divisible by 2 × context = {2 * context}; "
            "pad the sequence to a multiple of it"
        )
    chunk = length // (2 * context)
    chunks = [c for i in range(context) for c in (i, 2 * context - 1 - i)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def parse_layout(layout: Any, name: str = "layout") -> tuple[str, int | None]:
    """``(kind, C)`` of a layout: ``"contiguous"`` and ``"zigzag"`` carry no C (None),
    ``"zigzag:C"`` carries its C; anything else raises ``ValueError`` naming ``name``.

    >>> parse_layout("zigzag:4"), parse_layout("contiguous")
    (('zigzag', 4), ('contiguous', None))
    """
    if isinstance(layout, str) and layout in LAYOUTS:
        return layout, None
    kind, sep, size = layout.partition(":") if isinstance(layout, str) else ("", "", "")
    if kind == "zigzag" and sep and size.isdigit() and size.isascii() and int(size) >= 1:
        return kind, int(size)
    raise ValueError(
        f"{name} must be one of {list(LAYOUTS)} or 'zigzag:C' with C an integer >= 1 (the "
        f"context axis size the batch was reordered for, sx.parallel.zigzag_layout(C)), "
        f"got {layout!r}"
    )


@public("sx.parallel.zigzag_layout")
def zigzag_layout(context: int) -> str:
    """The layout of a batch reordered by :func:`zigzag` for ``context`` devices,
    ``"zigzag:C"``: pass it to :func:`attention` (or the model) with that batch, so that
    a mesh whose context axis has another size refuses it rather than mask it wrongly.

    >>> zigzag_layout(4)
    'zigzag:4'
    """
    return f"zigzag:{as_count('context', context)}"


@public("sx.parallel.zigzag")
def zigzag(batch: Any, context: int, *, seq_axis: int = 1) -> tuple[Any, np.ndarray]:
    """``(batch, positions)``: every array leaf of ``batch`` reordered along ``seq_axis``
    for causal load balancing over ``context`` devices, and the true position of each
    reordered token (give it to the model's position embedding; pass
    ``layout=zigzag_layout(context)``, ``"zigzag:C"``, to :func:`attention`). Segment ids
    in the batch are reordered with it. Leaves of rank <= ``seq_axis`` pass through.

    >>> batch, pos = zigzag({"tokens": np.arange(8)[None]}, 2)
    >>> batch["tokens"].tolist(), pos.tolist()
    ([[0, 1, 6, 7, 2, 3, 4, 5]], [0, 1, 6, 7, 2, 3, 4, 5])
    """
    lengths = {np.shape(x)[seq_axis] for x in jax.tree.leaves(batch) if np.ndim(x) > seq_axis}
    if len(lengths) != 1:
        raise ValueError(
            f"batch leaves must share one length along seq_axis={seq_axis}, got {sorted(lengths)}"
        )
    order = zigzag_order(lengths.pop(), context)
    return _take(batch, order, seq_axis), order


@public("sx.parallel.unzigzag")
def unzigzag(batch: Any, context: int, *, seq_axis: int = 1) -> Any:
    """The inverse of :func:`zigzag`: leaves back in sequence order.

    >>> unzigzag(np.array([[0, 1, 6, 7, 2, 3, 4, 5]]), 2).tolist()
    [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    lengths = {np.shape(x)[seq_axis] for x in jax.tree.leaves(batch) if np.ndim(x) > seq_axis}
    return _take(batch, np.argsort(zigzag_order(lengths.pop(), context)), seq_axis)


def _take(tree: Any, order: np.ndarray, axis: int) -> Any:
    def take(x):
        if np.ndim(x) <= axis:
            return x
        if not isinstance(x, jax.Array):
            return np.take(np.asarray(x), order, axis)
        index = (slice(None),) * axis + (jnp.asarray(order),)
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and jax.sharding.AxisType.Explicit in (
            sharding.mesh.axis_types
        ):  # Explicit axes: the result keeps the input's placement
            return x.at[index].get(out_sharding=sharding)
        return x[index]

    return jax.tree.map(take, tree)


@public("sx.parallel.sequence_sharding")
def sequence_sharding(
    mesh: Mesh, seq_axis: str = CONTEXT_AXIS, batch_axis: str | tuple[str, ...] | None = "data"
) -> NamedSharding:
    """A batch ``(B, T, ...)`` split over ``batch_axis`` on B (skipped when the mesh has no
    such axis) and over ``seq_axis`` on T: the placement :func:`attention` expects
    (``sx.batch_sharding(mesh, seq_axis=...)`` where the mesh has the batch axis).

    >>> sequence_sharding(jax.make_mesh((2, 4), ("data", "context"))).spec
    P('data', 'context')
    """
    if seq_axis not in mesh.shape:
        raise ValueError(
            f"seq_axis {seq_axis!r} is not in the mesh, whose axes are "
            f"{dict(mesh.shape)}; pass seq_axis= one of them"
        )
    names = (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis or ())
    names = tuple(n for n in names if n in mesh.shape)
    batch = names[0] if len(names) == 1 else (names or None)
    return NamedSharding(mesh, PartitionSpec(batch, seq_axis))


def layout_positions(length: int, context: int, layout: str) -> np.ndarray:
    """The true position of each of ``length`` tokens laid out ``layout`` over ``context``
    devices (``arange`` for ``"contiguous"``)."""
    if parse_layout(layout)[0] == "zigzag" and context > 1:
        return zigzag_order(length, context)
    return np.arange(length)


def _block_positions(src: Any, block: int, context: int, layout: str) -> jax.Array:
    """Positions of device ``src``'s ``block`` tokens (``src`` may be traced)."""
    t = jnp.arange(block)
    if layout == "contiguous" or context == 1:
        return src * block + t
    half = block // 2
    return jnp.where(t < half, src * half + t, (2 * context - 1 - src) * half + t - half)


# --------------------------------------------------------------------------- checks


def _check_window(window: Any) -> tuple[int, int] | None:
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


def _check_shapes(q: Any, k: Any, v: Any, segment_ids: Any, bias: Any) -> None:
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


def _check_dtypes(q: jax.Array, k: jax.Array, v: jax.Array, bias: Any) -> None:
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


_LAID_OUT: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "shardax_laid_out_for", default=None
)


@contextlib.contextmanager
def laid_out_for(mesh: Mesh) -> Iterator[None]:
    """Within it, a run on fewer devices keeps ``mesh``'s sequence layout: where ``axis``
    has size 1 (or is absent), bare ``layout="zigzag"`` means the batch was reordered for
    ``mesh.shape[axis]`` devices, and the masks and positions use that C
    (``"zigzag:C"`` says its C itself and needs no ``laid_out_for``).

    ``sx.verify`` runs its one-device reference inside it, so a zig-zag batch gives the
    same loss and gradients there as over the context axis.

    >>> with laid_out_for(jax.make_mesh((2, 4), ("data", "context"))):
    ...     layout_context()
    4
    """
    token = _LAID_OUT.set({str(k): int(v) for k, v in mesh.shape.items()})
    try:
        yield
    finally:
        _LAID_OUT.reset(token)


def layout_context(axis: str = CONTEXT_AXIS, layout: str = "zigzag") -> int:
    """The C a zig-zag sequence is laid out for: the C ``layout`` carries
    (``"zigzag:C"``), else the size of ``axis`` in the current mesh, or where that is 1,
    its size in an enclosing :func:`laid_out_for`."""
    carried = parse_layout(layout)[1]
    if carried is not None:
        return carried
    c, _ = context_size(axis)
    return c if c > 1 else (_LAID_OUT.get() or {}).get(axis, 1)


def context_size(axis: str = CONTEXT_AXIS) -> tuple[int, bool]:
    """``(C, manual)``: the size of mesh axis ``axis`` in the current mesh (1 when there is
    no mesh or no such axis) and whether it is manual here (inside shard_map over it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        if not mesh.empty and axis != CONTEXT_AXIS:
            raise ValueError(
                f"axis {axis!r} is not in the mesh, whose axes are "
                f"{dict(mesh.shape)}; add it to the mesh or pass axis= one of them"
            )
        return 1, False
    return mesh.shape[axis], axis in mesh.manual_axes


# --------------------------------------------------------------------------- choice


def sent_bytes(
    impl: str,
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    context: int,
    itemsize: int = 4,
    *,
    backward: bool = False,
) -> float:
    """Bytes one device sends for one call of scheme ``impl`` (forward, or forward and
    backward), from the global shapes q ``(B, T, H, D)`` and k ``(B, S, K, D)``:

    - all_gather: K and V gathered, ``2 (C-1)/C · B S K D``; backward reduce-scatters
      dK and dV, the same again;
    - ring: C-1 hops of a K/V block, ``2 (C-1)/C · B S K D``; backward sends K/V C-1
      hops and dK/dV C hops (home again), ``(4C-2)/C · B S K D``;
    - ulysses: all-to-all of q, k, v (kv heads repeated to H when ``K % C``) and the
      output, ``(C-1)/C² · B T D (2H + 2K')``; backward the same again.
    """
    (b, t, h, d), (_, s, kh, _) = q_shape, kv_shape
    c = context
    if c <= 1:
        return 0.0
    kv = b * s * kh * d * itemsize
    if impl == "all_gather":
        return 2 * (c - 1) / c * kv * (2 if backward else 1)
    if impl == "ring":
        return 2 * (c - 1) / c * kv + ((4 * c - 2) / c * kv if backward else 0)
    if impl == "ulysses":
        kh = kh if kh % c == 0 else h
        fwd = (c - 1) / c * b * (t // c) * d * (2 * h + 2 * kh) * itemsize
        return fwd * (2 if backward else 1)
    raise ValueError(f"sent_bytes: impl must be one of {list(IMPLS)}, got {impl!r}")


@public("sx.parallel.choose_impl")
def choose_impl(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    context: int,
    itemsize: int = 4,
    *,
    score_limit: int = SCORE_BYTES_LIMIT,
) -> tuple[str, str]:
    """``(impl, reason)``: the scheme ``impl="auto"`` takes for global shapes q
    ``(B, T, H, D)``, k ``(B, S, K, D)`` over ``context`` devices, and why.

    The ring when all_gather's scores (``B H T/C S`` in fp32) would exceed
    ``score_limit`` bytes per device; otherwise the one that sends fewer bytes
    (:func:`sent_bytes`), ulysses only when ``H % C == 0``.

    >>> choose_impl((1, 4096, 32, 128), (1, 4096, 8, 128), 4)[0]
    'all_gather'
    >>> choose_impl((1, 4096, 32, 128), (1, 4096, 32, 128), 4)[0]
    'ulysses'
    """
    (b, t, h, _), s = q_shape, kv_shape[1]
    if context <= 1:
        return "none", f"no context axis of size > 1 (C={context}): jax.nn.dot_product_attention"
    scores = b * h * (t // context) * s * 4
    if scores > score_limit:
        return "ring", (
            f"ring: all_gather/ulysses would hold {scores / 2**20:.0f} MiB of scores per device "
            f"(B·H·T/C·S, fp32) > {score_limit / 2**20:.0f} MiB; the ring holds (T/C)² blocks"
        )
    gather = sent_bytes("all_gather", q_shape, kv_shape, context, itemsize)
    if h % context:
        return "all_gather", (
            f"all_gather: heads {h} not divisible by C={context} (no ulysses); sends "
            f"{gather / 2**20:.2f} MiB per device like the ring, in one collective"
        )
    ulysses = sent_bytes("ulysses", q_shape, kv_shape, context, itemsize)
    if ulysses < gather:
        return "ulysses", (
            f"ulysses: sends {ulysses / 2**20:.2f} MiB per device vs all_gather's "
            f"{gather / 2**20:.2f} MiB (heads {h} divisible by C={context})"
        )
    return "all_gather", (
        f"all_gather: sends {gather / 2**20:.2f} MiB per device vs ulysses' "
        f"{ulysses / 2**20:.2f} MiB (few kv heads)"
    )


# --------------------------------------------------------------------------- masks


def _mask(
    qpos: jax.Array,
    kpos: jax.Array,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    causal: bool,
    window: tuple[int, int] | None,
) -> jax.Array | None:
    """``(B or 1, T, S)`` boolean: which key each query sees, from true positions."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        mask = both(mask, kpos[None, :] <= qpos[:, None])
    if window is not None:
        left, right = window
        diff = qpos[:, None] - kpos[None, :]
        mask = both(mask, (diff <= left) & (diff >= -right))
    if mask is not None:
        mask = mask[None]
    if qseg is not None:
        mask = both(mask, qseg[:, :, None] == kseg[:, None, :])
    return mask


def _dense(
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
    kernel :func:`shardax.parallel.fused.pick` takes: cuDNN's fused attention, splash
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
            return _xla_or_cudnn(q, k, v, qpos, kpos, qseg, kseg, None, causal, window,
                                 scale, natural, "cudnn")  # fmt: skip

        return fused.all_manual(local, (q, k, v), (qseg, kseg), (qpos, kpos))
    return _xla_or_cudnn(q, k, v, qpos, kpos, qseg, kseg, bias, causal, window, scale,
                         natural, "cudnn" if chosen == "cudnn" else None)  # fmt: skip


def _xla_or_cudnn(q, k, v, qpos, kpos, qseg, kseg, bias, causal, window, scale, natural,
                  impl):  # fmt: skip
    """``jax.nn.dot_product_attention`` with ``implementation=impl`` and the masks."""
    if natural:
        mask = None if qseg is None else (qseg[:, :, None] == kseg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(
            q, k, v, bias, mask, scale=scale, is_causal=causal,
            local_window_size=window, implementation=impl,
        )  # fmt: skip
    mask = _mask(qpos, kpos, qseg, kseg, causal, window)
    mask = None if mask is None else mask[:, None]
    return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, implementation=impl)


# --------------------------------------------------------------------------- schemes


def _all_gather(cfg: _Config, q, k, v, seg, bias):
    c, axis = cfg.size, cfg.axis
    t = q.shape[1]
    qpos = _block_positions(lax.axis_index(axis), t, c, cfg.layout)
    kpos = jnp.asarray(layout_positions(t * c, c, cfg.layout))
    k, v = _gather_seq(k, axis), _gather_seq(v, axis)
    kseg = None if seg is None else lax.all_gather(seg, axis, axis=1, tiled=True)
    return _dense(
        q, k, v, qpos=qpos, kpos=kpos, qseg=seg, kseg=kseg, bias=bias,
        causal=cfg.causal, window=cfg.window, scale=cfg.scale, natural=False,
        kernel=cfg.kernel,
    )  # fmt: skip


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


def _ulysses(cfg: _Config, q, k, v, seg, bias):
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
    out = _dense(
        q, k, v, qpos=pos, kpos=pos, qseg=seg, kseg=seg, bias=bias, causal=cfg.causal,
        window=cfg.window, scale=cfg.scale, natural=cfg.layout == "contiguous",
        kernel=cfg.kernel,
    )  # fmt: skip
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


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


def _scores(cfg: _Config, qg, kb, qseg, kseg, bias, qpos, kpos):
    """Masked logits ``(B, K, G, T, S)`` of queries ``qg`` at ``qpos`` against keys ``kb``
    at ``kpos`` (``bias``: their part of the bias, grouped; segment ids or Nones)."""
    s = jnp.einsum("btkgd,bskd->bkgts", qg, kb, preferred_element_type=jnp.float32)
    s = s * cfg.scale
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    mask = _mask(qpos, kpos, qseg, kseg, cfg.causal, cfg.window)
    if mask is None:
        return s
    return jnp.where(mask[:, None, None], s, _NEG)


_NEG = -0.7 * float(np.finfo(np.float32).max)


def _parts(cfg: _Config, t: int) -> list[slice]:
    """The parts of a device's block the ring pairs up, each a contiguous run of
    positions: the block itself, or under ``layout="zigzag"`` with a position mask its
    two chunks (i and 2C-1-i), so that a pair the mask hides entirely can be skipped."""
    n = 2 if cfg.layout == "zigzag" and (cfg.causal or cfg.window is not None) else 1
    sub = t // n
    return [slice(i * sub, (i + 1) * sub) for i in range(n)]


def _visible(cfg: _Config, qpos: jax.Array, kpos: jax.Array) -> Any:
    """Whether the causal mask and the window let any query of a part (a contiguous run
    of positions ``qpos``) see any key of another (``kpos``); True without them."""
    visible: Any = True
    if cfg.causal:
        visible = kpos[0] <= qpos[-1]
    if cfg.window is not None:
        left, right = cfg.window
        near = (qpos[0] - kpos[-1] <= left) & (qpos[-1] - kpos[0] >= -right)
        visible = near if visible is True else visible & near
    return visible


def _unless_hidden(visible: Any, fn: Callable[..., Any], carry: Any, *args: Any) -> Any:
    """``fn(carry, *args)``, or ``carry`` untouched (not computed) where ``visible`` is a
    traced False: the causal ring skips the blocks above the diagonal."""
    if visible is True:
        return fn(carry, *args)
    return lax.cond(visible, fn, lambda carry, *_: carry, carry, *args)


def _ring_setup(cfg: _Config, q):
    t = q.shape[1]
    idx = lax.axis_index(cfg.axis)
    return idx, _block_positions(idx, t, cfg.size, cfg.layout), _parts(cfg, t)


def _part(x: jax.Array | None, part: slice) -> jax.Array | None:
    return None if x is None else x[:, part]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Config, q, k, v, seg, bias):
    return _ring_fwd(cfg, q, k, v, seg, bias)[0]


def _zeros(x: jax.Array) -> jax.Array:
    """fp32 zeros of ``x``'s shape with ``x``'s type (its Explicit sharding, and the
    manual axes it varies over inside shard_map), for a scan carry."""
    return x.astype(jnp.float32) * 0


# The ring's blocks. A pair of functions computes one query part against one part of a
# K/V block (queries ``qg`` (B, T, K, G, D), keys and values (B, S, K, D)):
#   forward:  ``(o, lse)``, the block's normalised output (B, K, G, T, D) and the
#             log-sum-exp of its rows (B, K, G, T), both fp32;
#   backward: the block's share of (dq, (dk, dv), dbias) added to a carry, given the
#             GLOBAL output and log-sum-exp (P_block = exp(S - lse_global)).
# ``diag``: the part pair lies on the causal diagonal (the same positions: the mask is
# causal within it); other visible pairs are fully visible under causal alone.
# The ring combines the forwards by an online softmax (:func:`_combine`) whatever the
# pair: the dense one (einsums, every mask from the true positions) or cuDNN's
# (no mask or causal, kernel="cudnn").


def _dense_fwd(cfg: _Config, qg, kb, vb, qseg, kseg, bias, qpos, kpos, diag):
    """Dense block forward: masked logits, softmax, times V (einsums)."""
    del diag  # the masks come from the true positions
    s = _scores(cfg, qg, kb, qseg, kseg, bias, qpos, kpos)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)  # noqa: E741
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(vb.dtype), vb,
                    preferred_element_type=jnp.float32)  # fmt: skip
    return pv / l[..., None], m + jnp.log(l)


def _dense_bwd(cfg: _Config, carry, qg, kb, vb, qseg, kseg, bias, qpos, kpos, o, do, lse,
               delta, diag, where):  # fmt: skip
    """Dense block backward, added to ``carry = (dq, (dk, dv), dbias)`` (``where``: the
    pair's first row and column in the bias)."""
    del o, diag
    dq, (dk, dv), dbias = carry
    s = _scores(cfg, qg, kb, qseg, kseg, bias, qpos, kpos)
    p = jnp.exp(s - lse[..., None])
    dv = dv + jnp.einsum("bkgts,bkgtd->bskd", p, do)
    dp = jnp.einsum("bkgtd,bskd->bkgts", do, vb, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    dq = dq + cfg.scale * jnp.einsum("bkgts,bskd->btkgd", ds, kb,
                                     preferred_element_type=jnp.float32)  # fmt: skip
    dk = dk + cfg.scale * jnp.einsum("bkgts,btkgd->bskd", ds, qg,
                                     preferred_element_type=jnp.float32)  # fmt: skip
    if dbias is not None:
        dbias = _add_bias_grad(dbias, ds, *where)
    return dq, (dk, dv), dbias


def _heads(x: jax.Array, dtype: Any) -> jax.Array:
    """(B, K, G, T, D) -> (B, T, K·G, D) in ``dtype``: the kernels' layout."""
    b, kh, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kh * g, d).astype(dtype)


def _flash_fwd(cfg: _Config, qg, kb, vb, qseg, kseg, bias, qpos, kpos, diag):
    """A fused kernel's block forward (``_FLASH[cfg.kernel]``): no mask, or causal on
    the diagonal."""
    del qseg, kseg, bias, qpos, kpos  # none (the ring's kernel choice), or the diagonal
    b, t, kh, g, d = qg.shape
    out, lse = _FLASH[cfg.kernel][0](qg.reshape(b, t, kh * g, d), kb, vb, scale=cfg.scale,
                                     causal=diag)  # fmt: skip
    out = out.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
    return out, lse.reshape(b, t, kh, g).transpose(0, 2, 3, 1)


def _flash_bwd(cfg: _Config, carry, qg, kb, vb, qseg, kseg, bias, qpos, kpos, o, do, lse,
               delta, diag, where):  # fmt: skip
    """A fused kernel's block backward given the global output and log-sum-exp."""
    del qseg, kseg, bias, qpos, kpos, delta, where  # the kernel forms delta from o, do
    dq, (dk, dv), dbias = carry
    b, t, kh, g, d = qg.shape
    lse = lse.transpose(0, 3, 1, 2).reshape(b, t, kh * g)
    gq, gk, gv = _FLASH[cfg.kernel][1](
        qg.reshape(b, t, kh * g, d), kb, vb, _heads(o, qg.dtype), lse, _heads(do, qg.dtype),
        scale=cfg.scale, causal=diag,
    )  # fmt: skip
    dq = dq + gq.reshape(dq.shape).astype(jnp.float32)
    return dq, (dk + gk.astype(jnp.float32), dv + gv.astype(jnp.float32)), dbias


_FLASH: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "cudnn": (fused.cudnn_block, fused.cudnn_block_grads),
}
"""Fused kernels the ring runs its blocks with: forward ``(q, k, v, *, scale, causal)
-> (out, lse)`` and backward ``(q, k, v, out, lse, dout, *, scale, causal) -> (dq, dk,
dv)``, q and out ``(B, T, N, D)``, k and v ``(B, S, K, D)``, lse ``(B, T, N)`` fp32."""


def _pair(cfg: _Config) -> tuple[Callable[..., Any], Callable[..., Any]]:
    return (_flash_fwd, _flash_bwd) if cfg.kernel in _FLASH else (_dense_fwd, _dense_bwd)


def _combine(acc, block):
    """The online softmax: ``acc = (o, lse)`` and a block's ``(o, lse)`` combined."""
    o, lse = acc
    ob, lb = block
    new = jnp.logaddexp(lse, lb)
    return o * jnp.exp(lse - new)[..., None] + ob * jnp.exp(lb - new)[..., None], new


def _own_block_visible(cfg: _Config, first: bool, i: int, j: int) -> bool | None:
    """Whether query part ``i`` sees key part ``j`` of the device's own block (step 0,
    ``first``), known while tracing under causal alone: the parts lie in increasing
    positions, so query part i sees key part j > i never, j < i wholly, j == i causally.
    None: not known (another step, or a window); :func:`_visible` decides from the
    positions."""
    if not first or not cfg.causal or cfg.window is not None:
        return None
    return j <= i


def _ring_steps(cfg: _Config, compute, acc, block):
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


def _ring_fwd(cfg: _Config, q, k, v, seg, bias):
    b, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    idx, qpos, parts = _ring_setup(cfg, q)
    block_fwd = _pair(cfg)[0]

    def update(acc, *args, diag):
        return _combine(acc, block_fwd(cfg, *args, diag))

    def compute(accs, block, step, first):
        kb, vb, kseg = block
        src = (idx - step) % cfg.size
        kpos = _block_positions(src, t, cfg.size, cfg.layout)
        out = []
        for i, (qi, acc) in enumerate(zip(parts, accs, strict=True)):
            for j, kj in enumerate(parts):
                diag = first and i == j and cfg.causal
                seen = _own_block_visible(cfg, first, i, j)
                if seen is False:
                    continue
                bias_ij = _grouped_bias(bias, kh, qi, src * t + kj.start, kj.stop - kj.start)
                acc = _unless_hidden(
                    _visible(cfg, qpos[qi], kpos[kj]) if seen is None else True,
                    functools.partial(update, diag=diag), acc,
                    qg[:, qi], kb[:, kj], vb[:, kj], _part(seg, qi), _part(kseg, kj), bias_ij,
                    qpos[qi], kpos[kj],
                )  # fmt: skip
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


def _ring_bwd(cfg: _Config, res, g):
    q, k, v, seg, bias, o, lse = res
    b, t, h, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, h // kh, d)
    do = g.reshape(b, t, kh, h // kh, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
    delta = (do * o).sum(-1)
    idx, qpos, parts = _ring_setup(cfg, q)
    perm = [(i, (i + 1) % cfg.size) for i in range(cfg.size)]
    block_bwd = _pair(cfg)[1]

    def update(carry, *args, diag, where):
        return block_bwd(cfg, carry, *args, diag, where)

    def compute(acc, block, step, first):
        (dqs, dbias), dkvs = acc
        dqs, dkvs = list(dqs), list(dkvs)
        kb, vb, kseg = block
        src = (idx - step) % cfg.size
        kpos = _block_positions(src, t, cfg.size, cfg.layout)
        for i, qi in enumerate(parts):
            for j, kj in enumerate(parts):
                diag = first and i == j and cfg.causal
                seen = _own_block_visible(cfg, first, i, j)
                if seen is False:
                    continue
                col = src * t + kj.start
                dqs[i], dkvs[j], dbias = _unless_hidden(
                    _visible(cfg, qpos[qi], kpos[kj]) if seen is None else True,
                    functools.partial(update, diag=diag, where=(qi.start, col)),
                    (dqs[i], dkvs[j], dbias), qg[:, qi], kb[:, kj], vb[:, kj],
                    _part(seg, qi), _part(kseg, kj),
                    _grouped_bias(bias, kh, qi, col, kj.stop - kj.start), qpos[qi], kpos[kj],
                    o[..., qi, :], do[..., qi, :], lse[..., qi], delta[..., qi],
                )  # fmt: skip
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
        dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
        None, dbias,
    )  # fmt: skip


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


_ring.defvjp(_ring_fwd, _ring_bwd)

_SCHEMES = {"all_gather": _all_gather, "ring": _ring, "ulysses": _ulysses}


# --------------------------------------------------------------------------- entry


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
      impl: ``"all_gather"``, ``"ring"``, ``"ulysses"`` or ``"auto"`` (:func:`choose_impl`).
      layout: ``"contiguous"`` or ``"zigzag:C"`` (the batch reordered by
        :func:`zigzag` for C devices, :func:`zigzag_layout`); masks use the true
        positions. ``axis`` of size C' > 1 with C' != C is refused; of size 1, the
        positions are C's. Bare ``"zigzag"`` takes C from the mesh (warning once).
      kernel: ``"auto"``: the platform's fused kernel where it can compute this
        attention (cuDNN on a GPU, splash attention on a TPU;
        :func:`shardax.parallel.choose_kernel`), else the dense path, which a GPU or TPU
        logs once per reason; ``"dense"``, ``"cudnn"`` or ``"splash"`` force one (a
        ValueError names what it cannot do; splash off a TPU runs in Pallas' interpret
        mode, for tests). ``impl="ring"`` runs each K/V block through cuDNN on a GPU (no
        mask or causal; its log-sum-exp combines the blocks) and as einsums elsewhere.

    Every mask combines with every other and with every scheme; what a scheme cannot do
    (ulysses with heads not divisible by C) raises a ValueError naming the sizes.
    Under jit the arrays are global, ``(B, T, ...)`` with T split over ``axis``; inside
    a ``shard_map`` that binds ``axis`` they are this device's block.

    >>> q = jnp.ones((1, 8, 2, 4))
    >>> attention(q, q, q, causal=True, window=(2, 0)).shape
    (1, 8, 2, 4)
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    _check_shapes(q, k, v, segment_ids, bias)
    _check_dtypes(q, k, v, bias)
    causal = as_bool("causal", causal)
    window = _check_window(window)
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
        laid = 1 if kind == "contiguous" else _zigzag_context(axis, q.shape[1], k.shape[1], layout)
        pos = None if q.shape[1] != k.shape[1] else jnp.asarray(
            layout_positions(q.shape[1], laid, kind)
        )  # fmt: skip
        return _dense(
            q, k, v, qpos=pos, kpos=pos, qseg=segment_ids, kseg=segment_ids, bias=bias,
            causal=causal, window=window, scale=scale, natural=laid == 1, kernel=kernel,
        )  # fmt: skip
    gshape = tuple(q.shape), tuple(k.shape)
    if manual:  # inside shard_map over axis: these are this device's blocks
        gshape = tuple((s[0], s[1] * c, *s[2:]) for s in gshape)
    impl = _pick(impl, gshape[0], gshape[1], c, q.dtype.itemsize, layout)
    if impl == "ring":
        kernel = _ring_kernel(kernel, q.dtype, d, causal, window, segment_ids, bias)
    # "zigzag:C" checked equal to the axis: from here it is "zigzag" over this axis.
    cfg = _Config(axis, c, bool(causal), window, kind, scale, kernel)
    scheme = functools.partial(_SCHEMES[impl], cfg)
    if manual:
        return scheme(q, k, v, segment_ids, bias)
    return _shard_mapped(scheme, impl, axis, q, k, v, segment_ids, bias)


def _ring_kernel(kernel: str, dtype: Any, head_dim: int, causal: bool,
                 window: tuple[int, int] | None, segment_ids: Any, bias: Any) -> str:  # fmt: skip
    """The kernel the ring runs its blocks with: ``"cudnn"`` (each K/V block through
    cuDNN's fused attention, :data:`_FLASH`) where it can compute them, else ``"dense"``
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
        named = " and ".join(n for n, x in (("a window", window), ("segment ids", segment_ids))
                             if x is not None)  # fmt: skip
        why = (
            f"{named} (the ring's cuDNN blocks take causal or no mask; impl='all_gather' "
            "or 'ulysses' take cuDNN with it)"
        )
    return why


_BARE_ZIGZAG_WARNED = False


def _check_zigzag(layout: str, carried: int | None, c: int, axis: str) -> None:
    """``"zigzag:C"`` on an ``axis`` of size ``c`` > 1 other than C is refused (its masks
    would be another batch's); bare ``"zigzag"`` takes C from the mesh (or an enclosing
    :func:`laid_out_for`), warning once."""
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


def _zigzag_context(axis: str, t: int, s: int, layout: str = "zigzag") -> int:
    """The C of a zig-zag sequence run where ``axis`` has size 1: the layout's own
    (``"zigzag:C"``), else an enclosing :func:`laid_out_for`'s; refused when it cannot be
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
    _check_length(t, s, c, layout)
    return c


def _check_length(t: int, s: int, c: int, layout: str) -> None:
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


def _pick(impl, q_shape, kv_shape, c, itemsize, layout) -> str:
    (_, t, h, _), s = q_shape, kv_shape[1]
    _check_length(t, s, c, layout)
    if impl == "auto":
        impl, reason = choose_impl(q_shape, kv_shape, c, itemsize)
        _log.info("%s: impl=%r: %s", _NAME, impl, reason)
    if impl == "ulysses" and h % c:
        raise ValueError(
            f"impl='ulysses' splits heads over the context axis, so heads must be "
            f"divisible by C={c}; got heads {h}. Use impl='ring' or 'all_gather'"
        )
    return impl


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
