"""``sx.verify``: the distributed step against one device, leaf by leaf, with the likely cause.

``verify(step, state, batch)`` runs the step's program on its mesh and the same program
on the mesh's first device (a one-device mesh with the same axis names and types, so a
model's own sharding annotations still apply), from the same state and batch, for
``steps`` steps, and compares after each step:

- the loss and the aux metrics;
- the gradients (unscaled, before the optimizer), leaf by leaf;
- the updated params, optimizer state and non-trainable model state.

For a :class:`~shardax.train.step.TrainStep` (or a ``plan="auto"`` step) both sides are
the step's own program (its loss function, plan, mode, accumulation and precision),
built without donation and returning the gradients beside the update: two
compilations, one distributed and one reference step per verified step. For your own
step function (the keep-your-loop path), ``verify(train_step, (model, optimizer),
batch)`` runs it on copies of the state, placed as given and on the first device, and
compares the updated state and what it returns (the gradients are seen through the
update). The state passed in is never changed or donated.

>>> report = sx.verify(step, state, {"x": np.ones((16, 4)), "y": np.zeros((16, 2))})
>>> report.ok, report.cause
(True, None)
>>> print(report)  # a short table: the worst leaves, their differences  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.checks import as_count, public
from shardax.parallel.context import laid_out_for
from shardax.plan.tree import is_array, path_str
from shardax.train.masks import MASK_KEY
from shardax.train.precision import Precision, policy_name, resolve, unscale
from shardax.train.state import TrainState
from shardax.train.step import TrainStep

TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-4, 1e-6),
    "fp16": (2e-2, 1e-4),
    "bf16": (5e-2, 1e-3),
}
"""``(rtol, atol)`` by compute precision. A leaf differs when its largest difference is
above ``atol + rtol * max|reference|``: relative to the leaf's scale, not elementwise,
so elements near zero do not raise false alarms."""

CAUSES: dict[str, str] = {
    "per-device BatchNorm statistics": (
        "each device normalizes with the statistics of its own slice of the batch. "
        "sx.make_train_step binds the data axis for Flax NNX, Linen and Equinox "
        "BatchNorm in every mode; in your own shard_map/pmap step set the layers' "
        "axis_name to the data axis, or use jit"
    ),
    "per-device means weighted equally": (
        "under shard_map/pmap each device's loss is a mean over its own count (tokens, "
        "weights), and without a 'mask' leaf in the batch the step averages the devices "
        "with equal weights. Add batch['mask'] (booleans, shape (batch,) or (batch, seq), "
        "True where the loss counts); the loss can stay as it is. Or use mode='jit'"
    ),
    "device-folded RNG": (
        "under shard_map/pmap each device folds its index into the framework's RNG "
        "(step_rng, Linen's 'dropout' stream, NNX Rngs), by design, so dropout masks "
        "differ from one device's. Take the rng argument (one key per example, the same "
        "in every mode), use mode='jit', or verify with dropout off"
    ),
    "reduced precision": (
        "the differences are within what the reduced-precision compute dtype rounds "
        "to; leave rtol unset (it follows the precision) or raise it"
    ),
    "non-determinism": (
        "the distributed step gives different results for the same input twice "
        "(atomics, scatter-adds, autotuning); on GPU try "
        "XLA_FLAGS=--xla_gpu_deterministic_ops=true"
    ),
}
"""The causes ``verify`` can name, and what to do about each."""

SHOWN = 6
"""Leaves shown in the report's table."""


# -- the comparison ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeafDiff:
    """One leaf's difference at one step: ``max_abs`` (largest absolute difference),
    ``max_rel`` (that over ``scale``, the reference leaf's largest magnitude), ``limit``
    (the tolerance ``atol + rtol * scale``)."""

    path: str
    step: int
    max_abs: float
    max_rel: float
    limit: float
    scale: float

    def within(self, rtol: float, atol: float) -> bool:
        """Whether the leaf is within another tolerance."""
        return bool(self.max_abs <= atol + rtol * self.scale)

    @property
    def ok(self) -> bool:
        return bool(self.max_abs <= self.limit)

    @property
    def ratio(self) -> float:
        """The difference over the tolerance (above 1: the leaf differs)."""
        return self.max_abs / self.limit if self.limit > 0 else float(self.max_abs > 0) * np.inf


def _numeric(x: Any) -> bool:
    if not is_array(x) or isinstance(x, str):
        return False
    dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
    return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


def _diff(path: str, step: int, got: Any, want: Any, rtol: float, atol: float) -> LeafDiff:
    a = np.asarray(got, np.float64)
    b = np.asarray(want, np.float64)
    if a.shape != b.shape:
        return LeafDiff(path, step, np.inf, np.inf, atol, 0.0)
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    if a.size == 0:
        return LeafDiff(path, step, 0.0, 0.0, atol, 0.0)
    nan = np.isnan(a) != np.isnan(b)
    err = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    max_abs = np.inf if nan.any() else float(np.max(err))
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    return LeafDiff(path, step, max_abs, max_rel, atol + rtol * scale, scale)


def compare(got: Any, want: Any, step: int, rtol: float, atol: float) -> list[LeafDiff]:
    """The differences of the numeric leaves of two trees of one structure (PRNG keys
    and other leaves are skipped); paths are joined by "/"."""
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(got):
        y = want_leaves.get(path)
        if y is None or not _numeric(x) or jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        out.append(_diff(path_str(path), step, x, y, rtol, atol))
    return out


# -- the report ----------------------------------------------------------------------------


@public("sx.train.VerifyReport")
@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` compared, and its verdict. ``print(report)`` is a short table.

    Attributes:
        ok: every compared leaf is within tolerance at every step.
        worst: the leaf furthest from its tolerance (at the first step that diverged,
            if one did).
        first_step: the first step (1-based) at which a leaf differed, else None.
        cause: the likely cause, one of :data:`CAUSES`, or None (``hint`` says what to do).
        hint: what the cause means and how to fix it (or how to look further).
        diffs: the leaves that differed at ``first_step`` (or, when ok, the closest
            ones), worst first.
        steps, rtol, atol: what was compared, and the tolerance.
        what: the distributed side (the step's repr, or the function's name).
        reference: the device the reference ran on.
        compared: the number of leaves compared per step.
        seconds: wall time of the verification, compilations included.
    """

    ok: bool
    worst: LeafDiff | None
    first_step: int | None
    cause: str | None
    hint: str
    diffs: tuple[LeafDiff, ...]
    steps: int
    rtol: float
    atol: float
    what: str
    reference: str
    compared: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data."""
        out = dataclasses.asdict(self)
        out["worst"] = None if self.worst is None else dataclasses.asdict(self.worst)
        out["diffs"] = [dataclasses.asdict(d) for d in self.diffs]
        return out

    def __rich__(self) -> Any:
        from rich.table import Table

        verdict = "[green]ok[/]" if self.ok else f"[red]differs from step {self.first_step}[/]"
        table = Table(title=f"sx.verify: {verdict}")
        for col in ("leaf", "step", "max abs diff", "max rel diff", "tolerance", ""):
            table.add_column(col, justify="left" if col in ("leaf", "") else "right")
        for d in self.diffs[:SHOWN]:
            table.add_row(
                d.path,
                str(d.step),
                f"{d.max_abs:.3g}",
                f"{d.max_rel:.3g}",
                f"{d.limit:.3g}",
                "ok" if d.ok else "[red]differs[/]",
            )
        more = len(self.diffs) - SHOWN
        caption = [f"{self.what} against {self.reference}",
                   f"{self.compared} leaves × {self.steps} step(s), rtol={self.rtol:g}, "
                   f"atol={self.atol:g}, {self.seconds:.1f} s"]  # fmt: skip
        if more > 0:
            caption.append(f"{more} more leaves differ")
        if not self.ok:
            caption.append(f"likely cause: {self.cause or 'not named'}: {self.hint}")
        table.caption = "\n".join(caption)
        return table

    def __str__(self) -> str:
        from rich.console import Console

        out = io.StringIO()
        Console(file=out, width=120, force_terminal=False).print(self)
        return out.getvalue().rstrip()


def _verdict(
    diffs_by_step: list[list[LeafDiff]], rtol: float, atol: float
) -> tuple[bool, int | None, tuple[LeafDiff, ...]]:
    for diffs in diffs_by_step:
        bad = sorted((d for d in diffs if not d.ok), key=lambda d: -d.ratio)
        if bad:
            return False, bad[0].step, tuple(bad)
    closest = sorted((d for diffs in diffs_by_step for d in diffs), key=lambda d: -d.ratio)
    return True, None, tuple(closest[:SHOWN])


# -- tolerance and the reference device ----------------------------------------------------


def tolerance(precision: str | Precision) -> tuple[float, float]:
    """``(rtol, atol)`` for a precision: by its compute dtype (:data:`TOLERANCES`)."""
    dtype = jnp.dtype(resolve(precision).compute_dtype)
    name = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "fp16"}.get(dtype, "fp32")
    return TOLERANCES[name]


def one_device_mesh(mesh: Mesh) -> Mesh:
    """A mesh of ``mesh``'s first device with the same axis names and types (each of
    size 1), so a model's sharding annotations and ``sx.constrain`` still apply."""
    devices = np.asarray(mesh.devices.flat[0]).reshape((1,) * len(mesh.axis_names))
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _tree_bytes(tree: Any) -> int:
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
        if is_array(x) and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    )


def _too_big(device: Any, n: int, error: Exception | None = None) -> ValueError:
    why = f": {str(error).splitlines()[0]}" if error is not None else ""
    return ValueError(
        f"sx.verify runs the reference on one device ({device}) with the whole batch of "
        f"{n} examples and a whole copy of the state, and that does not fit{why}. Pass a "
        "smaller probe batch (a few examples per device is enough)"
    )


def _check_fits(device: Any, state: Any, batch: Any) -> None:
    """Refuses plainly when the state and batch alone exceed the device's free memory."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or not stats.get("bytes_limit"):
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if _tree_bytes(state) + _tree_bytes(batch) > free:
        raise _too_big(device, _batch_size(batch))


def _batch_size(batch: Any) -> int:
    leaves = [x for x in jax.tree.leaves(batch) if is_array(x)]
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else 0


def _out_of_memory(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def _on_one(device: Any, mesh: Mesh | None, batch: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` for the reference, on the distributed ``mesh``'s sequence layout (a
    zig-zag batch keeps its C, :func:`~shardax.parallel.context.laid_out_for`); running
    out of memory is said plainly."""
    try:
        if mesh is None:
            return fn(*args)
        with laid_out_for(mesh):
            return fn(*args)
    except Exception as e:
        if _out_of_memory(e):
            raise _too_big(device, _batch_size(batch), e) from e
        raise


# -- the train step's program, with its gradients -------------------------------------------


class _Probe(TrainStep):
    """The train step's program, not donating, returning the unscaled gradients, the
    loss and the aux metrics beside the updated state."""

    def finish(self, state: TrainState, grads: Any, loss: Any, aux: Any, model_state: Any):
        new, metrics = super().finish(state, grads, loss, aux, model_state)
        if self._scaling is not None:
            grads = unscale(grads, state.loss_scale)
        return new, {"metrics": metrics, "grads": grads}

    @classmethod
    def like(cls, step: TrainStep, mesh: Mesh | None = None) -> _Probe:
        """The probe of ``step`` (``mesh``: the step's config on another mesh, replicated)."""
        one = mesh is not None
        return cls(
            step.loss_fn,
            mesh=mesh if one else step.mesh,
            plan=None if one else step.plan,
            mode="jit" if one else step.mode,
            accumulate=step.accumulate,
            donate=False,
            data_axis=step.data_axis,
            precision=step.precision,
            stats=(),
            seq_axis=None if one else step.seq_axis,
        )


def _place(batch: Any, sharding: Any) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if is_array(x) else x, batch)


def _observed(state: TrainState, out: dict[str, Any]) -> dict[str, Any]:
    return {
        "metrics": out["metrics"],
        "grads": out["grads"],
        "params": state.params,
        "opt_state": state.opt_state,
        "model_state": state.model_state,
    }


def _fold_keys(tree: Any) -> Any:
    return jax.tree.map(
        lambda x: (
            jax.random.fold_in(x, 1)
            if is_array(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x
        ),
        tree,
    )


def _verify_step(
    step: TrainStep, state: TrainState, batch: Any, steps: int, rtol: float, atol: float
) -> tuple[list[list[LeafDiff]], Callable[[LeafDiff], tuple[str | None, str]], str]:
    mesh1 = one_device_mesh(step.mesh)
    device = mesh1.devices.flat[0]
    dist, ref = _Probe.like(step), _Probe.like(step, mesh1)
    dstate = dist.shard(state)
    _check_fits(device, state, batch)
    rbatch = _place(batch, NamedSharding(mesh1, PartitionSpec()))
    rstate = _on_one(device, step.mesh, batch, ref.shard, state)
    first: dict[str, Any] = {}
    by_step = []
    for k in range(1, steps + 1):
        dnew, dout = dist(dstate, batch)
        rnew, rout = _on_one(device, step.mesh, batch, ref, rstate, rbatch)
        got, want = _observed(dnew, dout), _observed(rnew, rout)
        if k == 1:
            first = {"dist": got, "ref": want}
        by_step.append(compare(got, want, k, rtol, atol))
        dstate, rstate = dnew, rnew

    def diagnose(worst: LeafDiff) -> tuple[str | None, str]:
        if jnp.dtype(step.precision.compute_dtype).itemsize < 4 and worst.within(
            *tolerance(step.precision)
        ):
            return "reduced precision", _precision_hint(policy_name(step.precision))
        again = _observed(*dist(dist.shard(state), batch))
        if any(not d.ok for d in compare(again, first["dist"], 1, rtol, atol)):
            return "non-determinism", CAUSES["non-determinism"]
        if step.mode in ("shard_map", "pmap"):
            loss = compare(first["dist"]["metrics"], first["ref"]["metrics"], 1, rtol, atol)
            if all(d.ok for d in loss):
                return None, _UNNAMED
            # Another seed for the framework's RNG: does the reference's loss change?
            key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 1)
            other = state.replace(
                rng=jax.random.key_data(key), model_state=_fold_keys(state.model_state)
            )
            reseeded = _observed(*_on_one(device, step.mesh, batch, ref, ref.shard(other), rbatch))
            reseeded = reseeded["metrics"]
            if any(not d.ok for d in compare(reseeded, first["ref"]["metrics"], 1, rtol, atol)):
                return "device-folded RNG", CAUSES["device-folded RNG"]
            if not (isinstance(batch, dict) and MASK_KEY in batch):
                return "per-device means weighted equally", CAUSES[
                    "per-device means weighted equally"
                ]
        return None, _UNNAMED

    return by_step, diagnose, str(device)


def _precision_hint(name: str) -> str:
    return CAUSES["reduced precision"].replace("the reduced-precision compute dtype", name)


_UNNAMED = (
    "no known cause fits; look at the first leaf that differs (a layer that "
    "communicates, a custom collective, a sharding annotation) and see the guide "
    "'Is my sharded run right?'"
)


# -- a user's own step function -----------------------------------------------------------


def _is_graph(tree: Any) -> bool:
    from flax import nnx

    return any(
        isinstance(x, nnx.Object)
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Object))
    )


def _arrays(args: tuple[Any, ...]) -> Any:
    """The array leaves of the state (NNX objects through ``nnx.state``), as a pytree."""
    if _is_graph(args):
        from flax import nnx

        return nnx.to_pure_dict(nnx.state(args))
    return args


def _copied(args: tuple[Any, ...], put: Callable[[jax.Array], jax.Array]) -> tuple[Any, ...]:
    """A copy of ``args`` (NNX objects rebuilt) whose arrays are ``put(array)``."""

    def one(x: Any) -> Any:
        return put(x) if isinstance(x, jax.Array | np.ndarray) else x

    if _is_graph(args):
        from flax import nnx

        graphdef, state = nnx.split(args)
        return nnx.merge(graphdef, jax.tree.map(one, state))
    return jax.tree.map(one, args)


def _mesh_of(tree: Any) -> Mesh | None:
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def _split_out(out: Any, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """``(state after the step, what else it returned)``: a functional step returns the
    new state first (``(state, metrics)`` or ``(*state, metrics)``); an NNX step
    updates its arguments in place and returns its metrics."""
    n = len(args)
    if not _is_graph(args) and isinstance(out, tuple) and len(out) > n:
        head = out[:n]
        if jax.tree.structure(head) == jax.tree.structure(args):
            rest = out[n:]
            return head, rest[0] if len(rest) == 1 else rest
    return args, out


def _rtol_of(args: Any) -> tuple[float, float]:
    dtypes = {jnp.dtype(x.dtype) for x in jax.tree.leaves(_arrays(args)) if hasattr(x, "dtype")}
    if jnp.dtype(jnp.float16) in dtypes:
        return TOLERANCES["fp16"]
    if jnp.dtype(jnp.bfloat16) in dtypes:
        return TOLERANCES["bf16"]
    return TOLERANCES["fp32"]


def _has_batchnorm(args: Any) -> bool:
    from flax import nnx

    if _is_graph(args):
        objs = jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, nnx.Object))
        if any(
            isinstance(m, nnx.BatchNorm)
            for o in objs
            if isinstance(o, nnx.Module)
            for _, m in nnx.iter_modules(o)
        ):
            return True
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(_arrays(args))]
    return any("batch_stats" in p or "BatchNorm" in p for p in paths)


def _verify_fn(
    fn: Callable[..., Any],
    state: Any,
    batch: Any,
    steps: int,
    rtol: float,
    atol: float,
    reference: Callable[..., Any] | None,
    mesh: Mesh | None,
):
    args = state if isinstance(state, tuple) else (state,)
    mesh = mesh or _mesh_of(_arrays(args)) or _mesh_of(batch)
    mesh1 = one_device_mesh(mesh) if mesh is not None else None
    device = mesh1.devices.flat[0] if mesh1 is not None else jax.devices()[0]
    one = NamedSharding(mesh1, PartitionSpec()) if mesh1 is not None else device
    _check_fits(device, _arrays(args), batch)
    rbatch = _place(batch, one)
    reference = fn if reference is None else reference

    def run(f: Callable[..., Any], start: tuple[Any, ...], data: Any, on_one: bool):
        if on_one and mesh1 is not None:
            with jax.sharding.set_mesh(mesh1):
                return _split_out(f(*start, data), start)
        return _split_out(f(*start, data), start)

    def fresh() -> tuple[Any, ...]:
        return _copied(args, jnp.copy)  # the user's step may donate: never the original

    rargs = _on_one(device, None, batch, _copied, args, lambda x: jax.device_put(x, one))
    dargs = fresh()
    by_step, first = [], {}
    for k in range(1, steps + 1):
        dargs, dout = run(fn, dargs, batch, False)
        rargs, rout = _on_one(device, mesh, batch, run, reference, rargs, rbatch, True)
        got = {"returned": dout, "state": _arrays(dargs)}
        want = {"returned": rout, "state": _arrays(rargs)}
        if k == 1:
            first = {"dist": got, "ref": want}
        by_step.append(compare(got, want, k, rtol, atol))

    def diagnose(worst: LeafDiff) -> tuple[str | None, str]:
        default = _rtol_of(args)
        if default != TOLERANCES["fp32"] and worst.within(*default):
            return "reduced precision", _precision_hint("the state's dtype")
        again = run(fn, fresh(), batch, False)
        redo = {"returned": again[1], "state": _arrays(again[0])}
        if any(not d.ok for d in compare(redo, first["dist"], 1, rtol, atol)):
            return "non-determinism", CAUSES["non-determinism"]
        returned = compare(first["dist"]["returned"], first["ref"]["returned"], 1, rtol, atol)
        if all(d.ok for d in returned):
            return None, _UNNAMED
        if _has_batchnorm(args):
            return "per-device BatchNorm statistics", CAUSES["per-device BatchNorm statistics"]
        if not (isinstance(batch, dict) and MASK_KEY in batch):
            return "per-device means weighted equally", (
                "if your step maps over devices (shard_map, pmap): "
                + CAUSES["per-device means weighted equally"]
            )
        return None, _UNNAMED

    return by_step, diagnose, str(device)


# -- verify ----------------------------------------------------------------------------------


@public("sx.verify")
def verify(
    step: Any,
    state: Any,
    batch: Any,
    *,
    steps: int = 1,
    rtol: float | None = None,
    atol: float | None = None,
    reference: Callable[..., Any] | None = None,
    mesh: Mesh | None = None,
) -> VerifyReport:
    """Runs ``step`` on its mesh and on one device from the same ``state`` and ``batch``
    for ``steps`` steps and compares them leaf by leaf (see the module doc).

    Args:
        step: a train step from :func:`shardax.make_train_step` (any mode and plan,
            ``plan="auto"`` included: it picks its plan for ``state`` and ``batch``,
            as its first call would), or your own step function: ``fn(state, batch)``
            returning ``(new_state, metrics)``, or ``fn(*state, batch)`` when ``state``
            is a tuple, e.g. an ``@nnx.jit`` ``train_step(model, optimizer, batch)``
            that updates them in place and returns its metrics.
        state: the step's state: a :class:`TrainState` (placed or not) for a train
            step; for a function, what it takes (NNX objects, a flax ``TrainState``,
            a tuple of pytrees), placed as you train it (``sx.prepare``). Never
            changed, never donated: the runs start from copies.
        batch: a probe batch: the whole of it goes through one device for the
            reference, so a few examples per device are enough.
        steps: the number of steps compared. Each step compares the loss and aux
            metrics, the gradients (train steps) and the updated params, optimizer
            state and model state; ``first_step`` is the first that differs.
        rtol, atol: the tolerance (a leaf differs above ``atol + rtol *
            max|reference leaf|``); by default from the precision's compute dtype
            (:data:`TOLERANCES`; for a function, from the state's dtypes).
        reference: for a function only: the one-device step to compare with (default:
            the same function, run on copies of the state on the first device, under a
            one-device mesh with the same axis names). Give it when your step
            cannot run there, e.g. one written with ``shard_map`` or ``pmap``.
        mesh: for a function only: the mesh it runs on (default: the mesh of the
            state's or the batch's first sharded array).

    Returns:
        a :class:`VerifyReport`: ``ok``, the worst leaf, the first step that
        differed, the likely cause and how to fix it; ``print(report)`` is a table.

    Raises:
        ValueError: when the reference does not fit on one device (a smaller probe batch
            does), ``steps`` is not a positive integer, or the job has several processes.
    """
    from shardax.train.auto import AutoStep

    steps = as_count("steps", steps)
    if jax.process_count() > 1:
        raise ValueError(
            f"sx.verify runs the reference on one device of one process, and this job has "
            f"{jax.process_count()} processes: verify the step in a one-process run on one "
            "host's devices first (shardax train --verify does so before a launch)"
        )
    start = time.perf_counter()
    if isinstance(step, AutoStep):
        step = step.pick(state, batch)
    if isinstance(step, TrainStep):
        if reference is not None or mesh is not None:
            raise TypeError(
                "reference= and mesh= are for your own step function; a train "
                "step's reference is its own program on its mesh's first device"
            )
        if not isinstance(state, TrainState):
            raise TypeError(f"a train step takes a sx.TrainState, got {type(state).__name__}")
        rtol, atol = _given(tolerance(step.precision), rtol, atol)
        by_step, diagnose, device = _verify_step(step, state, batch, steps, rtol, atol)
        what = repr(step)
    elif callable(step):
        rtol, atol = _given(_rtol_of(state if isinstance(state, tuple) else (state,)), rtol, atol)
        by_step, diagnose, device = _verify_fn(
            step, state, batch, steps, rtol, atol, reference, mesh
        )
        what = getattr(step, "__name__", type(step).__name__)
    else:
        raise TypeError(
            f"step must be a train step (sx.make_train_step) or your own step "
            f"function, got {type(step).__name__}"
        )
    ok, first_step, diffs = _verdict(by_step, rtol, atol)
    worst = diffs[0] if diffs else None
    cause, hint = (None, "") if ok or worst is None else diagnose(worst)
    return VerifyReport(
        ok=ok,
        worst=worst,
        first_step=first_step,
        cause=cause,
        hint=hint,
        diffs=diffs,
        steps=steps,
        rtol=rtol,
        atol=atol,
        what=what,
        reference=device,
        compared=len(by_step[0]) if by_step else 0,
        seconds=time.perf_counter() - start,
    )


def _given(default: tuple[float, float], rtol: Any, atol: Any) -> tuple[float, float]:
    """``(rtol, atol)``: the given ones, else the default; a given ``rtol`` alone scales the
    default ``atol`` with it."""
    if atol is None:
        atol = default[1] if rtol is None else rtol * default[1] / default[0]
    return (default[0] if rtol is None else rtol), atol


def verify_first_batch(
    step: Any, state: Any, batches: Iterable[Any], **kwargs: Any
) -> VerifyReport:
    """:func:`verify` on the first batch of ``batches`` (for ``shardax train --verify``).

    A loader with ``get_state()``/``set_state()`` is put back where it was, so training
    then starts from the same first batch."""
    saved = batches.get_state() if hasattr(batches, "get_state") else None
    batch = next(iter(batches))
    if saved is not None:
        batches.set_state(saved)
    return verify(step, state, batch, **kwargs)
