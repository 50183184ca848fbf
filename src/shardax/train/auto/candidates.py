"""The candidates of the search: each plan × model variant × microbatch count of one mesh
(a ``Group``) compiled once for abstract values and analysed once, by the analysis
``sx.estimate`` reports (``shardax.cost.estimation.analyse``): memory per device,
collectives, and on a device with a datasheet (or a registered calibration) the
predicted step time with its interval.

>>> label("fsdp", "full", 2, counts=3)
'fsdp·full·mb2'
>>> label("fsdp", None, 1, counts=1, layout="stage=4")
'stage=4:fsdp'
>>> label("fsdp", "full", 1, counts=1, precision="fp8")
'fsdp·full·fp8'
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from shardax._format import format_bytes
from shardax.checks import expect_type, public
from shardax.cost.estimation import analyse, estimate
from shardax.cost.figures import device_figures
from shardax.cost.refusal import out_of_memory
from shardax.cost.report import HEADROOM, Estimate
from shardax.plan.core import Plan
from shardax.plan.follow import FollowParams, select
from shardax.plan.tree import map_arrays
from shardax.train.auto.options import check_accumulate
from shardax.train.config import StepConfig
from shardax.train.state import TrainState
from shardax.train.step import TrainStep


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
    """The predicted step time (the per-op model's point where it prices the device, a
    GPU; else ``shardax.cost.predict``'s, with overlap); None without a datasheet or a
    registered calibration."""
    refused: str | None = None
    """The backend's out-of-memory error where it refused to compile this candidate."""
    accumulate: int = 1
    """Its number of microbatches (``make_train_step``'s ``accumulate``)."""
    variant: str | None = None
    """The model variant's name, where several were ranked (e.g. remat)."""
    skipped: str | None = None
    """Why it was not compiled (a cheaper candidate of its plan already fits with
    headroom); its figures are then zeros."""
    estimate: Estimate | None = None
    """Its whole analysis (what ``sx.estimate`` reports), None where not compiled."""
    config: StepConfig | None = None
    """The settings its train step compiled with (its mesh, plan and count included)."""
    microbatches: int | None = None
    """``sx.pipeline``'s microbatches in its model, where its mesh says (the flags)."""
    precision: str | None = None
    """Its precision's name, where the search ranked several (``SearchSpace.precisions``)."""

    @property
    def total_bytes(self) -> int:
        """Peak bytes of one device: arguments + outputs - donated aliases + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def interval_s(self) -> tuple[float, float] | None:
        """The predicted step time's interval ``(low, high)`` in seconds (the per-op
        model's, on a GPU), None without one."""
        return None if self.estimate is None else self.estimate.interval_s

    @property
    def mesh(self) -> Mesh:
        """The mesh its plan places the state on."""
        return self.plan.mesh

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain data (the plan by name, the mesh by its shape)."""
        hidden = ("plan", "estimate", "config")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out = {k: v for k, v in out.items() if k not in hidden}
        mesh = getattr(self.plan, "mesh", None)
        shape = None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()}
        return {
            **out,
            "total_bytes": self.total_bytes,
            "interval_s": self.interval_s,
            "mesh": shape,
        }


def from_estimate(name: str, plan: Plan, report: Estimate, **fields: Any) -> Candidate:
    """The [`Candidate`][shardax.train.Candidate] of one analysed step: the compiler's
    memory figures, the bytes its collectives send and their runs, its predicted time; a
    step the backend refused for lack of memory does not fit."""
    if report.compile_error is not None or report.compiled_bytes is None:
        return Candidate(
            name,
            plan,
            0,
            0,
            0,
            int(report.memory.get("temporaries", 0)),
            0.0,
            {},
            False,
            refused=report.compile_error,
            estimate=report,
            **fields,
        )
    b = report.compiled_bytes
    runs: Counter[str] = Counter()
    for row in report.collectives:
        runs[row["op"]] += row["runs"]
    return Candidate(
        name=name,
        plan=plan,
        argument_bytes=b["arguments"],
        output_bytes=b["outputs"],
        alias_bytes=b["aliased"],
        temp_bytes=b["temporaries"],
        collective_bytes=sum(row["sent_bytes"] for row in report.collectives),
        collectives=dict(runs),
        fits=None,
        predicted_s=report.predicted_s,
        estimate=report,
        **fields,
    )


def measure(name: str, compiled: Any, plan: Plan) -> Candidate:
    """A [`Candidate`][shardax.train.Candidate] from a compiled step, by the same analysis."""
    return from_estimate(name, plan, analyse(compiled, plan.mesh))


def refused_candidate(name: str, plan: Plan, error: BaseException) -> Candidate | None:
    """A [`Candidate`][shardax.train.Candidate] that does not fit, from a backend's
    out-of-memory compile error (libtpu refuses a step whose temporaries exceed HBM);
    None for other errors."""
    oom = out_of_memory(error)
    if oom is None:
        return None
    first = str(error).strip().splitlines()[0]
    return Candidate(name, plan, 0, 0, 0, int(oom[0]), 0.0, {}, False, refused=first)


def abstract(tree_or_init: Any) -> Any:
    """Abstract values (``ShapeDtypeStruct``) of a tree, or of ``init()``'s result.

    Nothing is allocated: an ``init`` callable runs under ``jax.eval_shape``.
    """
    if callable(tree_or_init) and not isinstance(tree_or_init, TrainState):
        return jax.eval_shape(tree_or_init)
    return map_arrays(lambda _, x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree_or_init)


def abstract_states(given: Any, what: str = "abstract_state_or_init") -> dict[str | None, Any]:
    """``{variant: abstract TrainState}``: ``{None: state}`` for one state or init, one
    entry per name for a mapping of them (the model variants, e.g. remat policies)."""
    variants = isinstance(given, Mapping)
    if variants and not given:
        raise ValueError(
            f"{what} is an empty mapping; give {{name: state_or_init}} with at "
            "least one entry, or one state or init"
        )
    items = given.items() if variants else [(None, given)]
    states: dict[str | None, TrainState] = {}
    for name, value in items:
        if variants:
            expect_type(f"each {what} key", name, str, "a variant name (str)")
        state = abstract(value)
        if not isinstance(state, TrainState):
            where = f"{what}[{name!r}]" if variants else what
            returned = (
                f", which returned a {type(state).__name__}"
                if callable(value) and not isinstance(value, TrainState)
                else ""
            )
            raise ValueError(
                f"{where} must be a shardax TrainState (of arrays or ShapeDtypeStructs) or a "
                "function of no arguments returning one, so abstract values can be built; "
                f"got {type(value).__name__}{returned}. Wrap params with "
                "sx.TrainState.from_params(params, apply_fn, tx) (a model: "
                "sx.TrainState.create(model, tx))"
            )
        states[name] = state
    return states


def label(
    plan: str,
    variant: str | None,
    accumulate: int,
    counts: int,
    layout: str | None = None,
    precision: str | None = None,
) -> str:
    """A candidate's name: the layout (its mesh's name, where several are ranked), the
    plan, then the variant (if any), the precision (where several are ranked), then
    ``mb<k>`` when several microbatch counts are ranked."""
    parts = [plan] + ([variant] if variant is not None else [])
    parts += [precision] if precision is not None else []
    name = "·".join(parts + ([f"mb{accumulate}"] if counts > 1 else []))
    return name if layout is None else f"{layout}:{name}"


@dataclasses.dataclass(frozen=True)
class Group:
    """The candidates of one mesh: its ``plans`` × the model ``states`` (variants) × the
    microbatch ``counts``, each the train step of ``config`` (its plan and count
    replaced) for ``loss_fn``; with ``loss_fn`` None, the optimizer update alone.
    ``precision``: the name of ``config``'s precision where the search ranks several."""

    plans: Mapping[str, FollowParams]
    states: Mapping[str | None, TrainState]
    loss_fn: Callable[..., Any] | None
    config: StepConfig | None
    counts: Sequence[int] = (1,)
    name: str | None = None
    microbatches: int | None = None
    precision: str | None = None

    def with_precision(self, precision: str) -> Group:
        """This group under the precision named ``precision`` (its candidates named so)."""
        if self.config is None:
            raise TypeError("a precision is a setting of the train step, and this group "
                            "compiles the optimizer update alone")  # fmt: skip
        config = dataclasses.replace(self.config, precision=precision)
        return dataclasses.replace(self, config=config, precision=precision)

    @property
    def mesh(self) -> Mesh:
        if self.config is not None:
            return self.config.mesh
        return next(iter(self.plans.values())).mesh

    @classmethod
    def build(
        cls,
        plans: Mapping[str, FollowParams],
        model: Any,
        loss_fn: Callable[..., Any] | None,
        config: StepConfig,
        accumulate: Any,
        batch: Any,
        name: str | None = None,
        microbatches: int | None = None,
    ) -> Group:
        """The group of ``plans`` on ``config``'s mesh, checked: the microbatch counts of
        ``accumulate`` that split ``batch``'s rows over its data axes
        (``check_accumulate``) and the model's abstract states (``model``: a state, an
        init or ``{variant: either}``)."""
        counts = check_accumulate(accumulate, config.mesh, config.data_axis, batch)
        states = abstract_states(model)
        return cls(plans, states, loss_fn, config, counts, name, microbatches)


def compile_candidates(
    group: Group,
    batch: Any,
    budget: float | None = None,
    limit: int | None = None,
    figures: Mapping[str, Any] | None = None,
) -> list[Candidate]:
    """Each candidate of ``group`` compiled once and analysed once, at most ``limit`` of
    them (None: no limit; the rest are listed as not compiled). ``figures`` go to the
    analysis (``sx.estimate``'s ``model_flops``, ``model_flops_note``, ``tokens``).

    Where the devices have a datasheet (or a calibration) and ``budget`` is known (the
    ranking is by predicted time), a plan's remaining candidates are not compiled once
    they cannot win; they are listed with ``skipped`` saying why:

    - within a variant, the counts after the first that fits with headroom (more
      microbatches only add per-microbatch work);
    - the later variants (more remat: order them from least to most memory-saving),
      once one fits with headroom at the smallest count;
    - all the rest, once the step's arguments alone (state and batch, which neither
      remat nor microbatches shrink) exceed ``budget``.
    """
    prune = budget is not None and group.loss_fn is not None
    prune = prune and device_figures(group.mesh.devices.flat[0]) is not None
    room = None if budget is None else budget * (1 - HEADROOM)
    measured: list[Candidate] = []
    compiled = 0
    for plan_name, plan in group.plans.items():
        rest = None  # why this plan's remaining candidates are not compiled
        for variant, state in group.states.items():
            more = None  # why this variant's larger counts are not compiled
            for k in group.counts:
                name = label(plan_name, variant, k, len(group.counts), group.name,
                             group.precision)  # fmt: skip
                fields = {"accumulate": k, "variant": variant, "microbatches": group.microbatches,
                          "precision": group.precision}  # fmt: skip
                if limit is not None and compiled >= limit and not (rest or more):
                    more = f"the limit of {limit} compiles is reached"
                if rest or more:
                    zeros = (0, 0, 0, 0, 0.0, {}, None)
                    measured.append(Candidate(name, plan, *zeros, skipped=more or rest, **fields))
                    continue
                c = _compile_one(name, plan, state, group, batch, k, figures or {})
                compiled += 1
                c = dataclasses.replace(c, **fields)
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
                    if k == group.counts[0] and len(group.states) > 1:
                        rest = f"{name} fits; the later variants only add recomputation"
    return measured


def _compile_one(
    name: str,
    plan: FollowParams,
    state: TrainState,
    group: Group,
    batch: Any,
    accumulate: int,
    figures: Mapping[str, Any],
) -> Candidate:
    """One candidate compiled and analysed: the train step through ``sx.estimate``
    (which reports a backend's out-of-memory refusal as a step that does not fit), or
    the optimizer update alone."""
    if group.loss_fn is None:
        try:
            compiled = _compile_update(plan, state)
        except RuntimeError as e:  # the backend refused it for lack of memory: no fit
            refused = refused_candidate(name, plan, e)
            if refused is None:
                raise
            return refused
        return from_estimate(name, plan, analyse(compiled, plan.mesh))
    if group.config is None:
        raise TypeError("compiling the train step needs the step's config")
    config = dataclasses.replace(group.config, plan=plan, accumulate=accumulate)
    report = estimate(TrainStep(group.loss_fn, config), state, batch, **figures)
    return from_estimate(name, plan, report, config=config)


def _compile_update(plan: FollowParams, state: TrainState) -> Any:
    """The optimizer update alone (gradients in, as the step hands them over)."""
    specs = plan.specs(state)
    grad_specs = plan.mirror_specs(state.params) if plan.shard_grads else select(specs, "params")
    shardings = plan(state)
    state = map_arrays(
        lambda _, x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
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
