"""The eval step: the forward pass on every device, no update.

[`EvalStep`][shardax.train.EvalStep] is a ``Program`` whose work (``StepWork``:
``objective``, ``forward``, ``metrics_of``, the model in inference mode) stops after the
forward pass: no gradients, no optimizer, no donation, and the state is never written. It
shares the train step's placement, modes, precision, microbatching and mask rules, so its
metrics are means over the real examples (or tokens) of the whole global batch in every
mode. NNX and Equinox models run in inference mode
(``shardax.train.model.deterministic``).

Built by [`shardax.make_eval_step`][shardax.make_eval_step].

>>> mesh = sx.make_mesh({"data": -1})
>>> state = sx.TrainState.from_params({"w": jnp.zeros(3)}, lambda p, x: x @ p["w"],
...                                   optax.sgd(0.1))
>>> def loss_fn(model, batch):
...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
>>> evaluate = sx.make_eval_step(loss_fn, mesh=mesh)
>>> float(evaluate(evaluate.shard(state), {"x": np.ones((16, 3)), "y": np.ones(16)})["loss"])
1.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from shardax.checks import public
from shardax.train.config import StepConfig, as_config
from shardax.train.loss import metric_dict
from shardax.train.model import deterministic
from shardax.train.program import Program
from shardax.train.protocol import StepWork
from shardax.train.state import TrainState


def objective(out: Any) -> tuple[dict[str, Any], None]:
    """The metrics: a dict, a scalar loss or ``(loss, aux)``
    (``shardax.train.loss.metric_dict``)."""
    return metric_dict(out), None


def forward(loss: Callable[[Any], Any], params: Any, loss_scale: Any):
    """No gradients: the forward pass only."""
    metrics, (aux, model_state) = loss(params)
    return None, metrics, aux, model_state


def metrics_of(state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any) -> Any:
    """The metrics, means over the whole global batch."""
    return loss


@public("sx.train.EvalStep")
class EvalStep(Program):
    """``evaluate(state, batch) -> metrics``; ``evaluate.shard(state)`` places a state.

    Attributes as for [`TrainStep`][shardax.train.TrainStep] (``donate`` is False).
    """

    def __init__(
        self, metric_fn: Callable[..., Any], config: StepConfig | None = None, **settings: Any
    ) -> None:
        """``config`` (a [`StepConfig`][shardax.train.StepConfig]; see
        [`for_eval`][shardax.train.StepConfig.for_eval]), or the keywords to build one."""
        work = StepWork(
            objective=objective,
            differentiate=forward,
            finish=metrics_of,
            view=deterministic,
            returns_state=False,
        )
        super().__init__(metric_fn, as_config(config, settings), work)

    def __call__(self, state: TrainState, batch: Any) -> dict[str, jax.Array]:
        """The metrics on the global ``batch``: means over its real examples or tokens."""
        return super().__call__(state, batch)
