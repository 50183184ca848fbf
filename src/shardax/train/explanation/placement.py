"""Placement against intent: how many ways the plan split each parameter and optimizer byte,
against what it meant, and why each leaf left whole or less split is so.

The plan's intent is read from the plan itself: the most ways it splits any leaf of the
kind (parameters, optimizer state), and for each leaf the spec the plan gives the same
path at a shape every axis divides and no size threshold refuses (its shape times the
device count). A leaf below that is named with its reason: under the plan's ``min_size``, no
dimension the axis divides, its axes of size 1, or the plan's own rule for it (with the
rules that match nothing). A mesh axis of size > 1 that splits no byte is named too (a
2-axis mesh whose FSDP uses one axis).

>>> mesh = sx.make_mesh({"data": 8})
>>> state = {"params": {"w": jax.ShapeDtypeStruct((64, 16), jnp.float32),
...                     "b": jax.ShapeDtypeStruct((7,), jnp.float32)}}
>>> report = placement(state, sx.fsdp(mesh, min_size=1))
>>> report.ways["parameter"], [(leaf.path, leaf.why) for leaf in report.leaves]
({1: 28, 8: 4096}, [("['params']['b']", 'no dimension of (7,) is divisible by data (8)')])
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Group

from shardax._format import format_bytes, rich_text, titled_table
from shardax.cost.buffers import input_kind
from shardax.plan.tree import is_array
from shardax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A leaf split fewer ways than the plan meant: its path, kind, shape, spec, ways,
    the ways meant, its bytes (global) and why."""

    path: str
    kind: str
    shape: tuple[int, ...]
    spec: str
    ways: int
    meant: int
    bytes: int
    why: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Bytes (global) per kind split ``n`` ways (``ways``: ``{kind: {n: bytes}}``), the
    ways the plan meant per kind, the leaves below it, the mesh axes that split nothing
    and the plan's notes (rules that match no leaf)."""

    plan: str
    mesh: dict[str, int]
    ways: dict[str, dict[int, int]]
    meant: dict[str, int]
    leaves: tuple[Leaf, ...]
    idle_axes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def share(self, kind: str) -> dict[int, float]:
        """The share of ``kind``'s bytes split ``n`` ways, for each ``n``."""
        total = sum(self.ways.get(kind, {}).values())
        return {n: b / total for n, b in self.ways.get(kind, {}).items()} if total else {}

    @property
    def ok(self) -> bool:
        """No leaf below the plan's intent, no idle axis, no unmatched rule."""
        return not (self.leaves or self.idle_axes or self.notes)

    def summary(self) -> str:
        """One line: each kind's share of bytes split as meant, the leaves below it and the
        idle axes (``sx.verify``'s report and ``shardax train``'s run summary)."""
        kinds = []
        for kind, meant in self.meant.items():
            kinds.append(f"{self.share(kind).get(meant, 0.0):.1%} of {kind} bytes {meant}-way")
        text = f"placement ({self.plan}): " + (", ".join(kinds) or "no parameter")
        if self.leaves:
            first = self.leaves[0]
            text += (
                f"; {len(self.leaves)} leaves split fewer ways than meant (first "
                f"{first.path}: {first.why})"
            )
        if self.idle_axes:
            text += f"; axes splitting nothing: {', '.join(self.idle_axes)}"
        if self.notes:
            text += f"; {self.notes[0]}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {
            "plan": self.plan,
            "summary": self.summary(),
            "mesh": self.mesh,
            "ok": self.ok,
            "ways": {k: {str(n): b for n, b in v.items()} for k, v in self.ways.items()},
            "meant": self.meant,
            "leaves": [leaf.to_dict() for leaf in self.leaves],
            "idle_axes": list(self.idle_axes),
            "notes": list(self.notes),
        }

    def __rich__(self) -> Any:
        table = titled_table(f"placement against intent: plan {self.plan}, mesh {self.mesh}")
        table.add_column("state")
        table.add_column("split n ways: share of its bytes (global)")
        table.add_column("meant", justify="right")
        for kind, ways in self.ways.items():
            shares = self.share(kind)
            text = ", ".join(
                f"{n}: {shares[n]:.1%} ({format_bytes(b)})"
                for n, b in sorted(ways.items(), reverse=True)
            )
            table.add_row(kind, text, str(self.meant.get(kind, 1)))
        parts: list[Any] = [table]
        if self.leaves:
            below = titled_table("leaves split fewer ways than the plan meant")
            for col in ("leaf", "shape", "spec", "ways", "why"):
                below.add_column(col, justify="right" if col == "ways" else "left")
            for leaf in self.leaves:
                below.add_row(
                    leaf.path, str(leaf.shape), leaf.spec, f"{leaf.ways}/{leaf.meant}", leaf.why
                )
            parts.append(below)
        for axis in self.idle_axes:
            parts.append(
                f"mesh axis {axis!r} ({self.mesh[axis]}) splits no parameter or "
                "optimizer byte: they are copied along it (HSDP's replica axis is "
                "meant so; FSDP over it would be fsdp(mesh, axis=(..., "
                f"{axis!r})))"
            )
        parts += [f"note: {n}" for n in self.notes]
        return Group(*parts)

    def __str__(self) -> str:
        return rich_text(self, width=120)


def _ways(spec: PartitionSpec, mesh: Any) -> int:
    axes = [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]
    return math.prod(int(mesh.shape[a]) for a in axes)


def _axes(spec: PartitionSpec) -> list[str]:
    return [a for e in spec for a in ((e,) if isinstance(e, str) else e or ())]


def _plan_spec(plan: Any, path: str, shape: tuple[int, ...], kind: str) -> PartitionSpec | None:
    """The spec ``plan``'s own rule gives ``path`` at ``shape`` (the mirror plan's for an
    optimizer leaf of ZeRO, and for a parameter under ``gather="forward"``), None where
    the plan has no rule to ask."""
    mirrored = kind == "optimizer state" or getattr(plan, "gathers_forward", False)
    source = getattr(plan, "mirror", None) if mirrored else None
    source = source or getattr(plan, "base", None) or plan
    spec_fn = getattr(source, "spec_fn", None)
    if spec_fn is None:
        return None
    try:
        return spec_fn(path, shape)
    except Exception:  # a rule that refuses the probe's shape: no intent read
        return None


_LARGE = 2**20  # the probe's shape: every axis divides it, and no min_size refuses it


def _why(
    plan: Any,
    path: str,
    shape: tuple[int, ...],
    spec: PartitionSpec,
    mesh: Any,
    kind: str,
    devices: int,
) -> str:
    size_one = [a for a in _axes(spec) if int(mesh.shape[a]) == 1]
    if size_one:
        return f"its axes {size_one} have size 1"
    probe = _plan_spec(plan, path, tuple(d * devices * _LARGE for d in shape), kind)
    if probe is not None and _ways(probe, mesh) > _ways(spec, mesh):
        axes = [a for a in _axes(probe) if a not in _axes(spec)]
        n = math.prod(int(mesh.shape[a]) for a in axes)
        over = "/".join(axes)
        if not any(d % n == 0 for d in shape):
            return f"no dimension of {shape} is divisible by {over} ({n})"
        return f"{math.prod(shape)} elements: under the plan's min_size"
    return f"the plan gives it {spec}"


def _pathname(path: Any) -> str:
    return jax.tree_util.keystr(path)


def placement(state: Any, plan: Any, shardings: Any = None) -> Placement:
    """The placement of ``state``'s arrays (abstract or placed) under ``plan``, against
    what ``plan`` meant (see the module). ``shardings``: the state's shardings where
    they are not the plan's (the compiled step's ``input_shardings``)."""
    mesh = plan.mesh
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(state) if is_array(x)]
    if shardings is None:
        shardings = plan(state)
    flat = [s for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
    if len(flat) != len(leaves):
        flat = [getattr(x, "sharding", None) for _, x in leaves]
    devices = int(np.prod(list(mesh.shape.values())))
    rows: list[tuple[str, str, tuple[int, ...], PartitionSpec, int, int]] = []
    for (path, leaf), sharding in zip(leaves, flat, strict=True):
        name = _pathname(path)
        kind = input_kind("state" + name)
        if kind not in ("parameter", "optimizer state") or not np.shape(leaf):
            continue
        spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
        size = math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize
        rows.append((name, kind, tuple(np.shape(leaf)), spec, _ways(spec, mesh), size))
    ways: dict[str, dict[int, int]] = {}
    for _, kind, _, _, n, size in rows:
        ways.setdefault(kind, {})
        ways[kind][n] = ways[kind].get(n, 0) + size
    meant = {kind: max(v) for kind, v in ways.items()}
    below = []
    for name, kind, shape, spec, n, size in rows:
        if n < meant[kind]:
            path = name.removeprefix(".")
            why = _why(plan, path_of(name), shape, spec, mesh, kind, devices)
            below.append(Leaf(path, kind, shape, str(spec), n, meant[kind], size, why))
    used = {a for row in rows for a in _axes(row[3])}
    idle = tuple(a for a in mesh.axis_names if int(mesh.shape[a]) > 1 and a not in used)
    if idle and not _splits_any(plan, rows):  # a replicating plan (DP) means to copy
        idle = ()
    notes = tuple(plan.notes(state)) if hasattr(plan, "notes") else ()
    return Placement(
        getattr(plan, "name", type(plan).__name__),
        {str(k): int(v) for k, v in mesh.shape.items()},
        ways,
        meant,
        tuple(below),
        idle,
        notes,
    )


def step_placement(step: Any, state: Any) -> Placement | None:
    """The placement of a ``make_train_step`` step's ``TrainState`` against its plan's
    intent (None: a step without a plan, as your own function)."""
    plan = getattr(step, "state_plan", None)
    if plan is None or not isinstance(state, TrainState) or not hasattr(plan, "mesh"):
        return None
    return placement(state, plan)


def _splits_any(plan: Any, rows: list[tuple[str, str, tuple[int, ...], Any, int, int]]) -> bool:
    """Some leaf is split by the plan, or would be at a shape every axis divides (False:
    a replicating plan, whose mesh axes are meant to copy the state)."""
    for name, kind, shape, spec, _, _ in rows:
        probe = _plan_spec(plan, path_of(name), tuple(_LARGE for _ in shape), kind)
        if _axes(spec) or (probe is not None and _axes(probe)):
            return True
    return not rows


def path_of(keystr: str) -> str:
    """A ``jax.tree_util.keystr`` path as plans see it, joined by "/".

    >>> path_of(".params['layers'][0].kernel")
    'params/layers/0/kernel'
    """
    parts = re.findall(r"\.(\w+)|\['([^']*)'\]|\[(\d+)\]", keystr)
    return "/".join(next(p for p in part if p) for part in parts)
