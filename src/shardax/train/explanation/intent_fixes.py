"""Placement fixes proven by compiling them: for each way a step's state is split fewer
ways than its plan meant (``placement``), the change that splits it as meant, compiled
(``sx.estimate``: its peak and predicted time), and kept only where the new placement
shows the problem gone:

- a mesh axis of size > 1 that splits no parameter byte (a 2-axis mesh whose FSDP uses one
  axis): FSDP over that axis too, on top of the plan (``sx.plan.fsdp_over``);
- a rule of ``sx.rules`` whose regex matches no leaf (a misspelt path): the rule with the
  nearest path of a leaf that no rule gives its spec;
- a parameter with no dimension the axis divides (an embedding of 1001 rows on 8 devices):
  that dimension padded to a multiple of the axis, the cheapest dimension first, as GPT-2's
  vocabulary of 50257 is padded to 50304; the model must leave the extra rows unused.

A change the step does not compile with (a padded width the next layer refuses) is not
proposed. A plan that is not a plain ``sx.Plan`` (the ZeRO plans, whose optimizer state
follows a mirror plan) gets no axis fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any

import jax

from shardax.cost.estimation import estimate
from shardax.cost.remats import stderr_captured
from shardax.plan.core import Plan, array_paths, fsdp_over
from shardax.plan.regex import rules
from shardax.train.explanation.fixes import Fix
from shardax.train.explanation.placement import Placement, placement
from shardax.train.make import make_train_step

PAD_LIMIT = 0.25
"""The largest share of a leaf's elements that padding it may add (more is no fix)."""
PADDED = 3
"""The parameters, largest first, that a padding is tried for (each is one compile)."""


def placement_fixes(
    step: Any, state: Any, batch: Any, where: Placement
) -> tuple[tuple[Fix, ...], tuple[str, ...]]:
    """The compiled changes that split ``state`` as ``step``'s plan meant (see the module),
    and a note for each change tried that did not compile or did not help; ``((), ())``
    where the placement is as meant or the step is not a ``make_train_step`` step."""
    config = getattr(step, "config", None)
    plan = getattr(config, "plan", None)  # the user's own (the step's state_plan wraps it)
    if where.ok or not isinstance(plan, Plan) or getattr(step, "loss_fn", None) is None:
        return (), ()
    out: list[Fix | str] = []
    if where.idle_axes and type(plan) is Plan:
        axis = where.idle_axes[0] if len(where.idle_axes) == 1 else where.idle_axes
        new = fsdp_over(plan, axis=axis)
        code = f"sx.plan.fsdp_over(plan, axis={axis!r})  # plan: your {plan.name!r} plan"
        name = f"FSDP over {'/'.join(where.idle_axes)} too"
        out.append(_proven(step, batch, new, state, name, code, _uses(where.idle_axes)))
    for rule, fixed in _nearest_rules(plan, state):
        new = rules(plan.mesh, fixed, plan.rules_given[1])
        code = f"sx.rules(mesh, [..., {fixed[rule]!r}, ...])  # was rules[{rule}]"
        name = f"rules[{rule}] matching {fixed[rule][0]!r}"
        out.append(_proven(step, batch, new, state, name, code, _no_note(rule)))
    largest = sorted((x for x in where.leaves if x.kind == "parameter"), key=lambda x: -x.bytes)
    for leaf in largest[:PADDED]:
        padded = _padded(leaf)
        if padded is None:
            continue
        grown = _with_leaf(state, leaf.path, padded)
        if grown is None:
            continue
        name = f"pad {leaf.path} to {padded} (was {leaf.shape})"
        code = f"pad {leaf.path} to {padded}: the model leaves the extra entries unused"
        out.append(_proven(step, batch, plan, grown, name, code, _split(leaf.path, leaf.meant)))
    fixes = tuple(f for f in out if isinstance(f, Fix))
    return fixes, tuple(f for f in out if isinstance(f, str))


def _proven(
    step: Any,
    batch: Any,
    plan: Any,
    new_state: Any,
    name: str,
    code: str,
    gone: Any,
) -> Fix | str:
    """The ``Fix`` where the step compiles with ``plan`` on ``new_state`` and ``gone``
    holds of the new placement, else the note saying which did not."""
    config = step.config
    try:
        fixed = make_train_step(step.loss_fn, config=dataclasses.replace(config, plan=plan))
        with stderr_captured():  # the partitioner's log, read for the step's own report
            report = estimate(fixed, new_state, batch)
    except Exception as e:  # the step does not compile with the change: no fix
        said = (str(e).strip().splitlines() or [""])[0][:300]
        return f"placement fix {name!r} was tried and does not compile: {type(e).__name__}: {said}"
    if not gone(placement(new_state, fixed.state_plan)):
        return f"placement fix {name!r} was tried and compiles, but leaves the placement short"
    peak = int(report.memory["peak"])
    return Fix(
        name,
        plan.name,
        config.accumulate,
        None,
        peak,
        report.predicted_s,
        report.interval_s,
        "",
        code,
    )


def _uses(axes: tuple[str, ...]) -> Any:
    return lambda where: not set(axes) & set(where.idle_axes)


def _no_note(rule: int) -> Any:
    return lambda where: not any(f"rules[{rule}]" in n for n in where.notes)


def _split(path: str, meant: int) -> Any:
    return lambda where: all(leaf.path != path or leaf.ways >= meant for leaf in where.leaves)


def _nearest_rules(plan: Any, state: Any) -> list[tuple[int, list[Any]]]:
    """``[(i, rule list with rules[i] fixed)]`` for each rule of a ``sx.rules`` plan that
    matches no path, fixed to the nearest path tail (as many components as the regex has)
    of a leaf that no rule matches, where one is near (difflib's ratio >= 0.6)."""
    given = getattr(plan, "rules_given", None)
    if given is None:
        return []
    rule_list = list(given[0])
    paths = [p for p, _ in array_paths(state)]
    patterns = [re.compile(r) for r, _ in rule_list]
    free = [p for p in paths if not any(c.search(p) for c in patterns)]
    out = []
    for i, (regex, spec) in enumerate(rule_list):
        if any(patterns[i].search(p) for p in paths):
            continue
        depth = regex.count("/") + 1
        tails = sorted({"/".join(p.split("/")[-depth:]) for p in free})
        near = difflib.get_close_matches(regex, tails, n=1, cutoff=0.6)
        if near:
            fixed = [*rule_list[:i], (re.escape(near[0]), spec), *rule_list[i + 1 :]]
            out.append((i, fixed))
    return out


def _padded(leaf: Any) -> tuple[int, ...] | None:
    """``leaf.shape`` with its cheapest dimension padded to a multiple of ``leaf.meant``
    ways, or None where that adds more than ``PAD_LIMIT`` of its elements."""
    if not leaf.why.startswith("no dimension of"):
        return None
    n, shape = leaf.meant, leaf.shape
    grown = [math.ceil(d / n) * n for d in shape]
    dim = min(range(len(shape)), key=lambda d: (grown[d] - shape[d]) / shape[d])
    if (grown[dim] - shape[dim]) / shape[dim] > PAD_LIMIT:
        return None
    return tuple(grown[dim] if d == dim else s for d, s in enumerate(shape))


def _with_leaf(state: Any, path: str, shape: tuple[int, ...]) -> Any:
    """``state`` (abstract) with the parameter at ``path`` grown to ``shape`` and the
    optimizer state made again for the new parameters (None: not a ``TrainState``)."""
    if not hasattr(state, "tx") or not hasattr(state, "params"):
        return None

    def grow(p: Any, x: Any) -> Any:
        if ("params" + jax.tree_util.keystr(p)) == path.removeprefix("."):
            return jax.ShapeDtypeStruct(shape, x.dtype)
        return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x

    params = jax.tree_util.tree_map_with_path(grow, state.params)
    return state.replace(params=params, opt_state=jax.eval_shape(state.tx.init, params))
