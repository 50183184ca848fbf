"""Checks ``PartitionSpec``s against array shapes and a mesh, before anything is placed.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 8})
>>> spec_errors("w", (6, 4), P("data"), mesh)
["leaf 'w' with shape (6, 4): dimension 0 of size 6 is not divisible by the size 8 of ..."]
"""

from __future__ import annotations

import math
from typing import Any

from jax.sharding import Mesh, PartitionSpec


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axis names in one entry of a ``PartitionSpec``."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_errors(path: str, shape: tuple[int, ...], spec: Any, mesh: Mesh) -> list[str]:
    """Every reason ``spec`` cannot shard an array of ``shape`` on ``mesh`` (empty if none).

    The rules: the spec is a ``PartitionSpec`` no longer than the rank, every axis is in
    the mesh, no mesh axis is used twice, and each sharded dimension is divisible by the
    size of its axes. Each message names ``path``, ``shape`` and the axis size.
    """
    where = f"leaf {path or '<root>'!r} with shape {shape}"
    if not isinstance(spec, PartitionSpec):
        return [f"{where}: the plan gave {spec!r}, which is not a PartitionSpec"]
    errors = []
    if len(spec) > len(shape):
        errors.append(
            f"{where}: spec {spec} has {len(spec)} entries, more than the rank {len(shape)}"
        )
    used: dict[str, int] = {}
    for dim, entry in enumerate(spec):
        axes = spec_axes(entry)
        missing = [n for n in axes if n not in mesh.shape]
        for name in missing:
            errors.append(
                f"{where}: spec {spec} names axis {name!r}, which is not in the mesh "
                f"(axes {dict(mesh.shape)})"
            )
        for name in axes:
            if name in used and name not in missing:
                errors.append(
                    f"{where}: spec {spec} uses mesh axis {name!r} (size {mesh.shape[name]}) "
                    f"twice, on dimensions {used[name]} and {dim}"
                )
            used.setdefault(name, dim)
        if missing or not axes or dim >= len(shape):
            continue
        size = math.prod(mesh.shape[n] for n in axes)
        if shape[dim] % size:
            errors.append(
                f"{where}: dimension {dim} of size {shape[dim]} is not divisible by the "
                f"size {size} of mesh axis {entry!r} (spec {spec})"
            )
    return errors


def check_spec(path: str, shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> None:
    """Raises ``ValueError`` with every message of ``spec_errors``, if there is any."""
    errors = spec_errors(path, shape, spec, mesh)
    if errors:
        raise ValueError("\n".join(errors))
