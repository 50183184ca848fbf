"""``DataParallel``: the seed's facade over batch shardings, plans and all-reduce."""

from __future__ import annotations

from typing import Any, Literal

from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardax.data.placement import batch_sharding, distribute_batch
from shardax.facade import facade
from shardax.mesh.make import DATA_AXIS
from shardax.plan.core import fsdp, replicate, shard
from shardax.train.collectives import all_reduce


def create_data_parallel_sharding(mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """The sharding that splits dimension 0 over ``data_axis``."""
    return batch_sharding(mesh, data_axis)


def shard_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Places ``batch`` with ``sharding`` (scalars replicated)."""
    return distribute_batch(batch, sharding)


def shard_model_state(
    state: Any, mesh: Mesh, param_sharding: Literal["replicate", "shard"] = "replicate"
) -> Any:
    """Replicates ``state``, or shards it FSDP-style (``"shard"``).

    ``"shard"`` splits each leaf on its largest dimension that the data axis divides
    (all mesh axes if the mesh has no ``"data"`` axis); small leaves and leaves with
    no such dimension are replicated. Values are unchanged.
    """
    if param_sharding == "replicate":
        return shard(state, replicate(mesh))
    if param_sharding == "shard":
        axis = DATA_AXIS if DATA_AXIS in mesh.shape else tuple(mesh.axis_names)
        return shard(state, fsdp(mesh, axis))
    raise ValueError(f"param_sharding must be 'replicate' or 'shard', got {param_sharding!r}")


def replicate_params(params: Any, mesh: Mesh) -> Any:
    """Copies ``params`` whole onto every device of ``mesh``."""
    return shard(params, replicate(mesh))


def all_reduce_gradients(
    gradients: Any, reduce_type: Literal["mean", "sum"] = "mean", axis_name: str = "batch"
) -> Any:
    """Averages (or sums) ``gradients`` across ``axis_name`` inside shard_map or pmap.

    Raises ``ValueError`` if ``reduce_type`` is not "mean" or "sum", and ``NameError``
    naming the axis if it is not bound where this is called.
    """
    if reduce_type not in ("mean", "sum"):
        raise ValueError(
            f"Unsupported reduce_type: {reduce_type}. Use 'mean' or 'sum' (reduce_type="
            f"{reduce_type!r}; sx.all_reduce also takes 'max' and 'min')"
        )
    return all_reduce(gradients, reduce_type, axis_name)


@facade(
    create_data_parallel_sharding,
    shard_batch,
    shard_model_state,
    all_reduce_gradients,
    replicate_params,
)
class DataParallel(nnx.Module):
    """Data-parallel training utilities; every method also exists as ``*_static``.

    >>> import shardax as sx
    >>> mesh = sx.make_mesh({"data": -1})
    >>> dp = sx.DataParallel()
    >>> batch = dp.shard_batch({"x": np.ones((16, 4))}, dp.create_data_parallel_sharding(mesh))
    """

    def __init__(self) -> None:
        pass
