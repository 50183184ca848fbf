"""The modes: how a step's per-shard function becomes a program on the mesh.

``mode_program`` wraps a ``PerShard`` for the step's mode and returns
``call(state, batch)`` and ``lower(state, batch)``:

- ``"jit"``: ``jax.jit`` of the whole-batch function with the plan's and the batch's
  shardings, traced under ``jax.set_mesh(mesh)`` (so ``sx.constrain`` in the model knows
  the mesh), one program per state structure (``CompiledCache``);
- ``"shard_map"``: ``jax.shard_map`` of the per-device function inside that jit;
- ``"pmap"``: ``jax.pmap`` over the data axis, the batch reshaped to
  ``(devices, per device, ...)``;
- ``"single"``: ``jax.jit`` on the mesh's first device.

Each jit compiles with the step's XLA options (``config.resolved_compiler_options``,
``shardax.train.compiler``); ``jax.pmap`` takes none, and under ``"pmap"`` they are none.

On simulated CPU devices the calls are throttled (``CPU_MAX_IN_FLIGHT``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from shardax.checks import refused_compiler_option
from shardax.plan.tree import map_arrays
from shardax.train.axis_types import explain_axis_types, mesh_axis_type, reshard_batch
from shardax.train.batch_placement import BatchPlacement
from shardax.train.compiled import CompiledCache
from shardax.train.compiler import for_state
from shardax.train.config import StepConfig
from shardax.train.per_shard import PerShard

CPU_MAX_IN_FLIGHT = 4
"""Steps queued at most on simulated CPU devices. XLA:CPU's in-process collectives can
deadlock (a 40 s rendezvous timeout, then abort) when many multi-device programs are
queued at once; waiting for the step ``CPU_MAX_IN_FLIGHT`` back keeps the queue short."""


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


def _placed_as_planned(state: Any, state_plan: Any) -> bool:
    """Every array leaf of ``state`` has the sharding ``state_plan`` gives it."""
    same: list[bool] = []
    map_arrays(
        lambda path, x, s: same.append(
            not isinstance(x, jax.Array) or x.sharding.is_equivalent_to(s, x.ndim)
        ),
        state,
        state_plan(state),
    )
    return all(same)


def _mismatch(
    config: StepConfig, shard: PerShard, batches: BatchPlacement, plan_name: Callable[[], str]
):
    """The error for a jit sharding mismatch: the batch's, or the state's, named."""

    def error(state: Any) -> Exception:
        if _placed_as_planned(state, shard.state_plan):  # then it is the batch
            return ValueError(
                f"the batch is committed to other devices or "
                f"shardings than this step's {batches.sharding.spec} over mesh "
                f"{dict(config.mesh.shape)}; pass NumPy arrays, or place the batch with "
                "sx.distribute_batch(batch, sx.batch_sharding(mesh)) for this step's mesh"
            )
        # A state placed by another plan (e.g. an eval step built with a plan other
        # than the train step's): name both, not jit's sharding dump.
        return ValueError(
            f"the state is not placed as this step's plan "
            f"{plan_name()!r} places it (it was placed by another plan or step); build "
            "this step with the same mesh and plan as the step that placed the state, or "
            "place it with this step's shard(state)"
        )

    return error


def build_jit(
    config: StepConfig, shard: PerShard, batches: BatchPlacement, state: Any
) -> Callable[..., Any]:
    """The ``"jit"`` or ``"shard_map"`` program for ``state``'s structure, jitted."""
    mesh, out = config.mesh, shard.work.out
    shardings = shard.state_plan(state)
    if config.mode == "jit":
        fn = shard.whole
    else:
        fn = jax.shard_map(
            shard.mapped,
            mesh=mesh,
            in_specs=(PartitionSpec(), PartitionSpec(config.data_axis)),
            out_specs=out(PartitionSpec(), PartitionSpec()),
            check_vma=False,
        )
    data_axis = config.data_axis
    names = (data_axis,) if isinstance(data_axis, str) else data_axis
    explicit = any(mesh_axis_type(mesh, n) == AxisType.Explicit for n in names)
    if explicit and not batches.by_leaf:
        # A NumPy batch's type is unsharded inside jit; the split belongs in its type.
        fn = reshard_batch(fn, batches.sharding)
    return jax.jit(
        explain_axis_types(fn, mesh),
        # with seq_axis or batch_spec the batch comes placed (place_batch), leaf by leaf
        in_shardings=(shardings, None if batches.by_leaf else batches.sharding),
        out_shardings=out(shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,) if config.donate else (),
        compiler_options=options_for(config, state) or None,
    )


def options_for(config: StepConfig, state: Any) -> dict[str, Any]:
    """The XLA options the step's program for ``state`` compiles with: the resolved
    ``compiler_options``, and under ``"auto"`` on a GPU mesh the collective combine
    thresholds of ``state``'s weights (``shardax.train.compiler.for_state``)."""
    return for_state(
        config.resolved_compiler_options,
        config.compiler_options,
        config.platform,
        state,
        config.precision.compute_dtype,
        config.mesh.size,
    )


def mode_program(
    config: StepConfig,
    shard: PerShard,
    batches: BatchPlacement,
    plan_name: Callable[[], str] | None = None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(call, lower)``, each ``(state, batch)``, for the mode, throttled on simulated
    CPU devices. ``plan_name()``: the plan's name as errors give it (the step's own,
    ``"auto:fsdp"`` for a plan the auto step picked), by default the config's."""
    if plan_name is None:
        plan_name = lambda: config.plan_name  # noqa: E731
    mode, mesh, work = config.mode, config.mesh, shard.work
    donate_argnums = (0,) if config.donate else ()
    if mode == "single":
        single = jax.jit(
            shard.whole,
            in_shardings=batches.device,
            out_shardings=batches.device,
            donate_argnums=donate_argnums,
            compiler_options=config.resolved_compiler_options or None,
        )
        call = lambda state, batch: single(state, batches.on_device(batch))  # noqa: E731
        lower = lambda state, batch: single.lower(state, batches.on_device(batch))  # noqa: E731
    elif mode == "pmap":
        pmapped = jax.pmap(
            shard.mapped,
            axis_name=config.data_axis,
            in_axes=(None, 0),
            out_axes=work.out(None, None),
            devices=list(mesh.devices.flat),
            donate_argnums=donate_argnums,
        )
        call = lambda state, batch: pmapped(state, batches.per_device(batch))  # noqa: E731
        lower = lambda state, batch: pmapped.lower(state, batches.per_device(batch))  # noqa: E731
    else:
        cache = CompiledCache(
            lambda state: build_jit(config, shard, batches, state),
            returns_state=work.returns_state,
            mismatch=_mismatch(config, shard, batches, plan_name),
        )
        call = cache
        by_leaf = batches.by_leaf
        if by_leaf:  # jit only
            call = lambda state, batch: cache(state, batches.place(batch))  # noqa: E731
        lower = lambda s, b: cache.lookup(s).fn.lower(s, batches.place(b) if by_leaf else b)  # noqa: E731
        if mode == "jit":  # lowered as it is called, so both are one program, compiled once
            call, lower = _under_mesh(call, mesh), _under_mesh(lower, mesh)
    if mode != "single" and mesh.size > 1 and mesh.devices.flat[0].platform == "cpu":
        call = _bounded(call, CPU_MAX_IN_FLIGHT, work.metrics_of)
    if mode != "pmap":  # pmap compiles with no options
        call = _options_named(call, config)
    return call, lower


def _options_named(call: Callable[..., Any], config: StepConfig) -> Callable[..., Any]:
    """``call``, raising a ``ValueError`` naming the option when XLA refuses one of the
    step's ``compiler_options`` as it compiles (``refused_compiler_option``)."""

    def named(state: Any, batch: Any) -> Any:
        try:
            return call(state, batch)
        except jax.errors.JaxRuntimeError as e:
            error = refused_compiler_option(e, config.resolved_compiler_options)
            if error is None:
                raise
            raise error from None

    return named
