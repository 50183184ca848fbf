"""verify's one algorithm, for a train step and for your own step function alike.

Step by step, a ``Side`` (the path's adapter) runs the distributed step and its one-device
reference from the same state, and their leaves are compared. Where a leaf of the update
differs, it is judged a second way: against the optimizer applied, on one device, to the
distributed gradients (the closer of the two references wins), or, where the side cannot
see the optimizer, at its noise floor. The first step that differs goes through the cause
ladder (``LADDER``), and the report says what was found.

>>> report = verify(step, state, {"x": np.ones((16, 4)), "y": np.zeros((16, 2))})
>>> report.ok, report.cause
(True, None)
>>> print(report)  # a short table: the worst leaves, their differences  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.sharding import Mesh

from shardax.checks import as_count, as_float, as_function, check_mesh, public
from shardax.train.auto import AutoStep
from shardax.train.eval import EvalStep
from shardax.train.explanation.placement import step_placement
from shardax.train.program import refuse_abstract, refuse_compile_only
from shardax.train.state import TrainState
from shardax.train.step import TrainStep
from shardax.train.verification.causes import Evidence, diagnose, rounding_noise
from shardax.train.verification.comparison import LeafDiff, compare, either
from shardax.train.verification.function import FunctionSide
from shardax.train.verification.noise import floored
from shardax.train.verification.report import VerifyReport, verdict
from shardax.train.verification.side import Run, Side
from shardax.train.verification.train_step import TrainStepSide

Judged = tuple[Run, list[LeafDiff], bool]
"""One compared step: the run, its leaves' differences, and whether the update was judged
against the optimizer applied to the distributed gradients."""


def judged(side: Side, run: Run, k: int, rtol: float, atol: float) -> Judged:
    """Step ``k``'s leaves against one device's; where an update leaf differs, each update
    leaf against the closer of one device's and the optimizer applied on one device to
    the distributed gradients or, where the side cannot see the optimizer, at its noise
    floor."""
    diffs = compare(run.got, run.want, k, rtol, atol)
    if all(d.ok for d in diffs if side.updated(d.path)):
        return run, diffs, False
    second = side.second(run)
    if second is not None:
        return run, either(diffs, compare(run.got, second, k, rtol, atol), side.updated), True
    diffs = floored(diffs, side.floor(run, rtol, atol))
    bad = [d.path for d in diffs if not d.ok]
    if bad and all(side.updated(p) for p in bad):
        noise = side.unread(run, bad, rtol, atol)
        diffs = [dataclasses.replace(d, noise=True) if d.path in noise else d for d in diffs]
    return run, diffs, False


def compared(side: Side, steps: int, rtol: float, atol: float) -> list[Judged]:
    """``steps`` steps of ``side``, each judged (``judged``)."""
    return [judged(side, side.step(), k, rtol, atol) for k in range(1, steps + 1)]


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
    for ``steps`` steps and compares them leaf by leaf (see ``shardax.train.verification``).

    Args:
        step: a train step from [`shardax.make_train_step`][shardax.make_train_step] (any
            mode and plan, ``plan="auto"`` included: it picks its plan for ``state`` and
            ``batch``, as its first call would), or your own step function: ``fn(state, batch)``
            returning ``(new_state, metrics)``, or ``fn(*state, batch)`` when ``state``
            is a plain tuple, e.g. an ``@nnx.jit`` ``train_step(model, optimizer, batch)``
            that updates them in place and returns its metrics. The one spread rule: a
            plain tuple is spread over the arguments; anything else, a ``NamedTuple``
            state included (Haiku's ``TrainingState``), is one argument.
        state: the step's state: a [`TrainState`][shardax.TrainState] (placed or not) for a train
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
            (``shardax.train.verification.TOLERANCES``; for a function, from the state's dtypes).
        reference: for a function only: the one-device step to compare with (default:
            the same function, run on copies of the state on the first device, under a
            one-device mesh with the same axis names; a ``jax.jit`` whose shardings name
            the mesh's devices is jitted again without them). Give it when your step
            cannot run there: one written with ``shard_map`` or ``pmap``, or one whose
            body names the mesh (a constraint on ``NamedSharding(mesh, ...)``), which
            is refused naming this argument.
        mesh: for a function only: the mesh it runs on (default: the mesh of the
            state's or the batch's first sharded array).

    Returns:
        a [`VerifyReport`][shardax.train.VerifyReport]: ``ok``, the worst leaf, the first step that
        differed, the likely cause and how to fix it; ``print(report)`` is a table.

    Raises:
        ValueError: when the reference does not fit on one device (a smaller probe batch
            does), ``steps`` is not a positive integer, or the job has several processes.
    """
    steps = as_count("steps", steps)
    _refuse(state, batch)
    rtol, atol = _checked(rtol, atol)
    start = time.perf_counter()
    side = _side(step, state, batch, reference, mesh)
    rtol, atol = _defaulted(side.tolerance, rtol, atol)
    runs = compared(side, steps, rtol, atol)
    ok, first_step, diffs = verdict([d for _, d, _ in runs])
    worst = diffs[0] if diffs else None
    cause, hint = None, ""
    if not ok and worst is not None:
        run, _, second = runs[worst.step - 1]
        cause, hint = diagnose(Evidence(side, run, worst, diffs, second, rtol, atol))
    noise = sorted({d.path for _, ds, _ in runs for d in ds if d.noise})
    if ok and noise:
        cause, hint = rounding_noise(noise)
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
        what=side.what,
        judged=side.judged,
        reference=str(side.reference.device),
        compared=len(runs[0][1]) if runs else 0,
        seconds=time.perf_counter() - start,
        placement=step_placement(step, state),
    )


def _refuse(state: Any, batch: Any) -> None:
    """Refuses a job of several processes, and abstract values."""
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


def _side(
    step: Any, state: Any, batch: Any, reference: Callable[..., Any] | None, mesh: Mesh | None
) -> Side:
    """The side for ``step``: a train step's (an auto step's pick) or a function's."""
    if isinstance(step, EvalStep):
        raise TypeError(
            "step is an eval step (sx.make_eval_step), which updates nothing: sx.verify "
            "compares a train step (or your own step function) with its one-device "
            "reference; verify the train step made with the same mesh, plan and mode"
        )
    if mesh is not None:
        check_mesh("mesh", mesh)
    if reference is not None:
        as_function("reference", reference, "a function: the one-device step to compare with")
    if isinstance(step, AutoStep):
        step = step.pick(state, batch)
    if isinstance(step, TrainStep):
        refuse_compile_only(step.mesh, "verifying the step")
        if reference is not None or mesh is not None:
            raise TypeError(
                "reference= and mesh= are for your own step function; a train "
                "step's reference is its own program on its mesh's first device"
            )
        if not isinstance(state, TrainState):
            raise TypeError(f"a train step takes a sx.TrainState, got {type(state).__name__}")
        return TrainStepSide(step, state, batch)
    if callable(step):
        return FunctionSide(step, state, batch, reference, mesh)
    raise TypeError(
        f"step must be a train step (sx.make_train_step) or your own step "
        f"function, got {type(step).__name__}"
    )


def _checked(rtol: Any, atol: Any) -> tuple[float | None, float | None]:
    """The given ``rtol`` and ``atol``, each a finite number >= 0 (or None): a negative or
    NaN one would fail every leaf, an infinite one pass every leaf."""
    rule = " (a leaf differs above atol + rtol * max|reference leaf|)"
    try:
        rtol = None if rtol is None else as_float("rtol", rtol, minimum=0)
        atol = None if atol is None else as_float("atol", atol, minimum=0)
    except ValueError as e:
        raise ValueError(f"{e}{rule}") from None
    return rtol, atol


def _defaulted(
    default: tuple[float, float], rtol: float | None, atol: float | None
) -> tuple[float, float]:
    """``(rtol, atol)``: the given ones, else the default; a given ``rtol`` alone scales
    the default ``atol`` with it."""
    if atol is None:
        atol = default[1] if rtol is None else rtol * default[1] / default[0]
    return (default[0] if rtol is None else rtol), atol


def verify_first_batch(
    step: Any, state: Any, batches: Iterable[Any], **kwargs: Any
) -> VerifyReport:
    """[`verify`][shardax.verify] on the first batch of ``batches`` (for ``shardax train
    --verify``).

    A loader with ``get_state()``/``set_state()`` is put back where it was, so training
    then starts from the same first batch."""
    saved = batches.get_state() if hasattr(batches, "get_state") else None
    batch = next(iter(batches))
    if saved is not None:
        batches.set_state(saved)
    return verify(step, state, batch, **kwargs)
