"""Tensor-parallel plans from regular expressions over leaf paths.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 4, "model": 2})
>>> plan = sx.rules(mesh, [(r"layers/1/w$", P(None, "model")), (r"layers/2/w$", P("model"))])
>>> plan.specs({"layers": [{"w": np.zeros((8, 8))}] * 3})["layers"][1]["w"]
P(None, 'model')
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from shardax.checks import check_mesh, public, received
from shardax.plan.core import Leaves, Plan

Rule = tuple[str, PartitionSpec]


def _compile(rule_list: Sequence[Rule]) -> list[tuple[re.Pattern[str], PartitionSpec]]:
    compiled = []
    for i, rule in enumerate(rule_list):
        if not (isinstance(rule, tuple | list) and len(rule) == 2):
            raise ValueError(f"rules[{i}] must be a (regex, PartitionSpec) pair, got {rule!r}")
        pattern, spec = rule
        if not isinstance(spec, PartitionSpec):
            raise ValueError(
                f"rules[{i}] ({pattern!r}): the spec must be a jax.sharding.PartitionSpec, "
                f"got {spec!r}"
            )
        try:
            compiled.append((re.compile(pattern), spec))
        except (re.error, TypeError) as e:
            raise ValueError(
                f"rules[{i}]: {pattern!r} is not a valid regular expression: {e}"
            ) from e
    return compiled


def check_rules(name: str, rule_list: Any) -> list[tuple[re.Pattern[str], PartitionSpec]]:
    """``rule_list`` compiled: a list of ``(regex, PartitionSpec)`` pairs, else an error
    naming ``name``, the rule at fault and what it is."""
    if isinstance(rule_list, str | bytes) or not isinstance(rule_list, Sequence):
        raise TypeError(
            f"{name} must be a list of (regex, PartitionSpec) pairs, got {received(rule_list)}"
        )
    try:
        return _compile(rule_list)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


@public("sx.rules")
def rules(
    mesh: Mesh,
    rule_list: Sequence[Rule],
    default: PartitionSpec | Plan | None = None,
) -> Plan:
    """A plan from ``(regex, PartitionSpec)`` pairs; the first that matches a leaf wins.

    Each regex is tried with ``re.search`` on the leaf's path joined by "/" (for
    example ``params/layers/0/kernel``; NNX variables end in ``/value``), so it may match
    anywhere in the path: anchor it with ``^``/``$`` to match a whole path. Leaves no
    rule matches get ``default``: a ``PartitionSpec``, another plan on the same mesh
    (e.g. ``fsdp(mesh)``), or ``None`` to replicate. A matched spec that cannot shard its
    leaf is an error, never skipped. Rank-0 leaves are always replicated.
    """
    check_mesh("mesh", mesh)
    compiled = check_rules("rule_list", rule_list)
    if isinstance(default, Plan) and default.mesh != mesh:
        raise ValueError(f"default plan {default.name!r} is on another mesh than the rules")
    if default is not None and not isinstance(default, PartitionSpec | Plan):
        raise ValueError(
            f"default must be a PartitionSpec, a Plan or None (replicate), got {default!r}"
        )

    def spec_fn(path: str, shape: tuple[int, ...]) -> PartitionSpec:
        for pattern, spec in compiled:
            if pattern.search(path):
                return spec
        if isinstance(default, Plan):
            return default.spec_fn(path, shape)
        return PartitionSpec() if default is None else default

    def unmatched(leaves: Leaves) -> dict[str, str]:
        notes = unused_rules(compiled, leaves)
        if isinstance(default, Plan) and default.unmatched:
            notes.update({f"default {k}": v for k, v in default.unmatched(leaves).items()})
        return notes

    given = (tuple(rule_list), default)
    return Plan(mesh, spec_fn, "rules", unmatched=unmatched, rules_given=given)


def unused_rules(
    compiled: list[tuple[re.Pattern[str], PartitionSpec]], leaves: Leaves
) -> dict[str, str]:
    """A message for every rule that gives no leaf its spec: it matches no path, or
    every path it matches is taken by an earlier rule (first match wins)."""
    used = set()
    for path, _ in leaves:
        first = next((i for i, (pattern, _) in enumerate(compiled) if pattern.search(path)), None)
        used.add(first)
    paths = [p for p, _ in leaves]
    shown = ", ".join(map(repr, paths[:8])) + (
        f", ... ({len(paths)} in all)" if len(paths) > 8 else ""
    )
    notes = {}
    for i, (pattern, spec) in enumerate(compiled):
        if i in used:
            continue
        if any(pattern.search(p) for p in paths):
            why = (
                "every leaf it matches is taken by an earlier rule (the first match wins); "
                "reorder the rules or drop this one"
            )
        else:
            why = (
                "its regex matches no leaf path, so the leaves it was meant for get the "
                f"default; check the regex against the paths: {shown}"
            )
        notes[f"rules[{i}]"] = (
            f"sx.rules: rules[{i}] ({pattern.pattern!r}, {spec}) gives no leaf its spec: {why}"
        )
    return notes
