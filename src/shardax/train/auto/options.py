"""The options of the search: what [`auto_plan`][shardax.auto_plan] and
[`search_plans`][shardax.search_plans] may rank on one mesh (the plans, the microbatch counts, the
step's settings), each checked before anything compiles.

>>> mesh = sx.make_mesh({"data": 8})
>>> list(candidate_plans(mesh))
['replicate', 'zero1', 'zero2', 'fsdp']
>>> check_accumulate((4, 1, 2), mesh, "data", {"x": jnp.zeros((64, 3))})
(1, 2, 4)
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardax.checks import as_count, as_float, check_mesh, expect_type, public
from shardax.mesh.axes import DATA_AXIS, STAGE_AXIS
from shardax.plan.core import (
    DEFAULT_FSDP_MIN_SIZE,
    Plan,
    axis_size,
    check_plan_mesh,
    fsdp,
    fsdp_over,
)
from shardax.plan.follow import FollowParams, follow_params
from shardax.plan.named import MESH_PLANS
from shardax.plan.regex import Rule, check_rules, rules
from shardax.plan.tree import is_array
from shardax.train.config import StepConfig
from shardax.train.loss import check_loss_fn

Rules = Sequence[Rule] | Plan | None


@public("sx.AutoPlanOptions")
@dataclasses.dataclass(frozen=True)
class AutoPlanOptions:
    """``make_train_step(..., plan=sx.AutoPlanOptions(...))``: [`auto_plan`][shardax.auto_plan]'s
    options for the plan the first ``step(state, batch)`` picks (``plan="auto"`` is
    ``sx.AutoPlanOptions()``).

    >>> stages = sx.make_mesh({"data": 2, "stage": 4})
    >>> auto = sx.AutoPlanOptions(pipeline_rules=[(r"blocks", P("stage"))])
    >>> step = sx.make_train_step(loss_fn, mesh=stages, plan=auto)
    >>> step.plan is None  # picked on the first step(state, batch)
    True
    """

    device_memory: float | None = None
    min_size: int = DEFAULT_FSDP_MIN_SIZE
    tp_rules: Rules = None
    pipeline_rules: Rules = None
    stage_axis: str = STAGE_AXIS

    def __post_init__(self) -> None:
        checked = check_options(
            self.device_memory, self.min_size, self.tp_rules, self.pipeline_rules, self.stage_axis
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    def check(self, mesh: Mesh) -> None:
        """Raises ValueError when ``mesh`` cannot hold the candidates these options ask
        for (``pipeline_rules`` without ``stage_axis``), before anything compiles."""
        check_mesh("mesh", mesh)
        check_stage_axis(mesh, self.pipeline_rules, self.stage_axis)


def check_options(
    device_memory: Any,
    min_size: Any,
    tp_rules: Any,
    pipeline_rules: Any,
    stage_axis: Any,
) -> dict[str, Any]:
    """The options of [`auto_plan`][shardax.auto_plan] checked, NumPy numbers as Python
    ones; errors name the option, the rule and the value received."""
    if device_memory is not None:
        try:
            device_memory = as_float("device_memory", device_memory, above=0)
        except ValueError as e:
            raise ValueError(f"{e} (bytes per device, e.g. 80 * 2**30, or None)") from None
    for name, given in (("tp_rules", tp_rules), ("pipeline_rules", pipeline_rules)):
        if given is not None and not isinstance(given, Plan):
            check_rules(f"{name} (or a Plan, or None)", given)
    return {
        "device_memory": device_memory,
        "min_size": as_count("min_size", min_size, minimum=0),
        "stage_axis": expect_type("stage_axis", stage_axis, str, "a mesh axis name"),
    }


def check_candidates(
    mesh: Mesh, candidates: Any, known: dict[str, FollowParams]
) -> dict[str, FollowParams]:
    """``candidates`` as plans the step can use: each value the name of one of the
    ``known`` plans (renamed to its key) or a shardax Plan over ``mesh`` (the optimizer
    state made to follow the params, as ``make_train_step`` does)."""
    expect_type("candidates", candidates, Mapping, "a dict {name: plan} or None")
    if not candidates:
        raise ValueError("candidates is empty; pass None for the default plans")
    plans: dict[str, FollowParams] = {}
    for name, plan in candidates.items():
        expect_type("each candidates key", name, str, "a name (str)")
        where = f"candidates[{name!r}]"
        if isinstance(plan, str):
            if plan not in known:
                raise ValueError(
                    f"{where} must be one of the known plans {list(known)} or a shardax Plan "
                    f"such as sx.fsdp(mesh), got {plan!r}"
                )
            plan = dataclasses.replace(known[plan], name=name)
        elif isinstance(plan, Plan):
            check_plan_mesh(plan, mesh, "auto_plan's ", f"{where}: plan {plan.name!r}")
            plan = follow_params(plan)
        else:
            expect_type(
                where, plan, Plan, f"a known plan's name ({', '.join(known)}) or a shardax Plan"
            )
        plans[name] = plan
    return plans


def check_stage_axis(mesh: Mesh, pipeline_rules: Rules, stage_axis: str) -> None:
    """``pipeline_rules`` need ``stage_axis`` in ``mesh`` with size > 1."""
    if pipeline_rules and mesh.shape.get(stage_axis, 1) < 2:
        raise ValueError(
            f"pipeline_rules split the stacked layers over mesh axis "
            f"{stage_axis!r} (stage_axis), which must be in the mesh with size > 1; the "
            f"mesh's axes are {dict(mesh.shape)}. Add it (e.g. sx.make_mesh({{'data': -1, "
            f"{stage_axis!r}: 4}})) or drop pipeline_rules"
        )


def _as_plan(mesh: Mesh, given: Sequence[Rule] | Plan) -> Plan:
    return given if isinstance(given, Plan) else rules(mesh, given)


def candidate_plans(
    mesh: Mesh,
    axis: str | tuple[str, ...] = DATA_AXIS,
    min_size: int = DEFAULT_FSDP_MIN_SIZE,
    tp_rules: Rules = None,
    pipeline_rules: Rules = None,
    stage_axis: str = STAGE_AXIS,
) -> dict[str, FollowParams]:
    """The mesh's own plans (``MESH_PLANS`` of ``shardax.plan.named``: replicate,
    zero1, zero2 and fsdp) over ``axis``; ``hsdp`` (fsdp over the last of
    several data axes, replicated over the others) when ``axis`` is a tuple;
    ``fsdp+tp`` (``tp_rules``, regex rules or a plan such as ``sx.from_nnx``'s, and fsdp
    over ``axis`` on the dimensions they leave unsplit: [`fsdp_over`][shardax.plan.fsdp_over])
    when rules are given; and ``pipeline`` (``pipeline_rules``, e.g. ``[(r"blocks",
    P("stage"))]`` or ``gpt.plan(mesh, model, "pipeline")``) when given, which needs
    ``stage_axis`` in the mesh with size > 1.

    The pipeline candidate is the rules alone: the stacked layers split over
    ``stage_axis``, everything they leave unsplit (embeddings, head, the layers' other
    dimensions) replicated over the data axis, i.e. pipeline × data parallelism, as
    GPipe and Megatron compose them. FSDP over the data axis on top would gather each
    stage's weights inside the schedule's loop, on every microbatch tick; pass
    ``candidates=`` with ``sx.plan.fsdp_over(...)`` of the rules to measure that too.
    """
    check_stage_axis(mesh, pipeline_rules, stage_axis)
    plans: dict[str, Plan] = {}
    for name, build in MESH_PLANS.items():  # replicate, zero1, zero2, fsdp
        plan = build(mesh, axis, min_size)
        plans[name] = follow_params(plan)
    if not isinstance(axis, str) and len(axis) > 1:
        plans["hsdp"] = follow_params(fsdp(mesh, axis[-1], min_size))
    if tp_rules:
        tp = _as_plan(mesh, tp_rules)
        plans["fsdp+tp"] = follow_params(fsdp_over(tp, axis, min_size))
    if pipeline_rules:
        plans["pipeline"] = follow_params(_as_plan(mesh, pipeline_rules))
    for name, plan in plans.items():
        plans[name] = dataclasses.replace(plan, name=name)
    return plans


Counts = int | Sequence[int]


def check_accumulate(accumulate: Any, mesh: Mesh, axis: Any, batch: Any) -> tuple[int, ...]:
    """``accumulate`` (a count or a sequence of counts) as ascending distinct counts,
    each one that splits ``batch``'s rows into microbatches even over the data ``axis``
    (rows divisible by the axis size × the count); errors name the count and the rule."""
    many = isinstance(accumulate, Sequence) and not isinstance(accumulate, str)
    if many:
        if not accumulate:
            raise ValueError("accumulate is an empty sequence; give counts such as (1, 2, 4)")
        counts = tuple(sorted({as_count(f"accumulate[{i}]", k) for i, k in enumerate(accumulate)}))
    else:
        counts = (as_count("accumulate (a count, or a sequence of counts)", accumulate),)
    if batch is None:
        if many and counts != (1,):
            raise ValueError(
                f"accumulate={tuple(accumulate)!r} ranks microbatch counts of the train "
                "step; pass loss_fn and batch, or one count"
            )
        return counts
    rows = {x.shape[0] for x in jax.tree.leaves(batch) if is_array(x) and x.ndim}
    devices = axis_size(mesh, axis)
    for k in counts:
        bad = [r for r in sorted(rows) if r % (devices * k)]
        if bad:
            given = tuple(accumulate) if many else accumulate
            raise ValueError(
                f"accumulate={given!r}: each count must split the batch's {bad[0]} rows into "
                f"microbatches that divide evenly over the data axis {axis!r} of size "
                f"{devices} (rows divisible by {devices} × count); {k} does not "
                f"({bad[0]} % {devices * k} = {bad[0] % (devices * k)})"
            )
    return counts


def step_config(mesh: Mesh, config: Any, axis: Any, precision: Any) -> StepConfig:
    """The settings each candidate's step is compiled with: ``config``, checked against
    ``mesh``, or the one ``axis`` and ``precision`` make (not both)."""
    if config is None:
        return StepConfig(
            mesh=mesh,
            data_axis=DATA_AXIS if axis is None else axis,
            precision="fp32" if precision is None else precision,
        )
    if not isinstance(config, StepConfig):
        raise TypeError(
            f"config must be a sx.train.StepConfig or None, got {type(config).__name__}"
        )
    given = [n for n, v in (("axis", axis), ("precision", precision)) if v is not None]
    if given:
        raise TypeError(
            f"pass the step's settings in config or as keywords, not both; got config and "
            f"{', '.join(given)} (config.data_axis and config.precision are used)"
        )
    check_searchable(config, "auto_plan")
    check_plan_mesh(config, mesh, "auto_plan's ", "config")
    return config


def check_auto_step(loss_fn: Callable[..., Any], config: StepConfig) -> StepConfig:
    """``config`` as the settings of a ``plan="auto"`` step for ``loss_fn``: mode
    ``"jit"`` (the plans are sharded), no plan yet, and a ``loss_fn`` the step can call
    (``shardax.train.loss.check_loss_fn``); nothing is built."""
    check_searchable(config, "plan='auto'", given="")
    check_loss_fn(loss_fn, config.batch_spec)
    return config


def check_searchable(config: StepConfig, who: str, given: str = "config.") -> None:
    """Refuses by name the settings a search cannot compile its candidates with: a plan
    (``who`` picks it) or a mode other than ``"jit"`` (the plans are sharded, which only
    jit runs). ``given``: how the user passed the settings (``"config."``, or ``""`` for
    a step's keywords)."""
    fix = "; build it with plan=None and mode='jit'" if given else ""
    if config.plan is not None:
        raise ValueError(f"{given}plan is {config.plan_name!r}, but {who} picks the plan{fix}")
    if config.mode != "jit":
        raise ValueError(
            f"{who} picks among sharded plans, which only mode='jit' runs; got "
            f"{given}mode={config.mode!r}{fix}"
        )


# --- the checks auto_plan and search_plans share (one home) ----------------------------


def check_search_loss(loss_fn: Any) -> None:
    """``loss_fn`` as the search compiles it: a function called ``loss_fn(model, batch)``
    (``TypeError`` naming what it takes otherwise)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"loss_fn must take (model, batch), as the step calls it, got "
            f"{getattr(loss_fn, '__qualname__', loss_fn)!s}{signature}"
        ) from None


def _rule_axes(given: Rules) -> set[str]:
    """The mesh axes regex rules (or a plan's specs, by its mesh) name."""
    if given is None:
        return set()
    if isinstance(given, Plan):
        return set(given.mesh.axis_names)
    axes: set[str] = set()
    for _, spec in given:
        for entry in spec if isinstance(spec, P) else ():
            axes.update((entry,) if isinstance(entry, str) else entry or ())
    return axes


def check_rules_meshes(
    meshes: Sequence[Mesh], tp_rules: Rules, pipeline_rules: Rules, stage_axis: str
) -> None:
    """The rules have a mesh to act on: ``tp_rules`` name only axes some mesh has,
    ``pipeline_rules`` need a mesh with ``stage_axis`` of size > 1; else ``ValueError``
    (rules that no mesh can use would be dropped without a word)."""
    shapes = [dict(m.shape) for m in meshes]
    where = f"the mesh {shapes[0]}" if len(shapes) == 1 else f"any searched mesh ({shapes})"
    if tp_rules is not None and not isinstance(tp_rules, Plan):
        missing = sorted(_rule_axes(tp_rules) - {a for m in meshes for a in m.axis_names})
        if missing:
            raise ValueError(
                f"tp_rules name mesh axis {', '.join(map(repr, missing))}, which is not in "
                f"{where}; add it to a mesh (e.g. {{'data': -1, {missing[0]!r}: 2}}) or "
                "drop tp_rules"
            )
    if len(meshes) == 1:
        check_stage_axis(meshes[0], pipeline_rules, stage_axis)
    elif pipeline_rules and all(m.shape.get(stage_axis, 1) < 2 for m in meshes):
        raise ValueError(
            f"pipeline_rules split the stacked layers over mesh axis {stage_axis!r} "
            f"(stage_axis), which is not in {where} with size > 1. Add a mesh with it "
            f"(e.g. {{'data': -1, {stage_axis!r}: 4}}) or drop pipeline_rules"
        )


def check_pipeline_placed(plans: Mapping[str, Plan], state: Any, stage_axis: str) -> None:
    """The ``pipeline`` candidate (``pipeline_rules``) splits some leaf of ``state`` over
    ``stage_axis``; else ``ValueError`` (its rules match no stacked layer)."""
    plan = plans.get("pipeline")
    if plan is None:
        return
    for spec in jax.tree.leaves(plan.specs(state), is_leaf=lambda x: isinstance(x, P)):
        for entry in spec:
            if stage_axis in ((entry,) if isinstance(entry, str) else entry or ()):
                return
    raise ValueError(
        f"pipeline_rules place no leaf of the state over mesh axis {stage_axis!r} "
        f"(stage_axis); give rules matching the stacked layers, e.g. "
        f"[(r'blocks', P({stage_axis!r}))]"
    )


def check_one_platform(meshes: Sequence[Mesh]) -> None:
    """The searched meshes are of one kind of device (their candidates are ranked
    against one memory budget and one clock); else ``ValueError`` naming the kinds."""
    kinds = {}
    for mesh in meshes:
        device = mesh.devices.flat[0]
        kinds.setdefault(
            f"{device.platform}:{getattr(device, 'device_kind', '?')}", dict(mesh.shape)
        )
    if len(kinds) > 1:
        raise ValueError(
            "meshes must all be of one kind of device, to be ranked against one memory "
            f"budget and step time; got {', '.join(f'{k} (mesh {v})' for k, v in kinds.items())}. "
            "Search each kind in its own SearchSpace (devices=sx.target(...) for a target)"
        )
