"""``make_train_step`` and ``make_eval_step``: the two doors to the compiled steps.

``plan="auto"`` (or an [`AutoPlanOptions`][shardax.AutoPlanOptions]) gives an
[`AutoStep`][shardax.train.AutoStep], which picks its plan on the first call; any other
plan a [`TrainStep`][shardax.train.TrainStep].

>>> mesh = sx.make_mesh({"data": -1})
>>> step = sx.make_train_step(lambda model, batch: jnp.mean(model(batch["x"])), mesh=mesh)
>>> step.mode, step.plan.name, step.accumulate, step.donate, step.compiler_options
('jit', 'replicate', 1, True, {})
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from jax.sharding import Mesh

from shardax.checks import public, received
from shardax.mesh.axes import DATA_AXIS
from shardax.plan.core import Plan
from shardax.train.auto import AutoPlanOptions, AutoStep
from shardax.train.config import StepConfig
from shardax.train.diloco import DiLoCo
from shardax.train.eval import EvalStep
from shardax.train.islands import IslandStep
from shardax.train.precision import Precision
from shardax.train.stats import DEFAULT_STATS
from shardax.train.step import TrainStep

Mode = Literal["jit", "shard_map", "pmap", "single"]
LossFn = Callable[..., Any]


@public("sx.make_train_step")
def make_train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    plan: Plan | AutoPlanOptions | Literal["auto"] | None = None,
    mode: Mode = "jit",
    accumulate: int = 1,
    donate: bool = True,
    data_axis: str | tuple[str, ...] = DATA_AXIS,
    precision: str | Precision = "fp32",
    stats: Sequence[str] = DEFAULT_STATS,
    stats_every: int = 1,
    seq_axis: str | None = None,
    batch_spec: Any = None,
    rng_per_device: bool = False,
    compiler_options: Literal["auto", "xla"] | Mapping[str, Any] = "auto",
    config: StepConfig | None = None,
    diloco: DiLoCo | None = None,
) -> TrainStep | AutoStep | IslandStep:
    """A compiled ``step(state, batch) -> (state, metrics)`` for ``loss_fn``.

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``, where ``model`` is what
            the framework calls a model (NNX or Equinox module, bound Linen module,
            ``partial(apply_fn, params)``) and ``loss`` is a scalar: the mean over the
            real examples of ``batch`` (see [`shardax.masked_mean`][shardax.masked_mean]).
            If it takes an ``rng`` argument it receives one key per example,
            ``fold_in(fold_in(rng, step), i)`` for example ``i`` of the global batch, the
            same in every mode. If it takes a ``step_rng`` argument it receives one key
            for the step, ``fold_in(rng, step)``, e.g. for ``nnx.Rngs(dropout=step_rng)``:
            the same numbers under ``"jit"`` on any mesh and ``"single"``. With
            ``accumulate=k`` microbatch ``j`` gets ``fold_in(step_rng, j)``; under
            ``"shard_map"`` and ``"pmap"`` each device folds in its index, so devices draw
            different masks (use ``rng`` for keys that no mode changes).
        mesh: the device mesh; the batch is split over ``data_axis``.
        plan: shardings of the state (default: replicate), wrapped in
            [`sx.plan.follow_params`][shardax.plan.follow_params] so the optimizer state
            follows the params. ``"shard_map"`` and ``"pmap"`` support only replicating
            plans. ``step.init`` builds a state straight onto it; ``jit`` mode traces
            under ``jax.set_mesh(mesh)``, so ``sx.constrain`` in the model applies, with
            the mesh's axis types: on Explicit axes the model's own shardings
            (``out_sharding=``, ``jax.sharding.reshard``) apply, and on Auto axes
            computation follows the data (``shardax.train.axis_types``). ``sx.zero2`` also
            constrains the gradients to the optimizer state's sharding. ``"auto"``: the
            first ``step(state, batch)`` picks the plan with
            [`shardax.auto_plan`][shardax.auto_plan] and places the state on it
            (``step.auto_report``);
            ``sx.AutoPlanOptions(tp_rules=..., pipeline_rules=..., device_memory=...)``
            passes auto_plan's options (the fsdp+tp and pipeline candidates, the budget).
        mode: ``"jit"`` (jit with the plan's and the batch's shardings), ``"shard_map"``
            (per-device gradients all-reduced over the data axis), ``"pmap"`` (the
            classic layout: the batch reshaped to (devices, per device, ...); the replicated
            state goes in with ``in_axes=None`` rather than stacked on a device axis, so
            it is the same object in every mode) or ``"single"`` (the first device of
            ``mesh``).
        accumulate: number of microbatches the global batch is split into (``lax.scan``).
        donate: donate the state's buffers to the step.
        data_axis: the mesh axis the batch is split over, or a tuple of axes (HSDP:
            ``("replica", "fsdp")`` with ``plan=sx.fsdp(mesh, axis="fsdp")``).
        precision: ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` or an
            [`shardax.Precision`][shardax.Precision]. Params and optimizer state stay in
            the state in ``param_dtype`` (float32); params and floating batch leaves are
            cast to ``compute_dtype`` for the forward and backward passes; gradients reach
            the optimizer in ``param_dtype``. ``"fp16"`` adds dynamic loss scaling: the
            scale is ``state.loss_scale`` and ``metrics["loss_scale"]`` (the scale after
            the step); a step with non-finite gradients leaves params, optimizer and model
            state unchanged and halves the scale.
        stats: the update statistics the step returns (``shardax.train.stats``):
            ``"grad_norm"`` (global L2 norm of the all-reduced gradients),
            ``"param_norm"`` (after the update) and ``"learning_rate"`` (with
            ``optax.inject_hyperparams``). Default ``("learning_rate",)``, which is free:
            the norms are a pass over the gradients or params each, asked for by name;
            ``()`` for none.
        stats_every: compute ``grad_norm`` and ``param_norm`` only on the steps whose
            count (after the update) is a multiple of this, NaN on the others, inside
            the same compiled step (``lax.cond``): a loop that logs every N steps asks
            for ``stats_every=N`` and pays for the norms once per log.
        seq_axis: a mesh axis (e.g. ``"context"``) that splits dimension 1 of every
            batch leaf of rank >= 2, the sequence, besides the rows over ``data_axis``
            (``"jit"`` mode): each device then receives only its part of each sequence,
            as ``sx.attention`` over that axis computes it. The step places NumPy
            batches so itself (``step.place_batch``) and takes batches placed with
            ``sx.batch_sharding(mesh, seq_axis=...)``; the sequence must divide by the
            axis size. Default None: the rows alone are split.
        batch_spec: for a batch whose leaves are not examples (a graph batch: nodes,
            edges and graphs of different counts), how each leaf is split: a
            ``PartitionSpec`` for every leaf (``P()``: not split, whole on every device)
            or a pytree of them, a prefix of the batch (``shardax.data.spec``). The
            step places the batch so; ``"jit"`` and ``"single"`` only, ``accumulate=1``.
            Default None: every leaf's rows are examples, split over ``data_axis``.
        rng_per_device: under ``"shard_map"`` and ``"pmap"``, a model that draws from
            its own generators (an ``nnx.Rngs`` held in the model: typed keys in its
            state; a Linen module's ``make_rng``, e.g. ``nn.Dropout``) draws from a key
            folded with the device index, so its numbers are not one device's; that is
            refused by name unless ``rng_per_device=True`` accepts it. With
            ``accumulate`` > 1 such a model is refused in every mode. (Keys the step
            hands out, ``rng`` and ``step_rng``, need no opt-in.)
        compiler_options: the XLA options every jit of the step compiles with
            (``shardax.train.compiler``). ``"auto"`` (default): shardax's for the
            mesh's platform: on GPUs the latency-hiding scheduler, collective pipelining
            and combining, cuBLAS matmuls
            ([`shardax.train.gpu_options`][shardax.train.gpu_options]); on CPUs and
            TPUs none for now. ``"xla"``: XLA's defaults. A dict ``{"xla_...": value}``:
            exactly those. The step keeps them resolved as ``step.compiler_options``;
            under ``"pmap"`` they are none (``jax.pmap`` takes none; a dict is refused).
        config: the settings as one [`StepConfig`][shardax.train.StepConfig] (as
            [`shardax.auto_plan`][shardax.auto_plan] takes them), instead of the keywords
            above: with it, the others stay at their defaults (``mesh`` may be the
            config's own; ``plan`` may be given where the config has none, ``"auto"``
            included); a setting given beside it is refused, naming it.
        diloco: a [`DiLoCo`][shardax.DiLoCo] (``sx.DiLoCo(inner_steps=H)``): train the
            islands of the mesh's island axis apart, each with ``plan`` and the user's
            optimizer over the other axes, and average their params every H steps with
            the outer optimizer (``step.sync(state)``): an
            [`IslandStep`][shardax.train.IslandStep] (``shardax.train.islands``).

    The settings are checked once, into a [`StepConfig`][shardax.train.StepConfig]
    (``step.config``); ``sx.train.TrainStep(loss_fn, config)`` builds a step from one.

    Metrics are ``{"loss": loss, **aux}`` (or ``{"loss", "aux"}`` for non-dict aux), means
    over the real examples of the whole global batch in every mode, plus ``stats``.
    """
    settings = {
        "mesh": mesh,
        "mode": mode,
        "accumulate": accumulate,
        "donate": donate,
        "data_axis": data_axis,
        "precision": precision,
        "stats": stats,
        "stats_every": stats_every,
        "seq_axis": seq_axis,
        "batch_spec": batch_spec,
        "rng_per_device": rng_per_device,
        "compiler_options": compiler_options,
    }
    if config is not None:
        config = _config_alone(config, settings, make_train_step)
        if plan is not None and config.plan is not None and plan is not config.plan:
            raise TypeError(
                f"plan is given twice: plan={getattr(plan, 'name', plan)!r} and the config's "
                f"plan {config.plan_name!r}; give one of them"
            )
        settings = {k: getattr(config, k) for k in settings}
        plan = config.plan if plan is None else plan
    if isinstance(plan, str) and plan == "auto":
        plan = AutoPlanOptions()
    if isinstance(plan, AutoPlanOptions):
        if diloco is not None:
            raise ValueError("diloco takes a plan for inside an island, not plan='auto'")
        return AutoStep(loss_fn, plan, **settings)
    if diloco is not None:
        base = StepConfig(plan=plan, **settings) if config is None else config
        return IslandStep(loss_fn, dataclasses.replace(base, plan=plan), diloco)
    if config is not None:
        return TrainStep(loss_fn, dataclasses.replace(config, plan=plan))
    return TrainStep(loss_fn, StepConfig(plan=plan, **settings))


def _config_alone(config: Any, settings: dict[str, Any], door: Callable[..., Any]) -> StepConfig:
    """``config``, a [`StepConfig`][shardax.train.StepConfig], when none of ``settings``
    (the door's keywords) differs from the door's default (``mesh`` may be the config's
    own); else a ``TypeError`` naming them."""
    if not isinstance(config, StepConfig):
        raise TypeError(
            f"config must be a sx.train.StepConfig (sx.train.StepConfig(mesh=..., ...)), "
            f"got {received(config)}"
        )
    defaults = inspect.signature(inspect.unwrap(door)).parameters
    given = [
        k
        for k, v in settings.items()
        if not (
            v is defaults[k].default
            or (k == "mesh" and v is config.mesh)
            or _equal(v, defaults[k].default)
        )
    ]
    if given:
        shown = ", ".join(f"{k}={settings[k]!r}" for k in given)
        replace = ", ".join(f"{k}=..." for k in given)
        raise TypeError(
            f"config holds the step's settings, so {shown} beside it would conflict with "
            f"them: set them in the config (dataclasses.replace(config, {replace})), or "
            "leave config out"
        )
    return config


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an array's == is not one bool
        return False


@public("sx.make_eval_step")
def make_eval_step(
    metric_fn: LossFn,
    *,
    mesh: Mesh | None = None,
    plan: Plan | None = None,
    mode: Mode = "jit",
    accumulate: int = 1,
    data_axis: str | tuple[str, ...] = DATA_AXIS,
    precision: str | Precision = "fp32",
    seq_axis: str | None = None,
    batch_spec: Any = None,
    rng_per_device: bool = False,
    compiler_options: Literal["auto", "xla"] | Mapping[str, Any] = "auto",
    config: StepConfig | None = None,
) -> EvalStep:
    """A compiled ``evaluate(state, batch) -> metrics`` that never changes ``state``.

    Args:
        metric_fn: ``metric_fn(model, batch)`` returning a dict of metrics, a scalar
            loss (reported as ``"loss"``) or ``(loss, aux)`` like a train step's loss
            function, so the training loss function serves as is. Each metric is the
            mean over the real examples (or tokens, with a ``(batch, seq)`` mask) of the
            batch it was given (see [`shardax.masked_mean`][shardax.masked_mean]); shards and
            microbatches are weighted by their count of real examples or tokens. It
            may take ``rng`` and ``step_rng`` like a train step's loss function; NNX and
            Equinox models are in inference mode (dropout off, running averages).
        mesh, plan, mode, accumulate, data_axis, seq_axis, batch_spec, rng_per_device:
            as for [`make_train_step`][shardax.make_train_step]; use
            the train step's mesh and plan to evaluate its state where it lies.
        precision: the compute and output dtypes, as for
            [`make_train_step`][shardax.make_train_step] (without loss scaling).
        compiler_options: the XLA options, as for [`make_train_step`][shardax.make_train_step].
        config: the settings as one [`StepConfig`][shardax.train.StepConfig], as for
            [`make_train_step`][shardax.make_train_step] (its ``donate`` and ``stats`` do not
            apply).
    """
    if config is not None:
        settings = {
            "mesh": mesh,
            "plan": plan,
            "mode": mode,
            "accumulate": accumulate,
            "data_axis": data_axis,
            "precision": precision,
            "seq_axis": seq_axis,
            "batch_spec": batch_spec,
            "rng_per_device": rng_per_device,
            "compiler_options": compiler_options,
        }
        return EvalStep(metric_fn, _config_alone(config, settings, make_eval_step).for_eval())
    config = StepConfig(
        mesh=mesh,
        plan=plan,
        mode=mode,
        accumulate=accumulate,
        donate=False,
        data_axis=data_axis,
        precision=precision,
        stats=(),
        seq_axis=seq_axis,
        batch_spec=batch_spec,
        rng_per_device=rng_per_device,
        compiler_options=compiler_options,
    )
    return EvalStep(metric_fn, config.for_eval())
