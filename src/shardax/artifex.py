"""The artifex distributed-training API (the seed documents), as thin facades.

Every name here is importable from ``shardax`` exactly as artifex spells it:
``DeviceMeshManager``, ``DataParallel``, ``DevicePlacement``, ``DistributedMetrics``,
``HardwareType``, ``BatchSizeRecommendation``, ``place_on_device``,
``distribute_batch`` and ``get_batch_size_recommendation``. Each class is a thin facade:
``facade`` adds every plain function to a class twice, as an instance method with
the seed's signature (``self`` first) that calls the function, and as the ``*_static``
twin, which *is* the function. The functions themselves live in their layers (mesh,
data, plan, parallel, cost).

>>> import shardax as sx
>>> mesh = sx.DeviceMeshManager().create_data_parallel_mesh()
>>> dp = sx.DataParallel()
>>> batch = dp.shard_batch({"x": np.ones((16, 4))}, dp.create_data_parallel_sharding(mesh))
>>> sx.DataParallel.shard_batch_static is shard_batch
True
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, Sharding

from shardax._names import exports as _exports
from shardax.checks import public
from shardax.cost.hardware import (
    BatchSizeRecommendation,
    HardwareType,
    detect_hardware_type,
    device_info,
    get_batch_size_recommendation,
    validate_batch_size,
)
from shardax.data import placement
from shardax.data.placement import (  # noqa: F401 (place_on_device: re-exported)
    batch_sharding,
    distribute_batch,
    place_on_device,
)
from shardax.data.prefetch import prefetch_to_device
from shardax.mesh.axes import DATA_AXIS
from shardax.mesh.make import MeshSpec, make_mesh, mesh_info
from shardax.parallel.collectives import all_gather as _all_gather
from shardax.parallel.collectives import all_reduce, reduce
from shardax.plan.core import fsdp, replicate, shard

__all__ = _exports(__name__)

T = TypeVar("T", bound=type)


def as_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """An instance method ``(self, ...)`` that calls ``fn(...)``; ``__wrapped__`` is ``fn``."""

    @functools.wraps(fn)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = sig.replace(parameters=[this, *sig.parameters.values()])  # type: ignore[attr-defined]
    return method


def facade(*fns: Callable[..., Any]) -> Callable[[T], T]:
    """A class decorator adding each of ``fns`` as a method and as its ``*_static`` twin."""

    def decorate(cls: T) -> T:
        for fn in fns:
            setattr(cls, fn.__name__, as_method(fn))
            setattr(cls, f"{fn.__name__}_static", staticmethod(fn))
        return cls

    return decorate


# -- DeviceMeshManager ----------------------------------------------------------------


@public("sx.DeviceMeshManager")
class DeviceMeshManager:
    """Creates device meshes for data, model and hybrid parallelism.

    >>> manager = DeviceMeshManager()
    >>> mesh = manager.create_device_mesh({"data": -1})
    >>> manager.get_mesh_info(mesh)["total_devices"] == manager.num_devices
    True
    """

    def __init__(self, devices: Sequence[Any] | None = None) -> None:
        self._devices = list(jax.devices() if devices is None else devices)

    def create_device_mesh(
        self,
        mesh_shape: MeshSpec,
        devices: Sequence[Any] | None = None,
    ) -> Mesh:
        """A mesh from ``{"data": 2, "model": 1}`` or ``[("data", 2), ("model", 1)]``."""
        return make_mesh(mesh_shape, devices=self._devices if devices is None else devices)

    def create_data_parallel_mesh(
        self, num_devices: int | None = None, axis_name: str = "data"
    ) -> Mesh:
        """A 1-D mesh over ``num_devices`` devices (default: all)."""
        return self.create_device_mesh({axis_name: -1 if num_devices is None else num_devices})

    def create_model_parallel_mesh(
        self, num_devices: int | None = None, axis_name: str = "model"
    ) -> Mesh:
        """A 1-D mesh named ``axis_name`` over ``num_devices`` devices (default: all)."""
        return self.create_device_mesh({axis_name: -1 if num_devices is None else num_devices})

    def create_hybrid_mesh(
        self,
        data_parallel_size: int = 1,
        model_parallel_size: int = 1,
        data_axis: str = "data",
        model_axis: str = "model",
    ) -> Mesh:
        """A 2-D ``(data, model)`` mesh; either size may be -1."""
        return self.create_device_mesh(
            [(data_axis, data_parallel_size), (model_axis, model_parallel_size)]
        )

    def get_mesh_info(self, mesh: Mesh) -> dict[str, Any]:
        """``total_devices`` and ``axes`` of ``mesh`` (see
        [`shardax.mesh.mesh_info`][shardax.mesh.mesh_info])."""
        return mesh_info(mesh)

    @property
    def num_devices(self) -> int:
        """The number of devices this manager builds meshes from."""
        return len(self._devices)

    @property
    def devices(self) -> list[Any]:
        """The devices this manager builds meshes from."""
        return list(self._devices)


# -- DevicePlacement ------------------------------------------------------------------


@public("sx.DevicePlacement")
class DevicePlacement:
    """Places pytrees on devices and gives hardware-aware batch-size advice.

    >>> placement = DevicePlacement()
    >>> placement.hardware_type  # on a CPU-only machine
    <HardwareType.CPU: 'cpu'>
    """

    def __init__(self, default_device: Any | None = None) -> None:
        self.default_device = jax.local_devices()[0] if default_device is None else default_device
        self._hardware_type = detect_hardware_type()

    def place_on_device(self, data: Any, device: Any | None = None) -> Any:
        """Commits ``data`` to ``device`` (default: this object's default device)."""
        return placement.place_on_device(data, self.default_device if device is None else device)

    def distribute_batch(self, data: Any, sharding: Sharding) -> Any:
        """Places ``data`` with ``sharding``; see
        [`shardax.distribute_batch`][shardax.distribute_batch]."""
        return placement.distribute_batch(data, sharding)

    def replicate_across_devices(self, data: Any, devices: list[Any] | None = None) -> Any:
        """Copies ``data`` whole onto every device of ``devices`` (default: all)."""
        return placement.replicate_across_devices(data, devices)

    def shard_batch_dim(
        self, data: Any, mesh: Mesh, batch_axis: int = 0, mesh_axis: str = "data"
    ) -> Any:
        """Splits dimension ``batch_axis`` of every leaf over ``mesh_axis``."""
        return placement.shard_batch_dim(data, mesh, batch_axis, mesh_axis)

    def prefetch_to_device(
        self, data_iterator: Iterator[Any], device: Any | None = None, buffer_size: int = 2
    ) -> Iterator[Any]:
        """Prefetches onto ``device`` (a Device, Sharding or Mesh; default: the default
        device); see [`shardax.prefetch_to_device`][shardax.prefetch_to_device]."""
        target = self.default_device if device is None else device
        return prefetch_to_device(data_iterator, target, buffer_size)

    def get_batch_size_recommendation(
        self, hardware_type: HardwareType | None = None
    ) -> BatchSizeRecommendation:
        """The table's recommendation for ``hardware_type`` (default: the detected one)."""
        return get_batch_size_recommendation(
            self._hardware_type if hardware_type is None else hardware_type
        )

    def validate_batch_size(
        self, batch_size: int, warn_suboptimal: bool = True
    ) -> tuple[bool, str]:
        """``(is_valid, message)`` for ``batch_size`` on the detected hardware."""
        return validate_batch_size(batch_size, self._hardware_type, warn_suboptimal)

    def get_device_info(self) -> dict[str, Any]:
        """``num_devices``, ``hardware_type`` (this object's), ``platforms``, ``device_kinds``
        and ``devices``; see [`sx.cost.device_info`][shardax.cost.device_info]."""
        return {**device_info(), "hardware_type": self._hardware_type.value}

    @property
    def hardware_type(self) -> HardwareType:
        """The detected hardware type."""
        return self._hardware_type

    @property
    def num_devices(self) -> int:
        """The number of devices of all processes."""
        return jax.device_count()


# -- DataParallel ---------------------------------------------------------------------


@public("sx.DataParallel.create_data_parallel_sharding")
def create_data_parallel_sharding(mesh: Mesh, data_axis: str = "data") -> NamedSharding:
    """The sharding that splits dimension 0 over ``data_axis``."""
    return batch_sharding(mesh, data_axis)


@public("sx.DataParallel.shard_batch")
def shard_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Places ``batch`` with ``sharding`` (scalars replicated)."""
    return distribute_batch(batch, sharding)


@public("sx.DataParallel.shard_model_state")
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


@public("sx.DataParallel.replicate_params")
def replicate_params(params: Any, mesh: Mesh) -> Any:
    """Copies ``params`` whole onto every device of ``mesh``."""
    return shard(params, replicate(mesh))


@public("sx.DataParallel.all_reduce_gradients")
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
            f"{reduce_type!r}; sx.parallel.all_reduce also takes 'max' and 'min')"
        )
    return all_reduce(gradients, reduce_type, axis_name)


@public("sx.DataParallel")
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


# -- DistributedMetrics ---------------------------------------------------------------


@public("sx.DistributedMetrics.all_gather")
def all_gather(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Stacks ``metrics`` from every device along ``axis_name`` on a leading axis."""
    return _all_gather(metrics, axis_name)


@public("sx.DistributedMetrics.reduce_mean")
def reduce_mean(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Means ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "mean", axis_name)


@public("sx.DistributedMetrics.reduce_sum")
def reduce_sum(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Sums ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "sum", axis_name)


@public("sx.DistributedMetrics.reduce_max")
def reduce_max(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Maximum of ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "max", axis_name)


@public("sx.DistributedMetrics.reduce_min")
def reduce_min(metrics: Any, axis_name: str | None = "batch") -> Any:
    """Minimum of ``metrics`` across ``axis_name`` (None: every bound axis)."""
    return reduce(metrics, "min", axis_name)


@public("sx.DistributedMetrics.reduce_custom")
def reduce_custom(
    metrics: dict[str, Any],
    reduce_fn: dict[str, str | None] | None = None,
    axis_name: str | None = "batch",
) -> dict[str, Any]:
    """Reduces each metric by its own op from ``reduce_fn`` (default "mean").

    An op of None leaves that metric as it is; an unknown op is a ``ValueError``.
    """
    ops = reduce_fn or {}
    return {
        k: v if ops.get(k, "mean") is None else reduce(v, ops.get(k, "mean"), axis_name)
        for k, v in metrics.items()
    }


@public("sx.DistributedMetrics.collect_from_devices")
def collect_from_devices(metrics: dict[str, Any]) -> dict[str, Any]:
    """Splits pmap outputs (leading device axis) into per-device lists, outside pmap."""
    return {
        k: list(v) if isinstance(v, jax.Array) and v.ndim > 0 else v for k, v in metrics.items()
    }


@public("sx.DistributedMetrics")
@facade(
    all_gather,
    reduce_mean,
    reduce_sum,
    reduce_max,
    reduce_min,
    reduce_custom,
    collect_from_devices,
)
class DistributedMetrics(nnx.Module):
    """Metric reductions across devices; every method also exists as ``*_static``."""

    def __init__(self) -> None:
        pass
