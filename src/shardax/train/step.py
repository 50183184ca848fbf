"""The train step: gradients, the optimizer update, loss scaling and update statistics.

[`TrainStep`][shardax.train.TrainStep] is a ``Program`` (placement, modes, accumulation,
the compiled-program cache) given the train step's work (``StepWork``): the loss and aux
(``loss_and_aux``), ``differentiate`` and
[`TrainStep.finish`][shardax.train.TrainStep.finish], which applies the update. It is
written once, for one shard of the batch: under ``"jit"`` and ``"single"`` the shard is
the whole global batch and the cross-device reductions are identities; under
``"shard_map"`` and ``"pmap"`` each device sees its slice and the program reduces over the
data axis. So every mode computes the same update from the same global batch (up to the
order of floating-point sums), when:

- the loss is a mean over the examples (or tokens) it was given, and a batch whose count
  of them differs between devices (padding, token weights) carries a ``"mask"`` leaf, by
  which the devices are weighted ([`shardax.masked_mean`][shardax.masked_mean]); without one,
  ``"shard_map"`` and ``"pmap"`` average the devices' means with equal weights;
- random numbers come from the ``rng`` argument (one key per example): the framework's
  RNG (``step_rng``, Linen's ``"dropout"``) folds in the device index under
  ``"shard_map"`` and ``"pmap"``, and a model holding its own NNX ``Rngs`` is refused
  there unless ``rng_per_device=True``;
- the model normalizes nothing per device, apart from NNX, Linen and Equinox BatchNorm,
  which the step binds to the data axis (``shardax.train.batchnorm``).

[`shardax.verify`][shardax.verify] checks it for a step, a state and a batch, and names the cause.

Built by [`shardax.make_train_step`][shardax.make_train_step].

>>> mesh = sx.make_mesh({"data": -1})
>>> state = sx.TrainState.from_params({"w": jnp.zeros(3)}, lambda p, x: x @ p["w"],
...                                   optax.sgd(0.1))
>>> def loss_fn(model, batch):
...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
>>> step = sx.make_train_step(loss_fn, mesh=mesh)
>>> state, metrics = step(step.shard(state), {"x": np.ones((16, 3)), "y": np.ones(16)})
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding

from shardax.checks import public
from shardax.train.config import StepConfig, as_config
from shardax.train.loss import as_metrics, loss_and_aux
from shardax.train.precision import (
    adjust_loss_scale,
    all_finite,
    cast_like,
    policy_name,
    scale_loss,
    select_tree,
    unscale,
)
from shardax.train.program import Program
from shardax.train.protocol import StepWork
from shardax.train.state import TrainState
from shardax.train.stats import every_nth


def differentiate(loss: Callable[[Any], Any], params: Any, loss_scale: Any):
    """The gradients of ``loss`` at ``params`` (of the scaled loss, with loss scaling;
    [`TrainStep.finish`][shardax.train.TrainStep.finish] unscales them), the loss, its aux and the
    new model state."""

    def scaled(params: Any) -> tuple[jax.Array, Any]:
        value, rest = loss(params)
        return scale_loss(value, loss_scale), (value, rest)

    (_, (value, (aux, model_state))), grads = jax.value_and_grad(scaled, has_aux=True)(params)
    return grads, value, aux, model_state


@public("sx.train.TrainStep")
class TrainStep(Program):
    """``step(state, batch) -> (state, metrics)``; ``step.shard(state)`` places a state.

    Attributes: ``mode``, ``mesh``, ``plan``, ``accumulate``, ``donate``, ``data_axis``,
    ``precision``, ``stats``, ``stats_every``; ``lower(state, batch)`` is the compiled step.
    """

    def __init__(
        self, loss_fn: Callable[..., Any], config: StepConfig | None = None, **settings: Any
    ) -> None:
        """``config`` (a [`StepConfig`][shardax.train.StepConfig]), or the keywords to
        build one from, as [`shardax.make_train_step`][shardax.make_train_step] takes them."""
        config = as_config(config, settings)
        self.stats, self.stats_every = config.stats, config.stats_every
        self._scaling = config.precision.loss_scaling  # type: ignore[union-attr]
        work = StepWork(objective=loss_and_aux, differentiate=differentiate, finish=self.finish)
        super().__init__(loss_fn, config, work)

    def finish(self, state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any):
        """The updated state and the metrics: the loss, the aux metrics, ``stats`` and,
        with loss scaling, ``loss_scale``. A step with non-finite gradients under loss
        scaling changes nothing but the step count and the scale."""
        grads = self._shard_grads(grads)
        metrics = as_metrics(loss, aux)
        if self._scaling is None:
            new = self.update(state, grads, model_state)
            return new, {**metrics, **every_nth(new, grads, self.stats, self.stats_every)}
        if "loss_scale" in metrics:
            raise ValueError(
                "loss_fn's aux metrics must not have a 'loss_scale' entry with loss scaling "
                f"(precision={policy_name(self.precision)!r}); the step reports the scale there"
            )
        grads = unscale(grads, state.loss_scale)
        state = self.update(state, grads, model_state)
        stats = every_nth(state, grads, self.stats, self.stats_every)
        return state, {**metrics, **stats, "loss_scale": state.loss_scale.scale}

    def update(self, state: TrainState, grads: Any, model_state: Any) -> TrainState:
        """The state after the optimizer's update with the (unscaled) ``grads``; with loss
        scaling, non-finite gradients change nothing but the step count and the scale.
        [`shardax.verify`][shardax.verify] applies it on one device to the distributed
        gradients. The optimizer state keeps its dtypes (moments narrowed to a bf16
        ``param_dtype`` stay bf16 where the transformation computes in f32), so step 2
        compiles nothing new."""
        updated = state.apply_gradients(grads, model_state)
        updated = updated.replace(opt_state=cast_like(updated.opt_state, state.opt_state))
        if self._scaling is None:
            return updated
        finite = all_finite(grads)
        state = select_tree(finite, updated, state.replace(step=updated.step))
        return state.replace(loss_scale=adjust_loss_scale(state.loss_scale, finite, self._scaling))

    def _shard_grads(self, grads: Any) -> Any:
        """zero2: the gradients constrained to the optimizer state's sharding."""
        plan = self.state_plan
        if not getattr(plan, "shard_grads", False):
            return grads
        return jax.tree.map(
            lambda g, s: lax.with_sharding_constraint(g, NamedSharding(self.mesh, s)),
            grads,
            plan.mirror_specs(grads),
        )

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One update on the global ``batch``; metrics are means over its real examples."""
        return super().__call__(state, batch)
