"""Plans: a pytree (arrays or ShapeDtypeStructs) to a pytree of ``NamedSharding``.

A plan is a mesh plus a rule ``spec_fn(path, shape) -> PartitionSpec``; calling it on
a tree gives the shardings, and [`shard`][shardax.shard] places a tree with it.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> params = {"w": np.zeros((1024, 16), np.float32), "b": np.zeros((16,), np.float32)}
>>> sx.fsdp(mesh, min_size=1).specs(params)["w"]
P('data', None)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from shardax.checks import as_count, check_mesh, public
from shardax.mesh.axes import DATA_AXIS
from shardax.plan.specs import spec_errors
from shardax.plan.tree import is_array, is_key, map_arrays, path_str
from shardax.runtime.processes import device_put_global

AxisNames = str | tuple[str, ...]
SpecFn = Callable[[str, tuple[int, ...]], PartitionSpec]
Leaves = list[tuple[str, tuple[int, ...]]]
UnmatchedFn = Callable[[Leaves], dict[str, str]]


def array_paths(tree: Any) -> Leaves:
    """``(path, shape)`` of every array leaf of ``tree``."""
    return [
        (path_str(p), tuple(np.shape(x)))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if is_array(x)
    ]


def leaf_spec(spec_fn: SpecFn, path: str, leaf: Any) -> PartitionSpec:
    """``spec_fn(path, shape)`` for an array leaf, replicated without asking for a rank-0
    leaf (a step count, a scalar) and for a typed PRNG key (a generator's state)."""
    shape = tuple(np.shape(leaf))
    return spec_fn(path, shape) if shape and not is_key(leaf) else PartitionSpec()


@public("sx.Plan")
@dataclasses.dataclass(frozen=True)
class Plan:
    """A named sharding rule over a mesh. Call it on a tree to get its shardings."""

    mesh: Mesh
    spec_fn: SpecFn
    name: str = "plan"
    # {rule: message} for the plan's rules that match no leaf of a tree (a misspelt regex).
    unmatched: UnmatchedFn | None = dataclasses.field(default=None, kw_only=True, compare=False)
    # Rules already warned about, so applying the plan again stays quiet.
    warned: set[str] = dataclasses.field(
        default_factory=set, kw_only=True, compare=False, repr=False
    )
    # A sx.rules plan's (rule_list, default), from which a fix builds it again (sx.explain).
    rules_given: tuple[tuple[Any, ...], Any] | None = dataclasses.field(
        default=None, kw_only=True, compare=False, repr=False
    )

    def notes(self, tree: Any) -> list[str]:
        """A message for every rule of the plan that matches no array leaf of ``tree``."""
        return list(self._unmatched(tree).values())

    def _unmatched(self, tree: Any) -> dict[str, str]:
        return {} if self.unmatched is None else self.unmatched(array_paths(tree))

    def _warn_unmatched(self, tree: Any) -> None:
        for rule, note in self._unmatched(tree).items():
            if rule not in self.warned:
                self.warned.add(rule)
                warnings.warn(note, UserWarning, stacklevel=4)

    def resolve(self, tree: Any) -> tuple[Any, list[str]]:
        """The ``PartitionSpec`` of every array leaf, and every error found checking them.

        Rank-0 leaves (step counts, scalars) and typed PRNG keys (``nnx.Rngs`` state) are
        always replicated, whatever ``spec_fn``.
        """
        errors: list[str] = []

        def one(path: str, leaf: Any) -> PartitionSpec:
            spec = leaf_spec(self.spec_fn, path, leaf)
            errors.extend(spec_errors(path, tuple(np.shape(leaf)), spec, self.mesh))
            return spec

        return map_arrays(one, tree), errors

    def specs(self, tree: Any) -> Any:
        """The ``PartitionSpec`` of every array leaf; raises ``ValueError`` listing all errors.
        Rules that match no leaf are warned about, once per plan (see
        [`notes`][shardax.Plan.notes])."""
        self._warn_unmatched(tree)
        specs, errors = self.resolve(tree)
        if errors:
            raise ValueError(
                f"plan {self.name!r} cannot shard {len(errors)} leaf/leaves:\n" + "\n".join(errors)
            )
        return specs

    def __call__(self, tree: Any) -> Any:
        """The ``NamedSharding`` of every array leaf; other leaves pass through. Rules
        that match no leaf are warned about, once per plan (see [`notes`][shardax.Plan.notes])."""
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s) if isinstance(s, PartitionSpec) else s,
            self.specs(tree),
            is_leaf=lambda s: isinstance(s, PartitionSpec),
        )


def as_plan(name: str, plan: Any) -> Any:
    """``plan`` if it is a shardax plan (or any callable from a tree to its shardings),
    else ``TypeError`` naming ``name`` and what came."""
    if callable(plan) and not isinstance(plan, Sharding | Mesh):
        return plan
    hint = ""
    if isinstance(plan, Sharding):
        hint = ". To place every leaf with one sharding use jax.device_put or sx.distribute_batch"
    raise TypeError(
        f"{name} must be a shardax Plan such as sx.replicate(mesh), sx.fsdp(mesh) or "
        f"sx.rules(mesh, ...), got {type(plan).__name__} {plan!r}{hint}"
    )


def check_plan_mesh(plan: Any, mesh: Mesh, whose: str = "", what: str | None = None) -> None:
    """``ValueError`` when ``plan`` (anything with a ``mesh``; without one, any mesh's) is
    over another mesh than ``mesh``, ``whose`` (``"the step's "``) that mesh; ``what``
    names the plan (default: ``plan 'name'``).

    >>> check_plan_mesh(sx.fsdp(mesh), mesh)  # the same mesh: nothing to say
    """
    plan_mesh = getattr(plan, "mesh", mesh)
    if plan_mesh != mesh:
        what = what or f"plan {getattr(plan, 'name', plan)!r}"
        raise ValueError(
            f"{what} is over mesh {dict(plan_mesh.shape)}, not {whose}mesh "
            f"{dict(mesh.shape)}; build both from the same mesh"
        )


@public("sx.replicate")
def replicate(mesh: Mesh) -> Plan:
    """Every leaf is copied whole onto every device of ``mesh``.

    >>> sx.replicate(mesh).specs({"w": np.ones(3)})
    {'w': P()}
    """
    check_mesh("mesh", mesh)
    return Plan(mesh, lambda path, shape: PartitionSpec(), "replicate")


def axis_size(mesh: Mesh, axis: AxisNames) -> int:
    """The number of devices along ``axis`` (a name or a tuple of names) of ``mesh``."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ValueError(
            f"axis {axis!r}: {missing} not in the mesh, whose axes are {dict(mesh.shape)}"
        )
    return math.prod(mesh.shape[n] for n in names)


def fsdp_spec(shape: tuple[int, ...], axis: AxisNames, size: int, min_size: int) -> PartitionSpec:
    """Shards the largest dimension that ``size`` divides; replicates small leaves.

    >>> fsdp_spec((7, 5), "data", 8, 1), fsdp_spec((16, 64), "data", 8, 1)
    (P(), P(None, 'data'))
    """
    if math.prod(shape) < min_size or size == 1:
        return PartitionSpec()
    # Largest dimension first; among equals, the earliest.
    for dim in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if shape[dim] % size == 0:
            entries: list[Any] = [None] * len(shape)
            entries[dim] = axis
            return PartitionSpec(*entries)
    return PartitionSpec()


DEFAULT_FSDP_MIN_SIZE = 1024


@public("sx.fsdp")
def fsdp(mesh: Mesh, axis: AxisNames = DATA_AXIS, min_size: int = DEFAULT_FSDP_MIN_SIZE) -> Plan:
    """Fully sharded data parallelism: each leaf split on its largest divisible dimension.

    Leaves with fewer than ``min_size`` elements, and leaves with no dimension that
    the axis size divides, are replicated.
    """
    check_mesh("mesh", mesh)
    min_size = as_count("min_size", min_size, minimum=0)
    size = axis_size(mesh, axis)
    return Plan(mesh, lambda path, shape: fsdp_spec(shape, axis, size, min_size), "fsdp")


@public("sx.plan.fsdp_over")
def fsdp_over(
    plan: Plan, axis: AxisNames = DATA_AXIS, min_size: int = DEFAULT_FSDP_MIN_SIZE
) -> Plan:
    """FSDP on top of ``plan`` (e.g. tensor-parallel rules): each leaf keeps ``plan``'s
    spec, and the largest of the dimensions it leaves unsplit that ``axis`` divides is
    split over ``axis`` too (leaves under ``min_size`` elements keep ``plan``'s spec).

    >>> mesh = sx.make_mesh({"data": 4, "model": 2})
    >>> tp = sx.rules(mesh, [("w", P(None, "model"))])
    >>> sx.plan.fsdp_over(tp, min_size=1).specs({"w": np.zeros((64, 16))})["w"]
    P('data', 'model')
    """
    size = axis_size(plan.mesh, axis)

    def spec_fn(path: str, shape: tuple[int, ...]) -> PartitionSpec:
        base = plan.spec_fn(path, shape)
        entries = list(base) + [None] * (len(shape) - len(base))
        if math.prod(shape) < min_size:
            return base
        free = [d for d, e in enumerate(entries) if e is None]
        extra = fsdp_spec(tuple(shape[d] for d in free), axis, size, 1)
        if not extra:
            return base
        for d, e in zip(free, extra, strict=True):
            entries[d] = entries[d] if e is None else e
        return PartitionSpec(*entries)

    return Plan(plan.mesh, spec_fn, f"fsdp+{plan.name}")


@public("sx.shard")
def shard(tree: Any, plan: Plan) -> Any:
    """Places every array leaf of ``tree`` with ``plan``; other leaves pass through.

    >>> state = sx.shard({"w": np.ones((8, 4))}, sx.fsdp(mesh, min_size=1))
    >>> state["w"].sharding.spec
    P('data', None)
    """
    shardings = as_plan("plan", plan)(tree)
    return map_arrays(lambda _, x, s: device_put_global(x, s), tree, shardings)
