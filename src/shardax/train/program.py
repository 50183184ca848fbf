"""The compiled program behind the train and eval steps: placement, modes, the cache.

A :class:`Program` runs ``program(state, batch)`` on a mesh in one of four modes. It
owns what the train and eval steps share:

- **placement**: ``shard(state)`` and ``init(init_fn, ...)`` put the state on the plan
  (or one device), in the precision's ``param_dtype``;
- **the per-shard function**: binding the model to its params, the precision's casts,
  the ``rng``/``step_rng`` keys, accumulation (:func:`~shardax.train.accumulate.microbatched`),
  BatchNorm over the global batch (:func:`~shardax.train.batchnorm.over_data_axis`);
- **the modes**: under ``"jit"`` and ``"single"`` a shard is the whole global batch;
  under ``"shard_map"`` and ``"pmap"`` each device has its slice and the program weights
  gradients, loss, aux and model state by each device's count of real examples;
- **the compiled-program cache** (one program per state structure) and ``lower``.

What a program computes is given by four methods, the **step protocol**, which
:class:`~shardax.train.step.TrainStep` and :class:`~shardax.train.eval.EvalStep`
implement:

- ``objective(out) -> (loss, aux)``: reads what ``loss_fn`` returned;
- ``view(model) -> model``: the model ``loss_fn`` sees (inference mode for evaluation);
- ``differentiate(loss, params, loss_scale) -> (grads | None, loss, aux, model_state)``:
  ``loss(params) -> (loss, (aux, model_state))`` is one (micro)batch's loss;
- ``finish(state, grads, loss, aux, model_state) -> out``: the program's result, from
  the whole global batch's means: ``(state, metrics)``, or ``metrics`` when the class
  sets ``returns_state = False``.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from shardax.checks import as_bool, as_count, public
from shardax.data.leaves import check_batch_leaves
from shardax.data.placement import batch_sharding
from shardax.data.spec import batch_shardings, check_batch_spec, place_by_spec
from shardax.parallel.collectives import all_reduce, weighted_mean
from shardax.plan.activation import constrain
from shardax.plan.core import Plan, axis_size, replicate
from shardax.plan.follow import FollowParams, follow_params
from shardax.plan.init import init_sharded
from shardax.plan.tree import is_array, is_key, map_arrays, path_str
from shardax.runtime.agreement import check_agreement
from shardax.runtime.processes import device_put_global
from shardax.train.accumulate import microbatched
from shardax.train.axis_types import explain_axis_types, mesh_axis_type, reshard_batch
from shardax.train.batch import batch_structure, check_batch, check_mask_has_examples
from shardax.train.batchnorm import over_data_axis
from shardax.train.loss import check_mapped_aux, rng_arguments, takes_state
from shardax.train.masks import valid_count
from shardax.train.model import LinenModel, is_stateful
from shardax.train.precision import (
    Precision,
    cast_floating,
    cast_like,
    init_loss_scale,
    narrow_floating,
    policy_name,
    resolve,
)
from shardax.train.rng import example_keys, step_key
from shardax.train.state import TrainState

MODES: tuple[str, ...] = ("jit", "shard_map", "pmap", "single")

CPU_MAX_IN_FLIGHT = 4
"""Steps queued at most on simulated CPU devices. XLA:CPU's in-process collectives can
deadlock (a 40 s rendezvous timeout, then abort) when many multi-device programs are
queued at once; waiting for the step ``CPU_MAX_IN_FLIGHT`` back keeps the queue short."""

COMPILED_CACHE_SIZE = 8
"""Compiled programs kept per step (one per state structure), most recent first."""
BATCH_CACHE_SIZE = 16
"""How many batch structures a step keeps checked (and their ``batch_spec`` shardings)."""


def _floating(tree: Any) -> Any:
    """``tree`` with None in place of every leaf that is not a floating array."""
    return jax.tree.map(
        lambda x: x if is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact) else None, tree
    )


def _map_keys(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
    """``fn`` applied to every typed PRNG key leaf of ``tree``."""
    return jax.tree.map(lambda x: fn(x) if is_key(x) else x, tree)


_fresh_copy = jax.jit(lambda tree: tree)


def _stateful_out(out: Any, old: Any) -> tuple[Any, Any]:
    """``(loss | (loss, aux), new_state)`` from a stateful loss function, checked."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            "loss_fn(model, state, batch) must return (loss, new_state) or "
            f"((loss, aux), new_state), got {type(out).__name__}"
        )
    new = out[1]
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            "loss_fn(model, state, batch) must return (loss, new_state) with new_state an "
            f"eqx.nn.State like the one it was given; got a {type(new).__name__} "
            "as the second item"
        )
    return out


def _buffers(x: jax.Array) -> set[int]:
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def unalias(source: Any, placed: Any) -> Any:
    """``placed``, with fresh copies of the leaves that share a buffer with ``source``.

    ``device_put`` may reuse the input's buffer for the shard on the source device, and
    donating it would then delete the user's array. Only those leaves are copied (one
    jitted identity for all of them), so a sharded state is not held twice.
    """
    src, treedef = jax.tree.flatten(source)
    out = jax.tree.leaves(placed)
    shared = [
        i
        for i, (x, y) in enumerate(zip(src, out, strict=True))
        if isinstance(x, jax.Array) and isinstance(y, jax.Array) and _buffers(x) & _buffers(y)
    ]
    if shared:
        for i, fresh in zip(shared, _fresh_copy([out[i] for i in shared]), strict=True):
            out[i] = fresh
    return jax.tree.unflatten(treedef, out)


def check_state(state: Any) -> None:
    """A :class:`TrainState` whose buffers are alive (not donated to an earlier step)."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"the train step takes a sx.TrainState (sx.TrainState.create(model, tx), "
            f".from_linen or .from_params), got {type(state).__name__}"
        )
    # The step counter is donated with the rest: checking it costs no tree flatten.
    if isinstance(state.step, jax.Array) and state.step.is_deleted():
        raise ValueError(
            "the state's buffers were donated to an earlier step, which consumed them: use "
            "the state that step returned, or build the step with donate=False to keep "
            "reusing a state (an EMA copy, a comparison)"
        )


def check_data_axis(data_axis: Any, mesh: Mesh, mode: str) -> str | tuple[str, ...]:
    """``data_axis`` (a mesh axis name, or a tuple of them for HSDP), checked."""
    names = (data_axis,) if isinstance(data_axis, str) else data_axis
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(n, str) for n in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"data_axis must be a mesh axis name or a tuple of distinct names, got {data_axis!r}"
        )
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        which = "" if isinstance(data_axis, str) else f": {', '.join(map(repr, missing))}"
        raise ValueError(
            f"data_axis {data_axis!r}{which} is not in the mesh, whose axes are {dict(mesh.shape)}"
        )
    if mode == "pmap" and len(names) > 1:
        raise ValueError(
            f"mode='pmap' maps over one axis, got data_axis {data_axis!r}; use mode='jit' or "
            "'shard_map' to split the batch over several axes"
        )
    return data_axis if isinstance(data_axis, str) or len(names) > 1 else names[0]


def _alive(tree: Any) -> list[jax.Array]:
    """The arrays of ``tree`` not deleted (donated) since."""
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted()]


def _bounded(call: Callable[..., Any], depth: int, metrics: Callable[[Any], Any]):
    """``call``, waiting for the result of the call ``depth`` back before returning
    (for the ``metrics`` of its output: the state may be donated by then). A metric the
    user wrote back into the state (an aux returned as model state) may be donated too:
    the wait skips it, the later step that consumed it is waited for in its turn."""
    pending: collections.deque[Any] = collections.deque()

    def bounded(state: Any, batch: Any) -> Any:
        out = call(state, batch)
        pending.append(metrics(out))
        if len(pending) > depth:
            jax.block_until_ready(_alive(pending.popleft()))
        return out

    return bounded


def _under_mesh(call: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """Runs (and so traces) ``call`` under ``jax.set_mesh(mesh)``, so that
    ``sx.constrain`` inside the model knows the mesh."""

    def under(state: Any, batch: Any) -> Any:
        with jax.sharding.set_mesh(mesh):
            return call(state, batch)

    return under


def _drawn_keys(before: Any, after: Any) -> list[str]:
    """The typed-key leaves of the model's own generators (NNX ``RngStream``s: a ``key``
    beside a ``count``) that a traced step drew from: drawing advances the stream's
    count, so its leaf after the trace is a new value, not the one it was given.
    Named ``model_state/<path>``; a key without a count beside it counts as drawn."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(before)[0]}
    new = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(after)[0]}
    out = []
    for path, x in flat.items():
        if not is_key(x):
            continue
        name = path.removesuffix("/value")
        stream = name.removesuffix("/key")
        counts = [c for c in (f"{stream}/count/value", f"{stream}/count") if c in flat]
        if name == stream or not counts or new.get(counts[0]) is not flat[counts[0]]:
            out.append(f"model_state/{name}")
    return out


def _drawn(counters: Any) -> set[str]:
    """The Linen rng streams a bound module drew from while tracing: flax counts
    ``make_rng`` calls per stream name, child scopes in nested dicts."""
    if not isinstance(counters, dict):
        return set()
    found: set[str] = set()
    for name, n in counters.items():
        if isinstance(n, dict):
            found |= _drawn(n)
        elif isinstance(name, str) and n:
            found.add(name)
    return found


class _Compiled:
    """One compiled program, its state structure, and the last state it returned (weakly)."""

    __slots__ = ("fn", "last", "treedef")

    def __init__(self, fn: Callable[..., Any], treedef: Any) -> None:
        self.fn, self.treedef = fn, treedef
        self.last: weakref.ref[Any] | None = None


@public("sx.train.Program")
class Program:
    """``program(state, batch)`` compiled for ``mesh`` in ``mode`` (see the module doc).

    Attributes: ``loss_fn``, ``mode``, ``mesh``, ``plan``, ``accumulate``, ``donate``,
    ``data_axis``, ``precision``.
    """

    returns_state: ClassVar[bool] = True

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        mesh: Mesh,
        plan: Plan | None,
        mode: str,
        accumulate: int,
        donate: bool,
        data_axis: str | tuple[str, ...],
        precision: str | Precision = "fp32",
        seq_axis: str | None = None,
        batch_spec: Any = None,
        rng_per_device: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        self.precision = resolve(precision)
        self._filled = rng_arguments(loss_fn)
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        data_axis = check_data_axis(data_axis, mesh, mode)
        accumulate = as_count("accumulate", accumulate)
        if mode == "single" and plan is not None and getattr(plan, "name", None) != "replicate":
            raise ValueError(
                f"mode='single' keeps the whole state on one device, so it takes no sharding "
                f"plan; got plan {getattr(plan, 'name', plan)!r}. Drop plan= or use mode='jit'"
            )
        plan = replicate(mesh) if plan is None else plan
        if not callable(plan):
            raise TypeError(
                f"plan must be a shardax Plan (a callable from a tree to its shardings, e.g. "
                f"sx.fsdp(mesh)), got {plan!r}"
            )
        self.plan_name = getattr(plan, "name", type(plan).__name__)
        plan_mesh = getattr(plan, "mesh", mesh)
        if plan_mesh != mesh:
            raise ValueError(
                f"plan {self.plan_name!r} is over mesh {dict(plan_mesh.shape)}, not the step's "
                f"mesh {dict(mesh.shape)}; build both from the same mesh"
            )
        if mode == "pmap" and axis_size(mesh, data_axis) != mesh.size:
            raise ValueError(
                f"mode='pmap' maps over one axis, but the mesh {dict(mesh.shape)} has devices "
                f"outside data axis {data_axis!r}; use mode='jit' for multi-axis meshes"
            )
        self.loss_fn, self.mesh, self.plan, self.mode = loss_fn, mesh, plan, mode
        self.accumulate, self.donate, self.data_axis = accumulate, donate, data_axis
        # The optimizer state follows the params (Adam's mu/nu), whatever the plan.
        self.state_plan = (
            follow_params(plan)
            if isinstance(plan, Plan) and not isinstance(plan, FollowParams)
            else plan
        )
        self._devices = 1 if mode == "single" else axis_size(mesh, data_axis)
        self._divisor = self._devices * accumulate
        self._what = f"the data axis size {self._devices}" if mode != "single" else "1"
        if accumulate > 1:
            self._what = f"{self._what} × accumulate={accumulate} = {self._divisor}"
        self._donate_argnums = (0,) if donate else ()
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_sharding = batch_sharding(mesh, data_axis)
        self.seq_axis, self._seq_sharding = seq_axis, None
        if seq_axis is not None:
            if mode != "jit":
                raise ValueError(
                    f"seq_axis splits the batch's sequence dimension under mode='jit' only; "
                    f"got mode={mode!r}"
                )
            self._seq_sharding = batch_sharding(mesh, data_axis, seq_axis=seq_axis)
        self.batch_spec = self._check_batch_spec(batch_spec)
        names = (data_axis,) if isinstance(data_axis, str) else data_axis
        self._explicit = any(mesh_axis_type(mesh, n) == AxisType.Explicit for n in names)
        self._compiled: collections.OrderedDict[Any, _Compiled] = collections.OrderedDict()
        # batch structure -> its batch_spec shardings (True without one): checked once
        self._batches: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self.rng_per_device = as_bool("rng_per_device", rng_per_device)
        self._device = SingleDeviceSharding(mesh.devices.flat[0])
        self._call = self._mode_call()

    def _check_batch_spec(self, batch_spec: Any) -> Any:
        """A batch whose leaves are not examples (:mod:`shardax.data.spec`) is placed as
        it says under ``"jit"`` and ``"single"``; the modes that split rows as examples
        refuse it."""
        batch_spec = check_batch_spec(batch_spec)
        if batch_spec is None:
            return None
        how = [f"mode={self.mode!r}"] if self.mode in ("shard_map", "pmap") else []
        how += [f"accumulate={self.accumulate}"] if self.accumulate > 1 else []
        how += [f"seq_axis={self.seq_axis!r}"] if self.seq_axis is not None else []
        if "rng" in self._filled:
            raise ValueError(
                f"loss_fn takes 'rng' (one key per example), but batch_spec={batch_spec!r} "
                "says the batch's leaves are not examples; take 'step_rng' (one key for "
                "the step) instead"
            )
        if how:
            raise ValueError(
                f"batch_spec={batch_spec!r} says the batch's leaves are not examples (a "
                f"graph batch, say), but {' and '.join(how)} splits every leaf's rows as if "
                "they were: each device or microbatch would get rows of every leaf that "
                "do not make whole examples, and train a different model. Use mode='jit' "
                "(any split, computed as one device would) with accumulate=1"
            )
        return batch_spec

    # -- the step protocol (implemented by TrainStep and EvalStep) -----------------------

    def objective(self, out: Any) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def view(self, model: Any) -> Any:
        return model

    def differentiate(self, loss: Callable[[Any], Any], params: Any, loss_scale: Any):
        raise NotImplementedError

    def finish(self, state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any):
        raise NotImplementedError

    # -- placement -----------------------------------------------------------------------

    def shard(self, state: TrainState) -> TrainState:
        """Places ``state`` as this step expects it: with the plan, or on one device.

        The result never shares buffers with ``state`` when the step donates, so the
        arrays the state was built from (a Linen ``variables`` dict, an NNX module)
        stay usable after the step consumes the placed state. With several processes,
        all first check that they run the same step and state shardings
        (:func:`shardax.runtime.check_agreement`), so a mismatch is an error, not a hang.
        """
        check_state(state)
        state = self._prepare(state)
        if self.mode == "single":
            shardings: Any = self._device
        else:
            if self.mode in ("shard_map", "pmap"):
                self._check_replicated(state)
            shardings = self.state_plan(state)
            if jax.process_count() > 1:
                check_agreement(train_step=repr(self), state_shardings=shardings)
        placed = device_put_global(state, shardings)
        return unalias(state, placed) if self.donate else placed

    def abstract(self, state: TrainState) -> TrainState:
        """``state`` (abstract or concrete) as :meth:`shard` and :meth:`init` make it,
        without allocating: ``jax.ShapeDtypeStruct`` leaves in the precision's dtypes
        (params in ``param_dtype``, the optimizer's moments no wider), with a loss scale
        under loss scaling. ``sx.estimate`` compiles for it.

        >>> step.abstract(jax.eval_shape(make_state)).params  # doctest: +SKIP
        """
        check_state(state)
        return jax.eval_shape(self._prepare, state)

    def init(self, init_fn: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
        """``init_fn(*args, **kwargs)`` (e.g. building the model and ``TrainState.create``)
        run under ``jax.jit`` straight onto the step's shardings: no leaf is ever whole on
        one device (see :func:`shardax.plan.init_sharded`).

        >>> state = step.init(lambda key: sx.TrainState.create(Model(nnx.Rngs(key)), tx),
        ...                   jax.random.key(0))  # doctest: +SKIP
        """

        def prepared(*args: Any, **kwargs: Any) -> TrainState:
            return self._prepare(init_fn(*args, **kwargs))

        if self.mode == "single":
            return init_sharded(prepared, lambda tree: self._device, *args, **kwargs)
        # Under the mesh, as the step: flax's eager sharding (variables annotated with
        # out_sharding=) places each variable as it is created.
        with jax.sharding.set_mesh(self.mesh):
            if self.mode in ("shard_map", "pmap"):
                self._check_replicated(jax.eval_shape(prepared, *args, **kwargs))
            return init_sharded(prepared, self.state_plan, *args, **kwargs)

    def _prepare(self, state: TrainState) -> TrainState:
        """``state`` with its floating params in the precision's ``param_dtype``, its
        optimizer's moments (floating leaves of one dimension or more) no wider than it,
        and, with loss scaling, a loss scale."""
        dtype = self.precision.param_dtype
        params = cast_floating(state.params, dtype)
        opt_state = narrow_floating(state.opt_state, dtype)
        return self._with_loss_scale(state.replace(params=params, opt_state=opt_state))

    def _with_loss_scale(self, state: TrainState) -> TrainState:
        scaling = self.precision.loss_scaling
        if scaling is None or state.loss_scale is not None:
            return state
        return state.replace(loss_scale=init_loss_scale(scaling))

    def _check_replicated(self, state: Any) -> None:
        """shard_map and pmap keep one whole copy of the state per device."""

        def one(path: str, leaf: Any, sharding: Any) -> None:
            spec = getattr(sharding, "spec", None)
            if spec is None or any(entry is not None for entry in spec):
                raise ValueError(
                    f"mode={self.mode!r} keeps a whole copy of the state on each device, so it "
                    f"supports only a replicating plan; plan {self.plan_name!r} gives leaf "
                    f"{path!r} with shape {tuple(np.shape(leaf))} the sharding "
                    f"{spec if spec is not None else sharding}. Use mode='jit' for sharded "
                    "plans such as sx.fsdp"
                )

        map_arrays(one, state, self.state_plan(state))

    # -- the per-shard function ----------------------------------------------------------

    def _shard_fn(self, state: TrainState, mapped: bool = False):
        """``fn(model_state, batch, keys, rng) -> (grads, loss, aux, model_state)`` on one
        (micro)batch, in the precision's compute dtype; loss and aux come out in its
        output dtype. BatchNorm layers normalize over the global batch in every mode
        (``mapped``: the data axis is bound; :mod:`shardax.train.batchnorm`)."""
        adapter, policy = state.adapter, self.precision
        stateful = self._check_stateful(adapter, mapped)
        loss_fn = over_data_axis(self.loss_fn, self.data_axis, mapped)
        scale = state.loss_scale if policy.loss_scaling is not None else None

        def fn(model_state: Any, batch: Any, keys: Any, rng: jax.Array):
            batch = cast_floating(batch, policy.compute_dtype)
            kwargs = {"rng": keys, "step_rng": rng}
            kwargs = {name: kwargs[name] for name in self._filled}

            def loss(params: Any) -> tuple[jax.Array, Any]:
                model = adapter.bind(cast_floating(params, policy.compute_dtype), model_state, rng)
                if stateful:
                    out, new = _stateful_out(
                        loss_fn(self.view(model), model_state["state"], batch, **kwargs),
                        model_state["state"],
                    )
                    new_model_state = {**model_state, "state": new}
                else:
                    out = loss_fn(self.view(model), batch, **kwargs)
                    new_model_state = adapter.model_state(model, model_state)
                    if isinstance(adapter, LinenModel):
                        self._check_linen_rng(model, mapped)
                    self._check_model_rng(model_state, new_model_state, mapped)
                value, aux = self.objective(out)
                value, aux = cast_floating((value, aux), policy.output_dtype)
                new_model_state = cast_like(new_model_state, model_state)
                return value, (aux, new_model_state)

            return self.differentiate(loss, state.params, scale)

        return fn

    def _check_stateful(self, adapter: Any, mapped: bool) -> bool:
        """Whether the state carries an Equinox ``eqx.nn.State``; refuses a loss function
        that does not take it (or takes one the state lacks), and the modes where its
        batch statistics would be one device's or one microbatch's."""
        stateful, wants = is_stateful(adapter), takes_state(self.loss_fn)
        if stateful and not wants:
            raise TypeError(
                "the state carries an eqx.nn.State (TrainState.create(..., state=...)), so "
                "loss_fn must take it as its second parameter, named 'state', and return "
                "the new one: loss_fn(model, state, batch) -> (loss, new_state)"
            )
        if wants and not stateful:
            raise TypeError(
                "loss_fn(model, state, batch) takes an Equinox state, but the train state "
                "has none: build it with sx.TrainState.create(model, tx, state=state) "
                "(model, state = eqx.nn.make_with_state(Model)(...))"
            )
        if stateful and (mapped or self.accumulate > 1):
            how = f"mode={self.mode!r}" if mapped else f"accumulate={self.accumulate}"
            raise ValueError(
                f"an eqx.nn.State (BatchNorm, SpectralNorm) is not supported with {how}: "
                "each device (or microbatch) would update it from its own slice of the "
                "batch, and the result would not be one device's. Use mode='jit' and "
                "accumulate=1, where its statistics are over the whole global batch"
            )
        return stateful

    def _check_model_rng(self, model_state: Any, new_model_state: Any, mapped: bool) -> None:
        """Randomness the model draws from its own generators (an ``nnx.Rngs``: typed
        keys in the model state) is one device's only under ``mode="jit"`` with
        ``accumulate=1``: refused with accumulation (each microbatch would advance the
        generator once), and under shard_map and pmap (each device draws from its own
        folded key) unless ``rng_per_device=True`` accepts per-device draws. Checked
        while tracing, after the loss: a generator the traced step did not draw from
        (the loss passed the step's keys at call time) is no reason to refuse."""
        if not (mapped or self.accumulate > 1):
            return
        keys = _drawn_keys(model_state, new_model_state)
        if not keys:
            return
        where = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        way_out = (
            "Take the step's keys instead: add an 'rng' (one key per example) or 'step_rng' "
            "parameter to loss_fn and pass it to the model (e.g. nnx.Rngs(noise=step_rng) "
            "or rngs=... at call time)"
        )
        if self.accumulate > 1:
            raise ValueError(
                f"the model draws from its own random generator ({where}), which "
                f"accumulate={self.accumulate} would advance once per microbatch: the "
                f"result would not be one device's. {way_out}, or use accumulate=1"
            )
        if not self.rng_per_device:
            raise ValueError(
                f"the model draws from its own random generator ({where}); under "
                f"mode={self.mode!r} each device would draw from its own folded key, so "
                f"the numbers would not be one device's. {way_out}, or use mode='jit'; "
                "or pass rng_per_device=True to make_train_step to accept per-device draws"
            )

    def _check_linen_rng(self, model: Any, mapped: bool) -> None:
        """A Linen module that called ``make_rng`` (``nn.Dropout``) while tracing drew from
        the step's bound stream, which accumulation folds per microbatch and shard_map /
        pmap per device: refused there by name, as :meth:`_check_model_rng` refuses
        NNX's own generators (``rng_per_device=True`` accepts per-device draws)."""
        if not (mapped or self.accumulate > 1):
            return
        drawn = sorted(_drawn(getattr(getattr(model, "scope", None), "rng_counters", None)))
        if not drawn or (mapped and self.rng_per_device and self.accumulate == 1):
            return
        way_out = (
            "Draw from the step's keys instead: add an 'rng' parameter (one key per "
            "example) to loss_fn and use sx.train.dropout(rng, x, rate), or call the "
            "module with deterministic=True"
        )
        if self.accumulate > 1:
            raise ValueError(
                f"the Linen model draws from make_rng({', '.join(map(repr, drawn))}), "
                f"whose key accumulate={self.accumulate} folds once per microbatch: the "
                f"masks would not be one device's over the whole batch. {way_out}, or use "
                "accumulate=1"
            )
        raise ValueError(
            f"the Linen model draws from make_rng({', '.join(map(repr, drawn))}); under "
            f"mode={self.mode!r} each device would draw from its own folded key, so the "
            f"numbers would not be one device's. {way_out}, or use mode='jit'; or pass "
            "rng_per_device=True to make_train_step to accept per-device draws"
        )

    def _shard_update(self, state: TrainState, batch: Any, index: jax.Array, mapped: bool):
        """Gradients, loss, aux and model state of one shard: means over its real examples."""
        key = jax.random.wrap_key_data(state.rng)
        rng = step_key(key, state.step)
        model_state = state.model_state
        if mapped:
            # Framework RNG (a bound Linen "dropout" stream, NNX RngKeys in the model
            # state) differs per device, so devices do not draw the same masks.
            device = lax.axis_index(self.data_axis)
            rng = jax.random.fold_in(rng, device)
            model_state = _map_keys(lambda k: jax.random.fold_in(k, device), model_state)
        keys = example_keys(key, state.step, index) if "rng" in self._filled else None
        split = None
        if not mapped and self.mode == "jit":
            split = self._split_microbatches
        fn = microbatched(self._shard_fn(state, mapped), self.accumulate, split)
        return fn(model_state, batch, keys, rng)

    def _split_microbatches(self, micro: Any) -> Any:
        """Microbatches ``(accumulate, rows, ...)``: rows over the data axis (and with
        ``seq_axis``, the sequence of each ``(rows, seq, ...)`` leaf over it)."""
        spec = PartitionSpec(None, self.data_axis)
        if self.seq_axis is None:
            return constrain(micro, spec, self.mesh)
        seq = PartitionSpec(None, self.data_axis, self.seq_axis)
        return jax.tree.map(lambda x: constrain(x, seq if x.ndim >= 3 else spec, self.mesh), micro)

    def _global(self, state: TrainState, batch: Any):
        """jit and single: the shard is the whole global batch."""
        size = jax.tree.leaves(batch)[0].shape[0] if self.batch_spec is None else 1
        grads, loss, aux, model_state = self._shard_update(
            state, batch, jnp.arange(size), mapped=False
        )
        return self.finish(state, grads, loss, aux, model_state)

    def _mapped(self, state: TrainState, batch: Any):
        """shard_map and pmap: one device's slice, reduced over the data axis, each
        device weighted by its count of real examples (equal weights without a mask)."""
        self._check_replicated(state)
        axis = self.data_axis
        size = jax.tree.leaves(batch)[0].shape[0]
        index = lax.axis_index(axis) * size + jnp.arange(size)
        grads, loss, aux, model_state = self._shard_update(state, batch, index, mapped=True)
        check_mapped_aux(aux, self.mode)
        count = valid_count(batch)
        if count is None:
            grads = all_reduce(grads, "mean", axis)
        else:
            weighted = jax.tree.map(lambda g: g * count.astype(g.dtype), grads)
            total = jnp.maximum(lax.psum(count, axis), 1)
            grads = jax.tree.map(
                lambda g: g / total.astype(g.dtype), all_reduce(weighted, "sum", axis)
            )
        loss, aux = weighted_mean((loss, aux), count, axis)
        reduced = weighted_mean(_floating(model_state), count, axis)
        model_state = jax.tree.map(
            lambda r, x: x if r is None else r, reduced, model_state, is_leaf=lambda x: x is None
        )
        # Keys come back unfolded: the state is the same on every device.
        model_state = jax.tree.map(
            lambda new, old: old if is_key(old) else new, model_state, state.model_state
        )
        return self.finish(state, grads, loss, aux, model_state)

    # -- the modes -----------------------------------------------------------------------

    def _out(self, state: Any, metrics: Any) -> Any:
        """The program's output (or its shardings, specs) from the state's and metrics'."""
        return (state, metrics) if self.returns_state else metrics

    def _metrics_of(self, out: Any) -> Any:
        return out[1] if self.returns_state else out

    def _mode_call(self) -> Callable[..., Any]:
        """``call(state, batch)`` for the mode, throttled on simulated CPU devices."""
        mode, mesh = self.mode, self.mesh
        if mode == "single":
            single = jax.jit(
                self._global,
                in_shardings=self._device,
                out_shardings=self._device,
                donate_argnums=self._donate_argnums,
            )
            call = lambda state, batch: single(state, self._single_batch(batch))  # noqa: E731
            self._lower = lambda state, batch: single.lower(state, self._single_batch(batch))
        elif mode == "pmap":
            pmapped = jax.pmap(
                self._mapped,
                axis_name=self.data_axis,
                in_axes=(None, 0),
                out_axes=self._out(None, None),
                devices=list(mesh.devices.flat),
                donate_argnums=self._donate_argnums,
            )
            call = lambda state, batch: pmapped(state, self._pmap_batch(batch))  # noqa: E731
            self._lower = lambda state, batch: pmapped.lower(state, self._pmap_batch(batch))
        else:
            call = self._call_cached
            seq = self.seq_axis is not None or self.batch_spec is not None
            if seq:  # jit only
                cached = call
                call = lambda state, batch: cached(state, self.place_batch(batch))  # noqa: E731
            if mode == "jit":
                call = _under_mesh(call, mesh)
            self._lower = _under_mesh(
                lambda s, b: self._lookup(s).fn.lower(s, self.place_batch(b) if seq else b), mesh
            )
        if mode != "single" and mesh.size > 1 and mesh.devices.flat[0].platform == "cpu":
            call = _bounded(call, CPU_MAX_IN_FLIGHT, self._metrics_of)
        return call

    def _build(self, state: TrainState) -> Callable[..., Any]:
        shardings = self.state_plan(state)
        if self.mode == "jit":
            fn = self._global
        else:
            fn = jax.shard_map(
                self._mapped,
                mesh=self.mesh,
                in_specs=(PartitionSpec(), PartitionSpec(self.data_axis)),
                out_specs=self._out(PartitionSpec(), PartitionSpec()),
                check_vma=False,
            )
        if self._explicit and not self._placed_batch:
            # A NumPy batch's type is unsharded inside jit; the split belongs in its type.
            fn = reshard_batch(fn, self.batch_sharding)
        return jax.jit(
            explain_axis_types(fn, self.mesh),
            # with seq_axis or batch_spec the batch comes placed (place_batch), leaf by leaf
            in_shardings=(shardings, None if self._placed_batch else self.batch_sharding),
            out_shardings=self._out(shardings, self._replicated),
            donate_argnums=self._donate_argnums,
        )

    def _lookup(self, state: TrainState) -> _Compiled:
        """The compiled program for ``state``'s structure, from a bounded most-recently-used
        cache. Hot path: ``state`` is what one of the cached programs returned last, so its
        structure is known without flattening it."""
        for entry in self._compiled.values():
            if entry.last is not None and entry.last() is state:
                break
        else:
            treedef = jax.tree.structure(state)
            entry = self._compiled.get(treedef)  # type: ignore[assignment]
            if entry is None:
                entry = self._compiled[treedef] = _Compiled(self._build(state), treedef)
                if len(self._compiled) > COMPILED_CACHE_SIZE:
                    self._compiled.popitem(last=False)
        self._compiled.move_to_end(entry.treedef)
        return entry

    def _call_cached(self, state: TrainState, batch: Any):
        entry = self._lookup(state)
        try:
            out = entry.fn(state, batch)
        except ValueError as e:
            if "Sharding passed to jit does not match" not in str(e):
                raise
            if self._placed_as_planned(state):  # then it is the batch
                raise ValueError(
                    f"the batch is committed to other devices or "
                    f"shardings than this step's {self.batch_sharding.spec} over mesh "
                    f"{dict(self.mesh.shape)}; pass NumPy arrays, or place the batch with "
                    "sx.distribute_batch(batch, sx.batch_sharding(mesh)) for this step's mesh"
                ) from e
            # A state placed by another plan (e.g. an eval step built with a plan other
            # than the train step's): name both, not jit's sharding dump.
            raise ValueError(
                f"the state is not placed as this step's plan "
                f"{self.plan_name!r} places it (it was placed by another plan or step); build "
                "this step with the same mesh and plan as the step that placed the state, or "
                "place it with this step's shard(state)"
            ) from e
        # The state the next call most likely gets: the new one, or (an eval step, which
        # returns only the metrics) the same one.
        entry.last = weakref.ref(out[0] if self.returns_state else state)
        return out

    def _placed_as_planned(self, state: TrainState) -> bool:
        """Every array leaf of ``state`` has the sharding this step's plan gives it."""
        same: list[bool] = []
        map_arrays(
            lambda path, x, s: same.append(
                not isinstance(x, jax.Array) or x.sharding.is_equivalent_to(s, x.ndim)
            ),
            state,
            self.state_plan(state),
        )
        return all(same)

    def _single_batch(self, batch: Any) -> Any:
        """The batch on the step's device; a batch placed over the mesh (``distribute_batch``,
        ``global_batch``, ``prefetch_to_device``) is gathered there."""
        device = self._device
        return jax.tree.map(
            lambda x: (
                jax.device_put(x, device)
                if isinstance(x, jax.Array) and x.sharding != device
                else x
            ),
            batch,
        )

    @property
    def _placed_batch(self) -> bool:
        """Whether the jit program takes the batch placed leaf by leaf (place_batch)."""
        return self.seq_axis is not None or self.batch_spec is not None

    def place_batch(self, batch: Any) -> Any:
        """``batch`` placed as this step takes it under ``"jit"``: rows over the data axis,
        and with ``seq_axis`` dimension 1 of each leaf of rank >= 2 over that axis
        (``sx.batch_sharding(mesh, seq_axis=...)``). The step calls it itself; a loop may
        call it ahead (prefetching). Leaves already placed so pass untouched.

        >>> step.place_batch({"x": np.ones((16, 4))})["x"].sharding.spec  # doctest: +SKIP
        PartitionSpec('data',)

        With ``batch_spec``, each leaf is placed as it says (:mod:`shardax.data.spec`).
        """
        if self.batch_spec is not None:
            shardings = self._checked_batch(batch)
            return place_by_spec(batch, self.mesh, self.batch_spec, shardings)

        def place(path: str, x: Any) -> Any:
            if not hasattr(x, "ndim") or x.ndim == 0:
                return x
            target = self.batch_sharding
            if self._seq_sharding is not None and x.ndim >= 2:
                target = self._seq_sharding
                size = axis_size(self.mesh, self.seq_axis)
                if x.shape[1] % size:
                    raise ValueError(
                        f"batch leaf {path or '<root>'!r} has {x.shape[1]} positions along "
                        f"dimension 1 (the sequence), not divisible by seq_axis "
                        f"{self.seq_axis!r} of size {size}; pad the sequence to a multiple "
                        f"of {size}"
                    )
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
                return x
            if isinstance(x, jax.ShapeDtypeStruct):  # lowering for abstract values
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
            return device_put_global(x, target)

        return jax.tree_util.tree_map_with_path(lambda p, x: place(path_str(p), x), batch)

    def _pmap_batch(self, batch: Any) -> Any:
        n = self._devices
        return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

    # -- calling -------------------------------------------------------------------------

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The program for ``state`` and ``batch``, lowered and not run: ``.as_text()`` is
        its HLO, ``.compile()`` the executable (``memory_analysis()``,
        ``cost_analysis()``). In ``"jit"`` and ``"shard_map"`` modes it is the function
        ``step(state, batch)`` runs (and caches).

        >>> compiled = step.lower(state, batch).compile()  # doctest: +SKIP
        >>> compiled.memory_analysis().argument_size_in_bytes  # doctest: +SKIP
        """
        self._check_batch(batch)
        return self._lower(state, batch)

    def __call__(self, state: TrainState, batch: Any) -> Any:
        check_state(state)
        self._check_batch(batch)
        return self._call(self._with_loss_scale(state), batch)

    def _check_batch(self, batch: Any) -> None:
        self._checked_batch(batch)

    def _checked_batch(self, batch: Any) -> Any:
        """A list of examples (:func:`~shardax.train.batch.check_batch`), or with a
        ``batch_spec`` arrays placed as it says: checked once per batch structure
        (:func:`~shardax.train.batch.batch_structure`), not per step. Returns the
        ``batch_spec`` shardings (True without one)."""
        check_mask_has_examples(batch)
        key = batch_structure(batch)
        known = self._batches.get(key) if key is not None else None
        if known is not None:
            self._batches.move_to_end(key)
            return known
        if self.batch_spec is None:
            check_batch(batch, divisor=self._divisor, what=self._what)
            known = True
        else:
            check_batch_leaves(batch, arrays_only=True)
            known = batch_shardings(batch, self.mesh, self.batch_spec)
        if key is not None:
            self._batches[key] = known
            if len(self._batches) > BATCH_CACHE_SIZE:
                self._batches.popitem(last=False)
        return known

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, plan={self.plan_name!r}, "
            f"mesh={dict(self.mesh.shape)}, accumulate={self.accumulate}, donate={self.donate}, "
            f"precision={policy_name(self.precision)!r}"
            + (f", seq_axis={self.seq_axis!r})" if self.seq_axis is not None else ")")
        )
