"""Topology-aware meshes from a dict or a list of ``(axis, size)`` pairs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardax.checks import as_count, public
from shardax.cost.compile_target import Target
from shardax.mesh.axes import DATA_AXIS, ISLAND_AXIS, REPLICA_AXIS

MeshSpec = Mapping[str, int] | Sequence[tuple[str, int]]


def resolve_mesh_shape(spec: MeshSpec, num_devices: int, *, of: str = "") -> dict[str, int]:
    """Validates ``spec`` and fills a ``-1`` size with the remaining devices; ``of`` names
    where the devices come from in the errors (e.g. ``"of target '8xH100'"``).

    >>> resolve_mesh_shape({"data": -1, "model": 2}, 8)
    {'data': 4, 'model': 2}
    """
    rule = "a dict {axis: size} or a list of (axis, size) pairs, e.g. {'data': -1}"
    if isinstance(spec, Mapping):
        pairs = list(spec.items())
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        pairs = list(spec)
        bad = [p for p in pairs if not (isinstance(p, Sequence) and len(p) == 2)]
        if bad or any(isinstance(p, str) for p in pairs):
            raise TypeError(f"mesh spec must be {rule}; got {spec!r}")
    else:
        raise TypeError(f"mesh spec must be {rule}; got {type(spec).__name__} {spec!r}")
    if not pairs:
        raise ValueError(f"mesh spec must name at least one axis ({rule}), got {spec!r}")
    names = [name for name, _ in pairs]
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"mesh axis names must be non-empty strings, got {name!r}")
    pairs = [(n, as_count(f"mesh axis {n!r} size", s, also=(-1,))) for n, s in pairs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"mesh axis names must be unique, got {names} (repeated: {dupes})")
    fills = [name for name, size in pairs if size == -1]
    if len(fills) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {fills}")
    known = math.prod(size for _, size in pairs if size != -1)
    shape = dict(pairs)
    if known > num_devices:
        raise ValueError(
            f"Not enough devices: mesh requires {known} devices but only {num_devices} "
            f"available{' ' + of if of else ''} (mesh shape {shape})"
            + ("; choose a larger target or a smaller mesh" if of else "")
        )
    if fills:
        if num_devices % known:
            raise ValueError(
                f"mesh {dict(pairs)}: the fixed axes need {known} devices, which does not "
                f"divide the {num_devices} devices available, so -1 cannot be filled"
            )
        shape[fills[0]] = num_devices // known
    return shape


@public("sx.make_mesh")
def make_mesh(
    spec: MeshSpec | None = None,
    *,
    devices: Sequence[Any] | None = None,
    axis_types: AxisType | Sequence[AxisType] = AxisType.Auto,
    dcn_axis: str | None = None,
) -> Mesh:
    """Builds a topology-aware ``jax.sharding.Mesh``.

    Args:
        spec: axis sizes as a dict or a list of ``(name, size)`` pairs; one size may
            be ``-1`` for "the remaining devices". Default: ``{"data": -1}``.
        devices: the devices to use (default: all devices of all processes), or a
            compile-only [`shardax.target`][shardax.target] (``sx.target("2x8xH100")``), whose hosts
            and TPU slices the hybrid layout follows. A mesh smaller than the devices uses
            the first ones (one process only).
        axis_types: ``AxisType.Auto`` (default: computation follows the data, as in
            the seeds) or ``AxisType.Explicit``; one for all axes, or one per axis.
        dcn_axis: with devices in several processes (or TPU slices), the axis split
            between them, over the slower network; every other axis stays inside one
            process. Its size must be a multiple of the number of processes. Default:
            ``"island"`` if the mesh has it (DiLoCo's islands, ``sx.DiLoCo``), else
            ``"replica"`` if the mesh has it (HSDP: replicas across processes,
            ``{"replica": 2, "fsdp": 4}`` or the GPT's ``{"replica": 2, "data": 4}``
            shards inside each), else ``"data"``.

    >>> mesh = make_mesh({"data": -1})
    >>> mesh.axis_names
    ('data',)
    """
    target_devices = devices
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty; pass at least one device, or None for all")
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise TypeError(
            f"devices must be jax.Device objects (e.g. jax.devices()[:4]), got "
            f"{type(bad[0]).__name__} {bad[0]!r}"
        )
    seen: set[Any] = set()
    twice = [d for d in devices if d in seen or seen.add(d)]  # type: ignore[func-returns-value]
    if twice:
        raise ValueError(
            f"devices must list each device once (a mesh places one shard on each), got "
            f"{', '.join(map(str, dict.fromkeys(twice)))} more than once among the "
            f"{len(devices)} given"
        )
    of = f"of target {target_devices!r}" if isinstance(target_devices, Target) else ""
    shape = resolve_mesh_shape({DATA_AXIS: -1} if spec is None else spec, len(devices), of=of)
    if isinstance(axis_types, AxisType):
        axis_types = (axis_types,) * len(shape)
    if isinstance(axis_types, str) or not all(isinstance(t, AxisType) for t in axis_types):
        raise TypeError(
            "axis_types must be a jax.sharding.AxisType (e.g. AxisType.Explicit) or "
            f"one per axis, got {axis_types!r}"
        )
    axis_types = tuple(axis_types)
    if len(axis_types) != len(shape):
        raise ValueError(
            f"axis_types has {len(axis_types)} entries but the mesh {shape} has {len(shape)} axes"
        )
    if len({d.process_index for d in devices}) > 1 and math.prod(shape.values()) != len(devices):
        raise ValueError(
            f"mesh {shape} uses {math.prod(shape.values())} of the {len(devices)} devices of "
            "several processes; a multi-process mesh must use every device (each process "
            "drives its own)"
        )
    if dcn_axis is None:
        dcn_axis = next((a for a in (ISLAND_AXIS, REPLICA_AXIS) if a in shape), DATA_AXIS)
    grid = _hybrid_grid(shape, devices, dcn_axis)
    if grid is not None:
        return Mesh(grid, tuple(shape), axis_types=axis_types)
    used = devices[: math.prod(shape.values())]
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=axis_types, devices=used)


def _hybrid_grid(shape: dict[str, int], devices: Sequence[Any], dcn_axis: str) -> Any:
    """The device grid when ``devices`` span several TPU slices, or several processes
    (GPU, CPU) with more than one device each: ``dcn_axis`` is split between them (slow
    network, DCN) and every other axis stays inside one (ICI). None where this does not
    apply (one process or slice; a single TPU slice spanning hosts is all ICI; one
    device per process): then ``jax.make_mesh`` lays the mesh out over the
    process-major device order. A ``dcn_axis`` that is missing or whose size is not a
    multiple of their number is an error, never a silent layout across the network."""
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        attr = "slice_index"
    elif devices[0].platform != "tpu":
        attr = "process_index"
    else:
        return None
    groups: dict[int, int] = {}
    for d in devices:
        groups[getattr(d, attr)] = groups.get(getattr(d, attr), 0) + 1
    n = len(groups)
    if n == 1 or len(set(groups.values())) > 1 or len(devices) == n:
        return None
    if shape.get(dcn_axis, 1) % n:
        where = "processes" if attr == "process_index" else "slices"
        raise ValueError(
            f"mesh {shape}: dcn_axis {dcn_axis!r} (size {shape.get(dcn_axis)}) must be split "
            f"between the {n} {where}, so its size must be a multiple of {n}; name the axis "
            "that should cross them with dcn_axis=, or change the sizes"
        )
    ici = [size // n if name == dcn_axis else size for name, size in shape.items()]
    dcn = [n if name == dcn_axis else 1 for name in shape]
    return mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=attr == "process_index"
    )


@public("sx.mesh.mesh_info")
def mesh_info(mesh: Mesh) -> dict[str, Any]:
    """``{"total_devices": N, "axes": {name: size}}`` plus axis types and device ids.

    >>> mesh_info(make_mesh({"data": 2}))["axes"]
    {'data': 2}
    """
    return {
        "total_devices": mesh.size,
        "axes": dict(mesh.shape),
        "axis_types": {n: t.name for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)},
        "device_ids": mesh.device_ids.tolist(),
    }
