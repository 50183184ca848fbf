"""Islands: the train step of DiLoCo, with no collective across islands between syncs.

[`make_train_step`][shardax.make_train_step] with ``diloco=sx.DiLoCo(inner_steps=H)``
gives an [`IslandStep`][shardax.train.IslandStep]. The mesh has an island axis
(``"island"``) beside the axes the plan and the batch use inside an island. The step's
state holds each island's params, optimizer and model state stacked ``(islands, ...)``
on that axis (each island's row on its own devices), and the outer state
(``TrainState.outer``, [`OuterState`][shardax.train.diloco.OuterState]): the params at
the last sync and the outer optimizer's state.

- ``step(state, batch)``: one inner step, the plain step (any plan: replicate, fsdp,
  zero, tp rules over the other axes) run by every island on its rows of the global batch
  (island ``i`` takes rows ``i*B/n`` to ``(i+1)*B/n``), ``jax.vmap``'d over the island
  axis (``spmd_axis_name``): nothing crosses islands, not even the metrics, which come
  back per island, ``(islands,)``.
- ``step.sync(state)``: every H inner steps the outer step
  ([`shardax.train.diloco.outer_update`][shardax.train.diloco.outer_update]), whose only
  cross-island traffic is the outer gradients' reduction; otherwise ``state`` unchanged.

The user's own loop adds one line (and ``diloco=`` at ``make_train_step``):

>>> mesh = sx.make_mesh({"island": 2, "data": 4})
>>> state = sx.TrainState.from_params({"w": jnp.zeros(3)}, lambda p, x: x @ p["w"],
...                                   optax.adam(1e-2))
>>> def loss_fn(model, batch):
...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
>>> step = sx.make_train_step(loss_fn, mesh=mesh, diloco=sx.DiLoCo(inner_steps=2))
>>> state = step.shard(state)
>>> for _ in range(4):
...     state, metrics = step(state, {"x": np.ones((16, 3)), "y": np.ones(16)})
...     state = step.sync(state)          # the outer step every 2 inner steps
>>> state.params["w"].shape, metrics["loss"].shape, int(state.outer.syncs)
((2, 3), (2,), 2)

[`step.traffic(state, batch)`][shardax.train.IslandStep.traffic] reads both compiled
programs and reports every collective whose replica groups span two islands, with its
bytes ([`crossing`][shardax.train.islands.crossing]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from shardax._format import format_bytes
from shardax.checks import public, received
from shardax.cost.hlo import Collective, collectives
from shardax.plan.init import init_sharded
from shardax.runtime.agreement import check_agreement
from shardax.runtime.processes import device_put_global
from shardax.train.batch_placement import BatchPlacement
from shardax.train.config import StepConfig
from shardax.train.diloco import DiLoCo, OuterState, init_outer, outer_update
from shardax.train.modes import CPU_MAX_IN_FLIGHT, _bounded
from shardax.train.per_shard import PerShard
from shardax.train.program import check_state, refuse_compile_only, unalias
from shardax.train.state import TrainState
from shardax.train.step import TrainStep

STACKED = ("params", "opt_state", "model_state", "loss_scale")
"""The fields of the state held per island, stacked ``(islands, ...)``; ``step`` and
``rng`` are one for all islands, ``outer`` is the outer state."""


def _axes(state: TrainState, stacked: Any, shared: Any) -> TrainState:
    """``state`` with ``stacked`` in each per-island field, ``shared`` in the others."""
    fields = {f: (stacked if f in STACKED else shared) for f in ("step", "rng", *STACKED)}
    return dataclasses.replace(state, outer=None, **fields)


def _take(state: TrainState, fn: Callable[[Any], Any]) -> TrainState:
    """``state`` with ``fn`` applied to the leaves of its per-island fields."""
    return state.replace(**{f: jax.tree.map(fn, getattr(state, f)) for f in STACKED})


@dataclasses.dataclass(frozen=True)
class Crossing:
    """The collectives of one compiled program whose replica groups span two islands.

    ``ops``: those collectives; ``bytes``: the bytes one device sends in them per run
    (``Collective.sent_bytes``: ring algorithms over each group); ``all_ops``: every
    collective of the program (within islands too)."""

    ops: tuple[Collective, ...]
    all_ops: tuple[Collective, ...]

    @property
    def bytes(self) -> float:
        return float(sum(c.sent_bytes for c in self.ops))

    def __len__(self) -> int:
        return len(self.ops)


def island_of(mesh: Any, axis: str) -> np.ndarray:
    """Each device index of ``mesh`` (``mesh.devices.flat`` order) mapped to its island."""
    index = list(mesh.axis_names).index(axis)
    return np.indices(mesh.devices.shape)[index].reshape(-1)


def crossing(hlo: str, mesh: Any, axis: str = "island") -> Crossing:
    """The collectives of ``hlo`` (a compiled program's ``as_text()`` on ``mesh``) whose
    replica groups hold devices of two islands (two indices along ``axis``).

    >>> mesh = sx.make_mesh({"island": 2, "data": 4})
    >>> f = jax.jit(lambda x: x.sum(), in_shardings=NamedSharding(mesh, P(("island", "data"))))
    >>> hlo = f.lower(jnp.ones(8)).compile().as_text()
    >>> len(crossing(hlo, mesh)) > 0
    True
    """
    islands = island_of(mesh, axis)
    found = collectives(hlo, mesh.devices.size)
    out = []
    for c in found:
        groups = c.groups or ((tuple(range(mesh.devices.size)),) if c.group > 1 else ())
        if any(len({int(islands[d]) for d in g}) > 1 for g in groups):
            out.append(c)
    return Crossing(tuple(out), tuple(found))


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What crosses islands: ``inner`` (the inner step's crossing collectives: none) and
    ``outer`` (the outer step's), and the bytes one device sends across islands per inner
    step on average, ``per_step = outer.bytes / inner_steps`` (``inner.bytes`` is 0)."""

    inner: Crossing
    outer: Crossing
    inner_steps: int

    @property
    def per_step(self) -> float:
        return self.inner.bytes + self.outer.bytes / self.inner_steps

    def __str__(self) -> str:
        ops = ", ".join(sorted({f"{c.op} {'/'.join(c.dtypes)}" for c in self.outer.ops}))
        return (
            f"cross-island collectives: inner step {len(self.inner)} "
            f"({format_bytes(self.inner.bytes)}), outer step {len(self.outer)} "
            f"({format_bytes(self.outer.bytes)}: {ops or 'none'}); "
            f"{format_bytes(self.per_step)} per inner step at H={self.inner_steps}"
        )


@public("sx.train.IslandStep")
class IslandStep:
    """DiLoCo's step (see the module doc): ``step(state, batch)`` the inner step,
    ``step.sync(state)`` the outer step every H, ``step.shard`` / ``step.init`` place a
    state on the islands. ``step.inner`` is the plain step every island runs
    (a [`TrainStep`][shardax.train.TrainStep] over the same mesh: its plan, its
    ``data_axis`` inside an island).
    """

    def __init__(self, loss_fn: Callable[..., Any], config: StepConfig, diloco: DiLoCo) -> None:
        if not isinstance(diloco, DiLoCo):
            raise TypeError(f"diloco must be a sx.DiLoCo(inner_steps=...), got {received(diloco)}")
        axis, mesh = diloco.axis, config.mesh
        if axis not in mesh.shape:
            raise ValueError(
                f"DiLoCo's axis {axis!r} is not in the mesh, whose axes are {dict(mesh.shape)}; "
                f"make the mesh with an island axis, e.g. sx.make_mesh({{{axis!r}: 2, 'data': -1}})"
            )
        inner_axes = (config.data_axis,) if isinstance(config.data_axis, str) else config.data_axis
        if axis in inner_axes or config.seq_axis == axis:
            raise ValueError(
                f"data_axis {config.data_axis!r} splits the batch inside an island, so it must "
                f"not hold the island axis {axis!r}: the step splits the rows over the islands "
                "itself"
            )
        if config.mode != "jit":
            raise ValueError(f"diloco runs under mode='jit' only, got mode={config.mode!r}")
        if config.batch_spec is not None:
            raise ValueError("diloco splits the batch's rows over the islands: batch_spec=None")
        self.config, self.diloco, self.loss_fn = config, diloco, loss_fn
        self.mesh, self.axis, self.islands = mesh, axis, mesh.shape[axis]
        self.inner = TrainStep(loss_fn, config)
        self._shard = PerShard(
            loss_fn,
            config,
            self.inner.work,
            filled=self.inner._filled,
            state_plan=self.inner.state_plan,
        )
        rows = dataclasses.replace(config, data_axis=(axis, *inner_axes))
        self._batches = BatchPlacement(rows)
        self.batch_sharding = self._batches.sharding
        self._inner_jit: dict[Any, Any] = {}
        self._outer_jit: dict[Any, Any] = {}
        self._run = self._inner
        if mesh.devices.flat[0].platform == "cpu" and mesh.size > 1:
            # XLA:CPU's in-process collectives deadlock with many programs queued.
            self._run = _bounded(self._inner, CPU_MAX_IN_FLIGHT, lambda out: out[1])

    inner_steps = property(lambda self: self.diloco.inner_steps)
    plan = property(lambda self: self.inner.plan)
    donate = property(lambda self: self.config.donate)
    compiler_options = property(lambda self: self.inner.compiler_options)
    compiler_summary = property(lambda self: self.inner.compiler_summary)
    mode = property(lambda self: self.config.mode)

    def compiler_options_for(self, state: TrainState) -> dict[str, Any]:
        """The XLA options both programs compile with for the island ``state``."""
        return self.inner.compiler_options_for(self._one(state))

    # -- the layout ----------------------------------------------------------------------

    def _one(self, state: TrainState) -> TrainState:
        """An island's state (abstract): row 0 of each per-island field, no outer state."""
        row = lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[1:], x.dtype)  # noqa: E731
        return _take(state, row).replace(
            outer=None,
            step=jax.eval_shape(lambda x: x, state.step),
            rng=jax.eval_shape(lambda x: x, state.rng),
        )

    def _specs(self, state: TrainState) -> TrainState:
        """The inner plan's shardings of one island's (unstacked) ``state``; a plan that
        shards over the island axis is refused, naming the leaf."""
        shardings = self.inner.state_plan(state)
        for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
            used = {
                a for e in s.spec if e is not None for a in (e if isinstance(e, tuple) else (e,))
            }
            if self.axis in used:
                raise ValueError(
                    f"plan {self.inner.plan_name!r} shards {jax.tree_util.keystr(path)} over "
                    f"the island axis {self.axis!r} ({s.spec}); inside an island a plan uses "
                    "the other axes, e.g. sx.fsdp(mesh, axis='data')"
                )
        return shardings

    def shardings(self, state: TrainState) -> TrainState:
        """The shardings of an island ``state`` (stacked, with its outer state): each
        per-island leaf ``P(island, *spec)`` of its spec inside an island."""
        one = self._one(state)
        inner = self._specs(one)
        mesh, axis = self.mesh, self.axis
        stack = lambda s: NamedSharding(mesh, PartitionSpec(axis, *s.spec))  # noqa: E731
        placed = _take(inner, stack)
        outer = state.outer
        if outer is None:
            raise ValueError(
                "the state has no outer state: place it with step.shard(state) or step.init"
            )
        follow = self.inner.state_plan({"params": one.params, "opt_state": outer.opt_state})
        error = None if outer.error is None else jax.tree.map(stack, inner.params)
        syncs = NamedSharding(mesh, PartitionSpec())
        return placed.replace(outer=OuterState(inner.params, follow["opt_state"], error, syncs))

    def _stack(self, state: TrainState) -> TrainState:
        """One state (the plain step's) as every island's, with a fresh outer state."""
        n = self.islands
        stacked = _take(state, lambda x: jnp.broadcast_to(x[None], (n, *jnp.shape(x))))
        return stacked.replace(outer=init_outer(self.diloco, state.params, n))

    def shard(self, state: TrainState) -> TrainState:
        """``state`` (a plain ``sx.TrainState``) placed on the islands: each island starts
        from its params, the outer state's anchor is them. A state placed already (with an
        outer state) is placed as it is, e.g. one restored elsewhere."""
        check_state(state)
        if self.inner._compile_only:
            refuse_compile_only(self.mesh, "shard(state)")
        if state.outer is not None:
            shardings = self.shardings(state)
            if jax.process_count() > 1:
                check_agreement(train_step=repr(self), state_shardings=shardings)
            placed = device_put_global(state, shardings)
            return unalias(state, placed) if self.donate else placed
        one = self.inner.shard(state)
        abstract = jax.eval_shape(self._stack, one)
        return jax.jit(self._stack, out_shardings=self.shardings(abstract))(one)

    def init(self, init_fn: Callable[..., TrainState], *args: Any, **kwargs: Any) -> TrainState:
        """``init_fn(*args, **kwargs)`` run straight onto the islands' shardings."""

        def stacked(*args: Any, **kwargs: Any) -> TrainState:
            return self._stack(self.inner._prepare(init_fn(*args, **kwargs)))

        with jax.sharding.set_mesh(self.mesh):
            return init_sharded(stacked, self.shardings, *args, **kwargs)

    def abstract(self, state: TrainState) -> TrainState:
        """``state`` (a plain one, abstract or not) as ``shard`` makes it, unallocated."""
        return jax.eval_shape(lambda s: self._stack(self.inner._prepare(s)), state)

    def place_batch(self, batch: Any) -> Any:
        """``batch``'s rows over the islands and, inside each, over ``data_axis``."""
        return self._batches.place(batch)

    # -- the programs --------------------------------------------------------------------

    def _inner_fn(self, state: TrainState, batch: Any):
        n, outer = self.islands, state.outer
        batch = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
        local = state.replace(outer=None)
        axes = _axes(local, 0, None)
        new, metrics = jax.vmap(
            self._shard.whole, in_axes=(axes, 0), out_axes=(axes, 0), spmd_axis_name=self.axis
        )(local, batch)
        return new.replace(outer=outer), metrics

    def _outer_fn(self, state: TrainState) -> TrainState:
        specs = jax.tree.map(lambda s: s.spec, self._specs(self._one(state)).params)
        params, outer = outer_update(self.diloco, state.params, state.outer, self.mesh, specs)
        return state.replace(params=params, outer=outer)

    def _compiled_inner(self, state: TrainState) -> Any:
        key = jax.tree.structure(state)
        if key not in self._inner_jit:
            shardings = self.shardings(state)
            metrics = NamedSharding(self.mesh, PartitionSpec(self.axis))
            self._inner_jit[key] = jax.jit(
                self._inner_fn,
                in_shardings=(shardings, self.batch_sharding),
                out_shardings=(shardings, metrics),
                donate_argnums=(0,) if self.donate else (),
                compiler_options=self.compiler_options_for(state) or None,
            )
        return self._inner_jit[key]

    def _compiled_outer(self, state: TrainState) -> Any:
        key = jax.tree.structure(state)
        if key not in self._outer_jit:
            shardings = self.shardings(state)
            self._outer_jit[key] = jax.jit(
                self._outer_fn,
                in_shardings=(shardings,),
                out_shardings=shardings,
                donate_argnums=(0,) if self.donate else (),
                compiler_options=self.compiler_options_for(state) or None,
            )
        return self._outer_jit[key]

    def _check(self, state: Any) -> None:
        check_state(state)
        if state.outer is None:
            raise ValueError(
                "the state has no outer state (the islands' anchor): place it with "
                "step.shard(state) or build it with step.init(...)"
            )
        if self.inner._compile_only:
            refuse_compile_only(self.mesh, "step(state, batch)")

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One inner step of every island on its rows of ``batch``; metrics per island."""
        self._check(state)
        self._batches.check(batch)
        return self._run(self.inner._with_loss_scale(state), batch)

    def _inner(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        with jax.sharding.set_mesh(self.mesh):
            return self._compiled_inner(state)(state, self._batches.place(batch))

    def local(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The metrics of the first island this process holds, each a 0-d array on one of
        its devices, read without any communication (for ``sx.loop``'s
        ``run.after_step``, which takes one number per metric; a mean over the islands
        would be a collective across them every step)."""

        def first(x: jax.Array) -> jax.Array:
            shard = min(x.addressable_shards, key=lambda s: s.index[0].indices(x.shape[0])[0])
            return shard.data[0]

        return jax.tree.map(first, metrics)

    def due(self, step: int) -> bool:
        """Whether the outer step follows inner step number ``step`` (a multiple of H)."""
        return step > 0 and step % self.inner_steps == 0

    def sync(self, state: TrainState, step: int | None = None) -> TrainState:
        """The outer step when ``step`` (default: ``state.step``, read from the device)
        is a multiple of H, else ``state`` unchanged. Pass your loop's own count to skip
        the read."""
        count = int(jax.device_get(state.step)) if step is None else step
        return self.outer(state) if self.due(count) else state

    def outer(self, state: TrainState) -> TrainState:
        """The outer step now: the islands' outer gradients averaged (the only traffic
        across islands), the anchor moved by the outer optimizer, every island restarted
        from it."""
        self._check(state)
        with jax.sharding.set_mesh(self.mesh):
            return self._compiled_outer(state)(state)

    # -- what crosses islands ------------------------------------------------------------

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The inner step lowered (not run), for ``state`` and ``batch`` (abstract or not)."""
        with jax.sharding.set_mesh(self.mesh):
            return self._compiled_inner(state).lower(state, self._batches.place(batch))

    def lower_outer(self, state: TrainState) -> jax.stages.Lowered:
        """The outer step lowered (not run)."""
        with jax.sharding.set_mesh(self.mesh):
            return self._compiled_outer(state).lower(state)

    def traffic(self, state: TrainState, batch: Any) -> Traffic:
        """Both programs compiled and read: the collectives that cross islands and their
        bytes (``Traffic``), for ``state`` and ``batch`` (abstract or not)."""
        inner = self.lower(state, batch).compile().as_text()
        outer = self.lower_outer(state).compile().as_text()
        return Traffic(
            crossing(inner, self.mesh, self.axis),
            crossing(outer, self.mesh, self.axis),
            self.inner_steps,
        )

    def __repr__(self) -> str:
        d = self.diloco
        return (
            f"IslandStep(islands={self.islands}, axis={self.axis!r}, H={d.inner_steps}, "
            f"compress={d.compress!r}, inner={self.inner!r})"
        )
