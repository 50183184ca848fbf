"""``sx.verify``: the distributed step against one device, leaf by leaf, with the likely cause.

``verify(step, state, batch)`` runs the step on its mesh and, for the reference, on the
mesh's first device (a one-device mesh with the same axis names and types, so a model's
own sharding annotations still apply) over the whole batch in one go, from the same
state, and compares what distribution can change:

- the loss and the aux metrics, the gradients (unscaled, before the optimizer) and the
  non-trainable model state, each against one device's, at a tolerance for the order of
  floating-point sums;
- the update: the distributed params and optimizer state against one device's and,
  where they differ, against the optimizer applied, on one device, to the *distributed*
  gradients (a leaf passes when it matches either). The optimizer's normalisation (Adam,
  Lion, Adafactor) may turn a gradient of rounding noise (a bias before BatchNorm, ~1e-9,
  its sign set by the order of the sums) into a step of ±lr; judged this way that noise is
  no difference, while a wrong update still is: the update must be one device's or the
  optimizer's, and the gradients it is applied to must be one device's. The second
  program is built only when the first comparison fails.

Each step starts both sides from the same state (the distributed one), so a difference
is the step's own. For a :class:`~shardax.train.step.TrainStep` (or a ``plan="auto"``
step) both sides run the step's program (its loss function, plan, mode and precision),
built without donation; the reference never accumulates: one device, the whole batch.
For your own step function (the keep-your-loop path), ``verify(train_step, (model,
optimizer), batch)`` runs it on copies of the state, placed as given and on the first
device; an ``nnx.Optimizer`` among them hands verify the gradients (its transformation
records them). Otherwise (an optax transformation closed over, as Equinox's examples and
plain ``jax.jit`` steps write it) verify cannot see the gradients: where an updated leaf
differs, the one-device step runs again on row-permuted copies of the batch (reversed,
rolled): the same examples in another order of the sums. A leaf within twice its own
largest spread over those runs is reduction noise the optimizer amplified, not a
distribution difference. The floor is used only when the reorderings leave what the step
returns unchanged (they are a symmetry of the step) and the batch's leaves share one
leading size. A wrong update is still caught: a leaf with a real gradient (a weight)
barely moves between reorderings, so a doubled update, unreduced gradients or per-device
statistics exceed its floor. The state passed in is never changed or donated.

>>> report = sx.verify(step, state, {"x": np.ones((16, 4)), "y": np.zeros((16, 2))})
>>> report.ok, report.cause
(True, None)
>>> print(report)  # a short table: the worst leaves, their differences  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import io
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.checks import as_count, as_float, public
from shardax.parallel.context import laid_out_for
from shardax.plan.core import axis_size
from shardax.plan.tree import is_array, is_key, path_str
from shardax.train.masks import valid_count
from shardax.train.precision import Precision, policy_name, resolve, unscale
from shardax.train.program import refuse_abstract, refuse_compile_only
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
        "each device normalizes with the statistics of its own slice of the batch (the "
        "distributed result is each device's slice run alone, and no weighting of those "
        "gives one device's). sx.make_train_step binds the data axis for Flax NNX, Linen "
        "and Equinox BatchNorm in every mode; in your own shard_map/pmap step set the "
        "layers' axis_name to the data axis, or use jit; a statistic of your own over the "
        "batch must reduce over the data axis"
    ),
    "per-device means weighted equally": (
        "under shard_map/pmap each device's loss is a mean over its own count (tokens, "
        "weights), and the devices are averaged with equal weights (the distributed result "
        "is the mean of the devices' slices run alone, and weighting them by their counts "
        "gives one device's). Add batch['mask'] (booleans, shape (batch,) or (batch, seq), "
        "True where the loss counts); the loss can stay as it is. Or use mode='jit'"
    ),
    "rows are not independent examples": (
        "the batch's rows refer to each other (a graph batch whose senders/receivers index "
        "the whole batch, pairs or in-batch negatives): reordering the rows changes one "
        "device's loss, and each device sees only its slice of them. Split the batch into "
        "independent examples (one graph per row, padded), or use mode='jit', where the "
        "step sees the whole batch"
    ),
    "device-folded RNG": (
        "under shard_map/pmap each device folds its index into the framework's RNG "
        "(step_rng, Linen's 'dropout' stream, NNX Rngs), by design, so dropout masks "
        "differ from one device's. Take the rng argument (one key per example, the same "
        "in every mode), use mode='jit', or verify with dropout off"
    ),
    "accumulation changes the update": (
        "one device running the step's own accumulation over the whole batch gives the "
        "distributed result, and one device over the whole batch in one go does not: the "
        "loss is not a mean over independent examples, so microbatches change it (BatchNorm "
        "normalizes each microbatch; a per-microbatch mean over a count the step cannot see "
        "needs batch['mask']). Use accumulate=1, or make the loss a masked mean over "
        "independent examples"
    ),
    "update not the optimizer's": (
        "the gradients agree with one device's, but the distributed params or optimizer "
        "state are not what the optimizer computes from them: the update itself is wrong "
        "(a sharded optimizer state, a reduction in the transformation over a sharded "
        "leaf, donation or aliasing)"
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
    "impure step": (
        "the distributed step gives different results for the same input twice, and XLA "
        "on this platform is deterministic: the step likely reads state outside its "
        "arguments (a Python global or counter, the time, a NumPy random draw, a host "
        "callback). Make it a function of its arguments (pass a step count or a key in)"
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
    (the tolerance ``atol + rtol * scale``); ``index``, ``got`` and ``want``: where the
    largest difference is, the distributed value and the reference's there; ``shapes``:
    the distributed and the reference leaf's shapes where they differ (else None)."""

    path: str
    step: int
    max_abs: float
    max_rel: float
    limit: float
    scale: float
    index: tuple[int, ...] = ()
    got: float = 0.0
    want: float = 0.0
    shapes: tuple[tuple[int, ...], tuple[int, ...]] | None = None

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

    def where(self) -> str:
        """``path[index]: got (distributed) vs want (one device), step k``."""
        if self.shapes is not None:
            got, want = self.shapes
            return f"{self.path} at step {self.step}: shape {got} distributed, {want} on one device"
        at = f"[{', '.join(map(str, self.index))}]" if self.index else ""
        return (
            f"{self.path}{at} at step {self.step}: {self.got:.6g} distributed, "
            f"{self.want:.6g} on one device"
        )


def _numeric(x: Any) -> bool:
    if not is_array(x) or isinstance(x, str):
        return False
    dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
    return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


def _values(x: Any) -> np.ndarray:
    """A leaf as float64 NumPy: a typed PRNG key by its key data."""
    if is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x, np.float64)


def _diff(path: str, step: int, got: Any, want: Any, rtol: float, atol: float) -> LeafDiff:
    a, b = _values(got), _values(want)
    if a.shape != b.shape:
        return LeafDiff(path, step, np.inf, np.inf, atol, 0.0, shapes=(a.shape, b.shape))
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    if a.size == 0:
        return LeafDiff(path, step, 0.0, 0.0, atol, 0.0)
    nan = np.isnan(a) != np.isnan(b)
    err = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    err = np.where(nan, np.inf, err)
    flat = int(np.argmax(err))
    index = tuple(int(i) for i in np.unravel_index(flat, a.shape)) if a.ndim else ()
    max_abs = float(err.flat[flat])
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else np.inf)
    exact = is_key(want) or jnp.issubdtype(np.asarray(want).dtype, jnp.integer)
    limit = 0.0 if exact else atol + rtol * scale
    return LeafDiff(
        path, step, max_abs, max_rel, limit, scale, index, float(a.flat[flat]), float(b.flat[flat])
    )


def compare(got: Any, want: Any, step: int, rtol: float, atol: float) -> list[LeafDiff]:
    """The differences of the numeric leaves of two trees of one structure; typed PRNG
    keys are compared by their key data, and integer leaves (and keys) exactly. Paths
    are joined by "/"."""
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(got):
        y = want_leaves.get(path)
        if y is None or not (is_key(x) or _numeric(x)):
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
        judged: what was compared, in words (which leaves against what).
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
    judged: str
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
        caption = [f"{self.what} against {self.reference}: {self.judged}",
                   f"{self.compared} leaves × {self.steps} step(s), rtol={self.rtol:g}, "
                   f"atol={self.atol:g}, {self.seconds:.1f} s"]  # fmt: skip
        if more > 0:
            caption.append(f"{more} more leaves differ")
        if not self.ok and self.worst is not None:
            caption.append(f"first difference: {self.worst.where()}")
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
        if is_array(x) and not is_key(x)
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


# -- evidence for the causes ----------------------------------------------------------------


def _close(got: Any, want: Any, rtol: float, atol: float) -> bool:
    return all(d.ok for d in compare(got, want, 1, rtol, atol))


def _floats(tree: Any) -> Any:
    """``tree`` with None in place of every leaf that is not a floating array."""
    return jax.tree.map(
        lambda x: x if _numeric(x) and jnp.issubdtype(x.dtype, jnp.inexact) else None, tree
    )


def _vector(tree: Any) -> np.ndarray:
    parts = [_values(x).ravel() for x in jax.tree.leaves(_floats(tree))]
    return np.concatenate(parts) if parts else np.zeros(0)


def _rows(batch: Any, fn: Callable[[np.ndarray], np.ndarray]) -> Any:
    return jax.tree.map(lambda x: fn(np.asarray(x)) if is_array(x) and np.ndim(x) else x, batch)


def _slices(batch: Any, n: int) -> list[Any]:
    """The batch's rows in ``n`` equal consecutive slices: what each device holds."""
    size = _batch_size(batch) // n
    return [_rows(batch, lambda x, i=i: x[i * size : (i + 1) * size]) for i in range(n)]


def _weighted(trees: list[Any], weights: list[float]) -> Any:
    w = np.asarray(weights, np.float64) / max(float(np.sum(weights)), 1e-30)
    return jax.tree.map(
        lambda *xs: sum(wi * _values(x) for wi, x in zip(w, xs, strict=True)),
        *[_floats(t) for t in trees],
    )


def _weights_explain(parts: list[Any], whole: Any, rtol: float) -> bool | None:
    """Whether some weighting of the slices' results gives the whole batch's (least
    squares over the loss and every gradient element); None when too few numbers."""
    a = np.stack([_vector(p) for p in parts], axis=1)
    b = _vector(whole)
    if b.size <= 2 * a.shape[1]:
        return None
    w, *_ = np.linalg.lstsq(a, b, rcond=None)
    return bool(np.linalg.norm(a @ w - b) <= min(10 * rtol, 1e-2) * np.linalg.norm(b))


def _per_device(
    run_slice: Callable[[Any], Any],
    reordered: Callable[[], Any] | None,
    batch: Any,
    n: int,
    got: Any,
    want: Any,
    rtol: float,
    atol: float,
    batchnorm: bool,
) -> tuple[str, str] | None:
    """The cause, when the distributed result is each device's slice run alone on one
    device and averaged as the step averages devices (by their mask counts, or equally):
    a weighting of the slices that gives one device's result names per-device means;
    otherwise the rows are coupled, through statistics over the batch (BatchNorm) or, when
    reordering the rows changes one device's loss, as rows that refer to each other."""
    if n < 2 or _batch_size(batch) % n:
        return None
    slices = _slices(batch, n)
    parts = [run_slice(b) for b in slices]
    counts = [1.0 if valid_count(b) is None else float(valid_count(b)) for b in slices]
    if not _close(_weighted(parts, counts), _floats(got), rtol, atol):
        return None
    if _weights_explain(parts, want, rtol):
        return "per-device means weighted equally", CAUSES["per-device means weighted equally"]
    if not batchnorm and reordered is not None:
        loss = {k: v for k, v in want.items() if k in ("metrics", "returned")}
        if not _close(reordered(), loss, rtol, atol):
            return "rows are not independent examples", CAUSES["rows are not independent examples"]
    return "per-device BatchNorm statistics", CAUSES["per-device BatchNorm statistics"]


def _rerun_differs(device: Any) -> tuple[str, str]:
    """The cause when the same step on the same input gives another result: XLA's own
    non-determinism on GPU, else a step that reads state outside its arguments."""
    if getattr(device, "platform", "") in ("gpu", "cuda", "rocm"):
        return "non-determinism", CAUSES["non-determinism"]
    return "impure step", CAUSES["impure step"]


def _precision_hint(name: str) -> str:
    return CAUSES["reduced precision"].replace("the reduced-precision compute dtype", name)


def _unnamed(judged: str, worst: LeafDiff) -> str:
    return (
        f"no known cause fits. Compared {judged}; the first difference is "
        f"{worst.where()}. Look at that leaf (a layer that communicates, a custom "
        "collective, a sharding annotation) and see the guide 'Is my sharded run right?'"
    )


def _update_only(bad: list[LeafDiff], update: tuple[str, ...]) -> bool:
    return bool(bad) and all(d.path.split("/")[0] in update for d in bad)


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
    def like(cls, step: TrainStep, mesh: Mesh | None = None, accumulate: int = 1) -> _Probe:
        """The probe of ``step``; with ``mesh``, the reference: jit on that (one-device)
        mesh, replicated, with ``accumulate`` (one device over the whole batch: 1)."""
        one = mesh is not None
        config = dataclasses.replace(step.config, donate=False, stats=(), stats_every=1,
                                     batch_spec=None)  # fmt: skip
        if one:
            config = dataclasses.replace(config, mesh=mesh, plan=None, mode="jit",
                                         accumulate=accumulate, seq_axis=None)  # fmt: skip
        return cls(step.loss_fn, config)


def _place(batch: Any, sharding: Any) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if is_array(x) else x, batch)


def _reduced(state: TrainState, out: dict[str, Any]) -> dict[str, Any]:
    """What distribution can change: the metrics, the gradients, the model state."""
    return {"metrics": out["metrics"], "grads": out["grads"], "model_state": state.model_state}


def _updated(state: TrainState) -> dict[str, Any]:
    return {"params": state.params, "opt_state": state.opt_state, "loss_scale": state.loss_scale}


_UPDATE = ("params", "opt_state", "loss_scale")
_STEP_JUDGED = (
    "the loss, aux metrics, gradients and model state against one device's over the whole "
    "batch; the params and optimizer state against one device's, or, where they differ, "
    "against the optimizer applied on one device to the distributed gradients"
)


def _fold_keys(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.random.fold_in(x, 1) if is_key(x) else x, tree)


def _either(first: list[LeafDiff], second: list[LeafDiff], which: Callable[[str], bool]):
    """Leaf by leaf (both lists in one order), the closer of two references for the
    leaves ``which`` selects, the first's for the others."""
    return [
        min(a, b, key=lambda d: d.ratio) if which(a.path) else a
        for a, b in zip(first, second, strict=True)
    ]


_PROBES: weakref.WeakKeyDictionary[TrainStep, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _probes(step: TrainStep) -> dict[Any, Any]:
    """The programs verify builds for ``step``, kept while the step lives: verifying it
    again (another batch, more steps) compiles nothing new for the same shapes."""
    cached = _PROBES.get(step)
    if cached is None:
        mesh1 = one_device_mesh(step.mesh)
        ref = _Probe.like(step, mesh1)
        cached = _PROBES[step] = {
            "mesh1": mesh1,
            "dist": _Probe.like(step),
            "ref": ref,
            "update": jax.jit(ref.update),
        }
    return cached


def _verify_step(
    step: TrainStep, state: TrainState, batch: Any, steps: int, rtol: float, atol: float
) -> tuple[list[list[LeafDiff]], Callable[[LeafDiff], tuple[str | None, str]], str, str]:
    probes = _probes(step)
    mesh1, dist, ref, update = probes["mesh1"], probes["dist"], probes["ref"], probes["update"]
    device = mesh1.devices.flat[0]
    one = NamedSharding(mesh1, PartitionSpec())
    dstate = dist.shard(state)
    _check_fits(device, state, batch)
    rbatch = _place(batch, one)

    def on_one(fn: Callable[..., Any], *args: Any) -> Any:
        def under(*args: Any) -> Any:
            with jax.sharding.set_mesh(mesh1):
                return fn(*args)

        return _on_one(device, step.mesh, batch, under, *args)

    def in_update(path: str) -> bool:
        return path.split("/")[0] in _UPDATE

    by_step, runs = [], []
    for k in range(1, steps + 1):
        rstart = on_one(ref.shard, dstate)  # both sides start from the same state
        dnew, dout = dist(dstate, batch)
        rnew, rout = on_one(ref, rstart, rbatch)
        got = {**_reduced(dnew, dout), **_updated(dnew)}
        want = {**_reduced(rnew, rout), **_updated(rnew)}
        diffs = compare(got, want, k, rtol, atol)
        if any(not d.ok for d in diffs if in_update(d.path)):
            # The optimizer may amplify rounding noise in the gradients (Adam, Lion):
            # judge the update from the distributed gradients, on one device.
            grads, model_state = _place((dout["grads"], dnew.model_state), one)
            want = {**want, **_updated(on_one(update, rstart, grads, model_state))}
            diffs = _either(diffs, compare(got, want, k, rtol, atol), in_update)
        by_step.append(diffs)
        runs.append((dstate, rstart, got, want))
        dstate = dnew

    def diagnose(worst: LeafDiff) -> tuple[str | None, str]:
        dstart, rstart, got, want = runs[worst.step - 1]
        bad = [d for d in by_step[worst.step - 1] if not d.ok]
        if jnp.dtype(step.precision.compute_dtype).itemsize < 4 and worst.within(
            *tolerance(step.precision)
        ):
            return "reduced precision", _precision_hint(policy_name(step.precision))
        dnew, dout = dist(dstart, batch)
        if not _close({**_reduced(dnew, dout), **_updated(dnew)}, got, rtol, atol):
            return _rerun_differs(device)
        if _update_only(bad, _UPDATE):
            return "update not the optimizer's", CAUSES["update not the optimizer's"]
        loss_and_grads = {k: want[k] for k in ("metrics", "grads")}
        if step.accumulate > 1:
            same = probes.get("accumulated")
            if same is None:
                same = probes["accumulated"] = _Probe.like(step, mesh1, step.accumulate)
            anew, aout = on_one(same, rstart, rbatch)
            if _close(_reduced(dnew, dout), _reduced(anew, aout), rtol, atol):
                return "accumulation changes the update", CAUSES["accumulation changes the update"]
        if step.mode in ("shard_map", "pmap"):
            # Another seed for the framework's RNG: does one device's loss change?
            key = jax.random.fold_in(jax.random.wrap_key_data(rstart.rng), 1)
            other = rstart.replace(
                rng=jax.random.key_data(key), model_state=_fold_keys(rstart.model_state)
            )
            if not _close(on_one(ref, other, rbatch)[1]["metrics"], want["metrics"], rtol, atol):
                return "device-folded RNG", CAUSES["device-folded RNG"]

            def run_slice(part: Any) -> Any:
                out = on_one(ref, rstart, _place(part, one))[1]
                return {"metrics": out["metrics"], "grads": out["grads"]}

            def reordered() -> Any:
                flipped = _place(_rows(batch, lambda x: x[::-1]), one)
                return {"metrics": on_one(ref, rstart, flipped)[1]["metrics"]}

            n = axis_size(step.mesh, step.data_axis)
            found = _per_device(
                run_slice,
                None if "rng" in step._filled else reordered,
                batch,
                n,
                {k: got[k] for k in ("metrics", "grads")},
                loss_and_grads,
                rtol,
                atol,
                batchnorm=False,
            )
            if found is not None:
                return found
        return None, _unnamed(_STEP_JUDGED, worst)

    return by_step, diagnose, str(device), _STEP_JUDGED


# -- a user's own step function -----------------------------------------------------------


def _node_type() -> type:
    from flax import nnx

    return getattr(nnx, "Pytree", nnx.Object)  # flax 0.12: Module and Optimizer are Pytrees


def _is_graph(tree: Any) -> bool:
    return bool(_objects(tree, _node_type()))


def _objects(args: Any, kind: type) -> list[Any]:
    return [
        x
        for x in jax.tree.leaves(args, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(x, kind)
    ]


def _arrays(args: tuple[Any, ...], which: Any = None) -> Any:
    """The array leaves of the state (NNX objects through ``nnx.state``, ``which``: a
    variable filter), as a pytree."""
    if _is_graph(args):
        from flax import nnx

        state = nnx.state(args) if which is None else nnx.state(args, which)
        return nnx.to_pure_dict(state)
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


def _recording(tx: Any) -> Any:
    """``tx``, whose state also holds the last gradients it was given."""
    import optax

    def init(params: Any) -> Any:
        return tx.init(params), jax.tree.map(jnp.zeros_like, params)

    def update(grads: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        updates, inner = tx.update(grads, state[0], params, **extra)
        return updates, (inner, grads)

    return optax.GradientTransformationExtraArgs(init, update)


def _shapes(tree: Any) -> list[tuple[int, ...]]:
    return [np.shape(x) for x in jax.tree.leaves(tree)]


def _recorded(args: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(optimizer, model)`` for each ``nnx.Optimizer`` in a copy of the state, its
    transformation made to record the gradients (in the copy only)."""
    from flax import nnx
    from flax.nnx.training.optimizer import to_opt_state

    if not _is_graph(args):
        return []
    modules = [m for m in _objects(args, nnx.Module) if not isinstance(m, nnx.Optimizer)]
    out = []
    for opt in _objects(args, nnx.Optimizer):
        want = _shapes(nnx.as_pure(opt.opt_state))
        for model in [getattr(opt, "model", None), *modules]:
            if not isinstance(model, nnx.Module):
                continue
            params = nnx.as_pure(nnx.state(model, opt.wrt))
            if _shapes(jax.eval_shape(opt.tx.init, params)) != want:
                continue
            zeros = to_opt_state(jax.tree.map(jnp.zeros_like, params))
            opt.opt_state = nnx.data((opt.opt_state, zeros))
            opt.tx = _recording(opt.tx)
            out.append((opt, model))
            break
    return out


def _optimizer_view(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Each recorded optimizer's gradients, params and (inner) state, by its position."""
    from flax import nnx

    out = {}
    for i, (opt, model) in enumerate(pairs):
        inner, grads = nnx.as_pure(opt.opt_state)
        params = nnx.as_pure(nnx.state(model, opt.wrt))
        out[str(i)] = {"grads": grads, "params": params, "opt_state": inner}
    return out


def _expected_update(tx: Any, params: Any, opt_state: Any, grads: Any) -> dict[str, Any]:
    import optax

    updates, new = tx.update(grads, opt_state, params)
    return {"params": optax.apply_updates(params, updates), "opt_state": new}


_expected_jit = jax.jit(_expected_update, static_argnums=0)


def _fresh(x: Any) -> Any:
    """A copy of an array in a buffer of its own (no compilation for a placed array)."""
    if isinstance(x, jax.Array):  # an uncommitted array stays uncommitted
        return jax.device_put(x, x.sharding if x.committed else None, may_alias=False)
    return jnp.copy(x)


def _shown(tree: Any) -> str:
    text = str(jax.tree.structure(tree))
    return text if len(text) <= 300 else text[:297] + "..."


def _check_structure(got: Any, want: Any, given: bool) -> None:
    """Refuses a reference (or a one-device run) that returned another structure than the
    distributed step: its leaves could not be compared."""
    if jax.tree.structure(got) == jax.tree.structure(want):
        return
    paths = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)}
    other = {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)}
    only = sorted(paths - other)[:3] or sorted(other - paths)[:3]
    who = "reference=" if given else "the step on one device"
    raise ValueError(
        f"{who} must return the structure the distributed step returns (its state and what "
        f"else it returns), so that every leaf is compared; the step gave {_shown(got)} and "
        f"{who} gave {_shown(want)} (first differing leaves: {', '.join(only) or '-'})"
    )


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
    dtypes = {
        jnp.dtype(x.dtype)
        for x in jax.tree.leaves(_arrays(args))
        if hasattr(x, "dtype") and not is_key(x)
    }
    if jnp.dtype(jnp.float16) in dtypes:
        return TOLERANCES["fp16"]
    if jnp.dtype(jnp.bfloat16) in dtypes:
        return TOLERANCES["bf16"]
    return TOLERANCES["fp32"]


def _has_batchnorm(args: Any) -> bool:
    from flax import nnx

    if _is_graph(args):
        objs = _objects(args, _node_type())
        if any(
            isinstance(m, nnx.BatchNorm)
            for o in objs
            if isinstance(o, nnx.Module)
            for _, m in nnx.iter_modules(o)
        ):
            return True
    paths = [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(_arrays(args))]
    return any("batch_stats" in p or "BatchNorm" in p for p in paths)


_PERMUTATIONS: tuple[Callable[[np.ndarray], np.ndarray], ...] = (
    lambda x: x[::-1],
    lambda x: np.roll(x, x.shape[0] // 2, axis=0),
    lambda x: np.roll(x, 1, axis=0),
)
NOISE_MARGIN = 2.0  # a leaf within twice the reference's own spread is reduction noise


def _rows_are_examples(batch: Any) -> bool:
    """Whether every array of the batch has the same leading dimension (>= 2): its rows
    can be reordered as examples (a batch of mixed leading sizes is left alone)."""
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if is_array(x) and np.ndim(x)}
    return len(sizes) == 1 and next(iter(sizes)) >= 2


def _noise_floor(want: dict[str, Any], alts: list[dict[str, Any]], rtol: float, atol: float):
    """Per leaf of the update (``state/...``), the largest difference between the reference
    and the reference run on row-permuted copies of the batch: how far the order of the
    sums alone moves it. None when a permutation changed what the step returned (the
    reordering is not a symmetry of the step: no floor)."""
    floor: dict[str, float] = {}
    for alt in alts:
        if not _close(alt["returned"], want["returned"], rtol, atol):
            return None
        for d in compare(alt["state"], want["state"], 1, rtol, atol):
            path = f"state/{d.path}"
            floor[path] = max(floor.get(path, 0.0), d.max_abs)
    return floor


def _floored(diffs: list[LeafDiff], floor: dict[str, float] | None) -> list[LeafDiff]:
    """``diffs``, each update leaf's tolerance raised to ``NOISE_MARGIN`` times its noise
    floor (its own tolerance kept when larger); integer leaves stay exact."""
    if not floor:
        return diffs
    return [
        dataclasses.replace(d, limit=max(d.limit, NOISE_MARGIN * floor[d.path]))
        if d.path in floor and d.limit > 0
        else d
        for d in diffs
    ]


def _fn_judged(recorded: bool) -> str:
    if recorded:
        return (
            "what the step returned, the gradients its nnx.Optimizer was given and the "
            "non-trainable state against one device's over the whole batch; the params and "
            "optimizer state against one device's, or, where they differ, against the "
            "optimizer applied on one device to the distributed gradients"
        )
    return (
        "what the step returned and the updated state against one device's over the whole "
        "batch; where an updated leaf differs, at a tolerance raised to twice the spread of "
        "the one-device step itself over row-permuted copies of the batch (the same "
        "examples, another order of the sums: rounding noise an optimizer like Adam "
        "amplifies), used only when the permutations leave what the step returns unchanged"
    )


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
    given = reference is not None
    reference = fn if reference is None else reference

    def run(f: Callable[..., Any], start: tuple[Any, ...], data: Any, on_one: bool):
        if on_one and mesh1 is not None:
            with jax.sharding.set_mesh(mesh1):
                return _split_out(f(*start, data), start)
        return _split_out(f(*start, data), start)

    def put_one(x: jax.Array) -> jax.Array:
        # a copy: device_put reuses the buffer of a replicated array's shard on the
        # device, and the user's step may donate it
        return jax.device_put(x, one, may_alias=False)

    def on_one(f: Callable[..., Any], *a: Any) -> Any:
        return _on_one(device, mesh, batch, f, *a)

    dargs = _copied(args, _fresh)  # the user's step may donate: never the original
    recorded = bool(_recorded(dargs))
    judged = _fn_judged(recorded)
    rest: Any = None
    if recorded:
        from flax import nnx
        from flax.nnx.training.optimizer import OptState

        wrt = nnx.Any(OptState, *[opt.wrt for opt, _ in _recorded_pairs(dargs)])
        rest = nnx.Not(wrt)

    def observe(start: tuple[Any, ...], out: Any) -> dict[str, Any]:
        seen = {"returned": out, "state": _arrays(start, rest)}
        if recorded:
            seen["optimizer"] = _optimizer_view(_recorded_pairs(start))
        return seen

    def step_from(start: tuple[Any, ...], data: Any, on_one_device: bool, f: Callable[..., Any]):
        copy = _copied(start, put_one if on_one_device else _fresh)
        if on_one_device:
            new, out = on_one(run, f, copy, data, True)
        else:
            new, out = run(f, copy, data, False)
        return observe(new, out)

    def in_update(path: str) -> bool:
        parts = path.split("/")
        return parts[0] == "optimizer" and len(parts) > 2 and parts[2] in ("params", "opt_state")

    by_step, runs = [], []
    for k in range(1, steps + 1):
        dstart = _copied(dargs, _fresh)
        before = on_one(_copied, dargs, put_one) if recorded else ()
        dargs, dout = run(fn, dargs, batch, False)
        got = observe(dargs, dout)
        want = step_from(dstart, rbatch, True, reference)
        _check_structure(got, want, given)
        diffs = compare(got, want, k, rtol, atol)
        if recorded and any(not d.ok for d in diffs if in_update(d.path)):
            # The optimizer may amplify rounding noise in the gradients (Adam, Lion):
            # judge the update from the distributed gradients, on one device.
            view = _optimizer_view(_recorded_pairs(before))
            want = {**want, "optimizer": dict(want["optimizer"])}
            for i, (opt, _) in enumerate(_recorded_pairs(before)):
                start_view = view[str(i)]
                grads = _place(got["optimizer"][str(i)]["grads"], one)
                expected = on_one(
                    _expected_jit,
                    opt.tx,
                    start_view["params"],
                    (start_view["opt_state"], start_view["grads"]),
                    grads,
                )
                expected["opt_state"] = expected["opt_state"][0]
                want["optimizer"][str(i)] = {**want["optimizer"][str(i)], **expected}
            diffs = _either(diffs, compare(got, want, k, rtol, atol), in_update)
        elif (
            not recorded
            and any(not d.ok for d in diffs if d.path.startswith("state/"))
            and _rows_are_examples(batch)
        ):
            # No optimizer in sight (a closed-over optax tx): the one-device step's own
            # spread over reorderings of the rows is the update's noise floor.
            try:
                alts = [
                    step_from(dstart, _place(_rows(batch, p), one), True, reference)
                    for p in _PERMUTATIONS
                ]
                floor = _noise_floor(want, alts, rtol, atol)
            except Exception:  # the step may not run on a reordered batch
                floor = None
            diffs = _floored(diffs, floor)
        by_step.append(diffs)
        runs.append((dstart, got, want))

    def diagnose(worst: LeafDiff) -> tuple[str | None, str]:
        dstart, got, want = runs[worst.step - 1]
        bad = [d for d in by_step[worst.step - 1] if not d.ok]
        default = _rtol_of(args)
        if default != TOLERANCES["fp32"] and worst.within(*default):
            return "reduced precision", _precision_hint("the state's dtype")
        if not _close(step_from(dstart, batch, False, fn), got, rtol, atol):
            return _rerun_differs(device)
        if recorded and all(
            d.path.startswith("optimizer/") and d.path.split("/")[2] in ("params", "opt_state")
            for d in bad
        ):
            return "update not the optimizer's", CAUSES["update not the optimizer's"]
        keep = ("returned", "optimizer") if recorded else ("returned", "state")

        def picked(seen: dict[str, Any]) -> dict[str, Any]:
            out = {k: seen[k] for k in keep}
            if recorded:
                out["optimizer"] = {i: {"grads": v["grads"]} for i, v in out["optimizer"].items()}
            return out

        def run_slice(part: Any) -> Any:
            return picked(step_from(dstart, _place(part, one), True, reference))

        def reordered() -> Any:
            flipped = _place(_rows(batch, lambda x: x[::-1]), one)
            return {"returned": step_from(dstart, flipped, True, reference)["returned"]}

        n = _devices_over_rows(batch, mesh)
        batchnorm = _has_batchnorm(args)
        try:
            found = _per_device(
                run_slice, reordered, batch, n, picked(got), picked(want), rtol, atol, batchnorm
            )
        except Exception:  # the step may not run on a slice (a fixed batch size)
            found = None
        if found is not None:
            return found
        return None, _unnamed(judged, worst)

    return by_step, diagnose, str(device), judged


def _recorded_pairs(args: tuple[Any, ...]) -> list[tuple[Any, Any]]:
    """``(optimizer, model)`` for the recording optimizers of a copy (made from a copy
    that :func:`_recorded` instrumented: the instrumentation is copied with it)."""
    from flax import nnx

    modules = [m for m in _objects(args, nnx.Module) if not isinstance(m, nnx.Optimizer)]
    out = []
    for opt in _objects(args, nnx.Optimizer):
        if not isinstance(opt.opt_state, tuple):
            continue
        shapes = _shapes(nnx.as_pure(opt.opt_state)[1])
        for model in [getattr(opt, "model", None), *modules]:
            if isinstance(model, nnx.Module) and shapes == _shapes(
                nnx.as_pure(nnx.state(model, opt.wrt))
            ):
                out.append((opt, model))
                break
    return out


def _devices_over_rows(batch: Any, mesh: Mesh | None) -> int:
    """The number of slices the batch's rows are split in: by the placement of a placed
    batch, else over the whole mesh."""
    for x in jax.tree.leaves(batch):
        if isinstance(x, jax.Array) and x.ndim:
            return x.shape[0] // max(x.sharding.shard_shape(x.shape)[0], 1)
    return mesh.size if mesh is not None else 1


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
    concrete = (
        "sx.verify runs the step and its one-device reference on values: pass concrete ones "
        "(the state as you train it, a probe batch of a few examples per device); for "
        "shapes only, sx.estimate(step, state, batch) compiles from abstract ones"
    )
    refuse_abstract("state", state, concrete)
    refuse_abstract("batch", batch, concrete)
    start = time.perf_counter()
    if isinstance(step, AutoStep):
        step = step.pick(state, batch)
    if isinstance(step, TrainStep):
        refuse_compile_only(step.mesh, "verifying the step")
    if isinstance(step, TrainStep):
        if reference is not None or mesh is not None:
            raise TypeError(
                "reference= and mesh= are for your own step function; a train "
                "step's reference is its own program on its mesh's first device"
            )
        if not isinstance(state, TrainState):
            raise TypeError(f"a train step takes a sx.TrainState, got {type(state).__name__}")
        rtol, atol = _given(tolerance(step.precision), rtol, atol)
        by_step, diagnose, device, judged = _verify_step(step, state, batch, steps, rtol, atol)
        what = repr(step)
    elif callable(step):
        rtol, atol = _given(_rtol_of(state if isinstance(state, tuple) else (state,)), rtol, atol)
        by_step, diagnose, device, judged = _verify_fn(
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
    if not ok and worst is not None and worst.shapes is not None:
        cause, hint = None, _shapes_differ([d for d in diffs if d.shapes is not None])
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
        judged=judged,
        reference=device,
        compared=len(by_step[0]) if by_step else 0,
        seconds=time.perf_counter() - start,
    )


def _shapes_differ(diffs: list[LeafDiff]) -> str:
    """The hint for leaves whose shapes differ between the run and its reference."""
    named = "; ".join(
        f"{d.path}: {d.shapes[0]} distributed, {d.shapes[1]} on one device"  # type: ignore[index]
        for d in diffs[:3]
    )
    more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
    return (
        f"the run and its reference give leaves of different shapes, so their values "
        f"cannot be compared: {named}{more}. A pmap step returns one copy per device "
        "(a leading axis of the device count, 1 on one device): compare one copy of each "
        "(wrap both steps to return jax.tree.map(lambda x: x[0], ...) of what is "
        "replicated), or run the reference on as many devices"
    )


def _given(default: tuple[float, float], rtol: Any, atol: Any) -> tuple[float, float]:
    """``(rtol, atol)``: the given ones, else the default; a given ``rtol`` alone scales the
    default ``atol`` with it. Each must be a finite number >= 0: a negative or NaN one
    would fail every leaf, an infinite one pass every leaf."""
    rule = " (a leaf differs above atol + rtol * max|reference leaf|)"
    try:
        rtol = None if rtol is None else as_float("rtol", rtol, minimum=0)
        atol = None if atol is None else as_float("atol", atol, minimum=0)
    except ValueError as e:
        raise ValueError(f"{e}{rule}") from None
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
