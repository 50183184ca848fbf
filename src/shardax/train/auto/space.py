"""The search space of [`search_plans`][shardax.search_plans]: meshes (each a
[`Layout`][shardax.train.Layout], e.g. data × stage for a pipeline, data × context for
long sequences), the plans on each, the model's variants (remat policies), the microbatch
counts, the precisions (e.g. ``("bf16", "fp8")``) and the step's settings (one
[`StepConfig`][shardax.train.StepConfig]), on the local devices or a target's.

>>> space = sx.SearchSpace(meshes=[{"data": 2, "stage": 4}, {"data": 4, "context": 2}])
>>> [layout.name for layout in space.layouts]
['stage=4', 'context=2']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardax.checks import as_count, expect_type, public
from shardax.cost.calibrate_fp8 import fp8_unsupported
from shardax.mesh.axes import CONTEXT_AXIS, DATA_AXIS, REPLICA_AXIS, STAGE_AXIS
from shardax.mesh.make import make_mesh
from shardax.plan.core import DEFAULT_FSDP_MIN_SIZE, Plan
from shardax.plan.follow import FollowParams
from shardax.train.auto.candidates import Group
from shardax.train.auto.options import (
    Counts,
    Rules,
    candidate_plans,
    check_accumulate,
    check_candidates,
    check_options,
    check_searchable,
)
from shardax.train.config import StepConfig
from shardax.train.precision import PRECISIONS


@public("sx.train.Layout")
@dataclasses.dataclass(frozen=True)
class Layout:
    """One mesh of a [`SearchSpace`][shardax.SearchSpace], and what differs on it.

    Args:
        mesh: a ``sx.make_mesh`` spec (built on the space's devices) or a mesh. The batch
            splits over its ``"replica"`` and ``"data"`` axes (one of them at least),
            its sequence over ``"context"`` where it has that axis (the step's
            ``seq_axis``); a model calling ``sx.pipeline`` runs its schedule over
            ``"stage"``.
        name: prefixes its candidates' names (``"stage=4:fsdp"``); None: no prefix. (A
            mesh or spec given to the space without a Layout is named by its axes beyond
            the data axes, where the space has several meshes.)
        plans: the plans to rank on it: names of the defaults
            (``candidate_plans``, e.g. ``("fsdp", "pipeline")``) or
            ``{name: plan or default's name}``; None: every default.
        model, loss_fn: its own model (a state, an init, or ``{variant: either}``) and
            loss, where it needs others (e.g. built with ``sx.pipeline``'s microbatches);
            None: the search's.
        accumulate: its microbatch counts (None: the space's).
        microbatches: ``sx.pipeline``'s microbatches in its model, for the flags.
    """

    mesh: Mesh | Mapping[str, int]
    name: str | None = None
    plans: Sequence[str] | Mapping[str, Plan | str] | None = None
    model: Any = None
    loss_fn: Callable[..., Any] | None = None
    accumulate: Counts | None = None
    microbatches: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh | Mapping):
            plan = " (a plan goes in plans=)" if isinstance(self.mesh, Plan) else ""
            raise TypeError(
                "mesh must be a sx.make_mesh spec (e.g. {'data': 4, 'stage': 2}) or a "
                f"jax.sharding.Mesh, got {type(self.mesh).__name__}{plan}"
            )

    @property
    def data_axis(self) -> str | tuple[str, ...]:
        """The axes the batch splits over: ``"replica"`` and ``"data"``, those present."""
        axes = tuple(a for a in (REPLICA_AXIS, DATA_AXIS) if a in self.mesh.shape)
        if not axes:
            raise ValueError(
                f"a searched mesh needs a {DATA_AXIS!r} (or {REPLICA_AXIS!r}) axis to split "
                f"the batch over, got {dict(self.mesh.shape)}"
            )
        return axes if len(axes) > 1 else axes[0]

    @property
    def seq_axis(self) -> str | None:
        """``"context"`` where the mesh splits it, else None."""
        return CONTEXT_AXIS if self.mesh.shape.get(CONTEXT_AXIS, 1) > 1 else None


@public("sx.SearchSpace")
@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What [`search_plans`][shardax.search_plans] ranks: the meshes × their plans × the model's
    variants × the microbatch counts × the precisions, each the train step of ``config``.

    Args:
        meshes: ``sx.make_mesh`` specs, meshes or [`Layout`][shardax.train.Layout]s (default: every
            device on ``"data"``).
        devices: where the specs are built: a ``sx.target(...)`` (compile-only) or a
            list of devices (default: ``jax.devices()``).
        plans: the plans to rank, by name (e.g. ``("fsdp", "pipeline")``), on each mesh
            that has them (None: every default plan of each mesh, ``candidate_plans``); a
            Layout's own ``plans`` replace them there.
        accumulate: a microbatch count or several, e.g. ``(1, 2, 4)`` (None: the
            config's, else 1); each mesh keeps those that split the batch's rows over its
            data axes (none: the error names the rule).
        config: the step's settings ([`StepConfig`][shardax.train.StepConfig], plan None, mode
            ``"jit"``, any mesh): precision, stats, compiler options... Each candidate
            compiles it with its own mesh, data axes, ``seq_axis``, plan and count.
        device_memory: bytes per device to fit in (default: the devices' figure).
        min_size, tp_rules, pipeline_rules, stage_axis: as ``sx.auto_plan``'s; the rules
            join the meshes that have their axes (``pipeline_rules``: a ``stage_axis`` of
            size > 1).
        max_compiles: compile at most this many candidates (None: no limit); the rest
            are listed as not compiled.
        precisions: precision names to rank (``make_train_step``'s, e.g. ``("bf16",
            "fp8")``), each replacing ``config``'s; the candidates' names end with theirs
            (``"fsdp·fp8"``) and the pick's flags give ``--precision``. Ranked by
            predicted step time like the rest (``sx.estimate``'s per-op model prices fp8
            GEMMs, at the datasheet's fp8 peak until the card's tables have fp8 rows). A
            precision the devices cannot run is refused by name before anything compiles:
            ``"fp8"`` needs fp8 tensor cores (an NVIDIA GPU of compute capability 8.9+;
            not a CPU, a TPU or an A100). None: ``config``'s precision alone.
    """

    meshes: Sequence[Mapping[str, int] | Mesh | Layout] = ({DATA_AXIS: -1},)
    devices: Any = None
    plans: Sequence[str] | None = None
    accumulate: Counts | None = None
    config: StepConfig | None = None
    device_memory: float | None = None
    min_size: int = DEFAULT_FSDP_MIN_SIZE
    tp_rules: Rules = None
    pipeline_rules: Rules = None
    stage_axis: str = STAGE_AXIS
    max_compiles: int | None = None
    precisions: Sequence[str] | None = None

    def __post_init__(self) -> None:
        checked = check_options(
            self.device_memory, self.min_size, self.tp_rules, self.pipeline_rules, self.stage_axis
        )
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.max_compiles is not None:
            object.__setattr__(self, "max_compiles", as_count("max_compiles", self.max_compiles))
        if self.config is not None:
            expect_type("config", self.config, StepConfig, "a sx.train.StepConfig or None")
            check_searchable(self.config, "the search")
        expect_type("meshes", self.meshes, Sequence, "a list of mesh specs, meshes or Layouts")
        if not self.meshes or isinstance(self.meshes, str | Mapping):
            raise ValueError(f"meshes must be a non-empty list, got {self.meshes!r}")
        object.__setattr__(self, "meshes", tuple(self.meshes))
        if self.plans is not None:
            if isinstance(self.plans, str) or not all(isinstance(n, str) for n in self.plans):
                raise TypeError(f"plans must be a list of plan names, got {self.plans!r}")
            if not self.plans:
                raise ValueError(
                    "plans is empty, so there is nothing to rank; name plans such as "
                    "('fsdp', 'zero1'), or pass None for every default plan"
                )
            object.__setattr__(self, "plans", tuple(self.plans))
        if self.precisions is not None:
            object.__setattr__(self, "precisions", _check_precisions(self.precisions))

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """Each mesh as a [`Layout`][shardax.train.Layout] with its mesh built and its name set.
        With the default meshes on devices of several hosts (a multi-host target), the
        hybrid mesh too: ``{"replica": hosts, "data": devices per host}`` with its
        ``hsdp`` plan (FSDP within a host, data parallelism across hosts), named
        ``"replica=<hosts>"``."""
        out = []
        meshes = list(self.meshes)
        hybrid = _hybrid(self.devices) if meshes == [{DATA_AXIS: -1}] else None
        if hybrid is not None and (self.plans is None or "hsdp" in self.plans):
            meshes.append(hybrid)
        for given in meshes:
            layout = given if isinstance(given, Layout) else Layout(given)
            mesh = layout.mesh
            if not isinstance(mesh, Mesh):
                devices = jax.devices() if self.devices is None else self.devices
                mesh = make_mesh(dict(mesh), devices=devices)
            layout = dataclasses.replace(layout, mesh=mesh)
            if layout.name is None and len(self.meshes) > 1 and not isinstance(given, Layout):
                layout = dataclasses.replace(layout, name=_mesh_name(mesh))
            out.append(layout)
        return tuple(out)

    def groups(self, model: Any, loss_fn: Callable[..., Any], batch: Any) -> list[Group]:
        """The candidates of each mesh, checked, before anything compiles."""
        layouts = self.layouts
        for layout in layouts if self.precisions is not None else ():
            assert isinstance(layout.mesh, Mesh)
            check_precisions_apply(self.precisions, layout.mesh)  # before anything is built
        groups = [self._group(layout, model, loss_fn, batch) for layout in layouts]
        if self.plans is not None:
            unknown = set(self.plans) - {n for g in groups for n in g.plans}
            if unknown:
                raise ValueError(
                    f"plans {list(self.plans)}: {', '.join(sorted(unknown))} on none of the "
                    f"meshes; each has: "
                    + "; ".join(f"{_mesh_name(g.mesh)}: {', '.join(g.plans)}" for g in groups)
                )
            groups = [g for g in groups if g.plans]
        names = [n for g in groups for n in (g.name,) if n is not None]
        if len(set(names)) < len(names):
            raise ValueError(f"two searched meshes have the same name: {names}; name each")
        if self.precisions is None:
            return groups
        return [group.with_precision(p) for group in groups for p in self.precisions]

    def _group(self, layout: Layout, model: Any, loss_fn: Any, batch: Any) -> Group:
        mesh, axis = layout.mesh, layout.data_axis
        assert isinstance(mesh, Mesh)
        if self.config is None:
            config = StepConfig(mesh=mesh, data_axis=axis, seq_axis=layout.seq_axis)
        else:
            config = dataclasses.replace(
                self.config, mesh=mesh, data_axis=axis, seq_axis=layout.seq_axis
            )
        stages = mesh.shape.get(self.stage_axis, 1) > 1
        tp = self.tp_rules if _over(self.tp_rules, mesh) else None
        pipeline = self.pipeline_rules if stages else None
        known = candidate_plans(mesh, axis, self.min_size, tp, pipeline, self.stage_axis)
        plans = _plans(layout, mesh, known)
        if self.plans is not None and layout.plans is None:  # those of them it has
            plans = {n: p for n, p in plans.items() if n in self.plans}
        accumulate = layout.accumulate
        if accumulate is None:
            given = self.accumulate
            if given is None:
                given = 1 if self.config is None else self.config.accumulate
            accumulate = _dividing(given, mesh, axis, batch)
        model = model if layout.model is None else layout.model
        loss = loss_fn if layout.loss_fn is None else layout.loss_fn
        return Group.build(
            plans, model, loss, config, accumulate, batch, layout.name, layout.microbatches
        )


def _check_precisions(precisions: Any) -> tuple[str, ...]:
    """``precisions`` as a tuple of distinct precision names (``PRECISIONS``), or an error
    naming the rule and the value."""
    names = list(PRECISIONS)
    if isinstance(precisions, str) or not isinstance(precisions, Sequence):
        raise TypeError(f"precisions must be a list of precision names from {names}, e.g. "
                        f"('bf16', 'fp8'), got {precisions!r}")  # fmt: skip
    if not precisions:
        raise ValueError(f"precisions is empty, so there is nothing to rank; name some of "
                         f"{names}, or pass None for the config's precision")  # fmt: skip
    unknown = [p for p in precisions if not isinstance(p, str) or p not in PRECISIONS]
    if unknown:
        raise ValueError(f"precisions: {unknown[0]!r} is not a precision name; each must be "
                         f"one of {names}, got {list(precisions)!r}")  # fmt: skip
    if len(set(precisions)) < len(precisions):
        raise ValueError(f"precisions names one twice: {list(precisions)!r}")
    return tuple(precisions)


def check_precisions_apply(precisions: Sequence[str], mesh: Mesh) -> None:
    """Refuses by name a precision ``mesh``'s devices cannot run: ``"fp8"`` without fp8
    tensor cores (``shardax.cost.calibrate_fp8.fp8_unsupported``; fp8 on a CPU is emulated
    in wide arithmetic, so no prediction of its speed means anything)."""
    if "fp8" not in precisions:
        return
    why = fp8_unsupported(mesh.devices.flat[0])
    if why is not None:
        raise ValueError(f"precisions {list(precisions)}: 'fp8' does not apply here: {why}; "
                         "search it on a target with fp8, e.g. sx.target('8xH100')")  # fmt: skip


def _hybrid(devices: Any) -> Layout | None:
    """The hybrid layout of ``devices`` (default ``jax.devices()``) over several hosts of
    equal size: replicas across hosts, ``hsdp`` within each; None on one host."""
    devices = list(jax.devices() if devices is None else devices)
    hosts: dict[int, int] = {}
    for d in devices:
        hosts[d.process_index] = hosts.get(d.process_index, 0) + 1
    sizes = set(hosts.values())
    if len(hosts) < 2 or len(sizes) != 1 or sizes == {1}:
        return None
    return Layout(
        {REPLICA_AXIS: len(hosts), DATA_AXIS: sizes.pop()},
        name=f"replica={len(hosts)}",
        plans=("hsdp",),
    )


def _dividing(accumulate: Counts, mesh: Mesh, axis: Any, batch: Any) -> Counts:
    """Of several counts, those that split ``batch``'s rows over ``mesh``'s data ``axis``
    (all of them where none does, so that the check names the rule)."""
    if batch is None or not isinstance(accumulate, Sequence) or isinstance(accumulate, str):
        return accumulate
    kept = []
    for k in accumulate:
        try:
            check_accumulate(k, mesh, axis, batch)
        except ValueError:
            continue
        kept.append(k)
    return tuple(kept) or accumulate


def _plans(layout: Layout, mesh: Mesh, known: dict[str, FollowParams]) -> dict[str, FollowParams]:
    """The plans ``layout`` asks for, each named by its key."""
    given = layout.plans
    if given is None:
        plans = known
    elif isinstance(given, Mapping):
        plans = check_candidates(mesh, given, known)
    else:
        unknown = [n for n in given if n not in known]
        if unknown or not given:
            raise ValueError(
                f"plans {list(given)}: {', '.join(map(repr, unknown)) or 'none'} not among "
                f"the candidates for mesh {dict(mesh.shape)}: {', '.join(known)}"
            )
        plans = {n: known[n] for n in given}
    return {n: dataclasses.replace(p, name=n) if p.name != n else p for n, p in plans.items()}


def _over(rules: Rules, mesh: Mesh) -> bool:
    """``rules`` name only axes of ``mesh`` (a plan: is over it)."""
    if rules is None:
        return False
    if isinstance(rules, Plan):
        return rules.mesh == mesh
    axes: set[str] = set()
    for _, spec in rules:
        for entry in spec if isinstance(spec, P) else ():
            axes.update((entry,) if isinstance(entry, str) else entry or ())
    return axes <= set(mesh.axis_names)


def _mesh_name(mesh: Mesh) -> str:
    """The mesh's axes beyond the data axes (all of them where it has no others)."""
    shape = dict(mesh.shape)
    data = {REPLICA_AXIS, DATA_AXIS}
    rest = {k: v for k, v in shape.items() if k not in data} or shape
    return ",".join(f"{k}={v}" for k, v in rest.items())
