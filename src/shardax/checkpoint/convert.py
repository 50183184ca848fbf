"""Any pytree <-> the nested dict of arrays that orbax stores.

Array leaves are keyed by their path (``{"params": {"layers": {"0": {"kernel": ...}}}}``);
typed PRNG keys are stored as their raw ``key_data``; Python numbers (``"epoch": 5``)
as 0-d arrays, restored as the same Python type. Static fields and graph definitions
live in the tree structure of ``like`` and are not stored; functions as leaves (an
Equinox activation) come from ``like``; other leaves (a string...) are stored as JSON by
the manager (``other_leaves``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from shardax.plan.tree import is_array, is_key, path_str


def _key(entry: Any) -> str:
    return jax.tree_util.keystr((entry,), simple=True)


def _is_number(x: Any) -> bool:
    return type(x) in (bool, int, float, complex)


def array_leaves(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, leaf)`` for every stored leaf of ``tree`` (arrays and Python numbers)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path, leaf) for path, leaf in leaves if is_array(leaf) or _is_number(leaf)]


def other_leaves(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` for the leaves that are neither arrays, Python numbers nor
    functions (a string...): a checkpoint stores them as JSON beside the arrays."""
    return {
        path_str(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if not (is_array(leaf) or _is_number(leaf) or callable(leaf))
    }


def with_other_leaves(tree: Any, values: dict[str, Any]) -> Any:
    """``tree`` with the leaves named in ``values`` (from ``other_leaves``) replaced."""
    return jax.tree_util.tree_map_with_path(lambda p, x: values.get(path_str(p), x), tree)


def nest(pairs: list[tuple[tuple[Any, ...], Any]]) -> dict[str, Any]:
    """Nested dicts from ``(path, value)`` pairs, one level per path entry.

    Raises ``ValueError`` when two paths read the same once joined by "/" (a key that
    itself contains "/"), since they could not be told apart on restore.
    """
    out: dict[str, Any] = {}
    seen: dict[str, tuple[Any, ...]] = {}
    for path, value in pairs:
        if not path:
            raise ValueError("a checkpointed tree must be a container, not a single array")
        joined = "/".join(_key(e) for e in path)
        if joined in seen:
            raise ValueError(
                f"checkpoint keys collide: two leaves are both stored as {joined!r} "
                f"({seen[joined]} and {path}); rename the key that contains '/'"
            )
        seen[joined] = path
        node = out
        for entry in path[:-1]:
            node = node.setdefault(_key(entry), {})
        node[_key(path[-1])] = value
    return out


def flat_paths(nested: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a/b/c": leaf}`` from nested dicts."""
    if not isinstance(nested, dict):
        return {prefix: nested}
    out: dict[str, Any] = {}
    for k, v in nested.items():
        out.update(flat_paths(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def to_saveable(tree: Any) -> dict[str, Any]:
    """The array leaves of ``tree`` as nested dicts; PRNG keys as ``key_data``."""

    def one(x: Any) -> Any:
        if _is_number(x):
            return np.asarray(x)
        return jax.random.key_data(x) if is_key(x) else x

    return nest([(p, one(x)) for p, x in array_leaves(tree)])


def abstract_saveable(like: Any) -> dict[str, Any]:
    """What ``to_saveable`` of ``like`` would store, as ShapeDtypeStructs carrying the
    shardings of ``like`` (concrete arrays or ShapeDtypeStructs with a sharding)."""

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if isinstance(x, np.ndarray | np.generic) or _is_number(x):
            return np.asarray(x)
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            raise ValueError(
                f"leaf {path_str(path)!r} of `like` has no sharding; give `like` "
                "concrete arrays, or ShapeDtypeStructs with sharding= (e.g. from a plan)"
            )
        if is_key(x):
            shape = jax.eval_shape(jax.random.key_data, x).shape
            return jax.ShapeDtypeStruct(shape, np.uint32, sharding=sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return nest([(p, one(p, x)) for p, x in array_leaves(like)])


def key_impl(x: Any) -> Any:
    """The PRNG implementation of a typed key array, or of a ShapeDtypeStruct of one
    (``jax.random.key_impl`` takes arrays only; traced, it sees the abstract key)."""
    found: list[Any] = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), x)
    return found[0]


def from_saveable(like: Any, restored: dict[str, Any]) -> Any:
    """Puts the restored arrays back into the structure of ``like``. A leaf of ``like``
    that is an uncommitted ``jax.Array`` (one never placed: ``jnp.zeros``, a
    ``jax.random.key``) comes back uncommitted on the default device, as it was, so a
    jitted step still moves it beside its other inputs; committed to that device, it
    would fail with JAX's "incompatible devices" beside arrays on a mesh."""
    flat = flat_paths(restored)

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if not (is_array(x) or _is_number(x)):
            return x
        key = "/".join(_key(e) for e in path)
        value = flat[key]
        if _is_number(x):
            return type(x)(np.asarray(value).item())
        if isinstance(x, jax.Array) and not x.committed:
            value = jax.device_put(np.asarray(value))  # uncommitted, on the default device
        if is_key(x):
            return jax.random.wrap_key_data(value, impl=key_impl(x))
        return value

    return jax.tree_util.tree_map_with_path(one, like)
