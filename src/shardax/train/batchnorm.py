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

A layer written for ``pmap`` often names pmap's axis, not the mesh's: flax's ImageNet
example has ``nn.BatchNorm(axis_name="batch")``. A name that is no mesh axis and is not
bound where the layer runs (by the model's own ``vmap``, say) can only be that: it is
taken as the data axis (removed or rebound as above). An unbound name that is another
mesh axis (``"model"`` under ``"jit"``) is refused, naming the layer, its axis name and
the mesh's axes. Linen layers are checked as they are called; an NNX model with such a
name is traced once more, abstractly (``jax.eval_shape``), to learn whether its own
transforms bind it.

Only the bound copy the loss sees changes; the user's model and the state do not.

>>> loss = over_data_axis(lambda model, batch: 0.0, "data", mapped=True)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from shardax._extras import equinox, is_equinox


def _names(axis: Any) -> tuple[Any, ...]:
    if axis is None:
        return ()
    return tuple(axis) if isinstance(axis, tuple | list) else (axis,)


def is_bound(name: Any) -> bool:
    """Whether the axis ``name`` is bound here (by shard_map, pmap or a vmap)."""
    try:
        jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def _unbound(current: Any, data: tuple[str, ...]) -> list[Any]:
    """The names of ``current`` that are neither data axes nor bound here."""
    return [n for n in _names(current) if n not in data and not is_bound(n)]


def _rebound(
    current: Any,
    data: tuple[str, ...],
    mapped: bool,
    aliases: Any = (),
) -> Any:
    """The ``axis_name`` a layer should have: ``current`` (Equinox's vmap axis, say)
    plus the data axes when mapped, minus them when not; ``aliases`` (pmap-era names of
    the data axis) go as the data axes go."""
    names = [n for n in _names(current) if n not in data and n not in aliases]
    names += list(data) if mapped else []
    if not names:
        return None
    return names[0] if len(names) == 1 else tuple(names)


def _check_aliases(
    layer: str, current: Any, unbound: list[Any], mesh_axes: tuple[str, ...]
) -> None:
    """Refuses an unbound ``axis_name`` that is a mesh axis other than the data axis."""
    others = [n for n in unbound if n in mesh_axes]
    if others:
        raise ValueError(
            f"BatchNorm {layer!r} has axis_name={current!r}, but {others[0]!r} is a mesh "
            f"axis (the mesh's axes: {list(mesh_axes)}) that this step does not bind, and "
            "not its data axis; give the layer the data axis's name, or no axis_name (the "
            "step binds the data axis itself)"
        )


def _bind_nnx(model: nnx.Module, data: tuple[str, ...], mapped: bool, aliases: Any = ()) -> None:
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            module.axis_name = _rebound(module.axis_name, data, mapped, aliases)


def _nnx_aliases(
    model: nnx.Module, data: tuple[str, ...], mesh_axes: tuple[str, ...], run: Any
) -> tuple[Any, ...]:
    """The pmap-era axis names of ``model``'s NNX BatchNorm layers: unbound at the loss,
    no mesh axis, and unbound where the layer runs too (``run(model)``, traced abstractly
    on a copy, fails naming them; the model's own ``nnx.vmap`` binds its names)."""
    found: dict[Any, None] = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            unbound = _unbound(module.axis_name, data)
            _check_aliases("/".join(map(str, path)), module.axis_name, unbound, mesh_axes)
            found.update(dict.fromkeys(unbound))
    if not found:
        return ()
    try:
        jax.eval_shape(lambda: run(nnx.clone(model)))
    except NameError as e:
        named = tuple(n for n in found if str(n) in str(e))
        return named or tuple(found)
    return ()


def _bind_equinox(model: Any, data: tuple[str, ...], mapped: bool) -> Any:
    eqx = equinox()

    def is_bn(x: Any) -> bool:
        return isinstance(x, eqx.nn.BatchNorm)

    def bind(x: Any) -> Any:
        if not is_bn(x):
            return x
        # An Equinox BatchNorm always names the vmap axis over the examples.
        return eqx.tree_at(lambda bn: bn.axis_name, x, _rebound(x.axis_name, data, mapped))

    return jax.tree.map(bind, model, is_leaf=is_bn)


@contextlib.contextmanager
def _bind_linen(data: tuple[str, ...], mapped: bool, mesh_axes: tuple[str, ...]) -> Iterator[None]:
    def interceptor(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        if isinstance(module, nn.BatchNorm) and context.method_name == "__call__":
            # Checked where the layer runs: a name the model's own nn.vmap binds stays.
            unbound = _unbound(module.axis_name, data)
            layer = "/".join(map(str, module.scope.path)) if module.scope else module.name
            _check_aliases(layer, module.axis_name, unbound, mesh_axes)
            rebound = _rebound(module.axis_name, data, mapped, unbound)
            # The instance is created anew in each traced call: changing it is local.
            object.__setattr__(module, "axis_name", rebound)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(interceptor):
        yield


def over_data_axis(
    loss_fn: Callable[..., Any],
    data_axis: str | tuple[str, ...],
    mapped: bool,
    mesh_axes: tuple[str, ...] = (),
) -> Callable[..., Any]:
    """``loss_fn`` with the model's BatchNorm layers normalizing over the global batch
    (see the module doc): ``mapped`` is True under shard_map and pmap, where
    ``data_axis`` is bound; ``mesh_axes``: the mesh's axis names (a pmap-era name is
    none of them)."""
    data = _names(data_axis)

    @functools.wraps(loss_fn)
    def bound(model: Any, *args: Any, **kwargs: Any) -> Any:
        # args: (batch,), or (state, batch) for an Equinox model with its eqx.nn.State
        with _bind_linen(data, mapped, mesh_axes):
            if isinstance(model, nnx.Module):
                run = lambda copy: loss_fn(copy, *args, **kwargs)  # noqa: E731
                _bind_nnx(model, data, mapped, _nnx_aliases(model, data, mesh_axes, run))
            elif is_equinox(model):
                model = _bind_equinox(model, data, mapped)
            return loss_fn(model, *args, **kwargs)

    return bound
