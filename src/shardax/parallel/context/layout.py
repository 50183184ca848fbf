"""How the sequence lies over the context axis: contiguous, or zig-zag for causal load
balancing (device i holds chunks i and 2C-1-i of 2C), and the true position of each token.

``"zigzag:C"`` ([`zigzag_layout`][shardax.parallel.zigzag_layout]) carries the C the batch was
reordered for ([`zigzag`][shardax.parallel.zigzag]); bare ``"zigzag"`` takes C from the mesh, or
inside ``laid_out_for`` from the mesh it names.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.checks import as_count, public
from shardax.mesh.axes import CONTEXT_AXIS

LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")
"""How the sequence is laid out over the context axis: a layout is one of these, or ``"zigzag:C"``
([`zigzag_layout`][shardax.parallel.zigzag_layout]: reordered by [`zigzag`][shardax.parallel.zigzag]
for C devices), read by ``parse_layout``."""


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
    """The layout of a batch reordered by [`zigzag`][shardax.parallel.zigzag] for ``context``
    devices, ``"zigzag:C"``: pass it to [`attention`][shardax.attention] (or the model) with that
    batch, so that a mesh whose context axis has another size refuses it rather than mask it
    wrongly.

    >>> zigzag_layout(4)
    'zigzag:4'
    """
    return f"zigzag:{as_count('context', context)}"


@public("sx.parallel.zigzag")
def zigzag(batch: Any, context: int, *, seq_axis: int = 1) -> tuple[Any, np.ndarray]:
    """``(batch, positions)``: every array leaf of ``batch`` reordered along ``seq_axis`` for causal
    load balancing over ``context`` devices, and the true position of each reordered token (give it
    to the model's position embedding; pass ``layout=zigzag_layout(context)``, ``"zigzag:C"``, to
    [`attention`][shardax.attention]). Segment ids in the batch are reordered with it. Leaves of
    rank <= ``seq_axis`` pass through.

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
    """The inverse of [`zigzag`][shardax.parallel.zigzag]: leaves back in sequence order.

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


def sequence_sharding(
    mesh: Mesh, seq_axis: str = CONTEXT_AXIS, batch_axis: str | tuple[str, ...] | None = "data"
) -> NamedSharding:
    """A batch ``(B, T, ...)`` split over ``batch_axis`` on B (skipped when the mesh has no
    such axis) and over ``seq_axis`` on T: the placement [`attention`][shardax.attention] expects
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


def block_positions(src: Any, block: int, context: int, layout: str) -> jax.Array:
    """Positions of device ``src``'s ``block`` tokens (``src`` may be traced)."""
    t = jnp.arange(block)
    if layout == "contiguous" or context == 1:
        return src * block + t
    half = block // 2
    return jnp.where(t < half, src * half + t, (2 * context - 1 - src) * half + t - half)


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
    its size in an enclosing ``laid_out_for``."""
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
