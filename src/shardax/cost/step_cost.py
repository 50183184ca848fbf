"""The per-op model's result: a compiled step's kernels priced by class, its collectives, the
step with its interval, and the report's breakdown of it.

>>> classes = {k: ClassCost() for k in PRICED}
>>> classes["gemm"].add(10, 1e-3, 0.8e-3, 1.2e-3, flops=1e12)
>>> cost = StepCost("calibrated: H200", classes, 2e-4, 0.0, 0.0, {})
>>> round(cost.step_s * 1e3, 1), cost.kernels
(10.2, 10.0)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shardax.cost.kernel_prices import FP8_GEMM_FACTOR

MODEL_NAME = "per-op"
PRICED = ("gemm", "attention", "elementwise", "optimizer", "copies", "other")
"""The classes of kernels priced one by one (collectives are priced from the schedule)."""


@dataclasses.dataclass
class ClassCost:
    """One class of kernels: how many per step, their seconds (point, low, high), the
    FLOPs and bytes they were priced by."""

    kernels: float = 0.0
    seconds: float = 0.0
    low: float = 0.0
    high: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0

    def add(
        self,
        runs: float,
        point: float,
        low: float,
        high: float,
        flops: float = 0.0,
        nbytes: float = 0.0,
    ) -> None:
        self.kernels += runs
        self.seconds += runs * point
        self.low += runs * low
        self.high += runs * high
        self.flops += runs * flops
        self.bytes += runs * nbytes


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A compiled step priced op by op (see the module): seconds per class, launches,
    collectives (their wire time and the part the schedule leaves exposed), the interval.

    Attributes:
        calibration: the name of the tables (``"calibrated: H200, JAX 0.11.2, ..."``),
            or ``"uncalibrated: ..."`` with how far the nearest calibrated kind is.
        classes: ``ClassCost`` per class of ``PRICED``.
        launch_s: kernels × the calibrated launch cost (point; high at twice).
        collective_s: the collectives' time on the wire (latency + bytes / bandwidth).
        exposed_s: the part of it the compiled schedule leaves exposed.
        unpriced: custom calls the model has no table for, by target, with their count
            per step (priced by their bytes, as memory-bound work).
        widen: the share the interval is widened by on each side (tables not measured
            on this kind).
        inter_host_s: the part of ``collective_s`` of collectives whose groups span
            hosts (priced level by level, ``shardax.cost.nccl``).
        exposed_inter_host_s: the part of ``exposed_s`` those leave exposed.
        fp8_datasheet_flops: FLOPs of fp8 GEMMs priced at ``FP8_GEMM_FACTOR`` times the
            bf16 rates (the tables have no fp8 rows: the datasheet's peak ratio).
        fp8_measured_flops: FLOPs of fp8 GEMMs priced by the tables' measured fp8 rows.
    """

    calibration: str
    classes: dict[str, ClassCost]
    launch_s: float
    collective_s: float
    exposed_s: float
    unpriced: dict[str, float]
    widen: float = 0.0
    inter_host_s: float = 0.0
    exposed_inter_host_s: float = 0.0
    fp8_datasheet_flops: float = 0.0
    fp8_measured_flops: float = 0.0

    @property
    def kernels(self) -> float:
        return sum(c.kernels for c in self.classes.values())

    @property
    def compute_s(self) -> float:
        """The kernels' time in sequence, launches included."""
        return sum(c.seconds for c in self.classes.values()) + self.launch_s

    @property
    def step_s(self) -> float:
        """The point prediction: kernels in sequence + exposed collectives."""
        return self.compute_s + self.exposed_s

    @property
    def low_s(self) -> float:
        low = max(sum(c.low for c in self.classes.values()) + self.launch_s, self.collective_s)
        low = min(low, self.step_s)  # collectives in flight together overlap each other too
        return low * (1 - self.widen)

    @property
    def high_s(self) -> float:
        high = sum(c.high for c in self.classes.values()) + 2 * self.launch_s + self.collective_s
        return high * (1 + self.widen)

    @property
    def executed_flops(self) -> float:
        """Matmul FLOPs priced (GEMMs and attention) per step."""
        return self.classes["gemm"].flops + self.classes["attention"].flops

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able)."""
        return {
            "model": MODEL_NAME,
            "calibration": self.calibration,
            "step_s": self.step_s,
            "low_s": self.low_s,
            "high_s": self.high_s,
            "classes": {k: dataclasses.asdict(v) for k, v in self.classes.items()},
            "launch_s": self.launch_s,
            "collective_s": self.collective_s,
            "exposed_s": self.exposed_s,
            "unpriced": dict(self.unpriced),
            "widen": self.widen,
            "inter_host_s": self.inter_host_s,
            "exposed_inter_host_s": self.exposed_inter_host_s,
            "fp8_datasheet_flops": self.fp8_datasheet_flops,
            "fp8_measured_flops": self.fp8_measured_flops,
            "kernels": self.kernels,
            "executed_flops": self.executed_flops,
        }


LABELS = {
    "gemm": "GEMMs",
    "attention": "attention (fused)",
    "elementwise": "elementwise fusions",
    "optimizer": "optimizer update",
    "copies": "copies and converts",
    "other": "other kernels",
}


def breakdown(cost: StepCost, model_flops: float | None = None) -> list[tuple[str, float, str]]:
    """The report's rows ``(label, seconds, what it was priced by)``: one per class,
    the GEMMs split into model work and the executed FLOPs beyond ``model_flops`` (per
    device: remat's recomputation and other work beyond the model's), launches,
    collectives (on the wire, and exposed).

    >>> from shardax.cost.calibration import H200
    >>> from shardax.cost.opcost import price_hlo
    >>> rows = breakdown(price_hlo("%d = bf16[64,64]{1,0} dot(%a, %b)", H200))
    >>> [r[0] for r in rows][-3:]
    ['kernel launches', 'collectives on the wire', 'collectives exposed (in the step)']
    """
    out = []
    for name in PRICED:
        k = cost.classes[name]
        if name == "gemm" and model_flops and cost.executed_flops > model_flops and k.flops:
            extra = min(cost.executed_flops - model_flops, k.flops) / k.flops
            out.append(
                (
                    "GEMMs: model work",
                    k.seconds * (1 - extra),
                    f"{k.flops * (1 - extra):.3g} FLOPs, {k.kernels:.0f} kernels",
                )
            )
            out.append(
                (
                    "GEMMs: beyond model FLOPs (remat, recompute)",
                    k.seconds * extra,
                    f"{k.flops * extra:.3g} executed FLOPs",
                )
            )
            continue
        basis = f"{k.flops:.3g} FLOPs" if k.flops else f"{k.bytes:.3g} B"
        out.append((LABELS[name], k.seconds, f"{basis}, {k.kernels:.0f} kernels"))
    out.append(("kernel launches", cost.launch_s, f"{cost.kernels:.0f} kernels"))
    out.append(("collectives on the wire", cost.collective_s, "latency + bytes / link"))
    out.append(("collectives exposed (in the step)", cost.exposed_s, "from the schedule"))
    if cost.inter_host_s:
        out.append(
            (
                "of which across hosts, exposed",
                cost.exposed_inter_host_s,
                f"from the schedule; {cost.inter_host_s * 1e3:.2f} ms on the wire, "
                "priced level by level",
            )
        )
    return out


def format_cost(
    cost: StepCost, model_flops: float | None = None, tokens: float | None = None
) -> str:
    """The breakdown as text: one line per row, then the step with its interval."""
    lines = [
        f"{label}: {s * 1e3:.2f} ms ({basis})" for label, s, basis in breakdown(cost, model_flops)
    ]
    step = (
        f"step {cost.step_s * 1e3:.1f} ms, interval {cost.low_s * 1e3:.1f}–"
        f"{cost.high_s * 1e3:.1f} ms ({cost.calibration})"
    )
    if tokens:
        step += f"; {tokens / cost.step_s:,.0f} tokens/s"
    if cost.unpriced:
        names = ", ".join(f"{k} × {v:.0f}" for k, v in cost.unpriced.items())
        lines.append(f"not in the tables (priced by their bytes): {names}")
    if cost.fp8_datasheet_flops:
        lines.append(
            f"fp8 GEMMs ({cost.fp8_datasheet_flops:.3g} FLOPs) priced at the "
            f"datasheet's fp8 peak, {FP8_GEMM_FACTOR:g}x the measured bf16 rates: the "
            "tables have no fp8 rows"
        )
    if cost.fp8_measured_flops:
        lines.append(
            f"fp8 GEMMs ({cost.fp8_measured_flops:.3g} FLOPs) priced by the tables' "
            "measured fp8 rows"
        )
    return "\n".join([*lines, step])
