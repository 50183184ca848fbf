"""Framework adapters: how a model splits into params, model state and static parts.

Each adapter is a small frozen dataclass kept as static data in a ``TrainState``. It
rebuilds what the user's ``loss_fn(model, batch)`` receives from the trainable params
and the non-trainable model state, and reads the model state back after the call:

- ``NNXModel``: an ``nnx.Module`` from its graphdef (``nnx.Param`` is trainable);
- ``EquinoxModel``: an ``eqx.Module`` from its static part (floating arrays are
  trainable, other arrays are model state);
- ``LinenModel``: a bound Linen module (collections other than "params" are model
  state, mutable during the call; every RNG stream it asks for is bound:
  ``linen_rngs``);
- ``ApplyFnModel``: ``functools.partial(apply_fn, params)`` for plain pytrees.

>>> adapter, params, model_state = split_model(eqx.nn.Linear(2, 3, key=jax.random.key(0)))
>>> model = adapter.bind(params, model_state, jax.random.key(1))
>>> model(jnp.ones(2)).shape
(3,)
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable
from typing import Any

import jax
from flax import linen, nnx
from flax.core import Scope
from flax.errors import InvalidRngError

from shardax._extras import equinox, is_equinox
from shardax.train.boxes import unconstrained_boxes


@dataclasses.dataclass(frozen=True)
class NNXModel:
    """An NNX module: its graphdef; params are the variables ``wrt`` selects (an NNX
    filter, ``nnx.Param`` unless an ``nnx.Optimizer`` says otherwise), the rest is model
    state."""

    graphdef: Any
    wrt: Any = nnx.Param

    def bind(self, params: Any, model_state: Any, rng: jax.Array) -> nnx.Module:
        # copy: the state's Variables belong to the outer trace; the model mutates its own.
        return nnx.merge(self.graphdef, params, model_state, copy=True)

    def model_state(self, model: nnx.Module, model_state: Any) -> Any:
        return nnx.split(model, self.wrt, ...)[2]


@dataclasses.dataclass(frozen=True)
class EquinoxModel:
    """An Equinox module: its static part (everything that is not an array).

    ``stateful``: the model comes with an ``eqx.nn.State`` (``eqx.nn.make_with_state``);
    the model state is then ``{"model": arrays, "state": state}``, and the loss function
    takes the state and returns the new one (``shardax.train.loss.STATE``)."""

    static: Any
    stateful: bool = False

    def bind(self, params: Any, model_state: Any, rng: jax.Array) -> Any:
        arrays = model_state["model"] if self.stateful else model_state
        return equinox().combine(params, arrays, self.static)

    def model_state(self, model: Any, model_state: Any) -> Any:
        return model_state


def linen_rngs(rng: jax.Array, streams: Any = ()) -> dict[str, jax.Array]:
    """The keys of a Linen module's RNG streams at a step whose key is ``rng``
    (``step_rng``): ``"dropout"`` is ``rng`` itself, any other stream ``name`` (a
    ``self.make_rng(name)``) is ``fold_in(rng, zlib.crc32(name.encode()))``, so no two
    streams draw alike.

    >>> sorted(linen_rngs(jax.random.key(0), ("lstm",)))
    ['dropout', 'lstm']
    """
    keys = {"dropout": rng}
    for name in streams:
        if name != "dropout":
            keys[name] = jax.random.fold_in(rng, zlib.crc32(name.encode()))
    return keys


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A Linen module, bound to its variables; non-"params" collections are mutable.
    Its RNG streams (``linen_rngs``): ``"dropout"``, and each other stream the
    module has asked for (``streams``: learned when a call asks for a new one)."""

    module: Any

    @property
    def streams(self) -> tuple[str, ...]:
        return self.__dict__.get("_streams", ())

    def add_stream(self, name: str) -> None:
        """Binds ``name`` from now on (not a field: the adapter's identity stays)."""
        object.__setattr__(self, "_streams", (*self.streams, name))

    def bind(self, params: Any, model_state: Any, rng: jax.Array) -> Any:
        mutable = list(model_state) if model_state else False
        return self.module.bind(
            {"params": params, **model_state},
            rngs=linen_rngs(rng, self.streams),
            mutable=mutable,
        )

    def model_state(self, model: Any, model_state: Any) -> Any:
        return {name: model.variables[name] for name in model_state}


@dataclasses.dataclass(frozen=True)
class ApplyFnModel:
    """Plain params and ``apply_fn(params, *args)``: the model is ``partial(apply_fn, params)``."""

    apply_fn: Callable[..., Any]

    def bind(self, params: Any, model_state: Any, rng: jax.Array) -> Any:
        return functools.partial(self.apply_fn, params)

    def model_state(self, model: Any, model_state: Any) -> Any:
        return model_state


ModelAdapter = NNXModel | EquinoxModel | LinenModel | ApplyFnModel

# flax's make_rng, whose ``name`` argument is the stream a module asks for: the module's
# method, and the scope's that it calls (a functional ``flax.core`` module calls it alone).
_MAKE_RNG = (linen.Module.make_rng.__code__, Scope.make_rng.__code__)


def asked_stream(error: InvalidRngError) -> str | None:
    """The RNG stream whose ``make_rng(name)`` raised ``error``: the ``name`` argument of
    flax's ``make_rng`` call in the error's traceback (the module's own call, else the
    scope's), read from the call, not from the message's wording; None where no
    ``make_rng`` call raised it (another ``InvalidRngError``, such as a malformed
    ``rngs`` dict).

    Caught while traced, as the step calls the model: JAX drops flax's frames from a
    traceback only where the error leaves the outermost transformation (flax's ``apply``
    counts as one), so outside a trace the call is not found (None).

    >>> class Noisy(linen.Module):
    ...     def __call__(self):
    ...         return self.make_rng("lstm")
    >>> def traced():
    ...     try:
    ...         return Noisy().apply({})
    ...     except InvalidRngError as e:
    ...         print(asked_stream(e))
    >>> jax.eval_shape(traced)
    lstm
    """
    tb = error.__traceback__
    while tb is not None:  # outermost first: the module's call before the scope's
        if tb.tb_frame.f_code in _MAKE_RNG:
            name = tb.tb_frame.f_locals.get("name")
            return name if isinstance(name, str) else None
        tb = tb.tb_next
    return None


def call_binding_streams(
    adapter: Any, bind: Callable[[], Any], call: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """``(model, call(model))`` for ``model = bind()``. A Linen module that asks for an
    RNG stream it was not bound (``self.make_rng("lstm")`` raises flax's
    ``InvalidRngError``) gets it bound (``linen_rngs``) and is called again, while
    tracing; other adapters are called once.

    The stream is the ``name`` argument of the ``make_rng`` call that raised
    (``asked_stream``), so the rule does not depend on the wording of flax's message.
    The call and its retries run while the step is traced (no device work), where JAX
    keeps flax's frames in the traceback; an error naming no stream, or one already
    bound, is raised as flax raised it."""
    if not isinstance(adapter, LinenModel):
        model = bind()
        return model, call(model)

    while True:
        model = bind()
        try:
            with unconstrained_boxes():  # the plan places the params (train/boxes.py)
                return model, call(model)
        except InvalidRngError as e:
            name = asked_stream(e)
            if name is None or name in ("dropout", *adapter.streams):
                raise
            adapter.add_stream(name)


def is_stateful(adapter: Any) -> bool:
    """Whether ``adapter`` carries an Equinox ``eqx.nn.State`` in its model state."""
    return getattr(adapter, "stateful", False)


def split_stateful(model: Any, state: Any) -> tuple[ModelAdapter, Any, Any]:
    """``(adapter, params, model_state)`` of an Equinox module and its ``eqx.nn.State``:
    the model state is ``{"model": the module's other arrays, "state": state}``."""
    if not is_equinox(model):
        raise TypeError(
            f"state= is the eqx.nn.State of an Equinox module (eqx.nn.make_with_state), "
            f"but the model is a {type(model).__name__}; NNX and Linen keep their state "
            "in the model"
        )
    if not isinstance(state, equinox().nn.State):
        raise TypeError(
            f"state must be an eqx.nn.State (from eqx.nn.make_with_state), got "
            f"{type(state).__name__}"
        )
    _check_own_state(model, state)
    adapter, params, arrays = split_model(model)
    return EquinoxModel(adapter.static, stateful=True), params, {"model": arrays, "state": state}


def _check_own_state(model: Any, state: Any) -> None:
    """A ``ValueError`` naming the mismatch when ``state`` is not ``model``'s own
    ``eqx.nn.State``: a stateful layer of the model with no entry in it (the state of
    another model), or entries for a model with no stateful layer."""
    index_type = equinox().nn.StateIndex
    is_index = lambda x: isinstance(x, index_type)  # noqa: E731
    indices = [x for x in jax.tree.leaves(model, is_leaf=is_index) if is_index(x)]
    held = sorted(map(str, getattr(state, "_state", {})))  # for the message only
    for index in indices:
        try:
            state.get(index)
        except KeyError:
            raise ValueError(
                f"state is not the model's eqx.nn.State: the model's stateful layer "
                f"{index.marker!r} has no entry in it, whose entries are "
                f"{held[:4]}{' ...' if len(held) > 4 else ''}; pass the state that "
                f"eqx.nn.make_with_state made with this model "
                f"({type(model).__name__})"
            ) from None
    if not indices and held:
        raise ValueError(
            f"state= is for a model with stateful layers (eqx.nn.BatchNorm, "
            f"SpectralNorm), and this {type(model).__name__} has none, while the state "
            f"holds {held[:4]}; leave state= out"
        )
    _check_batchnorm_sizes(model, state)


def _check_batchnorm_sizes(model: Any, state: Any) -> None:
    """A ``ValueError`` where an ``eqx.nn.BatchNorm``'s running statistics in ``state``
    are not of its ``input_size``: the state of a same-named model of another width,
    whose entries the model's layers find by name."""
    norm_type = equinox().nn.BatchNorm
    is_norm = lambda x: isinstance(x, norm_type)  # noqa: E731
    for layer in (x for x in jax.tree.leaves(model, is_leaf=is_norm) if is_norm(x)):
        for name in ("ema_state_index", "batch_state_index"):
            index = getattr(layer, name, None)
            if index is None:
                continue
            shapes = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(state.get(index))]
            if any(shape != (layer.input_size,) for shape in shapes):
                raise ValueError(
                    f"state is not the model's eqx.nn.State: its entry for the stateful "
                    f"layer {index.marker!r} holds arrays of shapes {shapes}, and the "
                    f"model's BatchNorm has input_size {layer.input_size}; pass the state "
                    f"that eqx.nn.make_with_state made with this model "
                    f"({type(model).__name__})"
                )


def split_model(model: Any, wrt: Any = nnx.Param) -> tuple[ModelAdapter, Any, Any]:
    """``(adapter, params, model_state)`` of an NNX or Equinox module (for NNX, the
    params are the variables the filter ``wrt`` selects).

    Raises ``TypeError`` naming the type received for anything else, and pointing to
    ``TrainState.from_linen`` and ``TrainState.from_params``.
    """
    if isinstance(model, nnx.Module):
        graphdef, params, model_state = nnx.split(model, wrt, ...)
        return NNXModel(graphdef, wrt), params, model_state
    if is_equinox(model):
        eqx = equinox()
        params, rest = eqx.partition(model, eqx.is_inexact_array)
        model_state, static = eqx.partition(rest, eqx.is_array)
        return EquinoxModel(static), params, model_state
    hint = ""
    if hasattr(model, "init") and hasattr(model, "apply"):
        hint = " For a Flax Linen module use TrainState.from_linen(module, variables, tx)."
    raise TypeError(
        f"model must be a flax.nnx.Module or an equinox.Module, got "
        f"{type(model).__module__}.{type(model).__qualname__}.{hint} For plain params use "
        "TrainState.from_params(params, apply_fn, tx)."
    )


def deterministic(model: Any) -> Any:
    """``model`` in inference mode, for evaluation.

    NNX: ``nnx.view(model, deterministic=True, use_running_average=True)`` (dropout off,
    batch norm on its running averages) for the submodules that have those attributes.
    Equinox: ``eqx.nn.inference_mode(model)``. Linen modules and plain functions take
    their mode as a call argument, so they are returned as they are.

    >>> deterministic(nnx.Dropout(0.5, rngs=nnx.Rngs(0))).deterministic
    True
    """
    if isinstance(model, nnx.Module):
        return nnx.view(
            model, deterministic=True, use_running_average=True, raise_if_not_found=False
        )
    if is_equinox(model):
        return equinox().nn.inference_mode(model)
    return model
