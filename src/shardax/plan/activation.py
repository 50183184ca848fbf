"""Sharding constraints on activations inside a model, in every execution mode.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 4, "model": 2})
>>> def layer(x, w):
...     return sx.constrain(x @ w, P("data", "model"))  # batch on "data", features on "model"
>>> with jax.set_mesh(mesh):
...     y = jax.jit(layer)(jnp.ones((8, 4)), jnp.ones((4, 6)))
>>> y.sharding.spec
P('data', 'model')
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from shardax.checks import public
from shardax.plan.annotations import logical_to_mesh
from shardax.plan.specs import spec_axes, spec_errors
from shardax.plan.tree import is_array, path_str


@public("sx.constrain")
def constrain(x: Any, spec: PartitionSpec | NamedSharding, mesh: Mesh | None = None) -> Any:
    """Constrains every array leaf of ``x`` to ``spec`` where a global view exists.

    - Under ``jax.jit`` or eagerly, with a mesh known (``spec`` a ``NamedSharding``,
      ``mesh`` given, or the mesh set by ``jax.set_mesh``): ``with_sharding_constraint``
      (``jax.sharding.reshard`` for Explicit axes).
    - Inside ``jax.shard_map`` or ``jax.pmap`` over the spec's axes: values are per-device
      and cannot be constrained, so ``x`` is returned unchanged; so it is with no mesh at
      all (single-device mode).

    Logical names in ``spec`` are mapped by the current
    [`axis_rules`][shardax.plan.axis_rules], so a model annotated once runs on any mesh. A
    name neither mapped nor in the mesh, or a spec that does not divide the shape, raises
    ``ValueError`` naming it and the axis size.
    """
    if isinstance(spec, NamedSharding):
        mesh, spec = spec.mesh, spec.spec
    if not isinstance(spec, PartitionSpec):
        raise ValueError(f"spec must be a PartitionSpec or NamedSharding, got {spec!r}")
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and len(context.manual_axes) == len(context.axis_names):
        return x  # inside shard_map or pmap over every axis: values are per-device
    target = mesh if mesh is not None else (None if context.empty else context)
    if target is None:
        return x  # no mesh known: single-device mode
    spec = logical_to_mesh(spec, target, where=f"constrain({spec})")
    used = {a for e in spec for a in spec_axes(e)}
    if used & set(context.manual_axes):
        return x
    explicit = {
        n
        for n, t in zip(target.axis_names, target.axis_types, strict=True)
        if t == AxisType.Explicit
    }

    def one(path: Any, leaf: Any) -> Any:
        if not is_array(leaf):
            return leaf
        errors = spec_errors(path_str(path), tuple(leaf.shape), spec, target)
        if errors:
            raise ValueError("\n".join(errors))
        sharding = NamedSharding(mesh, spec) if mesh is not None else spec
        if used & explicit:
            return jax.sharding.reshard(leaf, sharding)
        return jax.lax.with_sharding_constraint(leaf, sharding)

    return jax.tree_util.tree_map_with_path(one, x)
