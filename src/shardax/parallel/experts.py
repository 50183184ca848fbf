"""Mixture of experts with expert parallelism: ``sx.moe`` over an ``"expert"`` mesh axis.

``moe(x, router_weight, expert_fn, expert_params)`` sends each token to its ``top_k``
experts and sums their outputs weighted by its gates. ``expert_fn(params, tokens)`` is the
user's own expert (any function of one expert's parameters and a ``(n, d)`` block of
tokens); ``expert_params`` stacks E experts on a leading dimension. Under a mesh with an
``"expert"`` axis of size n > 1 each device holds E/n experts (place them ``P("expert")``)
and the tokens travel to their experts and back.

>>> def swiglu(p, h):
...     return (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
>>> rng = np.random.default_rng(0)
>>> experts = {"gate": rng.normal(size=(8, 16, 32)), "up": rng.normal(size=(8, 16, 32)),
...            "down": rng.normal(size=(8, 32, 16))}           # 8 experts, stacked
>>> x, router = jnp.ones((4, 10, 16)), rng.normal(size=(16, 8))
>>> y, aux = jax.jit(lambda x: sx.moe(x, router, swiglu, experts, top_k=2))(x)
>>> y.shape, aux.tokens_per_expert.sum().item()      # 40 tokens × 2 assignments
((4, 10, 16), 80)

The rules, the same for every dispatch and every mesh:

- **Gates**: router logits ``x @ router_weight`` (E columns); the gates of a token are
  its softmax's ``top_k`` largest probabilities, renormalised to sum to 1 (equivalently
  the softmax over its ``top_k`` largest logits).
- **Groups**: the tokens are routed in groups, one per device of the batch axes (by
  default ``"data"`` and ``"expert"``, where the mesh has them: split the batch over
  data × expert outside the layer, ``sx.batch_sharding(mesh, ("data", "expert"))``);
  with no mesh, all tokens are one group.
- **Capacity**: each expert takes at most ``C = ceil(capacity_factor · T · top_k / E)``
  token-assignments from each group of T tokens (never more than T). An expert's
  assignments are ranked by gate, higher first, then by position in the group, earlier
  first; those ranked C or later are dropped: the lower gate first, then the later
  position. Gates are ranked in steps of ``1 / GATE_STEPS`` (rounded), so that a
  roundoff-level difference (another mesh sums the gradients in another order) does
  not reorder two near-equal gates and flip a drop: gates within a step are ranked by
  position. A dropped assignment adds zero to its token's output (the residual path,
  which is the caller's, carries the token on).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec

from shardax.checks import as_count, as_float, as_function, public, received
from shardax.mesh.axes import DATA_AXIS, EXPERT_AXIS

DISPATCHES = ("auto", "all_to_all", "ragged", "dense")
"""The values of [`moe`][shardax.moe]'s ``dispatch``."""

GATE_STEPS = 256
"""Gates are ranked for drops in steps of ``1 / GATE_STEPS`` (module docstring)."""


@public("sx.parallel.MoEAux")
class MoEAux(NamedTuple):
    """What [`moe`][shardax.moe] measures, over all the tokens of the call (every group).

    ``balance_loss`` is Switch's load-balancing loss ``E · Σ_e f_e · P_e``: ``f_e`` the
    fraction of token-assignments routed to expert e (before drops), ``P_e`` the mean
    router probability of e. It is 1.0 when routing is uniform, up to E when all tokens
    pick one expert; add ``α · balance_loss`` (α ≈ 1e-2) to the loss. ``z_loss`` is
    ST-MoE's router z-loss, the mean over tokens of ``logsumexp(logits)²`` (α ≈ 1e-3).
    A call on no tokens (an empty batch) measures 0 for each, so the losses add nothing.
    """

    balance_loss: jax.Array  # () float32
    z_loss: jax.Array  # () float32
    dropped_fraction: jax.Array  # () float32: dropped token-assignments / (tokens · top_k)
    tokens_per_expert: jax.Array  # (E,) int32: token-assignments routed to each expert


@public("sx.parallel.capacity")
def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Token-assignments each expert takes from a group of ``tokens`` tokens:
    ``ceil(capacity_factor · tokens · top_k / num_experts)``, at most ``tokens``.

    >>> capacity(64, 8, 2, 1.25)
    20
    """
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


# -- routing: one group of tokens --------------------------------------------------------


class Routing(NamedTuple):
    """One group's routing: every token's ``top_k`` experts, gates and queue ranks."""

    logits: jax.Array  # (T, E) float32
    probs: jax.Array  # (T, E) float32
    experts: jax.Array  # (T, k) int32: the top-k experts of each token, best first
    gates: jax.Array  # (T, k) float32: their renormalised gates
    rank: jax.Array  # (T, k) int32: place of each assignment in its expert's queue
    keep: jax.Array  # (T, k) bool: rank < capacity


def route(x: jax.Array, router_weight: jax.Array, top_k: int, capacity: int) -> Routing:
    """Routes the tokens ``x`` (T, d) to ``top_k`` of ``router_weight``'s E experts, each
    expert keeping ``capacity`` of its assignments (module docstring: the drop rule)."""
    logits = (x @ router_weight).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = lax.top_k(probs, top_k)
    gates = top / top.sum(axis=-1, keepdims=True)
    num_experts = router_weight.shape[-1]
    tokens = jnp.arange(x.shape[0])[:, None]
    # Per expert, its tokens by gate in steps (higher first), then position (stable sort).
    step = jnp.round(lax.stop_gradient(gates) * GATE_STEPS)
    key = jnp.full(probs.shape, jnp.inf).at[tokens, experts].set(-step)
    order = jnp.argsort(key, axis=0, stable=True)
    columns = jnp.arange(num_experts)[None, :]
    ranks = jnp.zeros_like(order).at[order, columns].set(jnp.arange(x.shape[0])[:, None])
    rank = ranks[tokens, experts].astype(jnp.int32)
    return Routing(logits, probs, experts.astype(jnp.int32), gates, rank, rank < capacity)


def _aux_sums(r: Routing) -> tuple[jax.Array, ...]:
    """The sums over one group that [`MoEAux`][shardax.parallel.MoEAux] is made of (psum-able)."""
    num_experts = r.probs.shape[-1]
    counts = jnp.zeros(num_experts, jnp.int32).at[r.experts].add(1)
    z = jnp.square(jax.nn.logsumexp(r.logits, axis=-1))
    dropped = jnp.sum(~r.keep).astype(jnp.int32)
    return counts, r.probs.sum(axis=0), z.sum(), dropped, jnp.array(r.probs.shape[0], jnp.int32)


def _aux(sums: tuple[jax.Array, ...], top_k: int) -> MoEAux:
    counts, prob_sum, z_sum, dropped, tokens = sums
    num_experts = counts.shape[0]
    tokens = jnp.maximum(tokens, 1)  # no tokens: every sum is 0, and so is each mean
    f = counts / (tokens * top_k)
    p = prob_sum / tokens
    balance = num_experts * jnp.sum(lax.stop_gradient(f) * p)
    return MoEAux(balance, z_sum / tokens, dropped / (tokens * top_k), counts)


# -- dispatch: tokens to their experts and back ------------------------------------------


def _combine(y_rows: jax.Array, rows: jax.Array, r: Routing) -> jax.Array:
    """``Σ_j gate_tj · y_rows[rows_tj]`` over the kept assignments (rows of dropped ones
    point past the end, at a zero row)."""
    padded = jnp.concatenate([y_rows, jnp.zeros((1, *y_rows.shape[1:]), y_rows.dtype)])
    weight = jnp.where(r.keep, r.gates, 0.0).astype(y_rows.dtype)
    return jnp.einsum("tk,tkd->td", weight, padded[rows])


def _gather_rows(x: jax.Array, rows: jax.Array, size: int) -> jax.Array:
    """A ``(size, d)`` buffer whose row ``rows[t, j]`` is token t (zeros elsewhere)."""
    tokens = jnp.broadcast_to(jnp.arange(x.shape[0])[:, None], rows.shape)
    source = jnp.full(size, x.shape[0], jnp.int32).at[rows.ravel()].set(tokens.ravel(), mode="drop")
    return jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[source]


def _checked(expert_fn: Callable) -> Callable:
    """``expert_fn``, whose output for tokens ``(n, d)`` must be ``(n, d_out)``: anything
    else (a scalar, a reduced or reshaped output) raises ``ValueError`` saying so, not an
    ``IndexError`` deep in the combine."""

    def one_expert(params: Any, tokens: jax.Array) -> jax.Array:
        out = expert_fn(params, tokens)
        if not hasattr(out, "shape"):
            raise TypeError(
                "expert_fn must map one expert's tokens (n, d) to one array of outputs "
                f"(n, d_out), got {type(out).__name__}"
                + (f" of {len(out)}" if isinstance(out, tuple | list) else "")
            )
        shape = jnp.shape(out)
        if len(shape) != 2 or shape[0] != tokens.shape[0]:
            raise ValueError(
                "expert_fn must map one expert's tokens (n, d) to outputs (n, d_out), got "
                f"outputs of shape {shape} for tokens of shape {tuple(tokens.shape)}"
                + (" (a scalar: it reduced over the tokens)" if not shape else "")
            )
        return out

    return one_expert


def _run_experts(expert_fn: Callable, params: Any, buffers: jax.Array) -> jax.Array:
    return jax.vmap(expert_fn)(params, buffers)


def _all_to_all(x, r, expert_fn, params, capacity, axis, n) -> jax.Array:
    """Fixed buffers: (E, C, d) per group, split by destination and exchanged."""
    num_experts = r.probs.shape[-1]
    rows = jnp.where(r.keep, r.experts * capacity + r.rank, num_experts * capacity)
    buf = _gather_rows(x, rows, num_experts * capacity).reshape(num_experts, capacity, -1)
    if n > 1:  # (E, C, d) -> (E/n, n·C, d): my experts' slots from every group
        buf = lax.all_to_all(buf, axis, split_axis=0, concat_axis=1, tiled=True)
    out = _run_experts(expert_fn, params, buf)
    if n > 1:  # back: (E/n, n·C, d) -> (E, C, d), my group's slots of every expert
        out = lax.all_to_all(out, axis, split_axis=1, concat_axis=0, tiled=True)
    return _combine(out.reshape(num_experts * capacity, -1), rows, r)


def _ragged(x, r, expert_fn, params, capacity, axis, n) -> jax.Array:
    """Only the kept tokens travel: one ``ragged_all_to_all`` slice per expert each way."""
    num_experts = r.probs.shape[-1]
    local = num_experts // n
    total = x.shape[0] * r.experts.shape[1]
    kept = jnp.zeros(num_experts, jnp.int32).at[r.experts].add(r.keep.astype(jnp.int32))
    start = jnp.cumsum(kept) - kept  # the kept assignments, by expert then rank
    rows = jnp.where(r.keep, start[r.experts] + r.rank, total)
    send = _gather_rows(x, rows, total)
    me = lax.axis_index(axis)
    # Expert e's slice lands at row (e mod E/n)·n·C + me·C of device e // (E/n): the
    # receiver's buffer is (E/n, n·C, d), as the all_to_all dispatch's.
    at = (jnp.arange(num_experts) % local) * (n * capacity) + me * capacity
    received = lax.all_to_all(kept, axis, 0, 0, tiled=True)
    buf = jnp.zeros((local * n * capacity, x.shape[1]), x.dtype)
    buf = lax.ragged_all_to_all(send, buf, start, kept, at, received, axis_name=axis)
    out = _run_experts(expert_fn, params, buf.reshape(local, n * capacity, -1))
    home = lax.all_to_all(start, axis, 0, 0, tiled=True)  # where each slice came from
    back_from = (jnp.arange(num_experts) % local) * (n * capacity) + (
        jnp.arange(num_experts) // local
    ) * capacity
    out = out.reshape(local * n * capacity, -1)
    ret = jnp.zeros((total, out.shape[-1]), out.dtype)
    ret = lax.ragged_all_to_all(out, ret, back_from, received, home, kept, axis_name=axis)
    return _combine(ret, rows, r)


def _dense(x, r, expert_fn, params, capacity, axis, n) -> jax.Array:
    """Every expert on every token of the expert group, weighted by a (T, E) matrix of
    kept gates (one-hot einsum); tokens all-gathered, outputs reduce-scattered."""
    del capacity
    num_experts = r.probs.shape[-1]
    weight = jnp.where(r.keep, r.gates, 0.0)
    weight = jnp.einsum("tk,tke->te", weight, jax.nn.one_hot(r.experts, num_experts))
    if n > 1:
        x = lax.all_gather(x, axis, tiled=True)  # (n·T, d)
        weight = lax.all_to_all(weight, axis, split_axis=1, concat_axis=0, tiled=True)
    out = jax.vmap(expert_fn, in_axes=(0, None))(params, x)  # (E/n, n·T, d)
    y = jnp.einsum("te,etd->td", weight.astype(out.dtype), out)
    if n > 1:
        y = lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
    return y


_DISPATCH = {"all_to_all": _all_to_all, "ragged": _ragged, "dense": _dense}


# -- choosing a dispatch -----------------------------------------------------------------


@functools.cache
def ragged_support(platform: str) -> tuple[bool, str]:
    """``(supported, reason)``: whether XLA on ``platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``)
    compiles ``lax.ragged_all_to_all``, found by compiling one on two of its devices (XLA:CPU
    does not, in JAX 0.10.2 and 0.12.0). Cached per platform."""
    devices = jax.devices(platform)
    if len(devices) < 2:
        return True, f"{platform} has one device: nothing travels"
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("x",), axis_types=(AxisType.Explicit,))

    def probe(v):
        ones = jnp.ones(2, jnp.int32)
        return lax.ragged_all_to_all(v, v, ones - 1, ones, ones - 1, ones, axis_name="x")

    fn = jax.shard_map(probe, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"))
    spec = jax.ShapeDtypeStruct(
        (4,), jnp.float32, sharding=jax.NamedSharding(mesh, PartitionSpec("x"))
    )
    compile_probe = lambda: jax.jit(fn).trace(spec).lower().compile()  # noqa: E731
    try:  # in a thread of its own: free of the caller's mesh and trace (thread-local)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(compile_probe).result()
    except Exception as e:  # XLA's error for an unsupported op (a JaxRuntimeError)
        if "ragged" not in str(e).lower():
            raise
        first = str(e).splitlines()[0]
        return False, f"XLA:{platform.upper()} does not compile ragged_all_to_all ({first})"
    return True, f"XLA:{platform.upper()} compiles ragged_all_to_all"


@public("sx.parallel.choose_dispatch")
def choose_dispatch(
    num_experts: int,
    top_k: int,
    capacity_factor: float,
    axis_size: int,
    dispatch: str = "auto",
    platform: str | None = None,
) -> tuple[str, str]:
    """``(dispatch, reason)``: what [`moe`][shardax.moe] runs for ``dispatch``, and why.

    ``"auto"`` picks ``"dense"`` when running every expert on every token costs at most
    twice the FLOPs of the capacity buffers (``E ≤ 2 · top_k · capacity_factor``), else
    ``"all_to_all"``. It never picks ``"ragged"``: it sends fewer bytes, but is not
    measured faster (ragged all-to-all has been reported at a small fraction of the ring's
    MFU on the same GPUs). An explicit ``"ragged"`` on a backend that cannot compile it
    over an axis of size > 1 raises ``ValueError`` with XLA's reason, rather than running
    something else.

    >>> choose_dispatch(8, 2, 1.25, 4)[0], choose_dispatch(4, 2, 1.25, 4)[0]
    ('all_to_all', 'dense')
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {list(DISPATCHES)}, got {dispatch!r}")
    dense_cost = num_experts / (top_k * capacity_factor)
    bound = f"2·top_k·capacity_factor={2 * top_k * capacity_factor:g}"
    if dispatch == "ragged" and axis_size > 1:
        ok, why = ragged_support(platform or jax.default_backend())
        if not ok:
            raise ValueError(
                f"dispatch='ragged' needs lax.ragged_all_to_all, and {why}; pass "
                "dispatch='all_to_all' (fixed capacity buffers) or 'dense'"
            )
        return "ragged", f"asked for; {why}"
    if dispatch != "auto":
        return dispatch, "asked for"
    if dense_cost <= 2:
        return "dense", (
            f"E={num_experts} <= {bound}: dense computes {dense_cost:.2g}× the expert FLOPs "
            "of capacity buffers and needs no token buffers"
        )
    return "all_to_all", (
        f"E={num_experts} > {bound}: dense would compute {dense_cost:.2g}× the expert FLOPs "
        "of capacity buffers"
    )


# -- checks and mesh ---------------------------------------------------------------------


def _check_experts(expert_params: Any, size: int, what: str) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(expert_params)
    if not leaves:
        raise ValueError("expert_params has no array leaves")
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape or shape[0] != size:
            where = jax.tree_util.keystr(path) or "<root>"
            raise ValueError(
                f"every leaf of expert_params needs the leading {what} dimension "
                f"{size}; leaf {where} has shape {shape}"
            )


class _Where(NamedTuple):
    """Where [`moe`][shardax.moe] runs: the mesh, the expert axis size n, the batch axes the
    groups are split over, those of them to make manual, and the axes to sum over."""

    mesh: Any
    n: int
    wrap: tuple[str, ...]
    reduce: tuple[str, ...]
    groups: int


def _where(axis: str, batch_axes: tuple[str, ...] | None) -> _Where:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _Where(mesh, 1, (), (), 1)
    if axis not in mesh.axis_names and axis != EXPERT_AXIS:
        raise ValueError(
            f"axis {axis!r} is not in the mesh, whose axes are {dict(mesh.shape)}; "
            "add it to the mesh or pass axis= one of them"
        )
    batch = (DATA_AXIS,) if batch_axes is None else tuple(batch_axes)
    for name in batch:
        if name not in mesh.axis_names and batch_axes is not None:
            raise ValueError(
                f"batch_axes entry {name!r} is not in the mesh, whose axes are {dict(mesh.shape)}"
            )
    batch = tuple(a for a in (*batch, axis) if a in mesh.axis_names)
    batch = tuple(dict.fromkeys(batch))
    n = mesh.shape[axis] if axis in mesh.axis_names else 1
    manual = set(mesh.manual_axes)
    wrap = tuple(a for a in batch if a not in manual)
    groups = math.prod(mesh.shape[a] for a in wrap)
    return _Where(mesh, n, wrap, batch, groups)


# -- the layer ---------------------------------------------------------------------------


@public("sx.moe")
def moe(
    x: jax.Array,
    router_weight: jax.Array,
    expert_fn: Callable[[Any, jax.Array], jax.Array],
    expert_params: Any,
    *,
    top_k: int = 2,
    capacity_factor: float = 1.25,
    axis: str = EXPERT_AXIS,
    dispatch: str = "auto",
    batch_axes: tuple[str, ...] | None = None,
) -> tuple[jax.Array, MoEAux]:
    """A mixture-of-experts layer: ``x``'s tokens through their ``top_k`` experts.

    Args:
        x: ``(tokens, d)`` or ``(batch, length, d)``.
        router_weight: ``(d, E)``; the router logits are ``x @ router_weight``.
        expert_fn: ``expert_fn(params_of_one_expert, tokens) -> outputs``, tokens
            ``(n, d)`` to outputs ``(n, d_out)``; vmapped over the experts.
        expert_params: a pytree whose leaves all have the leading size E (inside a
            ``shard_map`` manual over ``axis``: the local E/n).
        top_k: experts per token, 1..E.
        capacity_factor: > 0; capacity per expert per group is
            ``ceil(capacity_factor · T · top_k / E)`` ([`capacity`][shardax.parallel.capacity]).
        axis: the mesh axis the experts are split over (size n; E divisible by n).
        dispatch: ``"all_to_all"`` (fixed (E, C, d) buffers per group, ``lax.all_to_all``
            both ways), ``"ragged"`` (only kept tokens travel, ``lax.ragged_all_to_all``;
            not on XLA:CPU), ``"dense"`` (every expert on every token, one-hot einsum;
            tokens all-gathered and outputs reduce-scattered over ``axis``), or ``"auto"``
            ([`choose_dispatch`][shardax.parallel.choose_dispatch] says which and why). All give one
            result.
        batch_axes: the mesh axes the tokens' batch (leading dim of ``x``) is split over,
            one routing group per device; default ``("data",)``. ``axis`` is always one.

    Returns ``(y, aux)``: ``y`` has ``x``'s leading dims and ``expert_fn``'s output
    width; ``aux`` is a [`MoEAux`][shardax.parallel.MoEAux].

    With no mesh, or a mesh without the default ``"expert"`` axis or where it has size 1,
    every expert is local and nothing travels. Under ``jax.set_mesh`` (``jax.jit``, Auto
    or Explicit axes) it runs in a ``shard_map`` manual over the batch axes and ``axis``
    (other axes stay with the compiler); inside the user's ``shard_map`` over ``axis`` it
    runs as it is, on the local tokens and experts.

    Raises ValueError naming the argument for top_k outside 1..E, capacity_factor <= 0,
    expert params without the leading E, E not divisible by the axis size, a batch not
    divisible by the groups, an unknown dispatch, or ``"ragged"`` where XLA cannot.
    """
    if jnp.ndim(x) not in (2, 3):
        raise ValueError(f"x must be (tokens, d) or (batch, length, d), got shape {jnp.shape(x)}")
    as_function("expert_fn", expert_fn, "a function expert_fn(params_of_one_expert, tokens)")
    if isinstance(batch_axes, str):  # one axis, as data_axis takes it
        batch_axes = (batch_axes,)
    if batch_axes is not None and (
        not isinstance(batch_axes, tuple | list) or not all(isinstance(a, str) for a in batch_axes)
    ):
        raise TypeError(
            f"batch_axes must be a tuple of mesh axis names, e.g. ('data',), or None, got "
            f"{received(batch_axes)}"
        )
    if jnp.ndim(router_weight) != 2 or router_weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"router_weight must be (d, E) with d = x.shape[-1] = {x.shape[-1]}, got "
            f"shape {jnp.shape(router_weight)}"
        )
    num_experts = router_weight.shape[1]
    top_k = as_count("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(
            f"top_k must be <= the number of experts E={num_experts} "
            f"(router_weight.shape[1]), got {top_k}"
        )
    capacity_factor = as_float("capacity_factor", capacity_factor, above=0)
    where = _where(axis, batch_axes)
    n = where.n
    if num_experts % n:
        raise ValueError(
            f"the number of experts E={num_experts} is not divisible by the size "
            f"{n} of mesh axis {axis!r}"
        )
    inside = n > 1 and axis in where.mesh.manual_axes
    _check_experts(
        expert_params,
        num_experts // n if inside else num_experts,
        f"(experts on this device, E/{n})" if inside else "(experts)",
    )
    if x.shape[0] % where.groups:
        raise ValueError(
            f"x's leading (batch) dimension {x.shape[0]} is not divisible by the "
            f"{where.groups} routing groups (mesh axes {list(where.wrap)})"
        )
    dispatch, _ = choose_dispatch(num_experts, top_k, capacity_factor, n, dispatch)
    expert_fn = _checked(expert_fn)
    tokens = x.shape[0] // where.groups * (x.shape[1] if x.ndim == 3 else 1)
    cap = capacity(tokens, num_experts, top_k, capacity_factor)
    run = (
        _DISPATCH[dispatch]
        if n > 1
        else _DISPATCH["dense" if dispatch == "dense" else "all_to_all"]
    )

    def group(x, router_weight, expert_params):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        with jax.named_scope(f"moe_{dispatch}"):
            r = route(x2, router_weight, top_k, cap)
            y = run(x2, r, expert_fn, expert_params, cap, axis, n)
        sums = _aux_sums(r)
        if where.reduce:
            sums = tuple(lax.psum(s, where.reduce) for s in sums)
        return y.reshape(*lead, y.shape[-1]), _aux(sums, top_k)

    if not where.wrap:
        return group(x, router_weight, expert_params)
    mesh, wrap = where.mesh, where.wrap
    x_spec = PartitionSpec(wrap)
    e_spec = PartitionSpec(axis) if axis in wrap else PartitionSpec()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = any(types[a] == AxisType.Explicit for a in wrap)
    if explicit:  # on Explicit axes the split must be in the types
        original = tuple(jax.typeof(x).sharding.spec)
        original += (None,) * (x.ndim - len(original))
        x = jax.sharding.reshard(x, x_spec)
        router_weight = jax.sharding.reshard(router_weight, PartitionSpec())
        expert_params = jax.tree.map(lambda a: jax.sharding.reshard(a, e_spec), expert_params)
    y, aux = jax.shard_map(
        group,
        mesh=mesh,
        in_specs=(x_spec, PartitionSpec(), e_spec),
        out_specs=(x_spec, PartitionSpec()),
        axis_names=set(wrap),
    )(x, router_weight, expert_params)
    if explicit:  # back to the caller's split
        y = jax.sharding.reshard(y, PartitionSpec(*original[:-1], None))
    return y, aux
