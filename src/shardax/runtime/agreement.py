"""Checking that every process runs the same setup: fingerprints compared across processes.

In a multi-process run each process builds its own mesh, plan and config. If one differs
(another command-line flag, another environment), the processes compile different programs
and usually hang in their first collective.
[`check_agreement`][shardax.runtime.check_agreement] fingerprints each named part,
all-gathers the fingerprints with an XLA collective and raises
[`AgreementError`][shardax.runtime.AgreementError] on *every* process when they differ,
naming the parts.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> digest = sx.runtime.check_agreement(config={"lr": 1e-3}, mesh=mesh, plan=sx.fsdp(mesh))
>>> len(digest)
64
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.checks import public


class AgreementError(RuntimeError):
    """The processes of a multi-process run disagree on their setup."""


def _canon(x: Any) -> Any:
    """A JSON-able description of ``x`` that is the same in every process for equal setups."""
    if x is None or isinstance(x, bool | int | str):
        return x
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, enum.Enum):
        return f"{type(x).__qualname__}.{x.name}"
    if isinstance(x, Mesh):
        return {
            "Mesh": dict(x.shape),
            "axis_types": [t.name for t in x.axis_types],
            "device_ids": x.device_ids.tolist(),
        }
    if isinstance(x, NamedSharding):
        return {"NamedSharding": _canon(x.mesh), "spec": repr(x.spec)}
    if isinstance(x, PartitionSpec):
        return repr(x)
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        # Shape, dtype and placement; never the values, which may live on other hosts.
        sharding = getattr(x, "sharding", None)
        return {"shape": list(x.shape), "dtype": str(x.dtype), "sharding": _canon(sharding)}
    if isinstance(x, np.ndarray | np.generic):
        x = np.asarray(x)
        digest = hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()
        return {"shape": list(x.shape), "dtype": str(x.dtype), "sha256": digest}
    if isinstance(x, Mapping):
        return {"mapping": sorted([str(k), _canon(v)] for k, v in x.items())}
    if isinstance(x, list | tuple):
        return [type(x).__name__, *(_canon(v) for v in x)]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: _canon(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {type(x).__qualname__: fields}
    if isinstance(x, types.ModuleType):
        return {"module": x.__name__}
    if callable(x) and hasattr(x, "__code__"):
        # A plan's rule: the function's name and the values it closes over
        # (fsdp's axis, size and min_size), not its address.
        cells = [c.cell_contents for c in (x.__closure__ or ())]
        return {"function": f"{x.__module__}.{x.__qualname__}", "closure": _canon(cells)}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(x)
    if treedef.num_nodes > 1 or (leaves and leaves[0][1] is not x):
        return {type(x).__qualname__: [[jax.tree_util.keystr(p), _canon(v)] for p, v in leaves]}
    if hasattr(x, "__dict__") and type(x).__repr__ is object.__repr__:
        return {type(x).__qualname__: _canon(vars(x))}
    text = repr(x)
    if " at 0x" in text:
        raise TypeError(
            f"cannot fingerprint a {type(x).__qualname__} the same way in "
            f"every process (its repr holds a memory address: {text[:80]}); pass plain data"
        )
    return text


def fingerprint(value: Any) -> str:
    """The SHA-256 hex digest of ``value``'s setup description (shapes, specs, config).

    >>> fingerprint({"lr": 0.1}) == fingerprint({"lr": 0.1}) != fingerprint({"lr": 0.2})
    True
    """
    text = json.dumps(_canon(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _words(hexdigest: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hexdigest)[:16], dtype=np.uint32)


def _describe(value: Any, limit: int = 300) -> str:
    text = json.dumps(_canon(value), sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


def _gather_differ(rows: np.ndarray) -> list[list[int]]:
    """All-gathers this process's ``rows`` (same shape everywhere); for each row, the
    processes whose row differs from process 0's."""
    everyone = np.asarray(multihost_utils.process_allgather(rows))
    return [
        [p for p in range(len(everyone)) if (everyone[p, i] != everyone[0, i]).any()]
        for i in range(rows.shape[0])
    ]


def _leaf_differences(value: Any, limit: int = 5) -> str:
    """Which leaves of a pytree part differ between processes; empty when that does not
    say more than the whole part. A collective: every process calls it for the same part,
    and every branch below depends only on gathered values, so all take the same one."""
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    paths = [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in leaves]
    structure = np.concatenate([_words(fingerprint(paths)), np.uint32([len(leaves)])])
    if _gather_differ(structure[None])[0]:
        return f"; its tree structure differs, on process {jax.process_index()}: {paths[:8]}"
    if len(leaves) < 2:
        return ""
    differ = _gather_differ(np.stack([_words(fingerprint(v)) for _, v in leaves]))
    found = [f"{paths[i]}: {_short(leaves[i][1])}" for i, d in enumerate(differ) if d]
    if not found:  # the leaves agree; what differs is outside them (static fields)
        return ""
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    count = f"{len(found)} leaves differ" if len(found) > 1 else "1 leaf differs"
    return f"; {count}, on process {jax.process_index()}: " + ", ".join(found[:limit]) + more


def _short(leaf: Any) -> str:
    """A leaf in a few words: a sharding by its spec, an array by dtype, shape and spec."""
    if isinstance(leaf, NamedSharding):
        return str(leaf.spec)
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray):
        spec = getattr(getattr(leaf, "sharding", None), "spec", "")
        return f"{leaf.dtype}{list(leaf.shape)} {spec}".rstrip()
    if isinstance(leaf, bool | int | float | str):
        return repr(leaf)
    return _describe(leaf, 80)


@public("sx.runtime.check_agreement")
def check_agreement(**parts: Any) -> str:
    """Raises [`AgreementError`][shardax.runtime.AgreementError] on every process unless all
    processes pass equal parts.

    Each keyword is one named part of the setup, for example ``config=`` (a dict,
    dataclass or argparse namespace), ``mesh=`` (a Mesh), ``plan=`` (a Plan, or the
    shardings of the state: ``plan(abstract_state)``). Every process must call it at
    the same point. With one process it only computes the fingerprint.

    Returns:
        The fingerprint of all the parts together (SHA-256 hex digest).
    """
    if not parts:
        raise ValueError("pass at least one part, e.g. config=..., mesh=...")
    digests = {name: fingerprint(value) for name, value in sorted(parts.items())}
    overall = fingerprint(digests)
    if jax.process_count() == 1:
        return overall
    names = fingerprint(sorted(digests))
    mine = np.concatenate([_words(overall), _words(names)])
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    if (everyone == everyone[0]).all():
        return overall
    me = jax.process_index()
    if not (everyone[:, 4:] == everyone[0, 4:]).all():
        raise AgreementError(
            f"the processes passed different parts; process {me} passed "
            f"{sorted(digests)}. Call it with the same keywords on every process."
        )
    differ = _gather_differ(np.stack([_words(d) for d in digests.values()]))
    problems = []
    for name, procs in zip(digests, differ, strict=True):
        if procs:
            where = _leaf_differences(parts[name]) or (
                f"; on process {me}: {_describe(parts[name])}"
            )
            problems.append(f"{name!r} (processes {procs} differ from process 0{where})")
    raise AgreementError(
        "the processes disagree on " + "; ".join(problems) + ". Every "
        "process must build the same mesh, plan and config: check each process's "
        "command line and environment."
    )
