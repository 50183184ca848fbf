"""The plans a mesh alone defines, by name: the one home of those names.

``replicate``, ``zero1``, ``zero2`` and ``fsdp`` need no model, only the mesh, the data
axis and a minimum size: each is ``MESH_PLANS[name](mesh, axis, min_size)``. The auto
plan's candidates (``shardax.train.auto.candidate_plans``), the reference models'
plans (``shardax.models``) and the CLI's ``--plan`` choices take their names from here;
a model's own plans (``tp``, ``fsdp+tp``, ``pipeline``: rules over its layers) are
added where the model is. A new plan of this kind is its function and one line here.

>>> sorted(MESH_PLANS)
['fsdp', 'replicate', 'zero1', 'zero2']
>>> MESH_PLANS["zero2"](sx.make_mesh({"data": 8}), "data", 1024).name
'zero2'
"""

from __future__ import annotations

from collections.abc import Callable

from jax.sharding import Mesh

from shardax.plan.core import AxisNames, Plan, fsdp, replicate
from shardax.plan.zero import zero1, zero2

MeshPlan = Callable[[Mesh, AxisNames, int], Plan]


def _replicate(mesh: Mesh, axis: AxisNames, min_size: int) -> Plan:
    return replicate(mesh)


MESH_PLANS: dict[str, MeshPlan] = {
    "replicate": _replicate,
    "zero1": zero1,
    "zero2": zero2,
    "fsdp": fsdp,
}
"""``build(mesh, axis, min_size) -> Plan`` by name, in the auto plan's order (the most
replicated first)."""
