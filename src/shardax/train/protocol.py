"""The step protocol: what a compiled program computes, given to it as functions.

A ``Program`` runs the same per-shard machinery for the train and the eval step; what
differs is a ``StepWork``, four functions (and one flag) the step hands the program when
it is built. The program calls them; they never call back into it:

- ``objective(out) -> (loss, aux)``: reads what ``loss_fn`` returned;
- ``view(model) -> model``: the model ``loss_fn`` sees (inference mode for evaluation);
- ``differentiate(loss, params, loss_scale) -> (grads | None, loss, aux, model_state)``:
  ``loss(params) -> (loss, (aux, model_state))`` is one (micro)batch's loss;
- ``finish(state, grads, loss, aux, model_state) -> out``: the program's result, from
  the whole global batch's means: ``(state, metrics)``, or ``metrics`` when
  ``returns_state`` is False.

>>> work = StepWork(
...     objective=lambda out: (out, None),
...     differentiate=lambda loss, params, scale: (None, loss(params), None, None),
...     finish=lambda state, grads, loss, aux, model_state: loss,
...     returns_state=False,
... )
>>> work.out("state", "metrics"), work.view("model")
('metrics', 'model')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


def _as_is(model: Any) -> Any:
    return model


class StepWork(NamedTuple):
    """The step protocol's functions (see the module doc)."""

    objective: Callable[[Any], tuple[Any, Any]]
    differentiate: Callable[[Callable[[Any], Any], Any, Any], tuple[Any, Any, Any, Any]]
    finish: Callable[..., Any]
    view: Callable[[Any], Any] = _as_is
    returns_state: bool = True

    def out(self, state: Any, metrics: Any) -> Any:
        """The program's output (or its shardings, specs) from the state's and metrics'."""
        return (state, metrics) if self.returns_state else metrics

    def metrics_of(self, out: Any) -> Any:
        """The metrics of the program's output."""
        return out[1] if self.returns_state else out
