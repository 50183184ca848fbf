"""The likely cause of a difference: a ladder of tests, each run on the evidence of a step.

``LADDER`` lists the cause functions, most specific evidence first. Each takes the
``Evidence`` of the first step that differed and returns ``(cause, hint)`` when its
evidence holds, else None; the first to answer names the cause. A new cause is one
function here, added to ``LADDER`` (and its name and hint to ``CAUSES``); one that needs
evidence a path cannot give yet asks the ``Side`` for it, and a path that cannot give it
answers None.

>>> from shardax.train.verification.comparison import LeafDiff
>>> worst = LeafDiff("params/w", 1, max_abs=1e-3, max_rel=1e-3, limit=1e-4, scale=1.0)
>>> def mine(evidence):  # a cause of one's own: its test on the evidence
...     return "a cause of mine", f"{evidence.worst.path} differs"
>>> diagnose(Evidence(None, None, worst, (worst,), False, 1e-4, 1e-6), ladder=(mine,))
('a cause of mine', 'params/w differs')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from shardax.cost.hardware import is_gpu
from shardax.train.verification.comparison import TOLERANCES, LeafDiff, close
from shardax.train.verification.per_device import per_device
from shardax.train.verification.side import Run, Side

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
    "update of rounding noise": (
        "the step reads these leaves, yet shifted they change neither what it returns nor "
        "any other leaf: their exact gradient is zero (an attention "
        "key's bias, which softmax ignores; a bias before a normalisation), and an adaptive "
        "optimizer (Adam, Lion) turns the rounding noise of their gradient into steps of "
        "±lr whose signs follow the order of the sums, different on every mesh. Not a "
        "difference of the distributed step: the step is judged without them. Drop the "
        "leaves (use_bias=False on the key projection) to keep them from drifting"
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


@dataclasses.dataclass(frozen=True)
class Evidence:
    """The first step that differed: the ``side`` that ran it, its ``run``, the ``worst``
    leaf and all ``bad`` ones (worst first), whether ``second``: the update was judged
    against the optimizer applied on one device to the distributed gradients (so those
    agree with one device's), and the tolerance."""

    side: Side
    run: Run
    worst: LeafDiff
    bad: tuple[LeafDiff, ...]
    second: bool
    rtol: float
    atol: float

    def agrees(self, part: dict[str, Any], full: dict[str, Any]) -> bool:
        """Whether ``part`` is within the tolerance of ``full``'s leaves of its keys."""
        return close(part, {k: full[k] for k in part}, self.rtol, self.atol)


Finding = tuple[str | None, str]
"""``(cause, hint)``: the cause's name (a key of ``CAUSES``, or None: not a cause
verify can name) and what it means and how to fix it."""


def _named(name: str) -> Finding:
    return name, CAUSES[name]


def shapes_differ(evidence: Evidence) -> Finding | None:
    """Leaves of different shapes: their values cannot be compared (a pmap step's copies)."""
    if evidence.worst.shapes is None:
        return None
    shaped = [d for d in evidence.bad if d.shapes is not None]
    named = "; ".join(
        f"{d.path}: {d.shapes[0]} distributed, {d.shapes[1]} on one device"  # type: ignore[index]
        for d in shaped[:3]
    )
    more = f" (and {len(shaped) - 3} more)" if len(shaped) > 3 else ""
    return None, (
        f"the run and its reference give leaves of different shapes, so their values "
        f"cannot be compared: {named}{more}. A pmap step returns one copy per device "
        "(a leading axis of the device count, 1 on one device): compare one copy of each "
        "(wrap both steps to return jax.tree.map(lambda x: x[0], ...) of what is "
        "replicated), or run the reference on as many devices"
    )


def reduced_precision(evidence: Evidence) -> Finding | None:
    """The worst leaf is within the reduced-precision compute dtype's own tolerance."""
    default = evidence.side.tolerance
    if default == TOLERANCES["fp32"] or not evidence.worst.within(*default):
        return None
    dtype = "the reduced-precision compute dtype"
    return "reduced precision", CAUSES["reduced precision"].replace(dtype, evidence.side.precision)


def rerun_differs(evidence: Evidence) -> Finding | None:
    """The same step on the same input gives another result: XLA's own non-determinism on
    GPU, else a step that reads state outside its arguments."""
    side, run = evidence.side, evidence.run
    if evidence.agrees(side.rerun(run), run.got):
        return None
    if is_gpu(side.reference.device):
        return _named("non-determinism")
    return _named("impure step")


def update_only(evidence: Evidence) -> Finding | None:
    """The gradients agree with one device's, the update is neither one device's nor the
    optimizer's applied to them."""
    if evidence.second and all(evidence.side.updated(d.path) for d in evidence.bad):
        return _named("update not the optimizer's")
    return None


def accumulation(evidence: Evidence) -> Finding | None:
    """One device running the step's own accumulation gives the distributed result."""
    accumulated = evidence.side.accumulated(evidence.run)
    if accumulated is None or not evidence.agrees(accumulated, evidence.run.got):
        return None
    return _named("accumulation changes the update")


def device_folded_rng(evidence: Evidence) -> Finding | None:
    """One device's loss changes with the seed of the framework's RNG."""
    reseeded = evidence.side.reseeded(evidence.run)
    if reseeded is None or evidence.agrees(reseeded, evidence.run.want):
        return None
    return _named("device-folded RNG")


def per_device_slices(evidence: Evidence) -> Finding | None:
    """The distributed result is each device's slice run alone (``per_device``)."""
    slices = evidence.side.slices(evidence.run)
    if slices is None:
        return None
    try:
        name = per_device(slices, evidence.side.batch, evidence.rtol, evidence.atol)
    except Exception:  # the step may not run on a slice (a fixed batch size)
        if not evidence.side.slices_may_fail:
            raise
        return None
    return None if name is None else _named(name)


LADDER: tuple[Callable[[Evidence], Finding | None], ...] = (
    shapes_differ,
    reduced_precision,
    rerun_differs,
    update_only,
    accumulation,
    device_folded_rng,
    per_device_slices,
)
"""The cause functions, in the order they are tried."""


def rounding_noise(paths: Sequence[str]) -> Finding:
    """The finding for update leaves of rounding noise (``noise.unread``), named; the
    step is not failed for them."""
    named = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    return "update of rounding noise", f"{named}: {CAUSES['update of rounding noise']}"


def unnamed(judged: str, worst: LeafDiff) -> str:
    """The hint when no known cause fits: what was compared, and where it differs."""
    return (
        f"no known cause fits. Compared {judged}; the first difference is "
        f"{worst.where()}. Look at that leaf (a layer that communicates, a custom "
        "collective, a sharding annotation) and see the guide 'Is my sharded run right?'"
    )


def diagnose(
    evidence: Evidence, ladder: Sequence[Callable[[Evidence], Finding | None]] | None = None
) -> Finding:
    """The first finding of ``ladder`` (default: ``LADDER``, read when called), else
    no cause, with a hint that says what was compared and where it first differs."""
    for cause in LADDER if ladder is None else ladder:
        found = cause(evidence)
        if found is not None:
            return found
    return None, unnamed(evidence.side.judged, evidence.worst)
