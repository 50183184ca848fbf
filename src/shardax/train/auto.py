"""``auto_plan``: the plan that fits and communicates least, from the compiler's own figures.

Each candidate plan's train step is compiled for abstract values (``jax.ShapeDtypeStruct``,
nothing allocated): ``memory_analysis()`` gives its bytes per device (arguments +
outputs - donated aliases + temporaries) and the HLO its collectives. Of the candidates
that fit ``device_memory``, the one whose devices send the fewest bytes per step wins
(ties: the fewest bytes per device). On devices with a datasheet (GPUs, TPUs, and the
compile-only devices of ``sx.target``), each candidate also gets a *predicted* step time
(:mod:`shardax.cost.predict`), and the fastest predicted of those that fit with 10%
headroom wins. This sits in ``train``, not ``plan``, because it
compiles the train step.

Every candidate compiles the same ``loss_fn`` (the same model), so only the placement of
the state differs. On a mesh with a ``"stage"`` axis the batch is still split over the
data axis only: a model that calls ``sx.pipeline`` runs its schedule over ``"stage"``
under every candidate, but only the ``pipeline`` candidate (``pipeline_rules``) splits the
stacked layers there; the others replicate the state over ``"stage"``, and the report's
reason says so.

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": 8})
>>> apply = lambda params, x: x @ params["w"]
>>> init = lambda: sx.TrainState.from_params({"w": jnp.zeros((1024, 64))}, apply, optax.adam(1e-3))
>>> mse = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)
>>> report = sx.auto_plan(mesh, init, loss_fn=mse, batch={"x": jnp.zeros((64, 1024))})
>>> [c.name for c in report.candidates]
['replicate', 'zero1', 'zero2', 'fsdp']
>>> print(report)  # bytes per device, collective bytes, fits, the reason  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import io
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardax.checks import as_count, as_float, as_function, check_mesh, expect_type, public
from shardax.cost.hlo import collectives
from shardax.mesh.axes import DATA_AXIS, STAGE_AXIS
from shardax.plan.core import DEFAULT_FSDP_MIN_SIZE, Plan, fsdp, fsdp_over
from shardax.plan.follow import FollowParams, follow_params
from shardax.plan.named import MESH_PLANS
from shardax.plan.regex import Rule, check_rules, rules
from shardax.plan.report import format_bytes
from shardax.plan.tree import is_array, map_arrays
from shardax.train.compiler import describe as describe_options
from shardax.train.config import StepConfig
from shardax.train.state import TrainState
from shardax.train.step import TrainStep

Rules = Sequence[Rule] | Plan | None


@public("sx.AutoPlanOptions")
@dataclasses.dataclass(frozen=True)
class AutoPlanOptions:
    """``make_train_step(..., plan=sx.AutoPlanOptions(...))``: :func:`auto_plan`'s
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
    """The options of :func:`auto_plan` checked, NumPy numbers as Python ones; errors name
    the option, the rule and the value received."""
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
            if plan.mesh != mesh:
                raise ValueError(
                    f"{where}: plan {plan.name!r} is over mesh {dict(plan.mesh.shape)}, not "
                    f"auto_plan's mesh {dict(mesh.shape)}; build both from the same mesh"
                )
            plan = plan if isinstance(plan, FollowParams) else follow_params(plan)
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


@public("sx.train.Candidate")
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled candidate: its plan and the compiler's figures, per device."""

    name: str
    plan: Plan
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    collective_bytes: float
    collectives: dict[str, int]
    fits: bool | None
    predicted_s: float | None = None
    refused: str | None = None
    """The backend's out-of-memory error where it refused to compile this candidate."""
    accumulate: int = 1
    """Its number of microbatches (``make_train_step``'s ``accumulate``)."""
    variant: str | None = None
    """The model variant's name, where :func:`auto_plan` ranked several (e.g. remat)."""
    skipped: str | None = None
    """Why it was not compiled (a cheaper candidate of its plan already fits with
    headroom); its figures are then zeros."""

    @property
    def total_bytes(self) -> int:
        """Peak bytes of one device: arguments + outputs - donated aliases + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain data (the plan by name); ``predicted_s`` is a prediction
        (:mod:`shardax.cost.predict`, with overlap), None without a datasheet."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "plan"}
        return {**out, "total_bytes": self.total_bytes}


@public("sx.train.AutoPlan")
@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """What :func:`auto_plan` measured, and its pick. Print it for a table."""

    plan: Plan
    candidates: tuple[Candidate, ...]
    device_memory: float | None
    reason: str
    compiled: str
    pick: str | None = None
    """The picked candidate's name (None: the one candidate of ``plan``)."""

    @property
    def candidate(self) -> Candidate:
        """The picked candidate."""
        if self.pick is not None:
            return next(c for c in self.candidates if c.name == self.pick)
        return next(c for c in self.candidates if c.plan is self.plan)

    @property
    def name(self) -> str:
        """The picked candidate's name, e.g. ``"fsdp"``, or ``"fsdp·mb2"`` when several
        microbatch counts were ranked."""
        return self.candidate.name

    @property
    def accumulate(self) -> int:
        """The picked candidate's microbatches (``make_train_step``'s ``accumulate``)."""
        return self.candidate.accumulate

    @property
    def variant(self) -> str | None:
        """The picked model variant's name (None when one model was given)."""
        return self.candidate.variant

    def to_dict(self) -> dict[str, Any]:
        """Candidates, budget, pick and reason as plain data."""
        return {
            "pick": self.name,
            "accumulate": self.accumulate,
            "variant": self.variant,
            "reason": self.reason,
            "compiled": self.compiled,
            "device_memory_bytes": self.device_memory,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=f"candidate plans, compiled ({self.compiled}), per device")
        predicted = any(c.predicted_s is not None for c in self.candidates)
        # With predictions (a datasheet) the reason column needs the room: the arguments
        # and temporaries stay in to_dict() and the pick's estimate.
        cols = ["plan", "total", "sent", "fits", "predicted step (s)", "why"] if predicted else [
            "plan", "arguments", "temporaries", "total", "collective bytes", "fits"
        ]  # fmt: skip
        for col in cols:
            left = col in ("plan", "why")
            table.add_column(col, justify="left" if left else "right", no_wrap=col != "why")
        why = self.reasons()
        picked = self.name
        for c in self.candidates:
            name = f"[bold]{c.name}[/]" if c.name == picked else c.name
            fits = {None: "?", True: "yes", False: "[red]no[/]"}[c.fits]
            total, sent = format_bytes(c.total_bytes), format_bytes(c.collective_bytes)
            if c.skipped:
                fits = total = sent = "-"
            if predicted:
                t = "-" if c.skipped else "n/a" if c.predicted_s is None else f"{c.predicted_s:.3f}"
                table.add_row(name, total, sent, fits, t, why[c.name])
            else:
                args, temps = format_bytes(c.argument_bytes), format_bytes(c.temp_bytes)
                if c.skipped:
                    args = temps = "-"
                table.add_row(name, args, temps, total, sent, fits)
        table.caption = f"pick: {self.name}: {self.reason}"
        return table

    def reasons(self) -> dict[str, str]:
        """One line per candidate: why it ranks where it does."""
        pick = self.candidate
        out = {}
        for c in self.candidates:
            if c.name == pick.name:
                out[c.name] = "picked"
            elif c.skipped:
                out[c.name] = f"not compiled: {c.skipped}"
            elif c.refused:
                out[c.name] = f"does not fit: the compiler refused it ({c.refused})"
            elif c.fits is False:
                out[c.name] = f"does not fit: {format_bytes(c.total_bytes)} per device"
            elif c.predicted_s is not None and pick.predicted_s:
                out[c.name] = f"predicted {c.predicted_s / pick.predicted_s - 1:+.0%} slower"
            else:
                out[c.name] = f"sends {format_bytes(c.collective_bytes)} per step"
        return out

    def __str__(self) -> str:
        from rich.console import Console

        out = io.StringIO()
        Console(file=out, width=140, force_terminal=False).print(self)
        return out.getvalue().rstrip()


def default_device_memory(device: Any = None) -> float | None:
    """Bytes of memory of ``device`` (default: the first): its reported limit
    (``memory_stats()["bytes_limit"]``), else (a compile-only target device too) the
    hardware table's figure, else None."""
    from shardax.cost.hardware import device_spec

    device = jax.devices()[0] if device is None else device
    try:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    except RuntimeError:  # a compile-only target device (sx.target) has no stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    spec = device_spec(device)
    return None if spec is None else float(spec.memory_bytes)


def abstract(tree_or_init: Any) -> Any:
    """Abstract values (``ShapeDtypeStruct``) of a tree, or of ``init()``'s result.

    Nothing is allocated: an ``init`` callable runs under ``jax.eval_shape``.
    """
    if callable(tree_or_init) and not isinstance(tree_or_init, TrainState):
        return jax.eval_shape(tree_or_init)
    return map_arrays(lambda _, x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree_or_init)


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
    """The mesh's own plans (``MESH_PLANS`` of :mod:`shardax.plan.named`: replicate,
    zero1, zero2 and fsdp) over ``axis``; ``hsdp`` (fsdp over the last of
    several data axes, replicated over the others) when ``axis`` is a tuple;
    ``fsdp+tp`` (``tp_rules``, regex rules or a plan such as ``sx.from_nnx``'s, and fsdp
    over ``axis`` on the dimensions they leave unsplit: :func:`shardax.plan.fsdp_over`)
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
        plans[name] = plan if isinstance(plan, FollowParams) else follow_params(plan)
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


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return map_arrays(
        lambda _, x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _compile_step(config: StepConfig, state: Any, loss_fn: Callable[..., Any], batch: Any) -> Any:
    """The train step with ``config`` (its plan set), compiled for abstract ``state`` and
    ``batch``."""
    step = TrainStep(loss_fn, config)
    return step.lower(step.abstract(state), batch).compile()


def _compile_update(plan: FollowParams, state: TrainState) -> Any:
    """The optimizer update alone (gradients in, as the step hands them over)."""
    from shardax.plan.follow import select

    specs = plan.specs(state)
    grad_specs = plan.mirror_specs(state.params) if plan.shard_grads else select(specs, "params")
    shardings = plan(state)
    state = _with_shardings(state, shardings)
    grads = map_arrays(
        lambda _, x, s: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(plan.mesh, s)
        ),
        state.params,
        grad_specs,
    )
    update = jax.jit(lambda s, g: s.apply_gradients(g), out_shardings=shardings, donate_argnums=0)
    with jax.sharding.set_mesh(plan.mesh):
        return update.lower(state, grads).compile()


def measure(name: str, compiled: Any, plan: Plan) -> Candidate:
    """A :class:`Candidate` from a compiled step's ``memory_analysis()`` and HLO."""
    m = compiled.memory_analysis()
    ops = collectives(compiled.as_text(), plan.mesh.size)
    runs: Counter[str] = Counter()
    for op in ops:
        runs[op.op] += op.count
    return Candidate(
        name=name,
        plan=plan,
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes),
        collective_bytes=sum(op.sent_bytes for op in ops),
        collectives=dict(runs),
        fits=None,
    )


def refused_candidate(name: str, plan: Plan, error: BaseException) -> Candidate | None:
    """A :class:`Candidate` that does not fit, from a backend's out-of-memory compile
    error (libtpu refuses a step whose temporaries exceed HBM); None for other errors."""
    from shardax.cost.estimation import out_of_memory

    oom = out_of_memory(error)
    if oom is None:
        return None
    return Candidate(
        name=name,
        plan=plan,
        argument_bytes=0,
        output_bytes=0,
        alias_bytes=0,
        temp_bytes=int(oom[0]),
        collective_bytes=0.0,
        collectives={},
        fits=False,
        refused=str(error).strip().splitlines()[0],
    )


def predicted(candidate: Candidate, compiled: Any, batch: Any) -> Candidate:
    """``candidate`` with its predicted step time (:func:`shardax.cost.estimation.analyse`,
    with overlap) where the mesh's devices have a datasheet (a GPU, a TPU, a target)."""
    from shardax.cost.estimation import analyse
    from shardax.cost.hardware import device_spec

    mesh = candidate.plan.mesh
    if device_spec(mesh.devices.flat[0]) is None:
        return candidate
    report = analyse(compiled, mesh, batch=batch)
    if report.prediction is None:
        return candidate
    return dataclasses.replace(candidate, predicted_s=report.prediction.overlapped_s)


Counts = int | Sequence[int]


def check_accumulate(accumulate: Any, mesh: Mesh, axis: Any, batch: Any) -> tuple[int, ...]:
    """``accumulate`` (a count or a sequence of counts) as ascending distinct counts,
    each one that splits ``batch``'s rows into microbatches even over the data ``axis``
    (rows divisible by the axis size × the count); errors name the count and the rule."""
    from shardax.plan.core import axis_size

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


def _abstract_states(given: Any) -> dict[str | None, TrainState]:
    """``{variant: abstract TrainState}``: ``{None: state}`` for one state or init, one
    entry per name for a mapping of them."""
    variants = isinstance(given, Mapping)
    if variants and not given:
        raise ValueError(
            "abstract_state_or_init is an empty mapping; give {name: state_or_init} with at "
            "least one entry, or one state or init"
        )
    items = given.items() if variants else [(None, given)]
    states: dict[str | None, TrainState] = {}
    for name, value in items:
        if variants:
            expect_type("each abstract_state_or_init key", name, str, "a variant name (str)")
        state = abstract(value)
        if not isinstance(state, TrainState):
            where = f"abstract_state_or_init[{name!r}]" if variants else "abstract_state_or_init"
            raise ValueError(
                f"{where} must be a shardax TrainState (of arrays or ShapeDtypeStructs) or a "
                "function of no arguments returning one, so abstract values can be built; "
                f"got {type(value).__name__}"
            )
        states[name] = state
    return states


def label(plan: str, variant: str | None, accumulate: int, counts: int) -> str:
    """A candidate's name: the plan, then the variant (if any), then ``mb<k>`` when
    several microbatch counts are ranked.

    >>> label("fsdp", "full", 2, counts=3)
    'fsdp·full·mb2'
    """
    parts = [plan] + ([variant] if variant is not None else [])
    return "·".join(parts + ([f"mb{accumulate}"] if counts > 1 else []))


def _skipped(name: str, plan: Plan, variant: str | None, k: int, why: str) -> Candidate:
    return Candidate(name, plan, 0, 0, 0, 0, 0.0, {}, None, accumulate=k, variant=variant,
                     skipped=why)  # fmt: skip


def compile_candidates(
    plans: Mapping[str, FollowParams],
    states: Mapping[str | None, TrainState],
    loss_fn: Callable[..., Any] | None,
    batch: Any,
    counts: Sequence[int] = (1,),
    budget: float | None = None,
    limit: int | None = None,
    config: StepConfig | None = None,
) -> list[Candidate]:
    """Each plan × model variant × microbatch count compiled once and measured, at most
    ``limit`` of them (None: no limit; the rest are listed as not compiled). With
    ``loss_fn``, each compiles the train step of ``config`` (required then) with the
    candidate's plan and count.

    Where the devices have a datasheet and ``budget`` is known (the ranking is by
    predicted time), a plan's remaining candidates are not compiled once they cannot
    win; they are listed with ``skipped`` saying why:

    - within a variant, the counts after the first that fits with headroom (more
      microbatches only add per-microbatch work);
    - the later variants (more remat: order them from least to most memory-saving),
      once one fits with headroom at the smallest count;
    - all the rest, once the step's arguments alone (state and batch, which neither
      remat nor microbatches shrink) exceed ``budget``.
    """
    from shardax.cost.estimation import HEADROOM
    from shardax.cost.hardware import device_spec

    first = next(iter(plans.values())).mesh
    prune = budget is not None and loss_fn is not None
    prune = prune and device_spec(first.devices.flat[0]) is not None
    room = None if budget is None else budget * (1 - HEADROOM)
    measured: list[Candidate] = []
    compiled = 0
    for plan_name, plan in plans.items():
        rest = None  # why this plan's remaining candidates are not compiled
        for variant, state in states.items():
            more = None  # why this variant's larger counts are not compiled
            for k in counts:
                name = label(plan_name, variant, k, len(counts))
                if limit is not None and compiled >= limit and not (rest or more):
                    more = f"the limit of {limit} compiles is reached"
                if rest or more:
                    measured.append(_skipped(name, plan, variant, k, more or rest or ""))
                    continue
                c = _compile_one(name, plan, state, loss_fn, batch, k, config)
                compiled += 1
                c = dataclasses.replace(c, accumulate=k, variant=variant)
                measured.append(c)
                if not prune or c.refused:
                    continue
                assert room is not None and budget is not None
                if c.argument_bytes > budget:
                    rest = (
                        f"{name}'s arguments alone (state and batch) need "
                        f"{format_bytes(c.argument_bytes)} > {format_bytes(budget)}, which "
                        "neither remat nor microbatches shrink"
                    )
                elif c.total_bytes <= room:
                    more = f"{name} fits; more microbatches only add work"
                    if k == counts[0] and len(states) > 1:
                        rest = f"{name} fits; the later variants only add recomputation"
    return measured


def _compile_one(
    name: str,
    plan: FollowParams,
    state: TrainState,
    loss_fn: Callable[..., Any] | None,
    batch: Any,
    accumulate: int,
    config: StepConfig | None,
) -> Candidate:
    """One candidate compiled and measured (refused for memory: a candidate that does
    not fit; other compile errors propagate)."""
    try:
        if loss_fn is None:
            compiled = _compile_update(plan, state)
        else:
            if config is None:
                raise TypeError("compiling the train step needs the step's config")
            config = dataclasses.replace(config, plan=plan, accumulate=accumulate)
            compiled = _compile_step(config, state, loss_fn, batch)
    except RuntimeError as e:  # the backend refused it for lack of memory: no fit
        refused = refused_candidate(name, plan, e)
        if refused is None:
            raise
        return refused
    return predicted(measure(name, compiled, plan), compiled, batch)


@public("sx.auto_plan")
def auto_plan(
    mesh: Mesh,
    abstract_state_or_init: Any,
    *,
    loss_fn: Callable[..., Any] | None = None,
    batch: Any = None,
    device_memory: float | None = None,
    axis: str | tuple[str, ...] | None = None,
    min_size: int = DEFAULT_FSDP_MIN_SIZE,
    tp_rules: Rules = None,
    pipeline_rules: Rules = None,
    stage_axis: str = STAGE_AXIS,
    candidates: Mapping[str, FollowParams] | None = None,
    accumulate: Counts | None = None,
    precision: Any = None,
    config: StepConfig | None = None,
) -> AutoPlan:
    """Compiles every candidate plan's step and picks the one to train with.

    The candidates are the plans × the model variants (one, unless a mapping is given)
    × the microbatch counts (``accumulate``). Remat is a property of the model, not of
    the step, so remat policies are ranked as variants: pass
    ``{"none": init_a, "full": init_b}`` (the same model built with each policy; one
    ``loss_fn`` serves them all). The picked candidate is ``report.name`` (e.g.
    ``"fsdp·full·mb2"``), its plan ``report.plan``, its count ``report.accumulate`` and
    its variant ``report.variant``.

    >>> mesh = sx.make_mesh({"data": 8})
    >>> apply = lambda params, x: x @ params["w"]
    >>> init = lambda: sx.TrainState.from_params({"w": jnp.zeros((64, 8))}, apply, optax.sgd(0.1))
    >>> mse = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)
    >>> report = sx.auto_plan(mesh, init, loss_fn=mse, batch={"x": jnp.zeros((32, 64))},
    ...                       candidates={"fsdp": "fsdp"}, accumulate=(1, 2))
    >>> [c.name for c in report.candidates], report.accumulate
    (['fsdp·mb1', 'fsdp·mb2'], 1)

    Args:
        mesh: the device mesh.
        abstract_state_or_init: a :class:`shardax.TrainState` (arrays or
            ``ShapeDtypeStruct``s), or a function of no arguments returning one, run
            under ``jax.eval_shape``; or ``{variant name: either}`` to rank model
            variants too (e.g. remat policies), ordered from least to most
            memory-saving (see :func:`compile_candidates` for what that order prunes).
        loss_fn, batch: with both, the whole train step (``make_train_step``) is
            compiled for ``batch``'s shapes (arrays or ``ShapeDtypeStruct``s), so
            activations and the forward pass's collectives count. With neither, only
            the optimizer update is (gradients as the step would hand them over).
        device_memory: bytes per device to fit in (default: the device's reported
            limit, else the hardware table's figure; with neither, nothing is
            rejected and the report says so).
        axis: the data axis (or axes) the batch and the plans split over (default:
            ``config.data_axis``, else ``"data"``).
        min_size, tp_rules: as for ``sx.fsdp`` and ``sx.rules``; with ``tp_rules`` a
            ``fsdp+tp`` candidate joins (see :func:`candidate_plans`).
        pipeline_rules, stage_axis: with rules that place the model's stacked layers
            over ``stage_axis`` (regex rules or a plan, e.g.
            ``gpt.plan(mesh, model, "pipeline")``), a ``pipeline`` candidate joins; the
            model must run its layers with ``sx.pipeline`` (see :func:`candidate_plans`).
        candidates: ``{name: plan}`` to measure instead of :func:`candidate_plans`.
        accumulate: as for ``make_train_step``; or a sequence of counts, e.g.
            ``(1, 2, 4)``, each ranked (names end ``·mb<k>``). Each must split the
            batch's rows evenly over the data axis. Default: ``config.accumulate``,
            else 1.
        precision: as for ``make_train_step`` (default: ``config``'s, else
            ``"fp32"``).
        config: the step's settings (:class:`~shardax.train.StepConfig`, its ``plan``
            None): each candidate compiles the step they make, with its own plan and
            count, so ``seq_axis``, ``stats``, ``batch_spec`` and the rest count too.
            ``axis`` and ``precision`` then come from it and are not passed.

    Raises:
        ValueError: no candidate fits ``device_memory`` (naming the smallest and the
            budget), no abstract values can be built from the arguments, a count of
            ``accumulate`` does not divide the batch, ``pipeline_rules`` are given
            for a mesh without ``stage_axis`` (or split nothing over it), or ``config``
            has a plan, another mode than ``"jit"``, or another mesh.
        TypeError: ``config`` is not a ``StepConfig``, or comes with ``axis`` or
            ``precision``.
    """
    check_mesh("mesh", mesh)
    config = _step_config(mesh, config, axis, precision)
    axis = config.data_axis
    if accumulate is None:
        accumulate = config.accumulate
    options = check_options(device_memory, min_size, tp_rules, pipeline_rules, stage_axis)
    device_memory, min_size = options["device_memory"], options["min_size"]
    if loss_fn is not None:
        as_function("loss_fn", loss_fn, "a function loss_fn(model, batch) or None")
    if (loss_fn is None) != (batch is None):
        raise ValueError(
            "pass loss_fn and batch together (to compile the whole step) or "
            f"neither (the update alone); got loss_fn={loss_fn!r} and batch of type "
            f"{type(batch).__name__}"
        )
    states = _abstract_states(abstract_state_or_init)
    state = next(iter(states.values()))
    if batch is not None:
        batch = abstract(batch)
        if not any(is_array(x) for x in jax.tree.leaves(batch)):
            raise ValueError(f"batch must hold arrays or ShapeDtypeStructs, got {batch!r}")
    counts = check_accumulate(accumulate, mesh, axis, batch)
    budget = default_device_memory(mesh.devices.flat[0]) if device_memory is None else device_memory
    known = candidate_plans(mesh, axis, min_size, tp_rules, pipeline_rules, stage_axis)
    plans = known if candidates is None else check_candidates(mesh, candidates, known)
    split = {name: _split_axes(plan, state) for name, plan in plans.items()}
    if pipeline_rules and not candidates and stage_axis not in split["pipeline"]:
        raise ValueError(
            f"pipeline_rules place no leaf of the state over mesh axis "
            f"{stage_axis!r} (stage_axis); give rules matching the stacked layers, e.g. "
            f"[(r'blocks', P({stage_axis!r}))]"
        )
    measured = compile_candidates(plans, states, loss_fn, batch, counts, budget, config=config)
    what = "train step" if loss_fn is not None else "optimizer update"
    return choose(measured, budget, what, _compared(mesh, axis, split))


def _step_config(mesh: Mesh, config: Any, axis: Any, precision: Any) -> StepConfig:
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
    if config.plan is not None:
        raise ValueError(
            f"config.plan is {config.plan_name!r}, but auto_plan picks the plan; build the "
            "config with plan=None"
        )
    if config.mode != "jit":
        raise ValueError(
            f"auto_plan picks among sharded plans, which only mode='jit' runs; got "
            f"config.mode={config.mode!r}"
        )
    if config.mesh != mesh:
        raise ValueError(
            f"config's mesh {dict(config.mesh.shape)} is not auto_plan's mesh "
            f"{dict(mesh.shape)}; build both from the same mesh"
        )
    return config


def _split_axes(plan: Plan, state: Any) -> set[str]:
    """The mesh axes ``plan`` splits some leaf of ``state`` over."""
    found: set[str] = set()
    for spec in jax.tree.leaves(plan.specs(state), is_leaf=lambda x: isinstance(x, P)):
        for entry in spec:
            found.update((entry,) if isinstance(entry, str) else entry or ())
    return found


def _compared(mesh: Mesh, axis: str | tuple[str, ...], split: dict[str, set[str]]) -> str:
    """What the candidates share and where they differ, for a mesh with axes beyond the
    data axis: the batch is split over the data axis only, and each other axis splits the
    state only in the candidates named."""
    data = (axis,) if isinstance(axis, str) else tuple(axis)
    others = [a for a, n in mesh.shape.items() if a not in data and n > 1]
    if not others:
        return ""
    parts = []
    for a in others:
        users = [name for name, axes in split.items() if a in axes]
        parts.append(
            f"{a!r} ({mesh.shape[a]}) splits the state in {', '.join(users)} only, the "
            "others replicate it there"
            if users
            else f"{a!r} ({mesh.shape[a]}) splits no candidate's state"
        )
    return f"; batch split over {' × '.join(map(repr, data))} only; " + "; ".join(parts)


def choose(
    measured: Sequence[Candidate], budget: float | None, compiled: str, note: str = ""
) -> AutoPlan:
    """Of the ``measured`` candidates that fit ``budget`` bytes per device (all of them
    when ``budget`` is None), the one that sends the fewest bytes per step (ties: fewer
    microbatches, then the fewest bytes per device). Where every candidate has a
    predicted step time (devices with a datasheet: GPUs, TPUs, compile-only targets),
    the fastest predicted of those that fit with
    :data:`shardax.cost.estimation.HEADROOM` to spare instead. Candidates not compiled
    (``skipped``) stay in the report and are never picked. Raises ``ValueError`` when
    none fits. ``note`` (what the candidates share) ends the reason."""
    measured = [
        dataclasses.replace(
            c,
            fits=None
            if c.skipped or (budget is None and not c.refused)
            else (not c.refused and c.total_bytes <= budget),
        )
        for c in measured
    ]
    compiled_ = [c for c in measured if not c.skipped]
    count = f"{len(compiled_)} compiled" + (
        f", {len(measured) - len(compiled_)} not" if len(compiled_) < len(measured) else ""
    )
    fitting = [c for c in compiled_ if c.fits is not False]
    timed = all(c.predicted_s is not None for c in compiled_ if not c.refused)
    if timed and budget is not None:  # a datasheet: fit with headroom, then fastest
        from shardax.cost.estimation import HEADROOM

        roomy = [c for c in fitting if c.total_bytes <= budget * (1 - HEADROOM)]
        if roomy:
            pick = min(roomy, key=lambda c: (c.predicted_s, c.total_bytes))
            reason = (
                f"fastest predicted step, {pick.predicted_s:.3f} s (a prediction: "
                f"compute, HBM and links from the datasheet), of the {len(roomy)} of "
                f"{len(measured)} candidates ({count}) that fit {format_bytes(budget)} with "
                f"{HEADROOM:.0%} headroom ({format_bytes(pick.total_bytes)} per device){note}"
            )
            return AutoPlan(pick.plan, tuple(measured), budget, reason, compiled, pick.name)
    if not fitting:
        best = min(compiled_, key=lambda c: c.total_bytes)
        raise ValueError(
            f"no plan fits device_memory {format_bytes(budget or 0)} "
            f"({budget:.0f} bytes) per device; the smallest, {best.name!r}, needs "
            f"{format_bytes(best.total_bytes)} ({best.total_bytes} bytes: arguments "
            f"{best.argument_bytes} + outputs {best.output_bytes} - aliased "
            f"{best.alias_bytes} + temporaries {best.temp_bytes}). Add devices, shard over "
            "more axes, or shrink the batch"
        )
    pick = min(fitting, key=lambda c: (round(c.collective_bytes), c.accumulate, c.total_bytes))
    if budget is None:
        where = (
            "no device memory figure (pass device_memory=, or --device-memory), so all "
            "count as fitting"
        )
    else:
        where = f"{len(fitting)} of {len(measured)} fit {format_bytes(budget)}"
    reason = (
        f"least communication, {format_bytes(pick.collective_bytes)} sent per device per "
        f"step ({format_bytes(pick.total_bytes)} per device); {where}{note}"
    )
    return AutoPlan(pick.plan, tuple(measured), budget, reason, compiled, pick.name)


@public("sx.train.AutoStep")
class AutoStep:
    """A train step whose plan :func:`auto_plan` picks on the first ``step(state, batch)``.

    ``make_train_step(..., plan="auto")`` (or ``plan=sx.AutoPlanOptions(...)``) returns
    one. The first call compiles the candidates for that state and batch, keeps the
    report in ``auto_report``, places the state on the winner and runs the
    :class:`~shardax.train.step.TrainStep` built with it; later calls go straight to
    that step. ``step.shard`` and ``step.init`` have no batch to decide with, so they
    work only once the plan is picked.
    """

    def __init__(self, loss_fn: Callable[..., Any], options: AutoPlanOptions, **step_kw: Any):
        mode = step_kw.get("mode", "jit")
        if mode != "jit":
            raise ValueError(
                f"plan='auto' picks among sharded plans, which only mode='jit' runs; got "
                f"mode={mode!r}"
            )
        # Everything the step checks (loss_fn, mesh, accumulate, ...) is checked now.
        self.config = TrainStep(loss_fn, plan=None, **step_kw).config
        options.check(self.config.mesh)
        self.loss_fn, self.options = loss_fn, options
        self.auto_report: AutoPlan | None = None
        self.step: TrainStep | None = None
        self._unplaced = False  # picked, and no state placed on the plan yet

    def _picked(self, what: str) -> TrainStep:
        if self.step is None:
            raise ValueError(
                f"plan='auto' picks the plan by compiling the step for a state and a batch, "
                f"and {what} has no batch to build abstract values from: pass the unplaced "
                "state to the first step(state, batch), which places it, or pick beforehand "
                "with sx.auto_plan(mesh, init_or_state, loss_fn=..., batch=...).plan"
            )
        return self.step

    def pick(self, state: TrainState, batch: Any) -> TrainStep:
        """The step with the plan picked for ``state`` and ``batch`` (compiling the
        candidates once; ``sx.verify`` calls it). The next ``step(state, batch)`` places
        its state on the plan, as the first call does."""
        if self.step is None:
            config = self.config
            self.auto_report = auto_plan(
                config.mesh,
                state,
                loss_fn=self.loss_fn,
                batch=batch,
                config=config,
                **vars(self.options),
            )
            config = dataclasses.replace(config, plan=self.auto_report.plan)
            self.step = TrainStep(self.loss_fn, config)
            self.step.plan_name = f"auto:{self.auto_report.plan.name}"
            self._unplaced = True
        return self.step

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """Picks the plan on the first call (placing ``state`` on it), then steps."""
        step = self.pick(state, batch)
        if self._unplaced:
            self._unplaced = False
            state = step.shard(state)
        return step(state, batch)

    def shard(self, state: TrainState) -> TrainState:
        """``state`` placed on the picked plan (after the first call)."""
        step = self._picked("step.shard(state)")
        self._unplaced = False
        return step.shard(state)

    def init(self, init_fn: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
        """``init_fn`` run onto the picked plan (after the first call)."""
        return self._picked("step.init(...)").init(init_fn, *args, **kwargs)

    def lower(self, state: TrainState, batch: Any) -> Any:
        """The picked step, lowered (after the first call)."""
        return self._picked("step.lower(...)").lower(state, batch)

    @property
    def plan(self) -> Any:
        """The picked plan (None before the first call)."""
        return None if self.step is None else self.step.plan

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The XLA options the step compiles with (the candidates too), resolved."""
        return self.config.resolved_compiler_options

    @property
    def compiler_summary(self) -> str:
        """The XLA options in a few words, as :class:`~shardax.train.program.Program`'s."""
        config = self.config
        return describe_options(
            config.compiler_options, self.compiler_options, config.platform, config.mode
        )

    def __getattr__(self, name: str) -> Any:
        # mode, mesh, accumulate, donate, data_axis, precision, stats: as the step's.
        config = self.__dict__.get("config")
        if config is not None and name in {f.name for f in dataclasses.fields(config)}:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        if self.step is not None:
            return repr(self.step)
        config = self.config
        return (
            f"TrainStep(mode='jit', plan='auto', mesh={dict(config.mesh.shape)}, "
            f"accumulate={config.accumulate}, donate={config.donate}, "
            f"compiler_options={self.compiler_summary})"
        )
