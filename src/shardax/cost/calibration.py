"""Calibration tables: what one device kind's kernels measured, with where the figures came from.

A ``Calibration`` holds, for one device kind and JAX version, the microbenchmark
tables the per-op cost model (``shardax.cost.opcost``) prices a compiled step with:

- ``gemm``: ``(m, k) @ (k, n)`` rates by shape and operand dtype (TFLOP/s: bf16, and
  fp32 at JAX's default precision where measured; ``"f32-cublas"``: fp32 with Triton
  GEMMs off, what a cuBLAS call runs), as ``benchmarks/gpu/calibrate.py`` measures them;
- ``stream``: GB/s of elementwise passes (bytes read + written), slowest to fastest;
- ``attention``: cuDNN fused attention, ms per call by (batch, seq, heads, head_dim,
  causal, pass);
- ``launch_us``: the device's cost per kernel inside one program;
- ``dispatch_us``: one program's dispatch, back to back (a table row no longer than about
  this measured the host, not the kernel: ``gemm_rows`` drops it).

No step time is an input: the tables are microbenchmarks only, so a step predicted with
them is predicted "leave-one-out" by construction. ``CALIBRATIONS`` ships one per
kind; ``calibration_for`` finds one for a device kind (or says none fits).

>>> c = calibration_for("NVIDIA H200")
>>> c.name
'calibrated: H200, JAX 0.11.2, 2026-11-27'
>>> calibration_for("NVIDIA H100 80GB HBM3").name
'calibrated: H100, JAX 0.11.2, 2026-11-27'
>>> calibration_for("TPU v5p") is None
True
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One device kind's measured kernel tables (see the module).

    Attributes:
        kind: the device kind it was measured on (``"H200"``); jax: the JAX version;
        date: when; source: the file or page the figures are from.
        gemm: ``(m, n, k, dtype, TFLOP/s)`` rows; stream: GB/s per pass, sorted;
        attention: ``(batch, seq, heads, head_dim, causal, pass, ms)`` rows, ``pass``
        ``"fwd"`` or ``"fwd+bwd"``.
        launch_us: µs per kernel in a program; dispatch_us: µs per one-kernel program.
        peak_flops: the dense bf16 peak it was measured against (FLOP/s).
        derived: None where measured; else how the tables were derived (scaled from
            another kind's): then ``name`` says so.
    """

    kind: str
    jax: str
    date: str
    source: str
    gemm: tuple[tuple[int, int, int, str, float], ...]
    stream: tuple[float, ...]
    attention: tuple[tuple[int, int, int, int, bool, str, float], ...]
    launch_us: float
    dispatch_us: float
    peak_flops: float
    derived: str | None = None

    @property
    def name(self) -> str:
        """``"calibrated: H200, JAX 0.11.2, 2026-11-27"`` (``"derived: ..."`` where the
        tables were scaled from another kind's)."""
        word = "derived" if self.derived else "calibrated"
        return f"{word}: {self.kind}, JAX {self.jax}, {self.date}"

    def to_dict(self) -> dict[str, Any]:
        """The name and provenance (not the tables)."""
        return {"name": self.name, "kind": self.kind, "jax": self.jax, "date": self.date,
                "source": self.source, "derived": self.derived}  # fmt: skip


def gemm_rows(c: Calibration) -> list[tuple[int, int, int, str, float]]:
    """``c``'s GEMM rows that timed the kernel: a row no longer than 1.5 × the dispatch
    of a one-kernel program timed the host's dispatch (the H200's 1024³ and 2048³ both
    took ~40 µs), and is dropped; shapes measured twice are averaged.

    >>> [r[:3] for r in gemm_rows(H200) if r[0] == r[1] == r[2]]
    [(4096, 4096, 4096), (8192, 8192, 8192)]
    """
    floor = 1.5 * c.dispatch_us * 1e-3  # ms
    seen: dict[tuple[int, int, int, str], list[float]] = {}
    for m, n, k, dtype, tflops in c.gemm:
        if 2.0 * m * n * k / tflops / 1e9 > floor:
            seen.setdefault((m, n, k, dtype), []).append(tflops)
    return [(*key, sum(v) / len(v)) for key, v in seen.items()]


def _h200() -> Calibration:
    # benchmarks/gpu/results/2026-11-27-h200-1/session.json, core.calibration
    gemm = (
        (8192, 2048, 2048, "bf16", 638.41), (8192, 8192, 2048, "bf16", 659.32),
        (8192, 2048, 8192, "bf16", 744.07), (2048, 2048, 8192, "bf16", 653.94),
        (2048, 8192, 8192, "bf16", 700.39), (8192, 2048, 8192, "bf16", 732.11),
        (1024, 1024, 1024, "bf16", 53.29), (2048, 2048, 2048, "bf16", 420.38),
        (4096, 4096, 4096, "bf16", 676.37), (8192, 8192, 8192, "bf16", 710.95),
        (8192, 256, 2048, "bf16", 187.78), (16384, 6144, 2048, "bf16", 685.46),
    )  # fmt: skip
    attention = (
        (4, 2048, 16, 128, True, "fwd", 0.17894), (4, 2048, 16, 128, True, "fwd+bwd", 0.73624),
        (4, 2048, 16, 128, False, "fwd", 0.27142), (4, 2048, 16, 128, False, "fwd+bwd", 1.03519),
        (1, 8192, 16, 128, True, "fwd", 0.52845), (1, 8192, 16, 128, True, "fwd+bwd", 1.96684),
        (1, 8192, 16, 128, False, "fwd", 0.85722), (1, 8192, 16, 128, False, "fwd+bwd", 3.31285),
        (4, 2048, 32, 64, True, "fwd", 0.22055), (4, 2048, 32, 64, True, "fwd+bwd", 0.88459),
        (4, 2048, 32, 64, False, "fwd", 0.34628), (4, 2048, 32, 64, False, "fwd+bwd", 1.28536),
    )  # fmt: skip
    return Calibration(
        kind="H200", jax="0.11.2", date="2026-11-27",
        source="benchmarks/gpu/results/2026-11-27-h200-1/session.json (core.calibration, "
        "benchmarks/gpu/calibrate.py on one NVIDIA H200)",
        gemm=gemm, stream=(2859.8, 3928.2, 3977.3, 4071.7), attention=attention,
        launch_us=0.966, dispatch_us=35.52, peak_flops=989e12,
    )  # fmt: skip


H200 = _h200()


def _h100() -> Calibration:
    # benchmarks/gpu/results/2026-11-27-h100-1/session.json, core.calibration
    gemm = (
        (8192, 2048, 2048, "bf16", 638.01), (8192, 8192, 2048, "bf16", 626.54),
        (8192, 2048, 8192, "bf16", 747.61), (2048, 2048, 8192, "bf16", 716.11),
        (2048, 8192, 8192, "bf16", 712.25), (8192, 2048, 8192, "bf16", 748.82),
        (1024, 1024, 1024, "bf16", 48.95), (2048, 2048, 2048, "bf16", 364.07),
        (4096, 4096, 4096, "bf16", 695.40), (8192, 8192, 8192, "bf16", 690.42),
        (8192, 256, 2048, "bf16", 161.09), (16384, 6144, 2048, "bf16", 661.46),
        (8192, 2048, 2048, "f32", 317.43), (8192, 8192, 2048, "f32", 334.00),
        (2048, 8192, 8192, "f32", 400.88), (4096, 4096, 4096, "f32", 380.11),
        (8192, 8192, 8192, "f32", 359.75),
    )  # fmt: skip
    attention = (
        (4, 2048, 16, 128, True, "fwd", 0.17361), (4, 2048, 16, 128, True, "fwd+bwd", 0.74040),
        (4, 2048, 16, 128, False, "fwd", 0.24781), (4, 2048, 16, 128, False, "fwd+bwd", 1.03955),
        (1, 8192, 16, 128, True, "fwd", 0.52970), (1, 8192, 16, 128, True, "fwd+bwd", 1.98829),
        (1, 8192, 16, 128, False, "fwd", 0.85254), (1, 8192, 16, 128, False, "fwd+bwd", 3.39044),
        (4, 2048, 32, 64, True, "fwd", 0.21516), (4, 2048, 32, 64, True, "fwd+bwd", 0.88981),
        (4, 2048, 32, 64, False, "fwd", 0.33419), (4, 2048, 32, 64, False, "fwd+bwd", 1.28815),
    )  # fmt: skip
    return Calibration(
        kind="H100", jax="0.11.2", date="2026-11-27",
        source="benchmarks/gpu/results/2026-11-27-h100-1/session.json (core.calibration, "
        "benchmarks/gpu/calibrate.py on one NVIDIA H100 80GB HBM3)",
        gemm=gemm, stream=(2018.1, 2876.5, 2892.3, 2948.9), attention=attention,
        launch_us=1.297, dispatch_us=31.54, peak_flops=989e12,
    )  # fmt: skip


H100 = _h100()

CALIBRATIONS: dict[str, Calibration] = {"H200": H200, "H100": H100}
"""The shipped calibrations by kind."""

_KIND = re.compile(r"\b(H100|H200|H800|H20|A100|B200|GB200|GH200)\b", re.IGNORECASE)


def calibration_for(device_kind: str) -> Calibration | None:
    """The shipped calibration of ``device_kind`` (``"NVIDIA H200"``, ``"H100"``), else
    None (``nearest`` then says how far the nearest calibrated kind is).

    >>> calibration_for("NVIDIA H200").kind
    'H200'
    """
    found = _KIND.search(str(device_kind))
    return CALIBRATIONS.get(found.group(1).upper()) if found else None


def nearest(peak_flops: float | None, hbm_bandwidth: float | None) -> tuple[Calibration, str]:
    """The shipped calibration closest to a device of ``peak_flops`` and ``hbm_bandwidth``
    (its datasheet), and a sentence on how far off it is.

    >>> c, why = nearest(2.25e15, 8e12)
    >>> print(c.kind, why)  # doctest: +NORMALIZE_WHITESPACE
    H200 uncalibrated: the nearest calibrated kind, H200, has 0.44× its peak FLOP/s and 0.51×
    its HBM bandwidth
    """

    def gap(c: Calibration) -> float:
        ratios = [c.peak_flops / peak_flops if peak_flops else 1.0,
                  max(c.stream) * 1e9 / hbm_bandwidth if hbm_bandwidth else 1.0]  # fmt: skip
        return sum(abs(_log(r)) for r in ratios)

    measured = [c for c in CALIBRATIONS.values() if not c.derived]
    best = min(measured, key=gap)
    flops = f"{best.peak_flops / peak_flops:.2f}× its peak FLOP/s" if peak_flops else "?"
    bw = (
        f"{max(best.stream) * 1e9 / hbm_bandwidth:.2f}× its HBM bandwidth" if hbm_bandwidth else "?"
    )
    return best, f"uncalibrated: the nearest calibrated kind, {best.kind}, has {flops} and {bw}"


def _log(x: float) -> float:
    return math.log(x) if x > 0 else 0.0


__all__ = ["CALIBRATIONS", "Calibration", "calibration_for", "nearest"]
