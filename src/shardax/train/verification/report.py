"""The verdict of [`verify`][shardax.verify]: a report of the leaves compared.

``verdict`` finds the first step at which a leaf differed and its leaves, worst first (or,
when every leaf agreed, the closest ones); [`VerifyReport`][shardax.train.VerifyReport] holds
them with the cause and prints as a short table.

>>> from shardax.train.verification.comparison import compare
>>> diffs = compare({"w": np.ones(2)}, {"w": np.zeros(2)}, 1, 1e-4, 1e-6)
>>> ok, first_step, worst_first = verdict([diffs])
>>> ok, first_step, worst_first[0].path
(False, 1, 'w')
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardax._format import rich_text, titled_table
from shardax.checks import public
from shardax.train.verification.comparison import LeafDiff

SHOWN = 6
"""Leaves shown in the report's table."""


@public("sx.train.VerifyReport")
@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What [`verify`][shardax.verify] compared, and its verdict. ``print(report)`` is a short
    table.

    Attributes:
        ok: every compared leaf is within tolerance at every step.
        worst: the leaf furthest from its tolerance (at the first step that diverged,
            if one did).
        first_step: the first step (1-based) at which a leaf differed, else None.
        cause: the likely cause, one of ``shardax.train.verification.CAUSES``, or None
            (``hint`` says what to do). When ``ok``, None, or ``"update of rounding
            noise"``: leaves whose update is rounding noise (their exact gradient is zero),
            named in ``hint`` and not counted as differences.
        hint: what the cause means and how to fix it (or how to look further).
        diffs: the leaves that differed at ``first_step`` (or, when ok, the closest
            ones), worst first.
        steps, rtol, atol: what was compared, and the tolerance.
        what: the distributed side (the step's repr, or the function's name).
        judged: what was compared, in words (which leaves against what).
        reference: the device the reference ran on.
        compared: the number of leaves compared per step.
        seconds: wall time of the verification, compilations included.
        placement: the step's state split against its plan's intent (``Placement``; None
            for your own step function).
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
    placement: Any = None

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data."""
        out = dataclasses.asdict(self)
        out["worst"] = None if self.worst is None else dataclasses.asdict(self.worst)
        out["diffs"] = [dataclasses.asdict(d) for d in self.diffs]
        out["placement"] = None if self.placement is None else self.placement.to_dict()
        return out

    def __rich__(self) -> Any:
        verdict = "[green]ok[/]" if self.ok else f"[red]differs from step {self.first_step}[/]"
        table = titled_table(f"sx.verify: {verdict}")
        for col in ("leaf", "step", "max abs diff", "max rel diff", "tolerance", ""):
            table.add_column(col, justify="left" if col in ("leaf", "") else "right")
        for d in self.diffs[:SHOWN]:
            table.add_row(
                d.path,
                str(d.step),
                f"{d.max_abs:.3g}",
                f"{d.max_rel:.3g}",
                f"{d.limit:.3g}",
                ("noise" if d.noise else "ok") if d.ok else "[red]differs[/]",
            )
        more = len(self.diffs) - SHOWN
        caption = [
            f"{self.what} against {self.reference}: {self.judged}",
            f"{self.compared} leaves × {self.steps} step(s), rtol={self.rtol:g}, "
            f"atol={self.atol:g}, {self.seconds:.1f} s",
        ]
        if more > 0:
            caption.append(f"{more} more leaves differ")
        if not self.ok and self.worst is not None:
            caption.append(f"first difference: {self.worst.where()}")
        if not self.ok:
            caption.append(f"likely cause: {self.cause or 'not named'}: {self.hint}")
        elif self.cause is not None:  # leaves forgiven as no difference of the step
            caption.append(f"not a difference: {self.cause}: {self.hint}")
        if self.placement is not None:
            caption.append(self.placement.summary())
        table.caption = "\n".join(caption)
        return table

    def __str__(self) -> str:
        return rich_text(self, width=120)


def verdict(diffs_by_step: list[list[LeafDiff]]) -> tuple[bool, int | None, tuple[LeafDiff, ...]]:
    """``(ok, first_step, diffs)``: the leaves that differed at the first step at which one
    did, worst first, or, when none did, the ``SHOWN`` closest to their tolerance."""
    for diffs in diffs_by_step:
        bad = sorted((d for d in diffs if not d.ok), key=lambda d: -d.ratio)
        if bad:
            return False, bad[0].step, tuple(bad)
    closest = sorted((d for diffs in diffs_by_step for d in diffs), key=lambda d: -d.ratio)
    return True, None, tuple(closest[:SHOWN])
