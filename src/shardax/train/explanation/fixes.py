"""Fixes proven by compiling them: the candidate steps ``sx.search_plans`` compiles for the
step's mesh (its plans × microbatch counts × the model variants given, e.g. remat
policies), kept where the compiled peak fits the budget with ``HEADROOM`` to spare, ranked
by the predicted step time (the per-op model's on a GPU), then by their peak.

Where the budget is a GPU's ``memory_fraction`` of its memory (JAX's allocator's share, or
a ``sx.target``'s), a larger fraction is a fix too: the step's own compiled program, whose
peak fits the larger budget (XLA, given more room, rematerializes no more than it did).
Host offload of the optimizer state is never proposed as a fix: a shardax step keeps the
optimizer state in device memory (``offload_note`` says what it would free, and why not:
on XLA:CPU the device's memory is the host's, so nothing would be freed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardax._format import format_bytes
from shardax.train.auto.choice import train_flags
from shardax.train.auto.search import search_plans
from shardax.train.auto.space import SearchSpace
from shardax.train.explanation.memory import fits
from shardax.train.program import compile_only

ACCUMULATE = (1, 2, 4, 8)
"""The microbatch counts the fixes try (those that split the batch's rows)."""
FRACTIONS = (0.9, 0.95)
"""The larger ``memory_fraction`` shares the fixes try (those above the step's)."""


@dataclasses.dataclass(frozen=True)
class Fix:
    """One compiled change that fits: its name, plan, microbatches, model variant, peak
    bytes per device, predicted step time (seconds; None without a datasheet) with its
    interval, the ``shardax train`` flags and the ``make_train_step`` call to use."""

    name: str
    plan: str
    accumulate: int
    variant: str | None
    peak_bytes: int
    predicted_s: float | None
    interval_s: tuple[float, float] | None
    flags: str
    code: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return dataclasses.asdict(self)


_PLAN_CALLS = {
    "fsdp": "sx.fsdp(mesh)",
    "zero1": "sx.zero1(mesh)",
    "zero2": "sx.zero2(mesh)",
    "replicate": "sx.replicate(mesh)",
}


def _code(plan: str, accumulate: int, variant: str | None) -> str:
    call = _PLAN_CALLS.get(plan, f"the {plan!r} plan (report.config.plan)")
    text = f"sx.make_train_step(loss_fn, mesh=mesh, plan={call}"
    text += f", accumulate={accumulate})" if accumulate > 1 else ")"
    return text + (f"  # with the model's {variant!r} variant" if variant else "")


def propose(
    step: Any,
    state: Any,
    batch: Any,
    budget: float | None,
    *,
    accumulate: tuple[int, ...] = ACCUMULATE,
    variants: dict[str, Any] | None = None,
    plans: tuple[str, ...] | None = None,
) -> tuple[Fix, ...]:
    """The compiled changes to ``step`` that fit ``budget`` bytes per device, best first
    (see the module); ``()`` for a step that is not a ``make_train_step`` step."""
    config = getattr(step, "config", None)
    loss_fn = getattr(step, "loss_fn", None)
    if config is None or loss_fn is None or config.mode != "jit":
        return ()
    base = dataclasses.replace(config, plan=None, accumulate=1)
    space = SearchSpace(
        meshes=[config.mesh], accumulate=accumulate, config=base, device_memory=budget, plans=plans
    )
    report = search_plans(
        space, dict(variants) if variants else state, loss_fn=loss_fn, batch=batch
    )
    mesh = {str(k): int(v) for k, v in config.mesh.shape.items()}
    fixes = []
    for c in report.candidates:
        if c.skipped or c.refused or c.fits is False:  # None: no budget to fit
            continue
        fixes.append(
            Fix(
                c.name,
                c.plan.name,
                c.accumulate,
                c.variant,
                c.total_bytes,
                c.predicted_s,
                c.interval_s,
                train_flags(c.plan.name, mesh, c.variant, c.accumulate, c.microbatches),
                _code(c.plan.name, c.accumulate, c.variant),
            )
        )
    return rank(tuple(fixes))


def rank(fixes: tuple[Fix, ...]) -> tuple[Fix, ...]:
    """``fixes`` by predicted step time (those without one last), then by peak."""
    inf = float("inf")
    key = lambda f: (f.predicted_s if f.predicted_s is not None else inf, f.peak_bytes)  # noqa: E731
    return tuple(sorted(fixes, key=key))


def fraction_fixes(step: Any, estimate: Any, mesh: Any) -> tuple[Fix, ...]:
    """A larger ``memory_fraction`` where the step's budget is one (a GPU's): the step's
    own program and predicted time at the smallest larger share whose budget it fits;
    ``()`` where the budget is not a share of the GPU's memory."""
    hbm, budget = estimate.hbm_bytes, estimate.memory_budget
    device = mesh.devices.flat[0]
    if str(device.platform).lower() not in ("gpu", "cuda", "rocm"):
        return ()
    if not hbm or not budget or budget >= hbm:
        return ()
    peak, now = float(estimate.memory["peak"]), budget / hbm
    config = getattr(step, "config", None)
    plan = getattr(step, "plan_name", None) or "the step's"
    accumulate = getattr(config, "accumulate", 1) or 1
    out = []
    for f in FRACTIONS:
        if f <= now + 1e-9 or fits(peak, hbm * f) is not True:
            continue
        if compile_only(mesh) is not None:
            flags = f"--memory-fraction {f:g}"
            code = f"sx.target(..., memory_fraction={f:g})  # the same step, a larger budget"
        else:
            flags = f"XLA_CLIENT_MEM_FRACTION={f:g}"
            code = f"os.environ['XLA_CLIENT_MEM_FRACTION'] = '{f:g}'  # before JAX starts"
        name = f"memory_fraction {f:g} (was {now:.2g})"
        out.append(
            Fix(
                name,
                plan,
                accumulate,
                None,
                int(peak),
                estimate.predicted_s,
                estimate.interval_s,
                flags,
                code,
            )
        )
        break  # the smallest that fits
    return tuple(out)


def offload_note(memory: Any, peak: int, budget: float | None, device: Any) -> str | None:
    """What host offload of the optimizer state would free per device, and why it is not
    a fix here (None: no optimizer state at the peak): on XLA:CPU the device's memory is
    the host's, so moving it frees nothing; on a GPU or TPU (``pinned_host``, which a
    compile-only device does not list) a shardax step keeps it in device memory."""
    freed = 0 if memory is None else memory.by_kind().get("optimizer state", 0)
    if not freed:
        return None
    platform = str(getattr(device, "platform", "")).lower()
    head = f"host offload of the optimizer state would free {format_bytes(freed)} per device"
    if platform == "cpu":
        return (
            f"{head} of device memory, but on XLA:CPU that memory is the host's: "
            "moving it to pinned_host frees nothing, so it is not proposed"
        )
    try:
        kinds = sorted({m.kind for m in device.addressable_memories()})
    except Exception:  # a compile-only device lists none: XLA:GPU and TPU have pinned_host
        kinds = ["pinned_host"] if platform in ("gpu", "cuda", "rocm", "tpu") else []
    after = peak - freed
    verdict = "" if not budget else (" (fits)" if fits(after, budget) else " (still over)")
    named = ", ".join(kinds) or "none named"
    where = (
        "the backend has a pinned_host memory space for it, but"
        if "pinned_host" in kinds
        else f"the backend has no pinned_host memory space ({named}), and"
    )
    return (
        f"{head} at the peak, to about {format_bytes(after)}{verdict}: {where} a shardax "
        "step keeps the optimizer state in device memory, so it is not proposed"
    )
