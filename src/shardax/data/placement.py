"""Placing pytrees on devices: one device, a sharding, replicated, or split on the batch.

Every function takes any pytree; NumPy leaves are placed too, and leaves that are not
arrays pass through unchanged.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> batch = {"x": np.ones((16, 3)), "y": np.zeros(16), "scale": np.float32(2.0)}
>>> batch = sx.distribute_batch(batch, sx.batch_sharding(mesh))
>>> batch["x"].sharding.spec, batch["scale"].sharding.spec
(P('data',), P())
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from shardax.checks import as_count, check_mesh, expect_type, public
from shardax.data.leaves import check_batch_leaves, sharded_dims
from shardax.mesh.axes import DATA_AXIS
from shardax.mesh.make import make_mesh
from shardax.plan.specs import check_spec
from shardax.plan.tree import map_arrays
from shardax.runtime.processes import device_put_global


@public("sx.batch_sharding")
def batch_sharding(
    mesh: Mesh,
    axis: str | tuple[str, ...] = DATA_AXIS,
    batch_axis: int = 0,
    seq_axis: str | None = None,
) -> NamedSharding:
    """The sharding that splits dimension ``batch_axis`` over mesh ``axis``; with
    ``seq_axis``, the next dimension (the sequence of ``(batch, seq, ...)`` leaves) over
    that mesh axis too: the placement context parallelism ([`shardax.attention`][shardax.attention])
    expects, e.g. for a batch reordered by ``sx.parallel.zigzag``.

    >>> batch_sharding(make_mesh()).spec
    P('data',)
    >>> batch_sharding(make_mesh({"data": 2, "context": 4}), seq_axis="context").spec
    P('data', 'context')
    """
    check_mesh("mesh", mesh)
    batch_axis = as_count("batch_axis", batch_axis, minimum=0)
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ValueError(
            f"batch axis {axis!r} is not in the mesh, whose axes are "
            f"{dict(mesh.shape)}; pass axis= one of them"
        )
    if seq_axis is None:
        return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), axis))
    if not isinstance(seq_axis, str) or seq_axis not in mesh.shape or seq_axis in names:
        raise ValueError(
            f"seq_axis must be a mesh axis other than the batch's "
            f"{names}, one of {dict(mesh.shape)}; got {seq_axis!r}"
        )
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), axis, seq_axis))


def leaf_sharding(path: str, shape: tuple[int, ...], sharding: Sharding) -> Sharding:
    """Fits ``sharding`` to one leaf: scalars are replicated and trailing ``None``
    entries beyond the leaf's rank are dropped; any other mismatch is an error."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    if len(shape) == 0:
        spec = ()
    elif len(spec) > len(shape) and all(e is None for e in spec[len(shape) :]):
        spec = spec[: len(shape)]
    spec = PartitionSpec(*spec)
    check_spec(path, shape, spec, sharding.mesh)
    return sharding if spec == sharding.spec else NamedSharding(sharding.mesh, spec)


@public("sx.distribute_batch")
def distribute_batch(data: Any, sharding: Sharding) -> Any:
    """Places every array leaf of ``data`` with ``sharding`` (scalars replicated).

    Raises ``ValueError`` naming the leaf when a dimension is not divisible by its axes,
    or when leaves disagree on a dimension that ``sharding`` splits (the batch size).
    """
    sharding = expect_type(
        "sharding",
        sharding,
        Sharding,
        "a jax.sharding.Sharding",
        "For a mesh, pass sx.batch_sharding(mesh)",
    )
    check_batch_leaves(data, dims=sharded_dims(sharding))
    return map_arrays(
        lambda path, x: device_put_global(x, leaf_sharding(path, np.shape(x), sharding)), data
    )


@public("sx.place_on_device")
def place_on_device(data: Any, device: Any | None = None) -> Any:
    """Commits every array leaf of ``data`` to ``device`` (default: first local device).

    >>> place_on_device(np.ones(2)).devices() == {jax.local_devices()[0]}
    True
    """
    device = jax.local_devices()[0] if device is None else device
    expect_type(
        "device",
        device,
        jax.Device,
        "a jax.Device",
        "Pick one from jax.devices() or jax.local_devices()",
    )
    check_batch_leaves(data)
    target = SingleDeviceSharding(device)
    return map_arrays(lambda _, x: jax.device_put(x, target), data)


@public("sx.data.replicate_across_devices")
def replicate_across_devices(data: Any, devices: Sequence[Any] | None = None) -> Any:
    """Copies every array leaf of ``data`` whole onto each of ``devices`` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh({"replica": len(devices)}, devices=devices)
    return distribute_batch(data, NamedSharding(mesh, PartitionSpec()))


@public("sx.data.shard_batch_dim")
def shard_batch_dim(data: Any, mesh: Mesh, batch_axis: int = 0, mesh_axis: str = DATA_AXIS) -> Any:
    """Splits dimension ``batch_axis`` of every array leaf over ``mesh_axis``.

    Scalars are replicated. A leaf whose rank does not reach ``batch_axis`` is an error.
    """
    batch_axis = as_count("batch_axis", batch_axis, minimum=0)
    sharding = batch_sharding(mesh, mesh_axis, batch_axis)
    check_batch_leaves(data, dims=(batch_axis,))

    def one(path: str, x: Any) -> Any:
        shape = np.shape(x)
        if 0 < len(shape) <= batch_axis:
            raise ValueError(f"leaf {path!r} with shape {shape} has no batch_axis {batch_axis}")
        return device_put_global(x, leaf_sharding(path, shape, sharding))

    return map_arrays(one, data)
