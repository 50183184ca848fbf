"""DiLoCo's settings and its outer step, as pure functions over stacked pytrees.

DiLoCo (arXiv 2311.08105) trains ``n`` islands apart: each runs ``inner_steps`` (H)
updates of the user's optimizer on its own part of the batch, then all average their
*outer gradients*, ``anchor - params_i`` (how far each moved from the params at the
last sync), and the outer optimizer (Nesterov SGD by default) moves the anchor by that
average; every island restarts from the new anchor. Only that average crosses islands.

Here an island's params are row ``i`` of a stacked leaf ``(n, ...)``, the stacked dimension
over the mesh's island axis, so each island's rows live on its own devices.
[`outer_update`][shardax.train.diloco.outer_update] is the outer step on that layout; the
outer gradients cross islands in full (float32, one all-reduce), or compressed
(``compress=``):

- ``"bf16"``: rounded to bfloat16 and all-gathered (2 bytes a parameter, not 4);
- ``"int8"``: int8 in blocks of ``block`` values, each with a float32 scale (its
  largest magnitude / 127), all-gathered: ``1 + 4/block`` bytes a parameter;
- ``"topk"``: in each block of ``block`` values only the ``topk`` largest magnitudes are
  sent (bfloat16 values and their 1-byte or 2-byte positions in the block); what is
  not sent is kept per island (``error``) and added to the next outer gradient (error
  feedback, as SparseLoCo and DeMo do): ``topk * (2 + 1) / block`` bytes a parameter at
  ``block`` <= 256.

>>> config = sx.train.DiLoCo(inner_steps=50)
>>> config.inner_steps, config.axis, config.compress
(50, 'island', None)
>>> sx.train.DiLoCo(inner_steps=50, compress="int8").bytes_per_param(jnp.float32)
1.015625
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.checks import as_count, public, received
from shardax.mesh.axes import ISLAND_AXIS
from shardax.plan.activation import constrain
from shardax.train.static import comparable

COMPRESSIONS: tuple[str | None, ...] = (None, "bf16", "int8", "topk")
"""The outer gradients' encodings across islands (``DiLoCo(compress=...)``)."""


def default_outer() -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: ``optax.sgd(0.7, momentum=0.9, nesterov=True)``."""
    return optax.sgd(0.7, momentum=0.9, nesterov=True)


@public("sx.DiLoCo")
@dataclasses.dataclass(frozen=True)
class DiLoCo:
    """DiLoCo's settings for [`make_train_step`][shardax.make_train_step] (``diloco=``).

    Args:
        inner_steps: H, the inner updates between two outer steps (``step.sync``).
        outer: the outer optax transformation (default
            ``optax.sgd(0.7, momentum=0.9, nesterov=True)``, the paper's).
        axis: the mesh axis that separates the islands; the plan and the batch split
            inside an island use the other axes.
        compress: ``None`` (float32), ``"bf16"``, ``"int8"`` (per-block scales) or
            ``"topk"`` (per-block top-k with error feedback): see the module doc.
        block: the values per scale (``"int8"``) or per top-k selection (``"topk"``).
        topk: the values ``"topk"`` keeps in each block.

    >>> sx.DiLoCo(inner_steps=100, compress="topk", block=256, topk=8).bytes_per_param()
    0.09375
    """

    inner_steps: int
    outer: optax.GradientTransformation | None = None
    axis: str = ISLAND_AXIS
    compress: str | None = None
    block: int = 256
    topk: int = 8

    def __post_init__(self) -> None:
        set_ = lambda **kv: [object.__setattr__(self, k, v) for k, v in kv.items()]  # noqa: E731
        set_(inner_steps=as_count("inner_steps", self.inner_steps))
        outer = default_outer() if self.outer is None else self.outer
        if not isinstance(outer, optax.GradientTransformation):
            raise TypeError(
                f"outer must be an optax.GradientTransformation (the outer optimizer, e.g. "
                f"optax.sgd(0.7, momentum=0.9, nesterov=True)), got {received(outer)}"
            )
        set_(outer=comparable(outer))
        if not isinstance(self.axis, str):
            raise TypeError(f"axis must be a mesh axis name (the islands'), got {self.axis!r}")
        if self.compress not in COMPRESSIONS:
            raise ValueError(f"compress must be one of {list(COMPRESSIONS)}, got {self.compress!r}")
        set_(block=as_count("block", self.block), topk=as_count("topk", self.topk))
        if self.topk > self.block:
            raise ValueError(
                f"topk keeps topk values of each block, so it must be <= block={self.block}, "
                f"got topk={self.topk}"
            )

    def bytes_per_param(self, dtype: Any = jnp.float32) -> float:
        """Bytes one island sends across islands per parameter at an outer step, before
        the collective's own factor (a ``dtype`` param's outer gradient)."""
        if self.compress is None:
            return float(np.dtype(dtype).itemsize)
        if self.compress == "bf16":
            return 2.0
        if self.compress == "int8":
            return 1.0 + 4.0 / self.block
        return self.topk * (2.0 + _index_dtype(self.block).itemsize) / self.block


def _index_dtype(block: int) -> np.dtype:
    return np.dtype(np.uint8 if block <= 256 else np.uint16 if block <= 65536 else np.int32)


class OuterState(NamedTuple):
    """The outer step's state, in ``TrainState.outer``.

    anchor: the params at the last sync (unstacked, replicated over the islands).
    opt_state: the outer transformation's state for ``anchor``.
    error: ``"topk"``'s error feedback, stacked ``(islands, ...)`` like the params; else None.
    syncs: int32 ``[]``, the outer steps taken.
    """

    anchor: Any
    opt_state: Any
    error: Any
    syncs: jax.Array


def init_outer(config: DiLoCo, params: Any, islands: int) -> OuterState:
    """The outer state for (unstacked) ``params``: the anchor is ``params``."""
    error = None
    if config.compress == "topk":
        error = jax.tree.map(lambda p: jnp.zeros((islands, *p.shape), p.dtype), params)
    return OuterState(params, config.outer.init(params), error, jnp.zeros((), jnp.int32))


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``x`` as ``(blocks, block)``, zero-padded at the end."""
    flat = x.reshape(-1)
    return jnp.pad(flat, (0, (-flat.size) % block)).reshape(-1, block)


def _unblock(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``_blocks``'s inverse: ``(..., blocks, block)`` to ``(..., *shape)``."""
    lead = blocks.shape[:-2]
    flat = blocks.reshape(*lead, -1)[..., : math.prod(shape)]
    return flat.reshape(*lead, *shape)


def int8_encode(blocks: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Int8 values and float32 scales (largest magnitude / 127) of ``(..., block)``."""
    scale = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0).astype(jnp.float32)
    return jnp.clip(jnp.round(blocks / scale), -127, 127).astype(jnp.int8), scale


def topk_encode(blocks: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` largest magnitudes of each block of ``(..., block)``: bfloat16 values and
    their positions in the block."""
    _, index = lax.top_k(jnp.abs(blocks), k)
    values = jnp.take_along_axis(blocks, index, axis=-1).astype(jnp.bfloat16)
    return values, index.astype(_index_dtype(blocks.shape[-1]))


def topk_decode(values: jax.Array, index: jax.Array, block: int) -> jax.Array:
    """Dense ``(..., block)`` float32 blocks from ``topk_encode``'s output (one select per
    kept value: elementwise, so each island decodes its own rows where they lie)."""
    positions = jnp.arange(block, dtype=jnp.int32)
    dense = jnp.zeros((*values.shape[:-1], block), jnp.float32)
    for j in range(values.shape[-1]):
        at = index[..., j : j + 1].astype(jnp.int32) == positions
        dense = jnp.where(at, values[..., j : j + 1].astype(jnp.float32), dense)
    return dense


def _as_bits(x: jax.Array) -> jax.Array:
    """A bfloat16 array as uint16, so that the compiler moves its bits across islands as
    they are (XLA may otherwise send the float32 it was rounded from: excess precision)."""
    return lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _from_bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def exchange(
    config: DiLoCo, delta: jax.Array, error: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """On one device, inside ``shard_map`` over the mesh: the mean over the islands of this
    device's shard of the outer gradient ``delta``, sent across islands (``config.axis``)
    encoded as ``config.compress`` says, and ``"topk"``'s new error feedback."""
    axis, shape, dtype = config.axis, delta.shape, delta.dtype
    if config.compress is None:
        return lax.pmean(delta, axis), None
    if config.compress == "bf16":
        sent = _from_bits(lax.all_gather(_as_bits(delta.astype(jnp.bfloat16)), axis))
        return jnp.mean(sent.astype(jnp.float32), axis=0).astype(dtype), None
    if config.compress == "int8":
        q, scale = int8_encode(_blocks(delta.astype(jnp.float32), config.block))
        q, scale = lax.all_gather(q, axis), lax.all_gather(scale, axis)
        mean = jnp.mean(q.astype(jnp.float32) * scale, axis=0)
        return _unblock(mean, shape).astype(dtype), None
    full = delta.astype(jnp.float32) + error.astype(jnp.float32)
    values, index = topk_encode(_blocks(full, config.block), config.topk)
    kept = _unblock(topk_decode(values, index, config.block), shape)
    values = _from_bits(lax.all_gather(_as_bits(values), axis))
    index = lax.all_gather(index, axis)
    mean = jnp.mean(topk_decode(values, index, config.block), axis=0)
    return _unblock(mean, shape).astype(dtype), (full - kept).astype(error.dtype)


def reduce_outer(
    config: DiLoCo, delta: jax.Array, error: jax.Array | None, mesh: Mesh, spec: PartitionSpec
) -> tuple[jax.Array, jax.Array | None]:
    """The mean over islands of the stacked outer gradient ``delta`` ``(n, ...)`` (islands
    on ``config.axis``, each island's rows as ``spec``), and ``"topk"``'s new error
    feedback: each device encodes its own shard and exchanges it with the devices that
    hold the same shard in the other islands (``exchange``), the only collective."""
    stacked = PartitionSpec(config.axis, *spec)
    if error is None:
        fn = lambda d: exchange(config, d[0], None)[0]  # noqa: E731
        mapped = jax.shard_map(fn, mesh=mesh, in_specs=(stacked,), out_specs=spec, check_vma=False)
        return mapped(delta), None

    def fn(d: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        mean, new = exchange(config, d[0], e[0])
        return mean, new[None]

    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(stacked, stacked), out_specs=(spec, stacked), check_vma=False
    )
    return mapped(delta, error)


def outer_update(
    config: DiLoCo, params: Any, outer: OuterState, mesh: Mesh, specs: Any
) -> tuple[Any, OuterState]:
    """DiLoCo's outer step: the stacked ``params`` ``(islands, ...)`` all set to the new
    anchor, and the new outer state. ``specs``: each param's spec inside an island."""
    delta = jax.tree.map(lambda a, p: a[None] - p, outer.anchor, params)
    errors = outer.error if outer.error is not None else jax.tree.map(lambda _: None, delta)
    leaves, treedef = jax.tree.flatten(delta)
    spec_leaves = treedef.flatten_up_to(specs)
    error_leaves = treedef.flatten_up_to(errors)
    reduced = [
        reduce_outer(config, d, e, mesh, s)
        for d, e, s in zip(leaves, error_leaves, spec_leaves, strict=True)
    ]
    grads = treedef.unflatten([r[0] for r in reduced])
    error = None if outer.error is None else treedef.unflatten([r[1] for r in reduced])
    updates, opt_state = config.outer.update(grads, outer.opt_state, outer.anchor)
    anchor = optax.apply_updates(outer.anchor, updates)
    anchor = jax.tree.map(lambda a, old: a.astype(old.dtype), anchor, outer.anchor)
    n = jax.tree.leaves(params)[0].shape[0]
    restarted = jax.tree.map(
        lambda a, s: constrain(
            jnp.broadcast_to(a[None], (n, *a.shape)),
            NamedSharding(mesh, PartitionSpec(config.axis, *s)),
        ),
        anchor,
        specs,
    )
    return restarted, OuterState(anchor, opt_state, error, outer.syncs + 1)
