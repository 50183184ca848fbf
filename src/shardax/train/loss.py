"""The loss contract: what ``loss_fn`` takes and returns, checked once.

``loss_fn(model, batch) -> loss | (loss, aux)``:

- ``model`` is what the framework calls a model (an NNX or Equinox module, a bound
  Linen module, ``partial(apply_fn, params)`` for plain pytrees);
- ``loss`` is a scalar, the mean over the real examples of ``batch``
  ([`shardax.masked_mean`][shardax.masked_mean]);
- ``aux`` is a dict of metrics (scalars or arrays), or anything else under ``"jit"`` and
  ``"single"``, where it comes back as ``metrics["aux"]``;
- two optional parameters are filled by the step: ``rng`` (one key per example) and
  ``step_rng`` (one key per step). Any other parameter without a default is refused
  when the step is built: pass other values through a closure or a batch field.

>>> def loss_fn(model, batch, rng):
...     return jnp.mean(model(batch["x"]))
>>> rng_arguments(loss_fn)
('rng',)
>>> loss_and_aux((jnp.float32(1.0), {"accuracy": jnp.float32(0.5)}))[1]
{'accuracy': Array(0.5, dtype=float32)}
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.plan.tree import is_key
from shardax.train.stats import STATS

FILLED = ("rng", "step_rng")
"""The ``loss_fn`` parameters the step fills: per-example keys and the step's key."""

STATE = "state"
"""The name of ``loss_fn``'s second parameter when it takes the model's Equinox state:
``loss_fn(model, state, batch) -> (loss | (loss, aux), new_state)``."""


def takes_state(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn``'s second parameter is named ``state``: Equinox's stateful
    contract, ``loss_fn(model, state, batch) -> (out, new_state)``."""
    try:
        names = [p.name for p in inspect.signature(loss_fn).parameters.values()]
    except (TypeError, ValueError):
        return False
    names = [n for n in names if n not in FILLED]
    return len(names) >= 3 and names[1] == STATE


def check_loss_fn(loss_fn: Callable[..., Any], batch_spec: Any = None) -> tuple[str, ...]:
    """The step keys ``loss_fn`` takes (``rng_arguments``), checked against the
    step's ``batch_spec``: a batch whose leaves are not examples has no example to give
    an ``rng`` key each."""
    filled = rng_arguments(loss_fn)
    if batch_spec is not None and "rng" in filled:
        raise ValueError(
            f"loss_fn takes 'rng' (one key per example), but "
            f"batch_spec={batch_spec!r} says the batch's leaves are not examples; "
            "take 'step_rng' (one key for the step) instead"
        )
    return filled


def rng_arguments(loss_fn: Callable[..., Any], what: str = "loss_fn") -> tuple[str, ...]:
    """The parameters of ``FILLED`` that ``loss_fn`` takes; raises ``TypeError``
    naming any other parameter the step cannot fill (after ``model`` and ``batch``)."""
    if not callable(loss_fn):
        raise TypeError(f"{what} must be a function {what}(model, batch), got {loss_fn!r}")
    try:
        parameters = list(inspect.signature(loss_fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = [p for p in parameters if p.name not in FILLED]
    leading = 3 if takes_state(loss_fn) else 2
    required = [
        p for p in rest[leading:] if p.kind in positional and p.default is inspect.Parameter.empty
    ] + [
        p
        for p in rest
        if p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    ]
    if required:
        names = ", ".join(repr(p.name) for p in required)
        raise TypeError(
            f"{what} takes {names}, which the step cannot fill: it passes (model, batch) "
            f"and, when {what} asks for them by name, {FILLED[0]!r} (one key per example) "
            f"and {FILLED[1]!r} (the step's key). Pass other values through a closure "
            f"(functools.partial({what}, ...)) or a field of the batch"
        )
    return tuple(p.name for p in parameters if p.name in FILLED)


def loss_and_aux(out: Any) -> tuple[jax.Array, Any]:
    """Splits ``loss`` or ``(loss, aux)``; the loss must be a scalar."""
    if isinstance(out, tuple):
        if len(out) != 2:
            raise TypeError(
                f"loss_fn must return loss or (loss, aux), got a tuple of {len(out)} items"
            )
        loss, aux = out
    else:
        loss, aux = out, {}
    if not hasattr(loss, "shape") or jnp.shape(loss) != ():
        got = (
            f"an array of shape {loss.shape} and dtype {loss.dtype}"
            if hasattr(loss, "shape")
            else f"{type(loss).__name__} {loss!r}"
        )
        raise TypeError(
            "loss_fn must return a scalar loss (the mean over the real examples it was "
            f"given), or (loss, aux); got {got}"
        )
    return loss, aux


def as_metrics(loss: jax.Array, aux: Any) -> dict[str, Any]:
    """``{"loss": loss, **aux}`` for a dict ``aux``, else ``{"loss": loss, "aux": aux}``;
    refuses names the step reports itself."""
    check_metric_values(aux, "loss_fn's aux")
    if isinstance(aux, dict):
        if "loss" in aux:
            raise ValueError("loss_fn's aux metrics must not have a 'loss' entry; it is the loss")
        taken = sorted(set(aux) & set(STATS))
        if taken:
            raise ValueError(
                f"loss_fn's aux metrics must not use the names {taken}: the step adds them "
                f"(see shardax.train.stats); rename them"
            )
        return {"loss": loss, **aux}
    return {"loss": loss, "aux": aux}


def _numeric(leaf: Any) -> bool:
    if isinstance(leaf, bool | int | float | complex | np.number):
        return True
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
        return False
    return bool(
        jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_) or is_key(leaf)
    )


def check_metric_values(tree: Any, what: str) -> None:
    """Raises ``TypeError`` naming the first leaf of ``tree`` (metrics, aux) that is not
    a number or a numeric array: a string, an object, an array of strings. The step
    returns its metrics from a compiled program, which holds numbers only."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not _numeric(leaf):
            where = jax.tree_util.keystr(path) if path else ""
            got = (
                f"an array of dtype {leaf.dtype}"
                if hasattr(leaf, "dtype")
                else f"{type(leaf).__name__} {leaf!r:.60}"
            )
            raise TypeError(f"{what}{where} must be a number or a numeric array, got {got}")


def check_mapped_aux(aux: Any, mode: str) -> None:
    """Under ``"shard_map"`` and ``"pmap"`` the aux is averaged over devices, which means
    something only for a dict of metrics; anything else (e.g. logits) is refused."""
    if aux is not None and not isinstance(aux, dict):
        what = (
            f"an array of shape {tuple(aux.shape)}"
            if hasattr(aux, "shape") and hasattr(aux, "dtype")
            else f"a {type(aux).__name__}"
        )
        raise TypeError(
            f"loss_fn returned (loss, aux) with aux {what}; under "
            f"mode={mode!r} each device's aux is averaged over the data axis, which is "
            "meaningful only for a dict of metrics (e.g. {'accuracy': acc}). Return a dict "
            "of scalar metrics, or use mode='jit', which returns any aux as metrics['aux']"
        )


def metric_dict(out: Any) -> dict[str, Any]:
    """A metric function's output as a dict of floating metrics: a dict as it is, a
    scalar as ``{"loss": out}``, ``(loss, aux)`` as the train step's metrics."""
    metrics = out if isinstance(out, dict) else as_metrics(*loss_and_aux(out))
    for name, value in metrics.items():
        if not isinstance(value, int | float | np.number | np.ndarray | jax.Array):
            raise TypeError(
                f"metric {name!r} must be a number or an array, got "
                f"{type(value).__name__} {value!r}"
            )
        check_metric_values(value, f"metric {name!r}")
    return jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.result_type(float)), metrics)
