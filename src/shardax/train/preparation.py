"""``prepare``: place the objects of the user's own training loop, and give them back.

The loop stays the user's (an ``@nnx.jit`` step with ``nnx.Optimizer``, a
``flax.training`` train state, an ``eqx.filter_jit`` step, plain pytrees); ``prepare``
puts what it holds on the mesh with a plan and returns the same objects, so the step
runs unchanged on every device, as accelerate's ``prepare`` does for PyTorch:

>>> import shardax as sx
>>> mesh = sx.make_mesh({"data": -1})
>>> model = nnx.Linear(1024, 16, rngs=nnx.Rngs(0))
>>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
>>> model, optimizer = sx.prepare(model, optimizer, mesh=mesh, plan=sx.fsdp(mesh))
>>> model.kernel.sharding.spec, optimizer.opt_state[0].mu["kernel"].sharding.spec
(P('data', None), P('data', None))

Every object is placed as [`shardax.make_train_step`][shardax.make_train_step] would place it in a
[`TrainState`][shardax.TrainState]: the plan sees the same paths (``params/...``,
``model_state/...``, ``opt_state/...``) and the optimizer state follows its params under
every plan ([`shardax.plan.follow_params`][shardax.plan.follow_params];
[`shardax.zero1`][shardax.zero1] shards it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import linen, nnx
from jax.sharding import Mesh

from shardax._extras import equinox, is_equinox
from shardax.checks import check_mesh, public
from shardax.data.placement import batch_sharding
from shardax.data.prefetch import prefetch_to_device
from shardax.mesh.axes import DATA_AXIS
from shardax.mesh.make import make_mesh
from shardax.plan.core import Plan, as_plan, check_plan_mesh, replicate
from shardax.plan.follow import follow_params
from shardax.plan.placed import record
from shardax.plan.tree import is_array
from shardax.runtime.processes import device_put_global
from shardax.train.program import refuse_abstract
from shardax.train.state import TrainState, is_nnx_optimizer, optimizer_opt_state


def _is_nnx_module(x: Any) -> bool:
    return isinstance(x, nnx.Module)


def _is_train_state(x: Any) -> bool:
    """A ``flax.training.train_state.TrainState`` or any dataclass train state with
    ``params``, ``opt_state`` and ``replace``."""
    return (
        dataclasses.is_dataclass(x)
        and not isinstance(x, type)
        and all(hasattr(x, a) for a in ("params", "opt_state", "replace"))
    )


def _is_loader(x: Any) -> bool:
    """An iterable of batches: an iterator, or an iterable that is not a pytree node."""
    if isinstance(x, str | bytes) or is_array(x) or _is_nnx_module(x) or is_equinox(x):
        return False
    if isinstance(x, Iterator):
        return True
    return isinstance(x, Iterable) and jax.tree_util.treedef_is_leaf(jax.tree.structure(x))


def _mirrors(tree: Any, params: Any) -> bool:
    """Whether ``tree`` holds a subtree with ``params``' structure and shapes (Adam's
    ``mu``): then ``tree`` is an optimizer state for ``params``."""
    treedef = jax.tree.structure(params)
    if treedef.num_leaves == 0:
        return False
    shapes = [np.shape(x) for x in jax.tree.leaves(params)]

    def same(node: Any) -> bool:
        return (
            jax.tree.structure(node) == treedef
            and [np.shape(x) for x in jax.tree.leaves(node)] == shapes
        )

    return any(same(n) for n in jax.tree.leaves(tree, is_leaf=same))


def _place(view: Any, plan: Any) -> Any:
    """``view`` on ``plan``'s shardings (Python scalars become replicated arrays)."""
    return device_put_global(view, plan(view))


class _Preparer:
    """Places the objects of one [`prepare`][shardax.prepare] call; ``out`` holds the results in
    order."""

    def __init__(
        self, objects: tuple[Any, ...], mesh: Mesh, plan: Any, data_axis: Any, batch_spec: Any
    ) -> None:
        self.objects, self.mesh, self.plan, self.data_axis = objects, mesh, plan, data_axis
        self.batch_spec = batch_spec
        self.out: list[Any] = list(objects)
        self.done: set[int] = set()

    def run(self) -> list[Any]:
        objs = self.objects
        for i, obj in enumerate(objs):
            if is_nnx_optimizer(obj):
                self._nnx(self._model_of(i, obj), obj)
                self.done.add(i)
        for i, obj in enumerate(objs):
            if i in self.done:
                continue
            if _is_nnx_module(obj):
                self._nnx(obj, None)
                self.done.add(i)
            elif isinstance(obj, TrainState):
                self._set(i, _place(obj, self.plan))
            elif _is_train_state(obj):
                self._set(i, self._train_state(obj))
            elif _is_loader(obj):
                self._set(i, self._loader(obj))
        # Equinox models and pytrees, each with the optimizer states among the rest.
        for i, obj in enumerate(objs):
            if i in self.done or _is_eqx_state(obj):
                continue
            if is_equinox(obj) or _has_arrays(obj):
                self._params(i)
        for i, obj in enumerate(objs):  # an eqx.nn.State without its model
            if i not in self.done and _is_eqx_state(obj):
                # no params to follow: the plan's own specs for model_state/state/...
                plan = getattr(self.plan, "base", None) or self.plan
                self._set(i, _place({"model_state": {"state": obj}}, plan)["model_state"]["state"])
        return self.out

    def _loader(self, loader: Any) -> Any:
        """Batches prefetched onto the mesh: rows over the data axis, or as the
        ``batch_spec`` says for batches whose leaves are not examples."""
        if self.batch_spec is not None:
            return prefetch_to_device(loader, self.mesh, batch_spec=self.batch_spec)
        return prefetch_to_device(loader, batch_sharding(self.mesh, self.data_axis))

    def _set(self, i: int, value: Any) -> None:
        self.out[i] = value
        self.done.add(i)

    # -- NNX --------------------------------------------------------------------------

    def _model_of(self, i: int, optimizer: Any) -> Any:
        """The NNX model ``optimizer`` was built for: a ``ModelAndOptimizer``'s own, or
        the first model among the arguments whose params its state matches."""
        own = vars(optimizer).get("model")
        for j, obj in enumerate(self.objects):
            if j in self.done or is_nnx_optimizer(obj) or not isinstance(obj, nnx.Module):
                continue
            if own is not None and obj is not own:
                continue
            try:
                optimizer_opt_state(optimizer, nnx.state(obj, optimizer.wrt))
            except ValueError:
                continue
            self.done.add(j)
            return obj
        if own is not None:
            return own
        raise TypeError(
            f"argument {i} is an nnx.Optimizer, but no NNX model among the "
            "arguments has the params it was built for; pass the model with it: "
            "model, optimizer = sx.prepare(model, optimizer, ...)"
        )

    def _nnx(self, model: Any, optimizer: Any) -> None:
        """Places ``model`` (and ``optimizer``) in place, through their
        [`TrainState`][shardax.TrainState], so the plan sees what it sees under
        ``make_train_step``."""
        state = TrainState.create(model, optax.identity() if optimizer is None else optimizer)
        _place(state, self.plan).write_to(model, optimizer)

    # -- flax.training, Equinox, pytrees -----------------------------------------------

    def _train_state(self, state: Any) -> Any:
        """A ``flax.training`` train state: its pytree fields placed (``step``, ``params``,
        ``opt_state`` and any the user added), a Python-number ``step`` as an array."""
        fields = {
            f.name: getattr(state, f.name)
            for f in dataclasses.fields(state)
            if f.metadata.get("pytree_node", True) and f.name not in ("apply_fn", "tx")
        }
        fields = {
            name: np.asarray(value) if isinstance(value, int | float) else value
            for name, value in fields.items()
        }
        return state.replace(**_place(fields, self.plan))

    def _params(self, i: int) -> None:
        """An Equinox model or a pytree of params, with the arguments that mirror it
        (``optax.adam(...).init(params)``) as its optimizer states."""
        obj = self.objects[i]
        self.done.add(i)
        static = model_state = None
        candidates = [obj]
        if is_equinox(obj):
            eqx = equinox()
            arrays, static = eqx.partition(obj, eqx.is_array)
            params, model_state = eqx.partition(arrays, eqx.is_inexact_array)
            # optax states are built on eqx.filter(model, eqx.is_array) or is_inexact_array
            candidates = [params, arrays]
            state_at = self._state_of(obj)
        opt_states: list[int] = []
        for j, other in enumerate(self.objects):
            if j in self.done or is_equinox(other) or not _has_arrays(other):
                continue
            hit = next((k for k, c in enumerate(candidates) if _mirrors(other, c)), None)
            if hit is not None:
                opt_states.append(j)
                if static is not None and hit == 1:
                    params, model_state = arrays, None
        if static is None:
            params = obj
        elif state_at is not None:
            # as TrainState.create(model, tx, state=state) holds it: model_state/state/...
            model_state = {"model": model_state, "state": self.objects[state_at]}
        view = {
            "params": params,
            "model_state": model_state,
            "opt_state": tuple(self.objects[j] for j in opt_states),
        }
        placed = _place(view, self.plan)
        if static is not None:
            rest = placed["model_state"]
            if state_at is not None:
                self._set(state_at, rest["state"])
                rest = rest["model"]
            self.out[i] = equinox().combine(placed["params"], rest, static)
        else:
            self.out[i] = placed["params"]
        for j, value in zip(opt_states, placed["opt_state"], strict=True):
            self._set(j, value)

    def _state_of(self, model: Any) -> int | None:
        """The index of the first unplaced ``eqx.nn.State`` among the arguments, when
        ``model`` has stateful layers (an ``eqx.nn.StateIndex``): the model's state, as
        ``eqx.nn.make_with_state`` returns it."""
        index_type = equinox().nn.StateIndex

        def is_index(x: Any) -> bool:
            return isinstance(x, index_type)

        if not any(is_index(x) for x in jax.tree.leaves(model, is_leaf=is_index)):
            return None
        for j, obj in enumerate(self.objects):
            if j not in self.done and _is_eqx_state(obj):
                self.done.add(j)
                return j
        return None


def _is_eqx_state(x: Any) -> bool:
    """An Equinox ``eqx.nn.State`` (``eqx.nn.make_with_state``'s second result)."""
    eqx = equinox()
    return eqx is not None and isinstance(x, eqx.nn.State)


def _has_arrays(obj: Any) -> bool:
    return any(is_array(x) for x in jax.tree.leaves(obj))


def _record_plan(placed: list[Any]) -> None:
    """Records each placed object's shardings as its plan (for
    [`shardax.keep_plan`][shardax.keep_plan] and [`shardax.describe`][shardax.describe]):
    the object, and a train state's params and optimizer state, which a step may return on
    their own."""
    for obj in placed:
        if _is_loader(obj) and not _is_train_state(obj):
            continue
        record(obj)
        if _is_train_state(obj) or isinstance(obj, TrainState):
            record(obj.params)
            record(obj.opt_state)


PLACES_ARRAYS = (
    "prepare places arrays: build the objects (model, optimizer) "
    "first, or build them placed with jax.jit(init, out_shardings=plan(abstract)); a plan "
    "gives abstract values their shardings without prepare (sx.fsdp(mesh)(abstract))"
)


def _check_placeable(i: int, obj: Any) -> None:
    """Raises ``TypeError`` for an argument [`prepare`][shardax.prepare] cannot place: no
    arrays in it and not a loader (a Linen module, a number, a string, an object). An
    empty pytree (``optax.sgd``'s ``EmptyState``, None) has nothing to place and
    passes."""
    if _is_loader(obj):
        return
    refuse_abstract(f"objects[{i}]", obj, PLACES_ARRAYS)
    leaves = jax.tree.leaves(obj)
    if not leaves or _has_arrays(obj):
        return

    if isinstance(obj, linen.Module):
        raise TypeError(
            f"objects[{i}] is the Linen module {type(obj).__name__}, which holds no arrays: "
            "pass its variables (variables = model.init(key, x)) or a flax.training "
            "TrainState, and keep calling model.apply in your step"
        )
    raise TypeError(
        f"objects[{i}] must be a model, an optimizer or its state, a train state, a "
        f"pytree of arrays or an iterable of batches, got {type(obj).__name__} "
        f"{obj!r:.60}, which holds no array to place"
    )


@public("sx.prepare")
def prepare(
    *objects: Any,
    mesh: Mesh | None = None,
    plan: Plan | Any = None,
    data_axis: str | tuple[str, ...] = DATA_AXIS,
    batch_spec: Any = None,
) -> Any:
    """Places the objects of a training loop on ``mesh`` with ``plan``, and returns them:
    the same objects, or objects of the same types, in the same order (one object alone
    is returned as itself, not in a tuple). The user's own step then runs on every device
    of the mesh, unchanged.

    - **NNX**: modules and ``nnx.Optimizer`` / ``nnx.ModelAndOptimizer`` are updated in
      place (the same objects come back): ``model, optimizer = sx.prepare(model,
      optimizer, mesh=mesh, plan=sx.fsdp(mesh))``. The optimizer state follows its
      params under every plan; flax's ``optimizer_sharding`` variable metadata sets the
      optimizer state's spec where a variable has it.
    - **flax.training** train states (a Python-int ``step`` becomes a replicated array,
      as a jitted step returns it), and shardax [`TrainState`][shardax.TrainState].
    - **Equinox** modules and **plain pytrees** (params, ``optax`` states): an argument
      holding a subtree with the structure and shapes of a model's or pytree's params
      (Adam's ``mu``) is that model's optimizer state, and follows it. An
      ``eqx.nn.State`` (``eqx.nn.make_with_state``) is placed with its model, where a
      [`TrainState`][shardax.TrainState] holds it: the plan sees ``model_state/state/...``.
    - **batches**: any iterable of batches that is not a pytree (a generator, a loader)
      becomes [`shardax.prefetch_to_device`][shardax.prefetch_to_device] with the batch
      split over ``data_axis``: each process yields its own slice and gets global batches.
      A list is a pytree: pass ``iter(batches)``.

    Args:
      objects: what the loop holds, in any order.
      mesh: default: all devices on one ``"data"`` axis. An Explicit mesh keeps its axis
        types; run the step under ``jax.set_mesh(mesh)`` as usual.
      plan: a shardax plan on ``mesh`` (``sx.fsdp(mesh)``, ``sx.zero1(mesh)``,
        ``sx.rules``, ``sx.from_nnx``, ``sx.from_linen``); default: replicate. It sees
        the paths a [`TrainState`][shardax.TrainState] would have (``params/...``).
      data_axis: the mesh axis (or axes) the batches are split over.
      batch_spec: for batches whose leaves are not examples (a graph batch), how each
        leaf is split: a ``PartitionSpec`` (``P()``: not split) or a pytree of them
        (``shardax.data.spec``).
    """
    if not objects:
        raise TypeError(
            "sx.prepare takes the objects of a training loop (a model, its optimizer, a "
            "loader...), got none"
        )
    if mesh is None:
        mesh = make_mesh({data_axis: -1} if isinstance(data_axis, str) else None)
    check_mesh("mesh", mesh)
    plan = replicate(mesh) if plan is None else as_plan("plan", plan)
    check_plan_mesh(plan, mesh)
    if isinstance(plan, Plan):
        plan = follow_params(plan)
    for i, obj in enumerate(objects):
        _check_placeable(i, obj)
    out = _Preparer(objects, mesh, plan, data_axis, batch_spec).run()
    _record_plan(out)
    return out[0] if len(objects) == 1 else tuple(out)
