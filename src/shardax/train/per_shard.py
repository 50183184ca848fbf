"""The per-shard function of a step: what one device (or the whole mesh) computes.

``PerShard`` binds the model to its params, applies the precision's casts, hands
``loss_fn`` its ``rng``/``step_rng`` keys, splits microbatches (``microbatched``) and
binds BatchNorm to the data axis (``over_data_axis``). It runs the step's ``StepWork``
(``objective``, ``view``, ``differentiate``, ``finish``), which it is given and calls,
never the other way round:

- ``PerShard.whole``: under ``"jit"`` and ``"single"``, the shard is the whole
  global batch;
- ``PerShard.mapped``: under ``"shard_map"`` and ``"pmap"``, one device's slice,
  reduced over the data axis with each device weighted by its count of real examples.

It refuses by name what would not compute one device's numbers there: an Equinox
state, a model's own random generators, a Linen ``make_rng``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from shardax.parallel.collectives import all_reduce, weighted_mean
from shardax.plan.activation import constrain
from shardax.plan.tree import is_array, is_key, map_arrays, path_str
from shardax.train.accumulate import microbatched
from shardax.train.batchnorm import over_data_axis
from shardax.train.config import StepConfig, from_config
from shardax.train.forward_gather import gathered, gathers_forward
from shardax.train.fp8_layers import matmul_routing, route
from shardax.train.loss import check_mapped_aux, takes_state
from shardax.train.masks import valid_count
from shardax.train.model import LinenModel, call_binding_streams, is_stateful
from shardax.train.precision import cast_floating, cast_like
from shardax.train.protocol import StepWork
from shardax.train.rng import example_keys, fold_in_each, step_key
from shardax.train.state import TrainState


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


def check_replicated(state: Any, state_plan: Any, mode: str, plan_name: str) -> None:
    """shard_map and pmap keep one whole copy of the state per device."""

    def one(path: str, leaf: Any, sharding: Any) -> None:
        spec = getattr(sharding, "spec", None)
        if spec is None or any(entry is not None for entry in spec):
            raise ValueError(
                f"mode={mode!r} keeps a whole copy of the state on each device, so it "
                f"supports only a replicating plan; plan {plan_name!r} gives leaf "
                f"{path!r} with shape {tuple(np.shape(leaf))} the sharding "
                f"{spec if spec is not None else sharding}. Use mode='jit' for sharded "
                "plans such as sx.fsdp"
            )

    map_arrays(one, state, state_plan(state))


class PerShard:
    """The per-shard function of ``loss_fn`` under ``config``, running ``work``.

    ``filled``: the step keys ``loss_fn`` takes (``"rng"``, ``"step_rng"``);
    ``state_plan``: the state's plan (the optimizer state following the params).
    """

    # The settings, read from ``config`` (held once, not copied).
    mesh, mode, accumulate, data_axis = from_config(), from_config(), from_config(), from_config()
    seq_axis, batch_spec, precision = from_config(), from_config(), from_config()
    rng_per_device, plan_name = from_config(), from_config()

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        config: StepConfig,
        work: StepWork,
        *,
        filled: tuple[str, ...],
        state_plan: Any,
    ) -> None:
        self.config, self.loss_fn, self.work = config, loss_fn, work
        self._filled, self.state_plan = filled, state_plan

    def _shard_fn(self, state: TrainState, mapped: bool = False):
        """``fn(model_state, batch, keys, rng) -> (grads, loss, aux, model_state)`` on one
        (micro)batch, in the precision's compute dtype; loss and aux come out in its
        output dtype. BatchNorm layers normalize over the global batch in every mode
        (``mapped``: the data axis is bound; ``shardax.train.batchnorm``)."""
        adapter, policy = state.adapter, self.precision
        stateful = self._check_stateful(adapter, mapped)
        loss_fn = over_data_axis(self.loss_fn, self.data_axis, mapped, self.mesh.axis_names)
        scale = state.loss_scale if policy.loss_scaling is not None else None

        def fn(model_state: Any, batch: Any, keys: Any, rng: jax.Array):
            batch = cast_floating(batch, policy.compute_dtype)
            kwargs = {"rng": keys, "step_rng": rng}
            kwargs = {name: kwargs[name] for name in self._filled}

            def loss(params: Any) -> tuple[jax.Array, Any]:
                with matmul_routing(policy.matmul, policy.keep):
                    return routed_loss(params)

            def routed_loss(params: Any) -> tuple[jax.Array, Any]:
                def bind() -> Any:
                    cast = cast_floating(params, policy.compute_dtype)
                    model = adapter.bind(cast, model_state, rng)
                    return route(model, policy.keep) if policy.matmul == "fp8" else model

                if stateful:
                    model = bind()
                    out, new = _stateful_out(
                        loss_fn(self.work.view(model), model_state["state"], batch, **kwargs),
                        model_state["state"],
                    )
                    new_model_state = {**model_state, "state": new}
                else:
                    # A Linen module's RNG streams are bound as it asks for them.
                    model, out = call_binding_streams(
                        adapter, bind, lambda model: loss_fn(self.work.view(model), batch, **kwargs)
                    )
                    new_model_state = adapter.model_state(model, model_state)
                    if isinstance(adapter, LinenModel):
                        self._check_linen_rng(model, mapped)
                    self._check_model_rng(model_state, new_model_state, mapped)
                value, aux = self.work.objective(out)
                value, aux = cast_floating((value, aux), policy.output_dtype)
                new_model_state = cast_like(new_model_state, model_state)
                return value, (aux, new_model_state)

            return self.work.differentiate(loss, state.params, scale)

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
        pmap per device: refused there by name, as ``_check_model_rng`` refuses
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
            model_state = _map_keys(lambda k: fold_in_each(k, device), model_state)
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

    def whole(self, state: TrainState, batch: Any):
        """jit and single: the shard is the whole global batch. Under
        ``sx.zero1(mesh, gather="forward")`` the passes read the params' compute-dtype copy,
        gathered once at the start (``shardax.train.forward_gather``); the update applies
        to the split master."""
        size = jax.tree.leaves(batch)[0].shape[0] if self.batch_spec is None else 1
        read = state
        if self.mode == "jit" and gathers_forward(self.state_plan):
            specs = self.state_plan.mirror_specs(state.params)
            read = state.replace(params=gathered(state.params, specs, self.mesh, self.precision))
        grads, loss, aux, model_state = self._shard_update(
            read, batch, jnp.arange(size), mapped=False
        )
        loss = self._no_example_reads_nan(loss, valid_count(batch))
        return self.work.finish(state, grads, loss, aux, model_state)

    def _no_example_reads_nan(self, loss: jax.Array, count: jax.Array | None) -> jax.Array:
        """A train step over a global batch with no real example (its ``mask`` all False
        on the device, where it is not read back) reports a NaN loss, not the 0.0 of an
        empty mean, so the NaN guard stops the run at that step (its gradients are 0)."""
        if count is None or not self.work.returns_state:
            return loss
        return jnp.where(count > 0, loss, jnp.nan).astype(loss.dtype)

    def mapped(self, state: TrainState, batch: Any):
        """shard_map and pmap: one device's slice, reduced over the data axis, each
        device weighted by its count of real examples (equal weights without a mask)."""
        check_replicated(state, self.state_plan, self.mode, self.plan_name)
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
        if count is not None:
            loss = self._no_example_reads_nan(loss, lax.psum(count, axis))
        reduced = weighted_mean(_floating(model_state), count, axis)
        model_state = jax.tree.map(
            lambda r, x: x if r is None else r, reduced, model_state, is_leaf=lambda x: x is None
        )
        # Keys come back unfolded: the state is the same on every device.
        model_state = jax.tree.map(
            lambda new, old: old if is_key(old) else new, model_state, state.model_state
        )
        return self.work.finish(state, grads, loss, aux, model_state)
