"""Pipeline parallelism inside a model: ``sx.pipeline`` over a "stage" mesh axis.

``pipeline(layer_fn, stacked_params, x, microbatches=M)`` applies the L layers stacked
on the leading axis of ``stacked_params`` to ``x`` in order: it equals
``lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]``. Under a mesh
with a ``"stage"`` axis of size S (the stacked params placed ``P("stage")`` by a plan),
each device applies only its own layers, to one microbatch at a time, and hands the
activations to the next stage with ``ppermute``.

>>> mesh = sx.make_mesh({"data": 2, "stage": 4})
>>> def layer(p, h):
...     return jnp.tanh(h @ p["w"] + p["b"])
>>> def loss_fn(model, batch):                  # model = partial(apply_fn, params)
...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
>>> def apply_fn(params, x):
...     return sx.pipeline(layer, params["blocks"], x, microbatches=4)
>>> plan = sx.rules(mesh, [(r"blocks", P("stage"))])
>>> step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec

from shardax.checks import as_count, as_function, public
from shardax.mesh.axes import DATA_AXIS, STAGE_AXIS

H = TypeVar("H")


def num_layers(stacked_params: Any) -> int:
    """The common leading size L of every array leaf of ``stacked_params``."""
    leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
    if not leaves:
        raise ValueError("stacked_params has no array leaves")
    sizes: dict[int, str] = {}
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        where = jax.tree_util.keystr(path) or "<root>"
        if not shape:
            raise ValueError(
                f"every leaf of stacked_params needs a leading layer "
                f"dimension; leaf {where} is a scalar"
            )
        sizes.setdefault(shape[0], where)
    if len(sizes) > 1:
        got = ", ".join(f"{where}: {size}" for size, where in sizes.items())
        raise ValueError(
            f"the leaves of stacked_params must all have the same leading (layer) size, got {got}"
        )
    return next(iter(sizes))


def batch_size(x: Any, name: str = "x") -> int:
    """The common leading (batch) size of every leaf of ``x``; raises naming the shapes."""
    shapes = [jnp.shape(leaf) for leaf in jax.tree.leaves(x)]
    sizes = {shape[0] if shape else None for shape in shapes}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"every leaf of {name} needs the same leading (batch) size, got {shapes or 'no leaves'}"
        )
    return sizes.pop()


def shapes_text(tree: Any) -> str:
    """``tree``'s leaves as ``f32[8,16]``, in a tree of the same structure."""
    described = jax.tree.map(lambda a: f"{jnp.dtype(a.dtype).name}{list(a.shape)}", tree)
    return str(described).replace("'", "")


def check_layer_fn(layer_fn: Any, stacked_params: Any, x: Any) -> None:
    """Raises unless ``layer_fn(one layer's params, x)`` returns ``x``'s structure, shapes
    and dtypes: the layers are applied in turn, so each one's output is the next's input.
    Traced abstractly (``jax.eval_shape``): nothing runs."""
    as_function("layer_fn", layer_fn, "a function layer_fn(layer_params, h) -> h")
    # One layer's params as abstract values: no slicing of a leaf placed over the stages.
    one = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), stacked_params
    )
    out = jax.eval_shape(layer_fn, one, x)
    given = jax.eval_shape(lambda h: h, x)
    same = jax.tree.structure(out) == jax.tree.structure(given) and all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(given), strict=True)
    )
    if not same:
        raise ValueError(
            f"layer_fn must return h with the structure, shape and dtype of its "
            f"input (each layer's output is the next one's input); for h {shapes_text(given)} "
            f"it returned {shapes_text(out)}"
        )


def _batch_axes(mesh: Any, axis: str) -> tuple[str, ...]:
    """The mesh axes the batch is split over: ``"data"`` when the mesh has it."""
    return tuple(a for a in (DATA_AXIS,) if a in mesh.axis_names and a != axis)


def scan_layers(layer_fn: Callable[[Any, H], H], stacked_params: Any, x: H) -> H:
    """The L layers applied in order with ``lax.scan``: what [`pipeline`][shardax.pipeline]
    computes."""
    return lax.scan(lambda h, p: (layer_fn(p, h), None), x, stacked_params)[0]


@public("sx.parallel.bubble")
def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of the schedule, ``(S - 1) / (repeats * M + S - 1)``."""
    stages = as_count("stages", stages)
    microbatches = as_count("microbatches", microbatches)
    repeats = as_count("repeats", repeats)
    return (stages - 1) / (repeats * microbatches + stages - 1)


@public("sx.pipeline")
def pipeline(
    layer_fn: Callable[[Any, H], H],
    stacked_params: Any,
    x: H,
    *,
    microbatches: int,
    axis: str = STAGE_AXIS,
    repeats: int = 1,
) -> H:
    """Applies the L stacked layers to ``x`` in order, pipelined over the mesh ``axis``.

    Args:
        layer_fn: ``layer_fn(layer_params, h) -> h`` applies one layer; it must treat the
            examples (leading axis of ``h``) independently, as the batch is cut into
            microbatches.
        stacked_params: a pytree whose array leaves all have the leading size L.
        x: an array, or a pytree of arrays with a common leading batch size.
        microbatches: M, the number of pieces the batch of each data shard is cut into.
        axis: the mesh axis of the stages (size S). Place the stacked params
            ``P(axis)``, e.g. ``sx.rules(mesh, [(r"blocks", P("stage"))])``.
        repeats: r; ``r > 1`` is the circular (interleaved) schedule: stage ``s``
            applies layer chunks ``s, s + S, ...`` of L/(S·r) layers each, and the idle
            fraction falls from ``(S-1)/(M+S-1)`` to ``(S-1)/(r·M+S-1)``.

    The result equals ``scan_layers`` (``lax.scan`` over the layers). With no mesh
    (single-device mode), or a mesh without the default ``"stage"`` axis, or one where
    it has size 1, it *is* that scan, so one model runs on any mesh. Under a mesh where
    ``axis`` has size S > 1 (traced by ``sx.make_train_step`` in jit mode, or under
    ``jax.set_mesh``), it runs the GPipe schedule (circular with ``repeats > 1``) in a
    ``shard_map`` manual over ``axis`` only: the data axis and any model axis (tensor
    parallelism inside ``layer_fn``) stay with the compiler. The backward pass is
    ``jax.grad`` of this. Activations move between neighbouring stages with
    ``ppermute``; the stage output is broadcast to every stage with a ``psum``.

    Raises ValueError when L is not divisible by S·repeats, the per-shard batch not by
    ``microbatches``, ``microbatches < S``, the stacked leaves' leading sizes differ,
    ``layer_fn``'s output differs from its input in structure, shape or dtype, or a
    non-default ``axis`` is not in the mesh.
    """
    where = stage_mesh(stacked_params, x, microbatches, axis, repeats)
    check_layer_fn(layer_fn, stacked_params, x)
    if where is None:
        return scan_layers(layer_fn, stacked_params, x)
    return _pipelined(layer_fn, stacked_params, x, microbatches, repeats, *where)


def stage_mesh(
    stacked_params: Any,
    x: Any,
    microbatches: int,
    axis: str,
    repeats: int = 1,
) -> tuple[Any, str, int, tuple[str, ...]] | None:
    """``(mesh, axis, S, batch_axes)`` to pipeline over, or None for the plain scan.

    Checks every rule of [`pipeline`][shardax.pipeline], raising ValueError naming the sizes.
    """
    microbatches = as_count("microbatches", microbatches)
    repeats = as_count("repeats", repeats)
    layers = num_layers(stacked_params)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    if axis not in mesh.axis_names:
        if axis == STAGE_AXIS:
            return None
        raise ValueError(
            f"axis {axis!r} is not in the mesh, whose axes are "
            f"{dict(mesh.shape)}; add it to the mesh or pass axis= one of them"
        )
    stages = mesh.shape[axis]
    if stages == 1:
        return None
    if axis in mesh.manual_axes:
        raise ValueError(
            f"axis {axis!r} is already manual (inside shard_map or pmap over "
            "it); call it from a jit-mode step (sx.make_train_step(mode='jit'))"
        )
    if layers % (stages * repeats):
        raise ValueError(
            f"the number of layers L={layers} is not divisible by stages "
            f"S={stages} (mesh axis {axis!r}) × repeats={repeats} = {stages * repeats}"
        )
    if microbatches < stages:
        raise ValueError(
            f"microbatches={microbatches} is less than the number of stages "
            f"S={stages} (mesh axis {axis!r}); pass microbatches >= {stages}"
        )
    batch = batch_size(x)
    batch_axes = _batch_axes(mesh, axis)
    shards = 1
    for a in batch_axes:
        shards *= mesh.shape[a]
    if batch % (shards * microbatches):
        where = f"batch {batch} / {' × '.join(batch_axes)} {shards}" if shards > 1 else batch
        raise ValueError(
            f"the batch on each data shard ({where}"
            f"{'' if shards == 1 else f' = {batch / shards:g}'}) is not divisible by "
            f"microbatches={microbatches}"
        )
    return mesh, axis, stages, batch_axes


def split_microbatches(x: Any, m: int, mesh: Any = None, batch_axes: tuple[str, ...] = ()) -> Any:
    """``(B, ...) -> (M, B/M, ...)``: example ``i·M + j`` goes to microbatch ``j``, so
    each microbatch keeps the batch's split over the data axes and cutting moves nothing
    (constrained so under ``mesh``)."""
    micro = jax.tree.map(
        lambda a: jnp.moveaxis(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 1, 0), x
    )
    if mesh is None:
        return micro
    return _constrain(micro, PartitionSpec(None, batch_axes or None), mesh)


def merge_microbatches(micro: Any, mesh: Any, batch_axes: tuple[str, ...]) -> Any:
    """The inverse of ``split_microbatches``."""
    micro = _constrain(micro, PartitionSpec(None, batch_axes or None), mesh)
    return jax.tree.map(
        lambda a: jnp.moveaxis(a, 0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:]), micro
    )


def _constrain(tree: Any, spec: PartitionSpec, mesh: Any) -> Any:
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return tree
    return jax.tree.map(lambda a: lax.with_sharding_constraint(a, spec), tree)


def vary(tree: Any, axis: str) -> Any:
    """``tree`` typed as varying over the manual ``axis`` (a scan carry that will be)."""
    return jax.tree.map(lambda a: lax.pcast(a, (axis,), to="varying"), tree)


def pad_ticks(micro: Any, ticks: int) -> Any:
    """The M microbatches followed by zeros, one per tick: the first stage's inputs."""
    return jax.tree.map(
        lambda a: jnp.pad(a, [(0, ticks - a.shape[0])] + [(0, 0)] * (a.ndim - 1)), micro
    )


def _deal(local: Any, axis: str, stages: int, repeats: int) -> Any:
    """This stage's circular chunks, from its contiguous block of the layers.

    The params stay placed ``P(axis)`` in layer order, so stage ``d`` holds chunks
    ``d·r ... d·r + r - 1`` of K = L/(S·r) layers; the circular schedule runs chunk ``c``
    on stage ``c mod S``. Each chunk moves once, by ``ppermute`` (its gradient comes back
    the same way); with ``repeats=1`` nothing moves.
    """
    local = jax.tree.map(lambda w: w.reshape(repeats, w.shape[0] // repeats, *w.shape[1:]), local)
    if repeats == 1:
        return local
    slots = []
    for j in range(repeats):  # slot j of stage s holds chunk j·S + s
        parts = []
        for i in range(repeats):  # chunk d·r + i of stage d goes to stage (d·r + i) mod S
            pairs = [
                (d, (d * repeats + i) % stages)
                for d in range(stages)
                if (d * repeats + i) // stages == j
            ]
            if pairs:
                sent = jax.tree.map(lambda w, i=i: w[i], local)
                parts.append(lax.ppermute(sent, axis, pairs))
        slots.append(jax.tree.map(lambda *p: sum(p[1:], p[0]), *parts))
    return jax.tree.map(lambda *s: jnp.stack(s), *slots)


def _pipelined(
    layer_fn: Callable[[Any, H], H],
    stacked_params: Any,
    x: H,
    m: int,
    repeats: int,
    mesh: Any,
    axis: str,
    stages: int,
    batch_axes: tuple[str, ...],
) -> H:
    micro = split_microbatches(x, m, mesh, batch_axes)

    def stage_fn(chunks: Any, micro: Any) -> Any:
        chunks = _deal(chunks, axis, stages, repeats)  # (r, K, ...): this stage's chunks
        stage = lax.axis_index(axis)
        first, last = stage == 0, stage == stages - 1
        work = repeats * m  # (repeat, microbatch) pairs each stage works through
        # Circular: the last stage hands back to the first; GPipe: a line.
        ring = [(s, (s + 1) % stages) for s in range(stages if repeats > 1 else stages - 1)]

        def tick(carry: Any, xs: Any) -> tuple[Any, Any]:
            received, loop = carry
            t, fresh = xs  # fresh: microbatch t, the first stage's input while t < M
            i = t - stage  # this stage's work item: repeat j of microbatch i mod M
            j = jnp.clip(i, 0, work - 1) // m
            h = jax.tree.map(lambda f, r: jnp.where(first & (t < m), f, r), fresh, received)
            if repeats > 1:
                # The first stage's input for a later repeat is what the last stage sent
                # it M - S ticks earlier: a delay line of M - S + 1 slots, written at
                # slot t and read at slot t - (M - S), i.e. t + 1.
                size = m - stages + 1
                loop = jax.tree.map(lambda b, r: b.at[t % size].set(r), loop, received)
                h = jax.tree.map(
                    lambda h, b: jnp.where(first & (t >= m), b[(t + 1) % size], h), h, loop
                )
            # With one repeat the chunk is always the first: a static index keeps it
            # loop-invariant, so autodiff does not save a copy of it per tick.
            chunk = jax.tree.map(lambda w: w[0] if repeats == 1 else w[j], chunks)
            h = scan_layers(layer_fn, chunk, h)
            return (lax.ppermute(h, axis, ring), loop), h

        ticks = work + stages - 1
        # Built from ``micro`` (zeros_like, pad), so Explicit axes keep its sharding.
        one = jax.tree.map(lambda a: jnp.zeros_like(a[0]), micro)
        loop = jax.tree.map(lambda a: jnp.zeros_like(a[: m - stages + 1]), micro)
        init = (vary(one, axis), vary(loop, axis) if repeats > 1 else None)
        _, ys = lax.scan(tick, init, (jnp.arange(ticks), pad_ticks(micro, ticks)))
        # The last stage finishes microbatch b of the last repeat at tick ticks - M + b.
        # Only it holds the result; every stage returns it.
        return jax.tree.map(lambda y: lax.psum(jnp.where(last, y[-m:], 0), axis), ys)

    param_spec = PartitionSpec(axis)
    out = jax.shard_map(
        stage_fn,
        mesh=mesh,
        in_specs=(param_spec, PartitionSpec()),
        out_specs=PartitionSpec(),
        axis_names={axis},
    )(stacked_params, micro)
    return merge_microbatches(out, mesh, batch_axes)
