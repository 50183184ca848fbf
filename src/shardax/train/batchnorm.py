"""BatchNorm over the global batch in every mode, with one model definition.

Under ``"jit"`` and ``"single"`` a BatchNorm layer sees the whole global batch, so its
batch statistics are the global ones. Under ``"shard_map"`` and ``"pmap"`` each device
sees only its slice, and a layer whose ``axis_name`` is unset normalizes with its own
slice's statistics: a different model from the one trained on one device. The step binds
the data axis for the BatchNorm layers of Flax NNX (``nnx.BatchNorm``), Flax Linen
(``nn.BatchNorm``) and Equinox (``eqx.nn.BatchNorm``) while it runs the loss, so the
statistics are means over the whole global batch (equal slices: the mean of the
devices' means) and the same model trains the same in every mode:

- mapped (shard_map, pmap): the data axis is added to the layer's ``axis_name`` (NNX,
  Linen: it is set when unset; Equinox: its vmap axis name becomes
  ``(name, data_axis)``);
- not mapped (jit, single): a layer whose ``axis_name`` names the data axis (written
  for pmap) has it removed, since the batch is already whole.

Only the bound copy the loss sees changes; the user's model and the state do not.

>>> loss = over_data_axis(lambda model, batch: 0.0, "data", mapped=True)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
from flax import nnx

from shardax.train.model import is_equinox


def _names(axis: Any) -> tuple[Any, ...]:
    if axis is None:
        return ()
    return tuple(axis) if isinstance(axis, tuple | list) else (axis,)


def _rebound(current: Any, data: tuple[str, ...], mapped: bool) -> Any:
    """The ``axis_name`` a layer should have: ``current`` (Equinox's vmap axis, say)
    plus the data axes when mapped, minus them when not."""
    names = [n for n in _names(current) if n not in data]
    names += list(data) if mapped else []
    if not names:
        return None
    return names[0] if len(names) == 1 else tuple(names)


def _bind_nnx(model: nnx.Module, data: tuple[str, ...], mapped: bool) -> None:
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            module.axis_name = _rebound(module.axis_name, data, mapped)


def _bind_equinox(model: Any, data: tuple[str, ...], mapped: bool) -> Any:
    import equinox as eqx

    def is_bn(x: Any) -> bool:
        return isinstance(x, eqx.nn.BatchNorm)

    def bind(x: Any) -> Any:
        if not is_bn(x):
            return x
        # An Equinox BatchNorm always names the vmap axis over the examples.
        return eqx.tree_at(lambda bn: bn.axis_name, x, _rebound(x.axis_name, data, mapped))

    return jax.tree.map(bind, model, is_leaf=is_bn)


@contextlib.contextmanager
def _bind_linen(data: tuple[str, ...], mapped: bool) -> Iterator[None]:
    import flax.linen as nn

    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
            # The instance is created anew in each traced call: changing it is local.
            object.__setattr__(module, "axis_name", _rebound(module.axis_name, data, mapped))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield


def over_data_axis(
    loss_fn: Callable[..., Any], data_axis: str | tuple[str, ...], mapped: bool
) -> Callable[..., Any]:
    """``loss_fn`` with the model's BatchNorm layers normalizing over the global batch
    (see the module doc): ``mapped`` is True under shard_map and pmap, where
    ``data_axis`` is bound."""
    data = _names(data_axis)

    @functools.wraps(loss_fn)
    def bound(model: Any, *args: Any, **kwargs: Any) -> Any:
        # args: (batch,), or (state, batch) for an Equinox model with its eqx.nn.State
        if isinstance(model, nnx.Module):
            _bind_nnx(model, data, mapped)
        elif is_equinox(model):
            model = _bind_equinox(model, data, mapped)
        with _bind_linen(data, mapped):
            return loss_fn(model, *args, **kwargs)

    return bound
