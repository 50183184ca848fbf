"""``make_train_step``: one compiled training step for every framework and every mode.

The step is written once, for one shard of the batch: under ``"jit"`` and ``"single"``
the shard is the whole global batch and the cross-device reductions are identities;
under ``"shard_map"`` and ``"pmap"`` each device sees its slice and gradients, losses,
metrics and model state are reduced over the data axis. So every mode computes the
same update from the same global batch.

>>> mesh = sx.make_mesh({"data": -1})
>>> state = sx.TrainState.from_params({"w": jnp.zeros(3)}, lambda p, x: x @ p["w"],
...                                   optax.sgd(0.1))
>>> def loss_fn(model, batch):
...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
>>> step = sx.make_train_step(loss_fn, mesh=mesh)
>>> state, metrics = step(step.shard(state), {"x": np.ones((16, 3)), "y": np.ones(16)})
"""

from __future__ import annotations

import collections
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from shardax.checks import as_count
from shardax.data.placement import batch_sharding
from shardax.mesh.axes import DATA_AXIS
from shardax.parallel.collectives import all_reduce, weighted_mean
from shardax.plan.activation import constrain
from shardax.plan.core import Plan, axis_size, replicate
from shardax.plan.follow import FollowParams, follow_params
from shardax.plan.init import init_sharded
from shardax.plan.tree import is_array, map_arrays
from shardax.runtime.agreement import check_agreement
from shardax.runtime.processes import device_put_global
from shardax.train.axis_types import explain_axis_types, mesh_axis_type, reshard_batch
from shardax.train.batch import check_batch, split_microbatches
from shardax.train.loss import batch_mask, valid_count
from shardax.train.precision import (
    Precision,
    adjust_loss_scale,
    all_finite,
    cast_floating,
    cast_like,
    init_loss_scale,
    policy_name,
    resolve,
    scale_loss,
    select_tree,
    unscale,
)
from shardax.train.rng import example_keys, step_key
from shardax.train.state import TrainState
from shardax.train.stats import DEFAULT_STATS, STATS, check_stats, update_stats

if TYPE_CHECKING:
    from shardax.train.auto import AutoPlanOptions

Mode = Literal["jit", "shard_map", "pmap", "single"]
MODES: tuple[str, ...] = ("jit", "shard_map", "pmap", "single")
LossFn = Callable[..., Any]


def _loss_and_aux(out: Any) -> tuple[jax.Array, Any]:
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


def _floating(tree: Any) -> Any:
    """``tree`` with None in place of every leaf that is not a floating array."""
    return jax.tree.map(
        lambda x: x if is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact) else None, tree
    )


_fresh_copy = jax.jit(lambda tree: tree)


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


def _check_state(state: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(
            f"the train step takes a sx.TrainState (sx.TrainState.create(model, tx), "
            f".from_linen or .from_params), got {type(state).__name__}"
        )


CPU_MAX_IN_FLIGHT = 4
"""Steps queued at most on simulated CPU devices. XLA:CPU's in-process collectives can
deadlock (a 40 s rendezvous timeout, then abort) when many multi-device programs are
queued at once; waiting for the step ``CPU_MAX_IN_FLIGHT`` back keeps the queue short."""


def _bounded(
    call: Callable[..., Any], depth: int, metrics: Callable[[Any], Any]
) -> Callable[..., Any]:
    """``call``, waiting for the result of the call ``depth`` back before returning
    (for the ``metrics`` of its output: the state may be donated by then)."""
    pending: collections.deque[Any] = collections.deque()

    def bounded(state: Any, batch: Any) -> Any:
        out = call(state, batch)
        pending.append(metrics(out))
        if len(pending) > depth:
            jax.block_until_ready(pending.popleft())
        return out

    return bounded


def _under_mesh(call: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """Runs (and so traces) ``call`` under ``jax.set_mesh(mesh)``, so that
    ``sx.constrain`` inside the model knows the mesh."""

    def under(state: Any, batch: Any) -> Any:
        with jax.sharding.set_mesh(mesh):
            return call(state, batch)

    return under


def _is_key(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _map_keys(fn: Callable[[jax.Array], jax.Array], tree: Any) -> Any:
    """``fn`` applied to every typed PRNG key leaf of ``tree``."""
    return jax.tree.map(lambda x: fn(x) if _is_key(x) else x, tree)


def _check_data_axis(data_axis: Any, mesh: Mesh, mode: str) -> str | tuple[str, ...]:
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


def _metrics(loss: jax.Array, aux: Any) -> dict[str, Any]:
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


COMPILED_CACHE_SIZE = 8
"""Compiled steps kept per ``TrainStep`` (one per state structure), most recent first."""


class _Compiled:
    """One compiled step, its state structure, and the last state it returned (weakly)."""

    __slots__ = ("fn", "last", "treedef")

    def __init__(self, fn: Callable[..., Any], treedef: Any) -> None:
        self.fn, self.treedef = fn, treedef
        self.last: weakref.ref[Any] | None = None


class TrainStep:
    """``step(state, batch) -> (state, metrics)``; ``step.shard(state)`` places a state.

    Built by :func:`make_train_step`. Attributes: ``mode``, ``mesh``, ``plan``,
    ``accumulate``, ``donate``, ``data_axis``, ``precision``, ``stats``.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        *,
        mesh: Mesh,
        plan: Plan | None,
        mode: str,
        accumulate: int,
        donate: bool,
        data_axis: str | tuple[str, ...],
        precision: str | Precision = "fp32",
        stats: Sequence[str] = DEFAULT_STATS,
    ) -> None:
        self.precision = resolve(precision)
        self.stats = check_stats(stats)
        self._scaling = self.precision.loss_scaling
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function loss_fn(model, batch), got {loss_fn!r}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        data_axis = _check_data_axis(data_axis, mesh, mode)
        accumulate = as_count("accumulate", accumulate)
        if mode == "single" and plan is not None and getattr(plan, "name", None) != "replicate":
            raise ValueError(
                f"mode='single' keeps the whole state on one device, so it takes no sharding "
                f"plan; got plan {getattr(plan, 'name', plan)!r}. Drop plan= or use mode='jit'"
            )
        from shardax.train.auto import AutoPlanOptions

        self._auto_options = AutoPlanOptions() if isinstance(plan, str) and plan == "auto" else plan
        self._auto = isinstance(self._auto_options, AutoPlanOptions)
        if self._auto:
            self._auto_options.check(mesh)
        self.auto_report = None
        if self._auto and mode != "jit":
            raise ValueError(
                f"plan='auto' picks among sharded plans, which only mode='jit' runs; got "
                f"mode={mode!r}"
            )
        plan = replicate(mesh) if plan is None or self._auto else plan
        if not callable(plan):
            raise TypeError(
                f"plan must be a shardax Plan (a callable from a tree to its shardings, e.g. "
                f"sx.fsdp(mesh)), got {plan!r}"
            )
        self._plan_name = getattr(plan, "name", type(plan).__name__)
        plan_mesh = getattr(plan, "mesh", mesh)
        if plan_mesh != mesh:
            raise ValueError(
                f"plan {self._plan_name!r} is over mesh {dict(plan_mesh.shape)}, not the step's "
                f"mesh {dict(mesh.shape)}; build both from the same mesh"
            )
        if mode == "pmap" and axis_size(mesh, data_axis) != mesh.size:
            raise ValueError(
                f"mode='pmap' maps over one axis, but the mesh {dict(mesh.shape)} has devices "
                f"outside data axis {data_axis!r}; use mode='jit' for multi-axis meshes"
            )
        self.loss_fn = loss_fn
        self.mesh, self.plan, self.mode = mesh, plan, mode
        # The optimizer state follows the params (Adam's mu/nu), whatever the plan.
        self._state_plan = (
            follow_params(plan)
            if isinstance(plan, Plan) and not isinstance(plan, FollowParams)
            else plan
        )
        self.accumulate, self.donate, self.data_axis = accumulate, donate, data_axis
        parameters = inspect.signature(loss_fn).parameters
        self._pass_rng, self._pass_step_rng = "rng" in parameters, "step_rng" in parameters
        self._devices = 1 if mode == "single" else axis_size(mesh, data_axis)
        self._divisor = self._devices * accumulate
        self._what = f"the data axis size {self._devices}" if mode != "single" else "1"
        if accumulate > 1:
            self._what = f"{self._what} × accumulate={accumulate} = {self._divisor}"
        self._donate_argnums = (0,) if donate else ()
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._batch_sharding = batch_sharding(mesh, data_axis)
        names = (data_axis,) if isinstance(data_axis, str) else data_axis
        self._explicit = any(mesh_axis_type(mesh, n) == AxisType.Explicit for n in names)
        self._compiled: collections.OrderedDict[Any, _Compiled] = collections.OrderedDict()
        self._call = getattr(self, f"_call_{mode}")
        if mode == "jit":
            self._call = _under_mesh(self._call, mesh)
        if mode != "single" and mesh.size > 1 and mesh.devices.flat[0].platform == "cpu":
            self._call = _bounded(self._call, CPU_MAX_IN_FLIGHT, self._metrics_of)
        if mode == "single":
            self._device = SingleDeviceSharding(mesh.devices.flat[0])
            self._single = jax.jit(
                self._global_update,
                in_shardings=self._device,
                out_shardings=self._device,
                donate_argnums=self._donate_argnums,
            )
        elif mode == "pmap":
            self._pmapped = jax.pmap(
                self._mapped_update,
                axis_name=data_axis,
                in_axes=(None, 0),
                out_axes=self._out(None, None),
                devices=list(mesh.devices.flat),
                donate_argnums=self._donate_argnums,
            )

    # -- placement ---------------------------------------------------------------------

    def _choose_plan(self, state: Any, batch: Any) -> None:
        """``plan="auto"``: the plan :func:`shardax.auto_plan` picks for this state and
        batch, from the compiled candidates; kept in ``self.auto_report``."""
        from shardax.train.auto import auto_plan

        report = auto_plan(
            self.mesh,
            state,
            loss_fn=self.loss_fn,
            batch=batch,
            axis=self.data_axis,
            accumulate=self.accumulate,
            precision=self.precision,
            **vars(self._auto_options),
        )
        self.auto_report, self.plan, self._auto = report, report.plan, False
        self._state_plan, self._plan_name = report.plan, f"auto:{report.plan.name}"

    def _no_auto(self, what: str) -> None:
        if self._auto:
            raise ValueError(
                f"plan='auto' picks the plan by compiling the step for a state and a batch, "
                f"and {what} has no batch to build abstract values from: pass the unplaced "
                "state to the first step(state, batch), which places it, or pick beforehand "
                "with sx.auto_plan(mesh, init_or_state, loss_fn=..., batch=...).plan"
            )

    def _shard_grads(self, grads: Any) -> Any:
        """zero2: the gradients constrained to the optimizer state's sharding."""
        plan = self._state_plan
        if not getattr(plan, "shard_grads", False):
            return grads
        return jax.tree.map(
            lambda g, s: lax.with_sharding_constraint(g, NamedSharding(self.mesh, s)),
            grads,
            plan.mirror_specs(grads),
        )

    def shard(self, state: TrainState) -> TrainState:
        """Places ``state`` as this step expects it: with the plan, or on one device.

        The result never shares buffers with ``state`` when the step donates, so the
        arrays the state was built from (a Linen ``variables`` dict, an NNX module)
        stay usable after the step consumes the placed state. With several processes,
        all first check that they run the same step and state shardings
        (:func:`shardax.check_agreement`), so a mismatch is an error, not a hang.
        """
        self._no_auto("step.shard(state)")
        _check_state(state)
        # Cast params (new arrays) or the user's, with a loss scale if the step scales.
        state = self._prepare(state)
        if self.mode == "single":
            shardings: Any = self._device
        else:
            if self.mode in ("shard_map", "pmap"):
                self._check_replicated(state)
            shardings = self._state_plan(state)
            if jax.process_count() > 1:
                check_agreement(train_step=repr(self), state_shardings=shardings)
        placed = device_put_global(state, shardings)
        return unalias(state, placed) if self.donate else placed

    def _prepare(self, state: TrainState) -> TrainState:
        """``state`` with its floating params in the precision's ``param_dtype`` and, with
        loss scaling, a loss scale."""
        params = cast_floating(state.params, self.precision.param_dtype)
        return self._with_loss_scale(state.replace(params=params))

    def _with_loss_scale(self, state: TrainState) -> TrainState:
        if self._scaling is None or state.loss_scale is not None:
            return state
        return state.replace(loss_scale=init_loss_scale(self._scaling))

    def _check_replicated(self, state: Any) -> None:
        """shard_map and pmap keep one whole copy of the state per device."""

        def one(path: str, leaf: Any, sharding: Any) -> None:
            spec = getattr(sharding, "spec", None)
            if spec is None or any(entry is not None for entry in spec):
                raise ValueError(
                    f"mode={self.mode!r} keeps a whole copy of the state on each device, so it "
                    f"supports only a replicating plan; plan {self._plan_name!r} gives leaf "
                    f"{path!r} with shape {tuple(np.shape(leaf))} the sharding "
                    f"{spec if spec is not None else sharding}. Use mode='jit' for sharded "
                    "plans such as sx.fsdp"
                )

        map_arrays(one, state, self._state_plan(state))

    # -- the step, for one shard of the batch --------------------------------------------

    _objective = staticmethod(_loss_and_aux)

    def _loss(self, state: TrainState, model_state: Any, batch: Any, keys: Any, rng: Any):
        """``loss(params) -> (loss, (aux, model state))`` on one (micro)batch, in the
        precision's compute dtype; loss and aux come out in its output dtype."""
        adapter, policy = state.adapter, self.precision
        batch = cast_floating(batch, policy.compute_dtype)
        kwargs = {"rng": keys} if self._pass_rng else {}
        if self._pass_step_rng:
            kwargs["step_rng"] = rng

        def loss(params: Any) -> tuple[jax.Array, Any]:
            model = adapter.bind(cast_floating(params, policy.compute_dtype), model_state, rng)
            value, aux = self._objective(self.loss_fn(self._view(model), batch, **kwargs))
            value, aux = cast_floating((value, aux), policy.output_dtype)
            new_model_state = cast_like(adapter.model_state(model, model_state), model_state)
            return value, (aux, new_model_state)

        return loss

    @staticmethod
    def _view(model: Any) -> Any:
        return model

    def _grads(self, state: TrainState, model_state: Any, batch: Any, keys: Any, rng: Any):
        loss = self._loss(state, model_state, batch, keys, rng)
        scale = state.loss_scale if self._scaling is not None else None

        def scaled(params: Any) -> tuple[jax.Array, Any]:
            value, rest = loss(params)
            return scale_loss(value, scale), (value, rest)

        (_, (value, (aux, new_model_state))), grads = jax.value_and_grad(scaled, has_aux=True)(
            state.params
        )
        return grads, value, aux, new_model_state

    def _shard_update(self, state: TrainState, batch: Any, index: jax.Array, mapped: bool):
        """Gradients, loss and aux of one shard: means over its real examples, and its
        count of real examples (None without a mask)."""
        key = jax.random.wrap_key_data(state.rng)
        rng = step_key(key, state.step)
        model_state = state.model_state
        if mapped:
            # Framework RNG (a bound Linen "dropout" stream, NNX RngKeys in the model
            # state) differs per device, so devices do not draw the same masks.
            device = lax.axis_index(self.data_axis)
            rng = jax.random.fold_in(rng, device)
            model_state = _map_keys(lambda k: jax.random.fold_in(k, device), model_state)
        keys = example_keys(key, state.step, index) if self._pass_rng else None
        k = self.accumulate
        if k == 1:
            grads, loss, aux, model_state = self._grads(state, model_state, batch, keys, rng)
            return grads, loss, aux, model_state, valid_count(batch)

        micro = split_microbatches(batch, k)
        micro_keys = None if keys is None else split_microbatches(keys, k)
        if not mapped and self.mode == "jit":
            micro = constrain(micro, PartitionSpec(None, self.data_axis), self.mesh)
        masked = batch_mask(batch) is not None

        def body(carry: Any, xs: Any) -> tuple[Any, None]:
            sums, total, model_state = carry
            mb, mkeys, j = xs
            grads, loss, aux, model_state = self._grads(
                state, model_state, mb, mkeys, jax.random.fold_in(rng, j)
            )
            count = valid_count(mb) if masked else jnp.float32(1)
            sums = jax.tree.map(
                lambda s, v: s + count.astype(v.dtype) * v, sums, (grads, loss, aux)
            )
            return (sums, total + count, model_state), None

        first = jax.tree.map(lambda x: x[0], (micro, micro_keys))
        shapes = jax.eval_shape(lambda mb, mk: self._grads(state, model_state, mb, mk, rng), *first)
        zeros = jax.tree.map(jnp.zeros_like, shapes[:3])  # with the shardings in their types
        (sums, total, model_state), _ = lax.scan(
            body,
            (zeros, jnp.float32(0), model_state),
            (micro, micro_keys, jnp.arange(k)),
        )
        scale = 1 / jnp.maximum(total, 1)
        grads, loss, aux = jax.tree.map(lambda s: (s * scale.astype(s.dtype)).astype(s.dtype), sums)
        return grads, loss, aux, model_state, total if masked else None

    @staticmethod
    def _out(state: Any, metrics: Any) -> Any:
        """The step's output (or its shardings, specs, axes) from the state's and the
        metrics' (the eval step returns the metrics only)."""
        return state, metrics

    @staticmethod
    def _metrics_of(out: Any) -> Any:
        return out[1]

    def _finish(self, state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any):
        metrics = _metrics(loss, aux)
        if self._scaling is None:
            new = state.apply_gradients(grads, model_state)
            return new, {**metrics, **update_stats(new, grads, self.stats)}
        if "loss_scale" in metrics:
            raise ValueError(
                "loss_fn's aux metrics must not have a 'loss_scale' entry with loss scaling "
                f"(precision={policy_name(self.precision)!r}); the step reports the scale there"
            )
        # Dynamic loss scaling: a step with non-finite gradients changes nothing but the
        # step count and the scale.
        grads = unscale(grads, state.loss_scale)
        finite = all_finite(grads)
        updated = state.apply_gradients(grads, model_state)
        state = select_tree(finite, updated, state.replace(step=updated.step))
        loss_scale = adjust_loss_scale(state.loss_scale, finite, self._scaling)
        stats = update_stats(state, grads, self.stats)
        return state.replace(loss_scale=loss_scale), {
            **metrics,
            **stats,
            "loss_scale": loss_scale.scale,
        }

    def _global_update(self, state: TrainState, batch: Any):
        """jit and single: the shard is the whole global batch."""
        size = jax.tree.leaves(batch)[0].shape[0]
        grads, loss, aux, model_state, _ = self._shard_update(
            state, batch, jnp.arange(size), mapped=False
        )
        grads = self._shard_grads(grads)
        return self._finish(state, grads, loss, aux, model_state)

    def _mapped_update(self, state: TrainState, batch: Any):
        """shard_map and pmap: one device's slice, reduced over the data axis."""
        self._check_replicated(state)
        axis = self.data_axis
        size = jax.tree.leaves(batch)[0].shape[0]
        index = lax.axis_index(axis) * size + jnp.arange(size)
        grads, loss, aux, model_state, count = self._shard_update(state, batch, index, mapped=True)
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
            lambda new, old: old if _is_key(old) else new, model_state, state.model_state
        )
        return self._finish(state, grads, loss, aux, model_state)

    # -- dispatch ------------------------------------------------------------------------

    def init(self, init_fn: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
        """``init_fn(*args, **kwargs)`` (e.g. building the model and ``TrainState.create``)
        run under ``jax.jit`` straight onto the step's shardings: no leaf is ever whole on
        one device (see :func:`shardax.init_sharded`).

        >>> state = step.init(lambda key: sx.TrainState.create(Model(nnx.Rngs(key)), tx),
        ...                   jax.random.key(0))
        """
        self._no_auto("step.init(...)")

        def prepared(*args: Any, **kwargs: Any) -> TrainState:
            return self._prepare(init_fn(*args, **kwargs))

        if self.mode == "single":
            return init_sharded(prepared, lambda tree: self._device, *args, **kwargs)
        # Under the mesh, as the step: flax's eager sharding (variables annotated with
        # out_sharding=) places each variable as it is created.
        with jax.sharding.set_mesh(self.mesh):
            if self.mode in ("shard_map", "pmap"):
                self._check_replicated(jax.eval_shape(prepared, *args, **kwargs))
            return init_sharded(prepared, self._state_plan, *args, **kwargs)

    def _build(self, state: TrainState) -> Callable[..., Any]:
        shardings = self._state_plan(state)
        if self.mode == "jit":
            fn = self._global_update
        else:
            fn = jax.shard_map(
                self._mapped_update,
                mesh=self.mesh,
                in_specs=(PartitionSpec(), PartitionSpec(self.data_axis)),
                out_specs=self._out(PartitionSpec(), PartitionSpec()),
                check_vma=False,
            )
        if self._explicit:
            # A NumPy batch's type is unsharded inside jit; the split belongs in its type.
            fn = reshard_batch(fn, self._batch_sharding)
        return jax.jit(
            explain_axis_types(fn, self.mesh),
            in_shardings=(shardings, self._batch_sharding),
            out_shardings=self._out(shardings, self._replicated),
            donate_argnums=self._donate_argnums,
        )

    def _lookup(self, state: TrainState) -> _Compiled:
        """The compiled step for ``state``'s structure, from a bounded most-recently-used
        cache. Hot path: ``state`` is what one of the cached steps returned last, so its
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

    def _call_jit(self, state: TrainState, batch: Any):
        entry = self._lookup(state)
        out = entry.fn(state, batch)
        # The state the next call most likely gets: the new one, or (an eval step, which
        # returns only the metrics) the same one.
        entry.last = weakref.ref(out[0] if isinstance(out, tuple) else state)
        return out

    _call_shard_map = _call_jit

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

    def _call_single(self, state: TrainState, batch: Any):
        return self._single(state, self._single_batch(batch))

    def _pmap_batch(self, batch: Any) -> Any:
        n = self._devices
        return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

    def _call_pmap(self, state: TrainState, batch: Any):
        return self._pmapped(state, self._pmap_batch(batch))

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The step for ``state`` and ``batch``, lowered and not run: ``.as_text()`` is
        its HLO, ``.compile()`` the executable (``memory_analysis()``,
        ``cost_analysis()``). In ``"jit"`` and ``"shard_map"`` modes it is the function
        ``step(state, batch)`` runs (and caches).

        >>> compiled = step.lower(state, batch).compile()
        >>> compiled.memory_analysis().argument_size_in_bytes  # doctest: +SKIP
        """
        check_batch(batch, divisor=self._divisor, what=self._what)
        if self.mode == "single":
            return self._single.lower(state, self._single_batch(batch))
        if self.mode == "pmap":
            return self._pmapped.lower(state, self._pmap_batch(batch))
        with jax.sharding.set_mesh(self.mesh):
            return self._lookup(state).fn.lower(state, batch)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One update on the global ``batch``; metrics are means over its real examples."""
        _check_state(state)
        check_batch(batch, divisor=self._divisor, what=self._what)
        if self._auto:
            self._choose_plan(state, batch)
            state = self.shard(state)
        if self._scaling is not None and state.loss_scale is None:
            state = self._with_loss_scale(state)
        return self._call(state, batch)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, plan={self._plan_name!r}, "
            f"mesh={dict(self.mesh.shape)}, accumulate={self.accumulate}, donate={self.donate}, "
            f"precision={policy_name(self.precision)!r})"
        )


def make_train_step(
    loss_fn: LossFn,
    *,
    mesh: Mesh,
    plan: Plan | AutoPlanOptions | Literal["auto"] | None = None,
    mode: Mode = "jit",
    accumulate: int = 1,
    donate: bool = True,
    data_axis: str | tuple[str, ...] = DATA_AXIS,
    precision: str | Precision = "fp32",
    stats: Sequence[str] = DEFAULT_STATS,
) -> TrainStep:
    """A compiled ``step(state, batch) -> (state, metrics)`` for ``loss_fn``.

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss | (loss, aux)``, where ``model`` is what
            the framework calls a model (NNX or Equinox module, bound Linen module,
            ``partial(apply_fn, params)``) and ``loss`` is a scalar: the mean over the real
            examples of ``batch`` (see :func:`shardax.masked_mean`). If it takes an ``rng``
            argument it receives one key per example, ``fold_in(fold_in(rng, step), i)``
            for example ``i`` of the global batch, the same in every mode. If it takes a
            ``step_rng`` argument it receives one key for the step,
            ``fold_in(rng, step)``, e.g. for ``nnx.Rngs(dropout=step_rng)``: the same
            numbers under ``"jit"`` on any mesh and ``"single"``. With
            ``accumulate=k`` microbatch ``j`` gets ``fold_in(step_rng, j)``; under
            ``"shard_map"`` and ``"pmap"`` each device folds in its index, so devices
            draw different masks (use ``rng`` for keys that no mode changes).
        mesh: the device mesh; the batch is split over ``data_axis``.
        plan: shardings of the state (default: replicate), wrapped in
            :func:`shardax.follow_params` so the optimizer state follows the params.
            ``"shard_map"`` and ``"pmap"`` support only replicating plans. ``step.init``
            builds a state straight onto it; ``jit`` mode traces under
            ``jax.set_mesh(mesh)``, so ``sx.constrain`` in the model applies, with the
            mesh's axis types: on Explicit axes the model's own shardings
            (``out_sharding=``, ``jax.sharding.reshard``) apply, and on Auto axes
            computation follows the data (:mod:`shardax.train.axis_types`).
            ``sx.zero2`` also constrains the gradients to the optimizer state's
            sharding. ``"auto"``: the first ``step(state, batch)`` picks the plan with
            :func:`shardax.auto_plan` and places the state on it (``step.auto_report``);
            ``sx.AutoPlanOptions(tp_rules=..., pipeline_rules=..., device_memory=...)`` passes
            auto_plan's options (the fsdp+tp and pipeline candidates, the budget).
        mode: ``"jit"`` (jit with the plan's and the batch's shardings), ``"shard_map"``
            (per-device gradients all-reduced over the data axis), ``"pmap"`` (seed 003's
            layout: the batch reshaped to (devices, per device, ...); the replicated
            state goes in with ``in_axes=None`` rather than stacked on a device axis, so
            it is the same object in every mode) or ``"single"`` (the first device of
            ``mesh``).
        accumulate: number of microbatches the global batch is split into (``lax.scan``).
        donate: donate the state's buffers to the step.
        data_axis: the mesh axis the batch is split over, or a tuple of axes (HSDP:
            ``("replica", "fsdp")`` with ``plan=sx.fsdp(mesh, axis="fsdp")``).
        precision: ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` or an
            :class:`shardax.Precision`. Params and optimizer state stay in the state in
            ``param_dtype`` (float32); params and floating batch leaves are cast to
            ``compute_dtype`` for the forward and backward passes; gradients reach the
            optimizer in ``param_dtype``. ``"fp16"`` adds dynamic loss scaling: the
            scale is ``state.loss_scale`` and ``metrics["loss_scale"]`` (the scale after
            the step); a step with non-finite gradients leaves params, optimizer and
            model state unchanged and halves the scale.
        stats: the update statistics the step returns (:mod:`shardax.train.stats`):
            ``"grad_norm"`` (global L2 norm of the all-reduced gradients),
            ``"param_norm"`` (after the update) and ``"learning_rate"`` (with
            ``optax.inject_hyperparams``). Default ``("grad_norm", "learning_rate")``;
            ``()`` for none, e.g. to time the bare step.

    Metrics are ``{"loss": loss, **aux}`` (or ``{"loss", "aux"}`` for non-dict aux), means
    over the real examples of the whole global batch in every mode, plus ``stats``.
    """
    return TrainStep(
        loss_fn,
        mesh=mesh,
        plan=plan,
        mode=mode,
        accumulate=accumulate,
        donate=donate,
        data_axis=data_axis,
        precision=precision,
        stats=stats,
    )
