"""``TrainState``: one pytree for the step, params, optimizer state, model state and RNG.

The framework's static part (NNX graphdef, Equinox static fields, Linen module or
``apply_fn``) and the optax transformation are static data, so the state goes through
``jax.jit``, ``jax.shard_map`` and ``jax.pmap`` like any pytree.

>>> model = eqx.nn.MLP(4, 1, 16, 1, key=jax.random.key(0))
>>> state = TrainState.create(model, optax.adam(1e-3))
>>> int(state.step), state.model(jnp.ones(4)).shape
(0, (1,))
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardax.checks import public
from shardax.plan.tree import is_key, path_str
from shardax.train.model import (
    ApplyFnModel,
    LinenModel,
    ModelAdapter,
    NNXModel,
    split_model,
    split_stateful,
)
from shardax.train.static import comparable

Seed = int | jax.Array


def _key_data(rng: Seed) -> jax.Array:
    """Raw ``uint32`` key data from an integer seed, a typed key or raw key data."""
    if isinstance(rng, numbers.Integral) or (
        hasattr(rng, "dtype") and np.ndim(rng) == 0 and jnp.issubdtype(rng.dtype, jnp.integer)
    ):
        return jax.random.key_data(jax.random.key(int(rng)))
    if is_key(rng):
        return jax.random.key_data(rng)
    expected = jax.random.key_data(jax.random.key(0))
    if not hasattr(rng, "dtype") or rng.dtype != expected.dtype or rng.shape != expected.shape:
        got = f"shape {np.shape(rng)} dtype {getattr(rng, 'dtype', type(rng).__name__)}"
        raise TypeError(
            f"rng must be an integer seed, a jax.random.key, or raw key data of shape "
            f"{expected.shape} and dtype uint32; got {got}"
        )
    return jnp.asarray(rng, jnp.uint32)


def is_nnx_optimizer(x: Any) -> bool:
    """True for an ``nnx.Optimizer`` (and ``nnx.ModelAndOptimizer``)."""
    return isinstance(x, nnx.Optimizer)


def _variables(tree: Any) -> list[Any]:
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return [v for v in jax.tree.leaves(tree, is_leaf=is_var) if is_var(v)]


def optimizer_opt_state(optimizer: Any, params: Any) -> Any:
    """The state of an ``nnx.Optimizer`` as its transformation's own state for ``params``
    (``tx.init(params)``'s structure, with the optimizer's values): flax wraps every leaf
    in an ``OptState`` variable, which ``tx.update`` does not take.

    Raises ``ValueError`` when the optimizer was not built for these params (another
    model, or a ``wrt`` that selects other variables).
    """
    template = jax.eval_shape(optimizer.tx.init, params)
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    values = jax.tree.leaves(optimizer.opt_state)
    if len(values) != len(paths):
        why = f"{len(values)} arrays, where the transformation's state has {len(paths)}"
    else:
        wrong = [
            f"opt_state/{path_str(p)} has shape {np.shape(v)}, the model's params give {t.shape}"
            for (p, t), v in zip(paths, values, strict=True)
            if np.shape(v) != t.shape
        ]
        if not wrong:
            return jax.tree.unflatten(treedef, values)
        why = wrong[0]
    raise ValueError(
        f"the nnx.Optimizer's state does not match this model's params (wrt="
        f"{getattr(optimizer.wrt, '__name__', optimizer.wrt)}): {why}. Pass the model the "
        "optimizer was built for, nnx.Optimizer(model, tx, wrt=nnx.Param)"
    )


def write_opt_state(optimizer: Any, opt_state: Any, step: Any) -> None:
    """Puts ``opt_state`` (the transformation's structure) and ``step`` into the variables
    of an ``nnx.Optimizer``, in place."""
    values = iter(jax.tree.leaves(opt_state))
    for var in _variables(optimizer.opt_state):
        old = var.get_value()
        var.set_value(jax.tree.map(lambda _: next(values), old))
    optimizer.step.set_value(jnp.asarray(step).astype(optimizer.step.get_value().dtype))


def check_tx(tx: Any) -> None:
    """Raises ``TypeError`` unless ``tx`` is an optax transformation (``init``/``update``)."""
    if isinstance(tx, optax.GradientTransformation) or (
        hasattr(tx, "init") and hasattr(tx, "update")
    ):
        return
    hint = ""
    if callable(tx):
        name = getattr(tx, "__name__", "it")
        hint = f"; {name} looks like an optax factory: call it, e.g. optax.{name}(1e-3)"
    raise TypeError(
        f"tx must be an optax.GradientTransformation (with init and update), "
        f"got {type(tx).__name__} {tx!r}{hint}"
    )


def check_opt_state(params: Any, opt_state: Any, tx: Any = None) -> None:
    """Raises ``ValueError`` naming the leaf and both shapes when a subtree of
    ``opt_state`` shaped like ``params`` (Adam's ``mu``, ``nu``...) no longer matches
    their shapes: the params changed shape after the optimizer was initialised.

    With ``tx``, a subtree whose shapes are what ``tx.init(params)`` gives there (the
    factored moments of Adafactor mirror the params' structure, not their shapes) is right.

    Runs when the step is traced (shapes are static), so it costs nothing per step.
    """
    treedef = jax.tree.structure(params)
    if treedef.num_leaves == 0:
        return
    kind = type(params)

    def mirrors(node: Any) -> bool:
        return type(node) is kind and jax.tree.structure(node) == treedef

    flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=mirrors)[0]
    params_leaves = jax.tree_util.tree_leaves_with_path(params)
    expected: dict[Any, Any] = {}
    if tx is not None:
        fresh = jax.eval_shape(tx.init, params)
        expected = dict(jax.tree_util.tree_flatten_with_path(fresh, is_leaf=mirrors)[0])
    for opt_path, node in flat:
        if not mirrors(node):
            continue
        like = expected.get(opt_path)
        if like is not None and [np.shape(x) for x in jax.tree.leaves(like)] == [
            np.shape(x) for x in jax.tree.leaves(node)
        ]:
            continue
        for (path, p), o in zip(params_leaves, jax.tree.leaves(node), strict=True):
            if np.shape(p) != np.shape(o):
                raise ValueError(
                    f"params leaf {path_str(path)!r} has shape {np.shape(p)}, but the "
                    f"optimizer state for it (opt_state/{path_str(opt_path + path)}) has shape "
                    f"{np.shape(o)}: the params changed shape after the optimizer was "
                    "initialised. Build the state again with TrainState.create (or re-run "
                    "tx.init on the new params)"
                )


@public("sx.TrainState")
@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "model_state", "rng", "loss_scale", "outer"],
    meta_fields=["adapter", "tx"],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Training state. Array fields are pytree children; ``adapter`` and ``tx`` are static.

    Attributes:
        step: int32 ``[]``, the number of updates applied.
        params: the trainable parameters.
        opt_state: ``tx``'s state for ``params``.
        model_state: non-trainable model state (batch-norm statistics, NNX RNG counts).
        rng: uint32 ``[2]`` raw key data; per-step keys are folded from it and ``step``.
        loss_scale: the dynamic loss scale of an fp16 step
            (``shardax.train.precision.LossScaleState``), else None.
        outer: a DiLoCo step's outer state (``shardax.train.diloco.OuterState``: the
            params at the last sync, the outer optimizer's state), else None.
        adapter: how to rebuild the framework's model (see ``shardax.train.model``).
        tx: the optax transformation; equal to any transformation that computes the
            same (``shardax.train.static.comparable``), so a new but equal one does
            not change the treedef.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    adapter: ModelAdapter
    tx: optax.GradientTransformation
    loss_scale: Any = None
    outer: Any = None

    def __post_init__(self) -> None:
        # An equal transformation gives an equal treedef, so no recompile (see static.py).
        object.__setattr__(self, "tx", comparable(self.tx))

    @classmethod
    def _new(
        cls,
        adapter: ModelAdapter,
        params: Any,
        model_state: Any,
        tx: optax.GradientTransformation,
        rng: Seed,
    ) -> TrainState:
        check_tx(tx)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=model_state,
            rng=_key_data(rng),
            adapter=adapter,
            tx=tx,
        )

    @classmethod
    def create(cls, model: Any, tx: Any, *, rng: Seed = 0, state: Any = None) -> TrainState:
        """From an NNX module (``nnx.Param`` trainable) or an Equinox module (floating
        arrays trainable). ``rng`` seeds the per-step keys (an int or a key).

        ``state``: the ``eqx.nn.State`` of an Equinox module built with
        ``eqx.nn.make_with_state`` (BatchNorm, SpectralNorm): the step then calls
        ``loss_fn(model, state, batch)``, which returns ``(loss, new_state)`` or
        ``((loss, aux), new_state)``, and keeps the new state
        (``state.model_state["state"]``).

        ``tx`` is an optax transformation, or for an NNX module its ``nnx.Optimizer``
        (or ``nnx.ModelAndOptimizer``): the state takes the optimizer's transformation,
        its current state and step, and its ``wrt`` as the trainable variables.
        [`write_to`][shardax.TrainState.write_to] puts the trained values back into the model and
        optimizer.

        >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        >>> state = TrainState.create(model, optimizer)
        >>> state.opt_state[0].mu["kernel"].shape, int(state.step)
        ((4, 2), 0)
        """
        if is_nnx_optimizer(tx):
            return cls._from_optimizer(model, tx, rng)
        if state is not None:
            return cls._new(*split_stateful(model, state), tx, rng)
        adapter, params, model_state = split_model(model)
        return cls._new(adapter, params, model_state, tx, rng)

    @classmethod
    def _from_optimizer(cls, model: Any, optimizer: Any, rng: Seed) -> TrainState:
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"an nnx.Optimizer goes with the NNX module it was built "
                f"for, got a model of type {type(model).__name__}"
            )
        adapter, params, model_state = split_model(model, optimizer.wrt)
        check_tx(optimizer.tx)
        return cls(
            step=jnp.asarray(optimizer.step.get_value(), jnp.int32),
            params=params,
            opt_state=optimizer_opt_state(optimizer, params),
            model_state=model_state,
            rng=_key_data(rng),
            adapter=adapter,
            tx=optimizer.tx,
        )

    def write_to(self, model: Any, optimizer: Any = None) -> None:
        """Puts this state's values into the user's NNX ``model`` (params and model
        state) and, if given, its ``nnx.Optimizer`` (state and step), in place: for code
        that expects them (evaluation, export). The model shares the state's buffers, so
        after a later donating step call ``write_to`` again.

        >>> state.write_to(model, optimizer)  # doctest: +SKIP
        """
        if not isinstance(self.adapter, NNXModel) or not isinstance(model, nnx.Module):
            raise TypeError(
                "sx.TrainState.write_to puts values into an NNX module and its nnx.Optimizer; "
                f"got a {type(model).__name__} for a state of a {type(self.adapter).__name__}. "
                "For Equinox, Linen or plain pytrees read state.model or state.params"
            )
        nnx.update(model, self.params, self.model_state)
        if optimizer is not None:
            if not is_nnx_optimizer(optimizer):
                raise TypeError(
                    f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}"
                )
            optimizer_opt_state(optimizer, self.params)  # the same structure, or an error
            write_opt_state(optimizer, self.opt_state, self.step)

    @classmethod
    def from_linen(
        cls, module: Any, variables: Any, tx: optax.GradientTransformation, *, rng: Seed = 0
    ) -> TrainState:
        """From a Linen module and ``module.init(...)``'s variables: ``"params"`` is
        trainable, the other collections (e.g. ``"batch_stats"``) are model state."""
        variables = dict(variables)
        if "params" not in variables:
            raise ValueError(
                f"variables need a 'params' collection, got collections {sorted(variables)}"
            )
        params = variables.pop("params")
        return cls._new(LinenModel(module), params, variables, tx, rng)

    @classmethod
    def from_params(
        cls,
        params: Any,
        apply_fn: Callable[..., Any],
        tx: optax.GradientTransformation,
        *,
        rng: Seed = 0,
    ) -> TrainState:
        """From plain params and ``apply_fn(params, *inputs)``; the loss function gets
        ``functools.partial(apply_fn, params)`` as its model."""
        if not callable(apply_fn):
            raise TypeError(f"apply_fn must be callable, got {apply_fn!r}")
        return cls._new(ApplyFnModel(apply_fn), params, None, tx, rng)

    @property
    def model(self) -> Any:
        """The framework's model for these params and model state (e.g. for evaluation)."""
        return self.adapter.bind(self.params, self.model_state, jax.random.wrap_key_data(self.rng))

    def apply_gradients(self, grads: Any, model_state: Any = None) -> TrainState:
        """One optimizer update; ``model_state`` replaces the model state if given."""
        check_opt_state(self.params, self.opt_state, self.tx)
        with jax.named_scope("optimizer"):  # the update's ops, by name in a profile
            updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
            params = optax.apply_updates(self.params, updates)
        return dataclasses.replace(
            self,
            step=self.step + 1,
            params=params,
            opt_state=opt_state,
            model_state=self.model_state if model_state is None else model_state,
        )

    def replace(self, **changes: Any) -> TrainState:
        """A copy with ``changes`` applied to the named fields."""
        return dataclasses.replace(self, **changes)
