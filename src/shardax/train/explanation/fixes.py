"""Fixes proven by compiling them: the candidate steps ``sx.search_plans`` compiles for the
step's mesh (its plans × microbatch counts × the model variants given, e.g. remat
policies), kept where the compiled peak fits the budget with ``HEADROOM`` to spare, ranked
by the predicted step time (the per-op model's on a GPU), then by their peak."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardax.train.auto.choice import train_flags
from shardax.train.auto.search import search_plans
from shardax.train.auto.space import SearchSpace

ACCUMULATE = (1, 2, 4, 8)
"""The microbatch counts the fixes try (those that split the batch's rows)."""


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


_PLAN_CALLS = {"fsdp": "sx.fsdp(mesh)", "zero1": "sx.zero1(mesh)", "zero2": "sx.zero2(mesh)",
               "replicate": "sx.replicate(mesh)"}  # fmt: skip


def _code(plan: str, accumulate: int, variant: str | None) -> str:
    call = _PLAN_CALLS.get(plan, f"the {plan!r} plan (report.config.plan)")
    text = f"sx.make_train_step(loss_fn, mesh=mesh, plan={call}"
    text += f", accumulate={accumulate})" if accumulate > 1 else ")"
    return text + (f"  # with the model's {variant!r} variant" if variant else "")


def propose(
    step: Any, state: Any, batch: Any, budget: float | None, *,
    accumulate: tuple[int, ...] = ACCUMULATE, variants: dict[str, Any] | None = None,
    plans: tuple[str, ...] | None = None,
) -> tuple[Fix, ...]:  # fmt: skip
    """The compiled changes to ``step`` that fit ``budget`` bytes per device, best first
    (see the module); ``()`` for a step that is not a ``make_train_step`` step."""
    config = getattr(step, "config", None)
    loss_fn = getattr(step, "loss_fn", None)
    if config is None or loss_fn is None or config.mode != "jit":
        return ()
    base = dataclasses.replace(config, plan=None, accumulate=1)
    space = SearchSpace(meshes=[config.mesh], accumulate=accumulate, config=base,
                        device_memory=budget, plans=plans)  # fmt: skip
    report = search_plans(space, dict(variants) if variants else state, loss_fn=loss_fn,
                          batch=batch)  # fmt: skip
    mesh = {str(k): int(v) for k, v in config.mesh.shape.items()}
    fixes = []
    for c in report.candidates:
        if c.skipped or c.refused or c.fits is False:  # None: no budget to fit
            continue
        fixes.append(Fix(c.name, c.plan.name, c.accumulate, c.variant, c.total_bytes,
                         c.predicted_s, c.interval_s,
                         train_flags(c.plan.name, mesh, c.variant, c.accumulate, c.microbatches),
                         _code(c.plan.name, c.accumulate, c.variant)))  # fmt: skip
    inf = float("inf")
    fixes.sort(key=lambda f: (f.predicted_s if f.predicted_s is not None else inf, f.peak_bytes))
    return tuple(fixes)
