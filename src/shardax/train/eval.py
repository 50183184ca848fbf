"""``make_eval_step``: the train step without the update.

The eval step is a :class:`~shardax.train.step.TrainStep` whose per-shard work stops
after the forward pass: no gradients, no optimizer, no donation, and the state is never
written. It shares the train step's placement, modes, precision, microbatching and
mask rules, so its metrics are means over the real examples (or tokens) of the whole
global batch in every mode. NNX and Equinox models run in inference mode
(:func:`shardax.train.model.deterministic`).

>>> evaluate = sx.make_eval_step(loss_fn, mesh=mesh)
>>> metrics = evaluate(state, {"x": np.ones((16, 3)), "y": np.ones(16)})
>>> float(metrics["loss"])
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from shardax.mesh.axes import DATA_AXIS
from shardax.plan.core import Plan
from shardax.train.model import deterministic
from shardax.train.precision import Precision, resolve
from shardax.train.state import TrainState
from shardax.train.step import LossFn, Mode, TrainStep, _loss_and_aux, _metrics


def _as_metrics(out: Any) -> tuple[dict[str, Any], None]:
    """A metric function's output as a dict of floating metrics: a dict as it is, a
    scalar as ``{"loss": out}``, ``(loss, aux)`` as the train step's metrics."""
    metrics = out if isinstance(out, dict) else _metrics(*_loss_and_aux(out))
    return jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.result_type(float)), metrics), None


class EvalStep(TrainStep):
    """``evaluate(state, batch) -> metrics``; ``evaluate.shard(state)`` places a state.

    Built by :func:`make_eval_step`; see :class:`~shardax.train.step.TrainStep` for
    the attributes.
    """

    _objective = staticmethod(_as_metrics)
    _view = staticmethod(deterministic)

    def __init__(
        self,
        metric_fn: LossFn,
        *,
        mesh: Mesh,
        plan: Plan | None,
        mode: str,
        accumulate: int,
        data_axis: str,
        precision: str | Precision,
    ) -> None:
        # Loss scaling only protects gradients; evaluation has none.
        policy = resolve(precision)._replace(loss_scaling=None)
        super().__init__(
            metric_fn,
            mesh=mesh,
            plan=plan,
            mode=mode,
            accumulate=accumulate,
            donate=False,
            data_axis=data_axis,
            precision=policy,
        )

    def _grads(self, state: TrainState, model_state: Any, batch: Any, keys: Any, rng: Any):
        metrics, (aux, model_state) = self._loss(state, model_state, batch, keys, rng)(state.params)
        return None, metrics, aux, model_state

    @staticmethod
    def _out(state: Any, metrics: Any) -> Any:
        return metrics

    @staticmethod
    def _metrics_of(out: Any) -> Any:
        return out

    def _finish(self, state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any):
        return loss

    def __call__(self, state: TrainState, batch: Any) -> dict[str, Any]:  # type: ignore[override]
        """The metrics on the global ``batch``: means over its real examples or tokens."""
        return super().__call__(state, batch)


def make_eval_step(
    metric_fn: LossFn,
    *,
    mesh: Mesh,
    plan: Plan | None = None,
    mode: Mode = "jit",
    accumulate: int = 1,
    data_axis: str = DATA_AXIS,
    precision: str | Precision = "fp32",
) -> EvalStep:
    """A compiled ``evaluate(state, batch) -> metrics`` that never changes ``state``.

    Args:
        metric_fn: ``metric_fn(model, batch)`` returning a dict of metrics, a scalar
            loss (reported as ``"loss"``) or ``(loss, aux)`` like a train step's loss
            function, so the training loss function serves as is. Each metric is the
            mean over the real examples (or tokens, with a ``(batch, seq)`` mask) of the
            batch it was given (see :func:`shardax.masked_mean`); shards and
            microbatches are weighted by their count of real examples or tokens. It
            may take ``rng`` and ``step_rng`` like a train step's loss function; NNX and
            Equinox models are in inference mode (dropout off, running averages).
        mesh, plan, mode, accumulate, data_axis: as for :func:`make_train_step`; use
            the train step's mesh and plan to evaluate its state where it lies.
        precision: the compute and output dtypes, as for :func:`make_train_step`
            (without loss scaling).
    """
    return EvalStep(
        metric_fn,
        mesh=mesh,
        plan=plan,
        mode=mode,
        accumulate=accumulate,
        data_axis=data_axis,
        precision=precision,
    )
