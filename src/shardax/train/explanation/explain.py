"""``sx.explain``: the compiled step explained in the user's words: what fills the memory at
its peak, the collectives its plan did not ask for (and the partitioner's involuntary full
rematerializations, read from its log during the compile), how its state is split against
the plan's intent, and the changes that make it fit, each compiled.

One home, beside ``sx.estimate`` rather than a mode of it: ``sx.estimate`` sits in ``cost``
(it compiles any step for any target and prices it), while an explanation reads the plan's
intent and compiles alternatives with ``sx.search_plans``, which live in ``train``. It
compiles the step once, with XLA's dump of the optimized module, and analyses that one
program as ``sx.estimate`` does (``report.estimate``).

>>> mesh = sx.make_mesh({"data": 8})
>>> state = sx.TrainState.from_params({"w": jnp.zeros((256, 64))},
...                                   lambda p, x: x @ p["w"], optax.adam(1e-3))
>>> step = sx.make_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), mesh=mesh,
...                           plan=sx.fsdp(mesh))
>>> report = sx.explain(step, state, {"x": jnp.zeros((64, 256))})
>>> report.memory.buffers[0].kind in ("parameter", "optimizer state", "gradient", "temporary")
True
>>> report.unasked  # every collective is one FSDP implies
()
>>> print(report)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from rich.console import Group

from shardax._format import format_bytes, rich_text, titled_table
from shardax.checks import public
from shardax.cost.buffers import COVERAGE, PeakBuffers
from shardax.cost.remats import absorb, rematerializations
from shardax.cost.report import Estimate
from shardax.cost.reshards import Reshard, collectives_explained
from shardax.train.explanation.fixes import (
    ACCUMULATE,
    Fix,
    fraction_fixes,
    offload_note,
    propose,
    rank,
)
from shardax.train.explanation.intent_fixes import placement_fixes
from shardax.train.explanation.memory import compile_step, fits, memory_table
from shardax.train.explanation.placement import Placement, placement


@public("sx.train.Explanation")
@dataclasses.dataclass(frozen=True)
class Explanation:
    """What [`explain`][shardax.explain] found. Print it for the tables; ``to_dict()`` for JSON.

    Attributes:
        memory: the buffers live at the compiled peak, named (``PeakBuffers``).
        collectives: every collective of the step and every full rematerialization
            (``Reshard``: op, axes, bytes, the user's line, the layouts, why the plan
            implies it or ``""``).
        placement: the state's split against the plan's intent (None without a plan).
        fixes: the compiled changes that fit the budget, best first (``Fix``).
        budget: the bytes per device the step must fit (None: unknown).
        peak_bytes: the compiler's peak per device (``memory_analysis()``).
        estimate: the step's analysis, as ``sx.estimate`` reports it.
        notes: what the report could not know.
        placement_fixes: the compiled changes that split the state as the plan meant
            (an idle axis used, a misspelt rule's path, a leaf padded), each kept only
            where its placement shows the problem gone (``Fix``; ``flags`` empty).
    """

    memory: PeakBuffers | None
    collectives: tuple[Reshard, ...]
    placement: Placement | None
    fixes: tuple[Fix, ...]
    budget: float | None
    peak_bytes: int
    estimate: Estimate | None = None
    notes: tuple[str, ...] = ()
    placement_fixes: tuple[Fix, ...] = ()

    @property
    def fits(self) -> bool | None:
        """The compiled peak fits ``budget`` with ``HEADROOM`` to spare (None: no budget)."""
        return fits(self.peak_bytes, self.budget)

    @property
    def unasked(self) -> tuple[Reshard, ...]:
        """The collectives neither the plan nor the model asks for."""
        return tuple(c for c in self.collectives if not c.implied)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {
            "fits": self.fits,
            "budget": self.budget,
            "peak_bytes": self.peak_bytes,
            "memory": None if self.memory is None else self.memory.to_dict(),
            "unasked": [c.to_dict() for c in self.unasked],
            "implied": [c.to_dict() for c in self.collectives if c.implied],
            "placement": None if self.placement is None else self.placement.to_dict(),
            "fixes": [f.to_dict() for f in self.fixes],
            "placement_fixes": [f.to_dict() for f in self.placement_fixes],
            "notes": list(self.notes),
        }

    def __rich__(self) -> Any:
        parts: list[Any] = []
        if self.memory is not None:
            parts.append(memory_table(self.memory, self.peak_bytes, self.budget, self.fits))
        parts.append(collectives_table(self.collectives))
        if self.placement is not None:
            parts.append(self.placement)
        if self.fixes:
            parts.append(fixes_table(self.fixes))
        if self.placement_fixes:
            parts.append(fixes_table(self.placement_fixes, "placement fixes, each compiled"))
        parts += [f"note: {n}" for n in self.notes]
        return Group(*parts)

    def __str__(self) -> str:
        return rich_text(self, width=140)


def collectives_table(collectives: tuple[Reshard, ...]) -> Any:
    """The unasked collectives, then a line per reason of the implied ones."""
    unasked = [c for c in collectives if not c.implied]
    table = titled_table(f"collectives the plan did not ask for: {len(unasked)}")
    for col in ("op", "axes", "per step", "your line", "before -> after", "suggestion"):
        # the line is kept whole (a path to find, not prose): the suggestion wraps instead
        table.add_column(
            col, justify="right" if col == "per step" else "left", no_wrap=col == "your line"
        )
    for c in sorted(unasked, key=lambda c: -c.sent_bytes):
        table.add_row(
            c.op,
            "/".join(c.axes),
            format_bytes(c.sent_bytes),
            c.source or c.what,
            f"{c.before} -> {c.after}",
            c.suggestion,
        )
    implied: dict[str, list[Reshard]] = {}
    for c in collectives:
        if c.implied:
            implied.setdefault(c.implied, []).append(c)
    table.caption = (
        "; ".join(
            f"{len(v)} × {reason}: {format_bytes(sum(c.sent_bytes for c in v))}"
            for reason, v in implied.items()
        )
        or "no collective the plan implies"
    )
    if implied:
        table.caption = "implied (apart): " + table.caption
    return table


def fixes_table(
    fixes: tuple[Fix, ...], title: str = "fixes, each compiled, that fit (best first)"
) -> Any:
    """The compiled fixes (that fit, best first), under ``title``."""
    table = titled_table(title)
    for col in ("change", "peak", "predicted step", "flags", "code"):
        table.add_column(col, justify="right" if col in ("peak", "predicted step") else "left")
    for f in fixes:
        pred = "-" if f.predicted_s is None else f"{f.predicted_s * 1e3:.1f} ms"
        if f.interval_s is not None:
            pred += f" ({f.interval_s[0] * 1e3:.1f}-{f.interval_s[1] * 1e3:.1f})"
        table.add_row(f.name, format_bytes(f.peak_bytes), pred, f.flags, f.code)
    return table


def _param_axes(shardings: Any) -> set[str]:
    out: set[str] = set()
    for s in jax.tree.leaves(shardings):
        for entry in getattr(s, "spec", ()):
            out |= {entry} if isinstance(entry, str) else set(entry or ())
    return out


@public("sx.explain")
def explain(
    step: Any,
    state: Any,
    batch: Any,
    *,
    budget: float | None = None,
    fixes: bool | str = "auto",
    accumulate: tuple[int, ...] = ACCUMULATE,
    variants: dict[str, Any] | None = None,
    plans: tuple[str, ...] | None = None,
    coverage: float = COVERAGE,
) -> Explanation:
    """Compiles ``step(state, batch)`` (abstract values suffice, on live devices or a
    ``sx.target``) and explains it: see the module.

    Args:
        step: a ``make_train_step`` step, or a ``jax.jit`` function of ``(state, batch)``.
        state, batch: as ``sx.estimate`` takes them.
        budget: bytes per device the step must fit (default: the device's memory budget,
            ``Estimate.memory_budget``, else its HBM; unknown on a CPU).
        fixes: ``"auto"`` proposes fixes when the step does not fit its budget, ``True``
            always, ``False`` never (a ``make_train_step`` step in mode ``"jit"`` only).
        accumulate: the microbatch counts the fixes try.
        variants: ``{name: state or init}`` model variants the fixes try (remat policies,
            least to most memory-saving), as ``sx.search_plans`` takes them.
        plans: the plans the fixes try, by name (None: every default plan of the mesh).
        coverage: the share of the peak's bytes the memory table covers, in (0, 1].
    """
    if fixes not in (True, False, "auto"):
        raise ValueError(f"fixes must be True, False or 'auto', got {fixes!r}")
    if not (isinstance(coverage, int | float) and 0 < coverage <= 1):
        raise ValueError(f"coverage must be a share of the peak in (0, 1], got {coverage!r}")
    if budget is not None and not (isinstance(budget, int | float) and budget > 0):
        raise ValueError(f"budget must be bytes per device > 0, got {budget!r}")
    given = budget is not None
    program = compile_step(step, state, batch)
    state, batch, mesh, shardings = program.state, program.batch, program.mesh, program.shardings
    report = program.estimate
    budget = budget or program.budget
    sources = program.sources
    notes = []
    memory = program.memory(coverage, sources)
    if memory is None:
        notes.append("the backend wrote no live-range dump: no buffer table")
    hlo = program.compiled.as_text()
    shapes = program.param_shapes()
    plan = getattr(step, "state_plan", None)
    axes = _param_axes(shardings)
    lowered = program.lowered
    asked = lowered.constraints() if lowered is not None else []
    rows = absorb(
        tuple(rematerializations(program.log, mesh, sources, lowered)),
        tuple(
            collectives_explained(hlo, mesh, sources, shapes, axes, asked, program.split_shapes())
        ),
    )
    where = placement(state, plan, shardings) if plan is not None else None
    peak = program.peak_bytes
    proposed: tuple[Fix, ...] = ()
    if fixes is True or (fixes == "auto" and fits(peak, budget) is False):
        proposed = propose(
            step, state, batch, budget, accumulate=accumulate, variants=variants, plans=plans
        )
        if not given:  # the budget is the device's: a GPU's larger memory_fraction
            proposed = rank(proposed + fraction_fixes(step, report, mesh))
        note = offload_note(memory, peak, budget, mesh.devices.flat[0])
        if note is not None:
            notes.append(note)
        if not proposed:
            notes.append(
                "no plan × microbatch count of the search fits the budget: pass "
                "variants= (remat policies) or more devices"
            )
    intent: tuple[Fix, ...] = ()
    if fixes is not False and where is not None:
        intent, tried = placement_fixes(step, state, batch, where)
        notes += tried
    return Explanation(memory, rows, where, proposed, budget, peak, report, tuple(notes), intent)
