"""A side: what verify's one algorithm asks of a path (a train step, or your own function).

The algorithm (``algorithm``) runs a ``Side`` step by step and compares each ``Run``'s
``got`` (the distributed step's leaves) with its ``want`` (one device's); the causes
(``causes``) ask it for more evidence. A path that cannot give some evidence answers None,
and the causes that need it are not named for it.

>>> run = Run(start=None, got={"loss": np.ones(())}, want={"loss": np.ones(())})
>>> sorted(run.got) == sorted(run.want)
True
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from shardax.train.verification.per_device import Slices
from shardax.train.verification.reference import Reference


@dataclasses.dataclass(frozen=True)
class Run:
    """One compared step: ``start`` (where both sides started, kept as the side needs it
    for more evidence), ``got`` (the distributed step's leaves, a dict of trees) and
    ``want`` (one device's, of the same structure)."""

    start: Any
    got: dict[str, Any]
    want: dict[str, Any]


class Side(Protocol):
    """A path through [`verify`][shardax.verify].

    Attributes:
        what: the distributed side, in words (the step's repr, the function's name).
        judged: what is compared against what, in words.
        batch: the probe batch, as given.
        reference: where the one-device reference runs.
        tolerance: the default ``(rtol, atol)``, by the compute precision.
        precision: the precision in words, for the reduced-precision hint.
    """

    what: str
    judged: str
    batch: Any
    reference: Reference
    tolerance: tuple[float, float]
    precision: str

    def step(self) -> Run:
        """The next step on both sides, from the same state (the distributed one)."""
        ...

    def updated(self, path: str) -> bool:
        """Whether the leaf at ``path`` is of the update (judged a second way)."""
        ...

    def second(self, run: Run) -> dict[str, Any] | None:
        """``run.want`` with the update of the optimizer applied, on one device, to the
        distributed gradients; None when the side cannot see its optimizer."""
        ...

    def floor(self, run: Run, rtol: float, atol: float) -> dict[str, float] | None:
        """The update leaves' noise floor (``noise``), by path; None when there is
        none."""
        ...

    def unread(self, run: Run, paths: list[str], rtol: float, atol: float) -> set[str]:
        """The update leaves of ``paths`` that nothing the step computes reads: their
        update is rounding noise (``noise.unread``); empty when the side judges the
        update from the gradients or cannot tell."""
        ...

    def rerun(self, run: Run) -> dict[str, Any]:
        """The distributed step again from ``run``'s start: leaves like ``run.got``."""
        ...

    def accumulated(self, run: Run) -> dict[str, Any] | None:
        """One device running the step's own accumulation over the whole batch: some of
        ``run.got``'s keys; None when the step does not accumulate."""
        ...

    def reseeded(self, run: Run) -> dict[str, Any] | None:
        """One device's loss with another seed of the framework's RNG: some of
        ``run.want``'s keys; None when the devices fold no RNG."""
        ...

    def slices(self, run: Run) -> Slices | None:
        """The per-device evidence (each device's slice run alone); None when the side
        does not split the batch's rows by hand."""
        ...

    slices_may_fail: bool
    """Whether a slice may not run (a user's function of a fixed batch size): its error
    then rules the per-device cause out; else the error is raised."""
