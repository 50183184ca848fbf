"""Checks a ``PartitionSpec`` against an array shape and a mesh, before placing it."""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import Mesh, PartitionSpec


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names in one entry of a ``PartitionSpec``."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_spec(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    """Raises ``ValueError`` naming ``path``, ``shape`` and the axis if ``spec`` cannot apply.

    The rules: the spec is no longer than the rank, every axis is in the mesh, no
    axis is used twice, and each sharded dimension is divisible by its axes' size.
    """
    where = f"leaf {path or '<root>'!r} with shape {shape}"
    if len(spec) > len(shape):
        raise ValueError(f"{where}: spec {spec} has {len(spec)} entries, more than the rank")
    used: list[str] = []
    for dim, entry in enumerate(spec):
        axes = spec_axes(entry)
        for name in axes:
            if name not in mesh.shape:
                raise ValueError(
                    f"{where}: spec {spec} names axis {name!r}, which is not in the mesh "
                    f"(axes {dict(mesh.shape)})"
                )
            if name in used:
                raise ValueError(f"{where}: spec {spec} uses mesh axis {name!r} twice")
            used.append(name)
        size = math.prod(mesh.shape[n] for n in axes)
        if axes and shape[dim] % size:
            raise ValueError(
                f"{where}: dimension {dim} of size {shape[dim]} is not divisible by the "
                f"size {size} of mesh axis {entry!r} (spec {spec})"
            )
