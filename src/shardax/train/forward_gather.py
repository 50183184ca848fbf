"""ZeRO-1's gather at the step's start: the params' compute-dtype copy, gathered once.

Under [`shardax.zero1`][shardax.zero1] with ``gather="forward"`` the state's params are the
master copy, split over the data axis as Adam's moments are. ``gathered`` casts them to
the precision's ``compute_dtype`` and constrains that copy to be whole on every device:
the SPMD partitioner gathers it there, in the compute dtype (bf16: half a float32
gather's bytes), and nothing later in the step needs it, so XLA's latency-hiding
scheduler may start each leaf's gather as early as it likes and wait for it just
before its first use in the forward pass. The copy is widened back to ``param_dtype``
(exact: every compute-dtype value is one of it), so the model binds, casts (XLA folds
the round trip away) and differentiates the same values as under ``gather="update"``,
and the gradients reach the optimizer in ``param_dtype``, whole, as there.

A leaf that stacks layers (three dimensions or more, the first not split: the GPT's
``nnx.vmap`` blocks, ``(layers, ...)``) is gathered one slice of its first dimension at a
time, so each layer's gather waits only for that layer: on an 8xH100 target the GPT's
17 bf16 gathers all run under the forward pass's matmuls but the first (the embedding's
and the first layer's, with nothing before them to hide behind). With the layers in
``lax.scan`` the loop reads the whole stack, so its gathers wait before the loop
(``docs/results.md``, ZeRO-1).

>>> master = jax.device_put({"w": jnp.arange(16.0)}, NamedSharding(mesh, P("data")))
>>> bf16 = sx.train.precision.resolve("bf16")
>>> copy = jax.jit(lambda params: gathered(params, {"w": P("data")}, mesh, bf16))(master)
>>> copy["w"].sharding.spec, copy["w"].dtype, copy["w"].addressable_shards[0].data.shape
(P(), dtype('float32'), (16,))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from shardax.plan.tree import is_array
from shardax.train.precision import Precision, cast_floating, cast_like

STACK_RANK = 3
"""Leaves of this many dimensions or more whose first is not split are stacks of layers'
weights (the GPT's ``nnx.vmap`` blocks): gathered one slice of the first dimension at a
time."""


def gathers_forward(plan: Any) -> bool:
    """Whether ``plan`` keeps the params split and has the step gather them at its start
    (``sx.zero1(mesh, gather="forward")``)."""
    return bool(getattr(plan, "gathers_forward", False))


def placed(x: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """``x`` constrained to ``spec`` on ``mesh`` (``reshard`` on a mesh of Explicit axes)."""
    if not is_array(x):
        return x
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _whole(x: Any, spec: PartitionSpec, mesh: Mesh) -> Any:
    """``x`` (split as ``spec``) gathered whole: a stack (three dimensions or more, the
    first not split, as an ``nnx.vmap`` of layers makes) slice by slice along its first
    dimension, so each layer's gather can wait for its layer; any other leaf at once."""
    if not is_array(x):
        return x
    whole = PartitionSpec()
    if x.ndim < STACK_RANK or x.shape[0] < 2 or (len(spec) and spec[0] is not None):
        return placed(x, mesh, whole)
    inner = PartitionSpec(*tuple(spec)[1:])
    return jnp.stack([placed(placed(x[i], mesh, inner), mesh, whole) for i in range(x.shape[0])])


def gathered(params: Any, specs: Any, mesh: Mesh, policy: Precision) -> Any:
    """``params`` (split as ``specs`` say) cast to ``policy.compute_dtype`` where they
    lie, gathered whole, and widened back to their own dtypes (see the module). The
    cast copy is pinned to the master's split first: otherwise the partitioner may
    gather the master and cast after (a ``param_dtype`` gather, as XLA:CPU does)."""
    copy = cast_floating(params, policy.compute_dtype)
    copy = jax.tree.map(lambda x, s: _whole(placed(x, mesh, s), s, mesh), copy, specs)
    return cast_like(copy, params)
