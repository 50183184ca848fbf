"""The compiled program behind the train and eval steps, composed of its parts.

A ``Program`` runs ``program(state, batch)`` on a mesh in one of four modes. It is built
from a [`StepConfig`][shardax.train.StepConfig] (the settings, checked) and a ``StepWork``
(what the step computes: the train step's gradients and update, the eval step's metrics),
and composes:

- ``shardax.train.per_shard``: the per-shard function (the model bound to its params,
  the precision's casts, the ``rng``/``step_rng`` keys, accumulation, BatchNorm over the
  global batch) running the step's work;
- ``shardax.train.modes``: how jit, shard_map, pmap or single wraps it;
- ``shardax.train.compiled``: the compiled-program cache (one per state structure);
- ``shardax.train.batch_placement``: checking and placing the batch for the mesh.

What it keeps itself is the state's placement: ``shard(state)``, ``init(init_fn, ...)``
and ``abstract(state)`` put the state on the plan (or one device), in the precision's
``param_dtype``; and the calls, ``program(state, batch)`` and ``lower(state, batch)``.
Control flows one way: the program calls the work's functions, which never call back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from shardax.checks import received
from shardax.plan.core import Plan
from shardax.plan.follow import follow_params
from shardax.plan.init import init_sharded
from shardax.runtime.agreement import check_agreement
from shardax.runtime.processes import device_put_global
from shardax.train.batch_placement import BatchPlacement
from shardax.train.boxes import unconstrained_boxes
from shardax.train.compiler import compile_only
from shardax.train.compiler import describe as describe_options
from shardax.train.config import StepConfig, from_config
from shardax.train.explanation.memory import is_out_of_memory, out_of_memory_note
from shardax.train.loss import check_loss_fn
from shardax.train.modes import mode_program, options_for
from shardax.train.per_shard import PerShard, check_replicated
from shardax.train.precision import (
    cast_floating,
    init_loss_scale,
    narrow_floating,
    policy_name,
)
from shardax.train.protocol import StepWork
from shardax.train.state import TrainState

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


ABSTRACT_INSTEAD = (
    "build the state with step.init(...) or sx.TrainState.create(...), or, for shapes only, "
    "compile it: step.lower(state, batch).compile() (memory_analysis(), cost_analysis()) or "
    "sx.estimate(step, state, batch) for its memory and predicted time"
)


def refuse_compile_only(mesh: Any, what: str) -> None:
    """A ``ValueError`` when ``mesh`` is of compile-only devices, saying what to do."""
    kind = compile_only(mesh)
    if kind is not None:
        raise ValueError(
            f"{what} runs on arrays, and the step's mesh is of compile-only devices "
            f"({mesh.devices.size} x {kind}, from sx.target), which hold no arrays and run "
            "nothing: compile the step for abstract inputs (jax.eval_shape, nnx.eval_shape) "
            "with step.lower(state, batch).compile(), or sx.estimate(step, state, batch) for "
            "its memory and predicted time; to run it, make the step on a mesh of this "
            "machine's devices (sx.make_mesh without devices=)"
        )


def refuse_abstract(name: str, tree: Any, instead: str) -> None:
    """A ``TypeError`` naming the first abstract leaf (``jax.ShapeDtypeStruct``) of
    ``tree`` (the argument ``name``), with ``instead``: what to do."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            where = jax.tree_util.keystr(path) or "itself"
            raise TypeError(
                f"{name} holds abstract values (jax.ShapeDtypeStruct at {where}: "
                f"{leaf.dtype}{list(leaf.shape)}), and {instead}"
            )


def check_state(state: Any, concrete: bool = True) -> None:
    """A [`TrainState`][shardax.TrainState] whose buffers are alive (not donated to an
    earlier step) and, with ``concrete``, not abstract."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"the train step takes a sx.TrainState (sx.TrainState.create(model, tx), "
            f".from_linen or .from_params), got {type(state).__name__}"
        )
    # jax.eval_shape's, nnx.eval_shape's: the step counter is abstract with the rest.
    if concrete and isinstance(state.step, jax.ShapeDtypeStruct):
        raise TypeError(
            f"the state holds abstract values (jax.ShapeDtypeStruct), and a step runs on "
            f"arrays: {ABSTRACT_INSTEAD}"
        )
    # The step counter is donated with the rest: checking it costs no tree flatten.
    if isinstance(state.step, jax.Array) and state.step.is_deleted():
        raise ValueError(
            "the state's buffers were donated to an earlier step, which consumed them: use "
            "the state that step returned, or build the step with donate=False to keep "
            "reusing a state (an EMA copy, a comparison)"
        )


class Program:
    """``program(state, batch)`` compiled for ``mesh`` in ``mode`` (see the module doc).

    Attributes: ``config`` (the [`StepConfig`][shardax.train.StepConfig]), ``work`` (the
    ``StepWork``), ``loss_fn``, ``mode``, ``mesh``, ``plan``, ``accumulate``, ``donate``,
    ``data_axis``, ``precision``, ``compiler_options`` (the XLA options it compiles with,
    resolved for the mesh's
    platform: ``shardax.train.compiler``).
    """

    # The settings, read from ``config`` (held once, not copied).
    mesh, mode, accumulate, donate = from_config(), from_config(), from_config(), from_config()
    data_axis, precision, seq_axis = from_config(), from_config(), from_config()
    batch_spec, rng_per_device = from_config(), from_config()
    plan = from_config("resolved_plan")
    compiler_options = from_config("resolved_compiler_options")
    """The XLA options every jit of the step compiles with (none under pmap)."""

    def __init__(self, loss_fn: Callable[..., Any], config: StepConfig, work: StepWork) -> None:
        if not isinstance(config, StepConfig):
            raise TypeError(f"config must be a sx.train.StepConfig, got {type(config).__name__}")
        self.config, self.work = config, work
        self._filled = check_loss_fn(loss_fn, config.batch_spec)
        self.loss_fn = loss_fn
        # The name errors show: the config's, which AutoStep renames "auto:<plan>".
        self.plan_name = config.plan_name
        plan = self.plan
        # The optimizer state follows the params (Adam's mu/nu), whatever the plan.
        self.state_plan = follow_params(plan) if isinstance(plan, Plan) else plan
        self._batches = BatchPlacement(config)
        self.batch_sharding = self._batches.sharding
        shard = PerShard(loss_fn, config, work, filled=self._filled, state_plan=self.state_plan)
        # The name read when an error names it (AutoStep renames its pick "auto:<plan>").
        name = lambda: self.plan_name  # noqa: E731
        self._call, self._lower = mode_program(config, shard, self._batches, name)
        self._compile_only = compile_only(self.mesh) is not None

    # -- placement of the state ----------------------------------------------------------

    def shard(self, state: TrainState) -> TrainState:
        """Places ``state`` as this step expects it: with the plan, or on one device.

        The result never shares buffers with ``state`` when the step donates, so the
        arrays the state was built from (a Linen ``variables`` dict, an NNX module)
        stay usable after the step consumes the placed state. With several processes,
        all first check that they run the same step and state shardings
        ([`shardax.runtime.check_agreement`][shardax.runtime.check_agreement]), so a mismatch is an
        error, not a hang.
        """
        check_state(state)
        if self._compile_only:
            refuse_compile_only(self.mesh, "shard(state)")
        state = self._prepare(state)
        if self.mode == "single":
            shardings: Any = self._batches.device
        else:
            if self.mode in ("shard_map", "pmap"):
                self._check_replicated(state)
            shardings = self.state_plan(state)
            if jax.process_count() > 1:
                check_agreement(train_step=repr(self), state_shardings=shardings)
        placed = device_put_global(state, shardings)
        return unalias(state, placed) if self.donate else placed

    def abstract(self, state: TrainState) -> TrainState:
        """``state`` (abstract or concrete) as ``shard`` and ``init`` make it,
        without allocating: ``jax.ShapeDtypeStruct`` leaves in the precision's dtypes
        (params in ``param_dtype``, the optimizer's moments no wider), with a loss scale
        under loss scaling. ``sx.estimate`` compiles for it.

        >>> step.abstract(jax.eval_shape(make_state)).params  # doctest: +SKIP
        """
        check_state(state, concrete=False)
        return jax.eval_shape(self._prepare, state)

    def init(self, init_fn: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
        """``init_fn(*args, **kwargs)`` (e.g. building the model and ``TrainState.create``)
        run under ``jax.jit`` straight onto the step's shardings: no leaf is ever whole on
        one device (see [`shardax.plan.init_sharded`][shardax.plan.init_sharded]).

        >>> state = step.init(lambda key: sx.TrainState.create(Model(nnx.Rngs(key)), tx),
        ...                   jax.random.key(0))  # doctest: +SKIP
        """

        if self._compile_only:
            refuse_compile_only(self.mesh, "init(init_fn, ...)")
        if not callable(init_fn):
            what = "a sx.TrainState, which is built already: place it with step.shard(state)"
            raise TypeError(
                "init_fn must be a function (*args, **kwargs) -> sx.TrainState that builds the "
                "state (the step runs it onto its shardings), got "
                + (what if isinstance(init_fn, TrainState) else received(init_fn))
            )

        def prepared(*args: Any, **kwargs: Any) -> TrainState:
            return self._prepare(init_fn(*args, **kwargs))

        if self.mode == "single":
            return init_sharded(prepared, lambda tree: self._batches.device, *args, **kwargs)
        # Under the mesh, as the step: flax's eager sharding (variables annotated with
        # out_sharding=) places each variable as it is created; Linen's boxes unbox
        # unconstrained, as in the step (train/boxes.py): the plan places the state.
        with jax.sharding.set_mesh(self.mesh), unconstrained_boxes():
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
        check_replicated(state, self.state_plan, self.mode, self.plan_name)

    def place_batch(self, batch: Any) -> Any:
        """``batch`` placed as this step takes it under ``"jit"``: rows over the data axis,
        and with ``seq_axis`` dimension 1 of each leaf of rank >= 2 over that axis
        (``sx.batch_sharding(mesh, seq_axis=...)``). The step calls it itself; a loop may
        call it ahead (prefetching). Leaves already placed so pass untouched.

        >>> step.place_batch({"x": np.ones((16, 4))})["x"].sharding.spec  # doctest: +SKIP
        PartitionSpec('data',)

        With ``batch_spec``, each leaf is placed as it says (``shardax.data.spec``).
        """
        return self._batches.place(batch)

    # -- calling -------------------------------------------------------------------------

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The program for ``state`` and ``batch``, lowered and not run: ``.as_text()`` is
        its HLO, ``.compile()`` the executable (``memory_analysis()``,
        ``cost_analysis()``). In ``"jit"`` and ``"shard_map"`` modes it is the function
        ``step(state, batch)`` runs (and caches).

        >>> compiled = step.lower(state, batch).compile()  # doctest: +SKIP
        >>> compiled.memory_analysis().argument_size_in_bytes  # doctest: +SKIP
        """
        self._batches.check(batch)
        try:
            return self._lower(state, batch)
        except RuntimeError as e:  # a host callback lowered for a compile-only target
            kind = compile_only(self.mesh) if "Unknown backend" in str(e) else None
            if kind is None:
                raise
            raise RuntimeError(
                f"the step calls back to the host (jax.debug.print, jax.debug.callback, "
                f"jax.pure_callback or io_callback in the loss or model), and a callback is "
                f"lowered for the runtime that runs it, which the step's compile-only mesh "
                f"({self.mesh.devices.size} x {kind}, from sx.target) does not have: leave "
                "the callback out of the step you compile for a target (behind a flag of "
                f"your own), or lower it on this machine's devices. JAX said: {e}"
            ) from None

    def __call__(self, state: TrainState, batch: Any) -> Any:
        check_state(state)
        if self._compile_only:
            refuse_compile_only(self.mesh, "step(state, batch)")
        self._batches.check(batch)
        try:
            return self._call(self._with_loss_scale(state), batch)
        except jax.errors.JaxRuntimeError as e:  # the allocator's dump, and which arrays
            if is_out_of_memory(e):
                e.add_note(out_of_memory_note(self, state, batch))
            raise

    def compiler_options_for(self, state: Any) -> dict[str, Any]:
        """The XLA options the program for ``state`` compiles with: ``compiler_options``,
        and under ``"auto"`` on a GPU mesh the collective combine thresholds sized from
        ``state``'s weights
        ([`shardax.train.combine_thresholds`][shardax.train.combine_thresholds]).

        >>> step.compiler_options_for(state)  # doctest: +SKIP
        """
        return options_for(self.config, state)

    @property
    def compiler_summary(self) -> str:
        """The XLA options in a few words: ``'auto' (gpu: 12 options)``, ``'xla'``, ..."""
        config = self.config
        return describe_options(
            config.compiler_options, self.compiler_options, config.platform, self.mode
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, plan={self.plan_name!r}, "
            f"mesh={dict(self.mesh.shape)}, accumulate={self.accumulate}, donate={self.donate}, "
            f"precision={policy_name(self.precision)!r}"
            + (f", seq_axis={self.seq_axis!r}" if self.seq_axis is not None else "")
            + f", compiler_options={self.compiler_summary})"
        )
