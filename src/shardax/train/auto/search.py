"""The search: every candidate compiled and analysed once, ranked, one picked.

[`auto_plan`][shardax.auto_plan] ranks the plans × model variants × microbatch counts of
one mesh; [`search_plans`][shardax.search_plans] those of every mesh of a
[`SearchSpace`][shardax.SearchSpace] (data × stage for a pipeline, data × context for long
sequences, ...), for the user's own model, on the local devices or a ``sx.target``'s
compile-only ones. This sits in ``train``, not ``plan``, because it compiles the train
step.

Every candidate of a mesh compiles the same ``loss_fn`` (the same model), so only the
placement of the state differs. On a mesh with a ``"stage"`` axis the batch is still split
over the data axes only: a model that calls ``sx.pipeline`` runs its schedule over
``"stage"`` under every candidate, but only the ``pipeline`` candidate
(``pipeline_rules``) splits the stacked layers there; the others replicate the state over
``"stage"``, and the report's reason says so.

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

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardax.checks import as_function, check_mesh, public
from shardax.mesh.axes import STAGE_AXIS
from shardax.plan.core import DEFAULT_FSDP_MIN_SIZE, Plan
from shardax.plan.follow import FollowParams
from shardax.plan.tree import is_array
from shardax.train.auto.candidates import Group, abstract, compile_candidates
from shardax.train.auto.choice import AutoPlan, choose, default_device_memory
from shardax.train.auto.options import (
    Counts,
    Rules,
    candidate_plans,
    check_candidates,
    check_one_platform,
    check_options,
    check_pipeline_placed,
    check_rules_meshes,
    check_search_loss,
    step_config,
)
from shardax.train.auto.space import SearchSpace
from shardax.train.config import StepConfig


@public("sx.search_plans")
def search_plans(
    space: SearchSpace,
    abstract_state_or_init: Any,
    *,
    loss_fn: Callable[..., Any],
    batch: Any,
    model_flops: float | None = None,
    model_flops_note: str | None = None,
) -> AutoPlan:
    """Compiles every candidate of ``space`` once for abstract values, analyses it as
    ``sx.estimate`` does, and picks the one to train with.

    >>> space = sx.SearchSpace(meshes=[{"data": 8}, {"data": 4, "context": 2}])
    >>> apply = lambda params, x: x @ params["w"]
    >>> init = lambda: sx.TrainState.from_params({"w": jnp.zeros((64, 8))}, apply, optax.sgd(0.1))
    >>> mse = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)
    >>> report = sx.search_plans(space, init, loss_fn=mse, batch={"x": jnp.zeros((16, 4, 64))})
    >>> report.candidates[-1].name, report.flags  # doctest: +ELLIPSIS
    ('context=2:fsdp', '--mesh ... --plan ...')

    Args:
        space: the meshes, plans, microbatch counts and step settings to rank.
        abstract_state_or_init: the model, as [`auto_plan`][shardax.auto_plan] takes it: a
            ``sx.TrainState``, a function returning one, or ``{variant: either}`` (e.g.
            remat policies, least to most memory-saving); a [`Layout`][shardax.train.Layout]
            may bring its own.
        loss_fn, batch: the step's loss and its batch (arrays or ``ShapeDtypeStruct``s).
        model_flops, model_flops_note: as ``sx.estimate``'s, for every candidate.

    Returns:
        an [`AutoPlan`][shardax.train.AutoPlan]: every candidate (name, mesh, memory, sent
        bytes, predicted step with its interval), the pick (``report.config``, the
        settings to build its step with; ``report.estimate``, its whole analysis), the
        reason, ``report.flags`` and ``report.launch(command)``.
    """
    expect = "a sx.SearchSpace(meshes=[...], ...)"
    if not isinstance(space, SearchSpace):
        raise TypeError(f"space must be {expect}, got {type(space).__name__}")
    as_function("loss_fn", loss_fn, "a function loss_fn(model, batch)")
    check_search_loss(loss_fn)
    batch = _abstract_batch(batch)
    meshes = [layout.mesh for layout in space.layouts]
    check_one_platform(meshes)
    check_rules_meshes(meshes, space.tp_rules, space.pipeline_rules, space.stage_axis)
    groups = space.groups(abstract_state_or_init, loss_fn, batch)
    for group in groups:
        if space.pipeline_rules:
            check_pipeline_placed(group.plans, next(iter(group.states.values())), space.stage_axis)
    first = groups[0].mesh.devices.flat[0]
    budget = default_device_memory(first) if space.device_memory is None else space.device_memory
    figures = {"model_flops": model_flops, "model_flops_note": model_flops_note}
    measured, left = [], space.max_compiles
    for group in groups:
        found = compile_candidates(group, batch, budget, left, figures)
        measured += found
        left = None if left is None else left - sum(not c.skipped for c in found)
    names = [c.name for c in measured]
    if len(set(names)) < len(names):
        raise ValueError(f"candidates share a name ({names}); give each mesh's Layout its own name")
    notes = list(dict.fromkeys(_layout_note(g) for g in groups))  # once per mesh
    note = "".join(notes) if len(notes) > 1 else ""
    return choose(measured, budget, "train step", note)


def _layout_note(group: Group) -> str:
    """``; <name>: mesh <axes>[, sx.pipeline in M microbatches]`` for the reason."""
    shape = ",".join(f"{k}={v}" for k, v in group.mesh.shape.items())
    micro = f", sx.pipeline in {group.microbatches} microbatches" if group.microbatches else ""
    return f"; {group.name or ', '.join(group.plans)}: mesh {shape}{micro}"


def _abstract_batch(batch: Any) -> Any:
    batch = abstract(batch)
    if not any(is_array(x) for x in jax.tree.leaves(batch)):
        raise ValueError(f"batch must hold arrays or ShapeDtypeStructs, got {batch!r}")
    return batch


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
        abstract_state_or_init: a [`TrainState`][shardax.TrainState] (arrays or
            ``ShapeDtypeStruct``s), or a function of no arguments returning one, run
            under ``jax.eval_shape``; or ``{variant name: either}`` to rank model
            variants too (e.g. remat policies), ordered from least to most
            memory-saving (see ``compile_candidates`` for what
            that order prunes).
        loss_fn, batch: with both, the whole train step (``make_train_step``) is
            compiled for ``batch``'s shapes (arrays or ``ShapeDtypeStruct``s), so
            activations and the forward pass's collectives count. With neither, only
            the optimizer update is (gradients as the step would hand them over).
        device_memory: bytes per device to fit in (default: the device's reported
            limit, a GPU target's ``memory_fraction`` of its memory, else the hardware
            table's figure; with none, nothing is rejected and the report says so).
        axis: the data axis (or axes) the batch and the plans split over (default:
            ``config.data_axis``, else ``"data"``).
        min_size, tp_rules: as for ``sx.fsdp`` and ``sx.rules``; with ``tp_rules`` a
            ``fsdp+tp`` candidate joins (see ``candidate_plans``).
        pipeline_rules, stage_axis: with rules that place the model's stacked layers
            over ``stage_axis`` (regex rules or a plan, e.g.
            ``gpt.plan(mesh, model, "pipeline")``), a ``pipeline`` candidate joins; the
            model must run its layers with ``sx.pipeline`` (see ``candidate_plans``).
        candidates: ``{name: plan}`` to measure instead of ``candidate_plans``.
        accumulate: as for ``make_train_step``; or a sequence of counts, e.g.
            ``(1, 2, 4)``, each ranked (names end ``·mb<k>``). Each must split the
            batch's rows evenly over the data axis. Default: ``config.accumulate``,
            else 1.
        precision: as for ``make_train_step`` (default: ``config``'s, else
            ``"fp32"``).
        config: the step's settings ([`StepConfig`][shardax.train.StepConfig], its ``plan``
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
    config = step_config(mesh, config, axis, precision)
    axis = config.data_axis
    if accumulate is None:
        accumulate = config.accumulate
    options = check_options(device_memory, min_size, tp_rules, pipeline_rules, stage_axis)
    device_memory, min_size = options["device_memory"], options["min_size"]
    check_rules_meshes([mesh], tp_rules, pipeline_rules, stage_axis)
    if loss_fn is not None:
        as_function("loss_fn", loss_fn, "a function loss_fn(model, batch) or None")
        check_search_loss(loss_fn)
    if (loss_fn is None) != (batch is None):
        raise ValueError(
            "pass loss_fn and batch together (to compile the whole step) or "
            f"neither (the update alone); got loss_fn={loss_fn!r} and batch of type "
            f"{type(batch).__name__}"
        )
    if batch is not None:
        batch = _abstract_batch(batch)
    budget = default_device_memory(mesh.devices.flat[0]) if device_memory is None else device_memory
    known = candidate_plans(mesh, axis, min_size, tp_rules, pipeline_rules, stage_axis)
    plans = known if candidates is None else check_candidates(mesh, candidates, known)
    group = Group.build(plans, abstract_state_or_init, loss_fn, config, accumulate, batch)
    state = next(iter(group.states.values()))
    split = {name: _split_axes(plan, state) for name, plan in plans.items()}
    if pipeline_rules and not candidates:
        check_pipeline_placed(plans, state, stage_axis)
    measured = compile_candidates(group, batch, budget)
    what = "train step" if loss_fn is not None else "optimizer update"
    return choose(measured, budget, what, _compared(mesh, axis, split))


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
