"""Mesh axis types in the train step: Explicit axes (sharding in types) and Auto axes.

On a mesh with Explicit axes every array's type says how it is split, and a model may
say where its activations go (``out_sharding=`` in flax layers and ``jnp.einsum``,
``jax.sharding.reshard``). On a mesh with Auto axes the compiler chooses, and
computation follows the data. The step runs the model with the mesh's own axis types,
never converting one into the other; when the model and the mesh disagree, the error
JAX raises gets a note saying which to change.

>>> mesh = sx.make_mesh({"data": -1}, axis_types=AxisType.Explicit)
>>> mesh_axis_type(mesh, "data") == AxisType.Explicit
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from shardax.runtime.compat import is_sharding_type_error


def mesh_axis_type(mesh: Mesh, axis: str) -> AxisType:
    """The type of ``mesh``'s axis ``axis``."""
    return dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[axis]


def reshard_batch(fn: Callable[..., Any], sharding: NamedSharding) -> Callable[..., Any]:
    """``fn(state, batch)`` with the batch's leaves resharded to ``sharding`` first: inside
    ``jax.jit`` a NumPy batch's type is unsharded even when ``in_shardings`` splits it, and
    on Explicit axes the split must be in the type."""

    @functools.wraps(fn)
    def resharded(state: Any, batch: Any) -> Any:
        return fn(state, jax.tree.map(lambda x: jax.sharding.reshard(x, sharding), batch))

    return resharded


def axis_type_note(error: BaseException, mesh: Mesh) -> str | None:
    """What to change when ``error`` comes from a model and a mesh whose axis types
    disagree; None for any other error."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    shape = dict(mesh.shape)
    explicit = [n for n, t in types.items() if t == AxisType.Explicit]
    if is_sharding_type_error(error) and explicit:
        return (
            f"shardax: the mesh {shape} has Explicit axes {explicit} (sharding in types), so "
            "each operation's output sharding must follow from its inputs' types, and this "
            "one does not. Say where the result goes in the model (out_sharding= in flax "
            "layers and jnp.einsum, jax.sharding.reshard, sx.constrain), or build the mesh "
            "with Auto axes (sx.make_mesh's default, or jax.make_mesh(..., axis_types="
            "(AxisType.Auto,) * n)) so that computation follows the data."
        )
    message = str(error)
    if "of type Auto" in message or "of type Manual" in message:
        auto = [n for n, t in types.items() if t == AxisType.Auto]
        if auto and "of type Auto" in message:
            return (
                f"shardax: the model gives shardings over axes that are Auto on the mesh "
                f"{shape} (Auto axes {auto}); out_sharding= and jax.sharding.reshard need "
                "Explicit axes. Build the mesh with axis_types=AxisType.Explicit "
                "(jax.make_mesh's default, or sx.make_mesh(..., axis_types=AxisType.Explicit))."
            )
        return (
            "shardax: the model gives shardings over an axis that is Manual here: mode "
            "'shard_map' and 'pmap' run the model on one device's slice. A model that "
            "carries its own shardings trains in mode='jit' on a mesh with Explicit axes."
        )
    return None


def explain_axis_types(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """``fn``, adding ``axis_type_note`` to the errors it raises (while traced)."""

    @functools.wraps(fn)
    def explained(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as error:
            note = axis_type_note(error, mesh)
            if note is not None:
                error.add_note(note)
            raise

    return explained
