"""What ``sx.estimate`` counts before it reads the compiled program: the step's mesh,
the abstract state and batch, the bytes per device of the params, optimizer and other
state (from their shardings), the gradients, the tokens per step, the memory budget.

>>> state = {"params": {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}}
>>> state_bytes(state, None)
({'params': 128, 'optimizer': 0, 'other_state': 0}, 32)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from shardax.cost.budget import device_memory


def budget_fields(device: Any) -> dict[str, Any]:
    """An [`Estimate`][shardax.cost.Estimate]'s ``memory_budget`` and ``budget_note`` on
    ``device``."""
    found = device_memory(device)
    return (
        {"memory_budget": None, "budget_note": ""}
        if found is None
        else {"memory_budget": found[0], "budget_note": found[1]}
    )


def mesh_of(step: Any, leaves: list[Any]) -> Any:
    mesh = getattr(step, "mesh", None)
    if mesh is not None:
        return mesh
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    raise ValueError(
        "step has no mesh and no leaf of state or batch carries a NamedSharding; pass a "
        "make_train_step step, or abstract values placed with sx.prepare (or "
        "jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh, spec)))"
    )


def check_axes(tree: Any, mesh: Any, what: str) -> None:
    """Every NamedSharding in ``tree`` names only axes of ``mesh``; else ValueError naming
    the leaf, the axis and the mesh's axes."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            continue
        for entry in sharding.spec:
            for axis in (entry,) if isinstance(entry, str) else entry or ():
                if axis not in mesh.shape:
                    raise ValueError(
                        f"{what} leaf {jax.tree_util.keystr(path)} is sharded over mesh axis "
                        f"{axis!r}, which the step's mesh {dict(mesh.shape)} lacks; place "
                        "it with the step's mesh (sx.prepare(..., mesh=mesh)) or use its axes"
                    )


def abstract_tree(tree: Any) -> Any:
    """Arrays as ShapeDtypeStructs (keeping their shardings); other leaves as they are."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    return jax.tree.map(one, tree)


def _per_device(leaf: Any, sharding: Any) -> int:
    shape = tuple(leaf.shape)
    if sharding is not None and hasattr(sharding, "shard_shape"):
        shape = sharding.shard_shape(shape)
    # a typed PRNG key's dtype (key<fry>) is no NumPy dtype; it gives its own itemsize
    itemsize = getattr(leaf.dtype, "itemsize", None) or np.dtype(leaf.dtype).itemsize
    return math.prod(shape) * itemsize


def _kind(path: str) -> str:
    low = path.lower()
    if "opt_state" in low or "optimizer" in low:
        return "optimizer"
    if any(k in low for k in ("model_state", "rng", ".step", "loss_scale", "batch_stats")):
        return "other_state"
    return "params"


def state_bytes(state: Any, shardings: Any) -> tuple[dict[str, int], int]:
    """Bytes per device of params, optimizer and other state, and the params' global
    element count."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays = [(jax.tree_util.keystr(p), x) for p, x in leaves if hasattr(x, "shape")]
    flat = [s for s in jax.tree.leaves(shardings) if hasattr(s, "shard_shape")]
    if len(flat) != len(arrays):
        flat = [getattr(x, "sharding", None) for _, x in arrays]
    out = {"params": 0, "optimizer": 0, "other_state": 0}
    count = 0
    for (path, leaf), sharding in zip(arrays, flat, strict=True):
        kind = _kind(path)
        out[kind] += _per_device(leaf, sharding)
        if kind == "params":
            count += math.prod(leaf.shape)
    return out, count


def param_shapes(state: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, global shape)`` of each parameter leaf of ``state`` (as ``_kind``)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return [
        (jax.tree_util.keystr(p), tuple(x.shape))
        for p, x in leaves
        if hasattr(x, "shape") and _kind(jax.tree_util.keystr(p)) == "params"
    ]


def grad_bytes(step: Any, state: Any, params_bytes: int, mesh: Any) -> int:
    """Gradients per device: as the params, or (ZeRO-2: ``plan.shard_grads``) split like
    the optimizer state, or (``sx.zero1(mesh, gather="forward")``: the params split, the
    gradients whole) as the plan's ``grad_specs`` say."""
    plan = getattr(step, "plan", None)
    split = getattr(plan, "shard_grads", False) or getattr(plan, "gathers_forward", False)
    if not split or not hasattr(state, "params"):
        return params_bytes
    specs = plan.grad_specs(state.params)
    total = 0
    for leaf, spec in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        strict=False,
    ):
        total += _per_device(leaf, jax.sharding.NamedSharding(mesh, spec))
    return total


def default_tokens(batch: Any) -> float:
    """Tokens per step: rows × sequence of the batch's first 2-D integer leaf (a token
    batch), else the rows of its first leaf."""
    leaves = [x for x in jax.tree.leaves(batch) if hasattr(x, "shape") and len(x.shape)]
    for x in leaves:
        if len(x.shape) == 2 and np.issubdtype(np.dtype(x.dtype), np.integer):
            return float(x.shape[0] * x.shape[1])
    return float(leaves[0].shape[0]) if leaves else 0.0


def compiled_memory(
    compiled: Any, state: Any, shardings: Any, grads_bytes: int | None
) -> tuple[dict[str, int], dict[str, int], bool]:
    """An [`Estimate`][shardax.cost.Estimate]'s ``memory`` (the state's bytes by kind, the
    batch, the gradients inside the temporaries, the other temporaries and the peak) and
    ``compiled_bytes`` from the compiler's ``memory_analysis()``, and whether the step
    trains (it has optimizer state: it makes gradients, ``grads_bytes`` or the params')."""
    m = compiled.memory_analysis()
    args, outs = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    memory, _ = state_bytes(state, shardings) if state is not None else ({"params": 0}, 0)
    memory["batch"] = max(0, args - sum(memory.values()))
    training = memory.get("optimizer", 0) > 0
    grads = (memory["params"] if grads_bytes is None else grads_bytes) if training else 0
    memory["gradients"] = min(grads, temp)
    memory["other_temporaries"] = temp - memory["gradients"]
    memory["peak"] = args + outs - alias + temp
    compiled_bytes = {"arguments": args, "outputs": outs, "aliased": alias, "temporaries": temp}
    return memory, compiled_bytes, training
