"""Collectives priced level by level as NCCL runs them, and measured collectives fitted to
those levels.

A collective over a group that spans hosts is priced as NCCL's tuner prices it
(``NCCL``: ``src/graph/tuning.cc``): for each algorithm (ring; tree for all-reduce) and
protocol (LL, Simple) a latency ``base + Σ steps × per-step latency of the level each step
crosses`` and a bandwidth term, the bytes each level carries per GPU over that level's
bandwidth (the slower level sets it: the levels move their shares at once); the cheapest
wins, as in NCCL. Bytes per GPU of one run of a collective whose result is ``S`` bytes over
``n`` GPUs on ``H`` hosts of ``g`` (``Layout``), with one ring per NIC (each of a host's
``g`` GPUs takes one ring's hop between hosts):

- ring all-gather / reduce-scatter / all-reduce: each GPU sends ``sent`` (``(n-1)/n·S``,
  ``(n-1)·S``, ``2(n-1)/n·S``); ``sent/g`` of it crosses hosts, the rest stays on NVLink;
  ``n-1`` steps (``2(n-1)`` for all-reduce), ``H-1`` of them (``2(H-1)``) between hosts;
- tree all-reduce (a chain within each host, a double binary tree between hosts): ``2S``
  per GPU within a host, ``2S/g`` per GPU between hosts; ``2((g-1) + ⌊log2 H⌋)`` steps;
- all-to-all: ``(n-g)/n·S`` between hosts, ``(g-1)/n·S`` within; one step;
- collective-permute: ``S`` over the level the pair crosses; one step.

>>> ib = sx.cost.named_network("ib-ndr")
>>> levels = network_levels(ib, nvlink=4.5e11)
>>> p = price_collective("all-gather", 1 << 30, Layout(128, 16, 8), levels)
>>> p.algorithm, p.protocol, round(p.bytes["inter-host"] / 2**20, 1)
('ring', 'Simple', 127.0)
>>> round(p.seconds * 1e3, 2), round(p.latency_s * 1e6)
(3.2, 533)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from shardax.cost.network import Network

LEVELS = ("intra-host", "inter-host")
"""The levels of a GPU cluster's network: NVLink within a host, the NICs between hosts."""

NCCL = (
    "NVIDIA/nccl src/graph/tuning.cc (commit 01afd20): baseLat, hwLat (NVLink, NET), the "
    "ring's LL bandwidth 1/4, the tree's 0.9 (LL 1/3.8), the ring's multi-node all-reduce "
    "latency x1.9 (its 'plateau effect')"
)
"""Where the algorithm's latency terms and protocol factors come from."""

BASE_LATENCY_S = {
    ("ring", "LL"): 6.6e-6,
    ("ring", "Simple"): 8.4e-6,
    ("tree", "LL"): 6.8e-6,
    ("tree", "Simple"): 0.0,
}
"""NCCL's ``baseLat`` (µs in its source): one launch of the algorithm, per protocol."""
STEP_LATENCY_S = {
    ("intra-host", "ring", "LL"): 0.47e-6,
    ("intra-host", "ring", "Simple"): 3.4e-6,
    ("intra-host", "tree", "LL"): 0.52e-6,
    ("intra-host", "tree", "Simple"): 28e-6,
    ("inter-host", "ring", "LL"): 2.7e-6,
    ("inter-host", "ring", "Simple"): 9.6e-6,
    ("inter-host", "tree", "LL"): 5.0e-6,
    ("inter-host", "tree", "Simple"): 50e-6,
}
"""NCCL's ``hwLat``: the latency of one step of the algorithm over NVLink and over the
network (its ``NET`` row, modelled on InfiniBand), per protocol."""
LL_INTRA_FACTOR = 1.8
"""NCCL multiplies LL's NVLink step latency by this when the group spans hosts."""
PROTOCOL_BANDWIDTH = {
    ("ring", "LL"): 0.25,
    ("ring", "Simple"): 1.0,
    ("tree", "LL"): 0.9 / 3.8,
    ("tree", "Simple"): 0.9,
}
"""The share of a level's bandwidth each algorithm and protocol reaches (NCCL's factors)."""
RING_PLATEAU = 1.9
"""NCCL's ring Simple all-reduce latency factor across hosts for large messages."""


@dataclasses.dataclass(frozen=True)
class Level:
    """One level's figures: bytes/s one way per GPU and the per-step latency scale.

    Attributes:
        bandwidth: bytes/s one way per GPU.
        latency_scale: over NCCL's ``hwLat`` row of the level.
        step_latency_s: a fitted ring Simple per-step latency (None: NCCL's, scaled).
        source: where they come from.
    """

    bandwidth: float
    latency_scale: float = 1.0
    step_latency_s: float | None = None
    source: str = ""

    def step(self, level: str, algorithm: str, protocol: str) -> float:
        """Seconds of one step of ``algorithm`` with ``protocol`` over this level."""
        if self.step_latency_s is not None and (algorithm, protocol) == ("ring", "Simple"):
            return self.step_latency_s
        return STEP_LATENCY_S[(level, algorithm, protocol)] * self.latency_scale


def network_levels(
    network: Network,
    nvlink: float,
    fitted: Mapping[str, tuple[float, float]] | None = None,
    inter_host: float | None = None,
) -> dict[str, Level]:
    """The two levels of ``network`` on GPUs whose NVLink moves ``nvlink`` bytes/s one way:
    the documented figures, or a calibration's ``fitted`` ones (``{level: (per-step
    latency s, bytes/s)}``, ``fit_levels``) where it has them; ``inter_host`` (bytes/s, a
    caller's ``links=``) over the network's bandwidth.

    >>> network_levels(sx.cost.named_network("ib-ndr"), 4.5e11)["inter-host"].bandwidth
    50000000000.0
    """
    fitted = fitted or {}
    intra = Level(nvlink, source="the datasheet's NVLink")
    if "intra-host" in fitted:
        lat, bw = fitted["intra-host"]
        intra = Level(bw, step_latency_s=lat, source="fitted")
    inter = Level(
        network.nic_bandwidth, network.latency_scale, network.step_latency_s, network.source
    )
    if "inter-host" in fitted:
        lat, bw = fitted["inter-host"]
        inter = Level(bw, step_latency_s=lat, source="fitted")
    if inter_host is not None:
        inter = dataclasses.replace(inter, bandwidth=inter_host, source="links= given")
    return {"intra-host": intra, "inter-host": inter}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a collective's group sits: ``devices`` in all, on ``hosts`` hosts, the
    fewest of them on one host ``per_host`` (those GPUs carry the most between hosts)."""

    devices: int
    hosts: int
    per_host: int


def layout_of(group: Sequence[Any]) -> Layout:
    """The ``Layout`` of ``group`` (devices with a ``process_index``: their host).

    >>> from types import SimpleNamespace as NS
    >>> layout_of([NS(process_index=i // 8) for i in range(0, 128, 8)])
    Layout(devices=16, hosts=16, per_host=1)
    """
    hosts: dict[int, int] = {}
    for d in group:
        hosts[d.process_index] = hosts.get(d.process_index, 0) + 1
    return Layout(len(group), len(hosts), min(hosts.values(), default=0))


@dataclasses.dataclass(frozen=True)
class LevelPrice:
    """One run of a collective priced level by level.

    Attributes:
        algorithm, protocol: NCCL's choice (the cheapest): ``"ring"``/``"tree"``,
            ``"LL"``/``"Simple"``.
        seconds: its time (latency + the slower level's bytes over its bandwidth).
        latency_s: the latency terms alone.
        bytes: bytes per GPU over each level (one run).
        level_s: each level's bandwidth time.
    """

    algorithm: str
    protocol: str
    seconds: float
    latency_s: float
    bytes: dict[str, float]
    level_s: dict[str, float]


_RINGS = ("all-gather", "reduce-scatter", "all-reduce")


def _ring_bytes(op: str, size: float, layout: Layout) -> dict[str, float]:
    n, g = layout.devices, max(layout.per_host, 1)
    if op == "collective-permute":
        return {"inter-host" if layout.hosts > 1 else "intra-host": float(size)}
    sent = {"all-reduce": 2 * (n - 1) / n * size, "reduce-scatter": (n - 1) * size}.get(
        op, (n - 1) / n * size
    )
    if layout.hosts <= 1:
        return {"intra-host": sent}
    if op in _RINGS:
        return {"inter-host": sent / g, "intra-host": sent - sent / g}
    return {"inter-host": (n - g) / n * size, "intra-host": (g - 1) / n * size}  # all-to-all


def _steps(op: str, algorithm: str, layout: Layout) -> dict[str, float]:
    """Steps over each level: NCCL's ``nsteps``/``nInterSteps`` (ring), the tree's depth."""
    n, hosts, g = layout.devices, layout.hosts, max(layout.per_host, 1)
    if algorithm == "tree":
        return {
            "intra-host": 2.0 * (g - 1),
            "inter-host": 2.0 * math.floor(math.log2(hosts)) if hosts > 1 else 0.0,
        }
    if op not in _RINGS:  # all-to-all, permute: all peers at once, one step
        return {"inter-host" if hosts > 1 else "intra-host": 1.0}
    twice = 2 if op == "all-reduce" else 1
    inter = twice * (hosts - 1)
    return {"intra-host": twice * (n - 1) - inter, "inter-host": float(inter)}


def price_collective(
    op: str, size: float, layout: Layout, levels: Mapping[str, Level]
) -> LevelPrice:
    """One run of ``op`` whose result is ``size`` bytes per GPU over a group placed as
    ``layout``, on ``levels`` (``network_levels``): the cheapest of NCCL's algorithms and
    protocols (see the module).

    >>> levels = network_levels(sx.cost.named_network("ib-ndr"), 4.5e11)
    >>> small = price_collective("all-reduce", 128, Layout(128, 16, 8), levels)
    >>> small.algorithm, small.protocol, round(small.seconds * 1e6, 1)
    ('tree', 'LL', 59.9)
    """
    if op == "ragged-all-to-all":
        op = "all-to-all"
    algorithms = ("ring", "tree") if op == "all-reduce" and layout.hosts > 1 else ("ring",)
    best: LevelPrice | None = None
    for algorithm in algorithms:
        if algorithm == "tree":
            g = max(layout.per_host, 1)
            moved = {"intra-host": 2.0 * size if g > 1 else 0.0, "inter-host": 2.0 * size / g}
        else:
            moved = _ring_bytes(op, size, layout)
        moved = {k: v for k, v in moved.items() if v}
        steps = _steps(op, algorithm, layout)
        for protocol in ("LL", "Simple"):
            factor = PROTOCOL_BANDWIDTH[(algorithm, protocol)]
            level_s = {k: v / (levels[k].bandwidth * factor) for k, v in moved.items()}
            latency = BASE_LATENCY_S[(algorithm, protocol)]
            for level, count in steps.items():
                step = levels[level].step(level, algorithm, protocol)
                if protocol == "LL" and level == "intra-host" and layout.hosts > 1:
                    step *= LL_INTRA_FACTOR
                latency += count * step
            if (algorithm, protocol, op) == ("ring", "Simple", "all-reduce") and (
                layout.hosts > 1 and size >= layout.devices / 16 * 65536
            ):
                latency *= RING_PLATEAU
            seconds = latency + max(level_s.values(), default=0.0)
            if best is None or seconds < best.seconds:
                best = LevelPrice(algorithm, protocol, seconds, latency, moved, level_s)
    assert best is not None
    return best


def _fit_line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """``(a, b)`` of ``t = a·x + b·s`` through ``(x, s, t)`` points, least squares in
    relative error; None where the points do not resolve both, or either is < 0."""
    sxx = sum((x / t) ** 2 for x, _, t in points)
    sxs = sum(x * s / t**2 for x, s, t in points)
    sss = sum((s / t) ** 2 for _, s, t in points)
    sx, ss = sum(x / t for x, _, t in points), sum(s / t for _, s, t in points)
    det = sxx * sss - sxs**2
    if det <= 0:
        return None
    a, b = (sx * sss - ss * sxs) / det, (sxx * ss - sxs * sx) / det
    if a < 0 and sss > 0:  # no latency the sizes can resolve: the bandwidth alone
        a, b = 0.0, ss / sss
    return (a, b) if b > 0 else None


def fit_levels(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """``{level: (per-step latency s, bytes/s)}`` fitted to measured collectives
    (``shardax calibrate``'s ``collectives`` rows: ``op``, ``devices``, ``bytes`` (each
    device's buffer), ``ms``, and ``hosts`` where they spanned hosts), by the ring Simple
    model of ``price_collective``: rows within one host fit NVLink's
    ``ms = base + steps × latency + sent / bandwidth``; rows across hosts, with NVLink's
    fit taken off, fit the network's ``inter-host steps × latency + bytes between hosts
    / bandwidth`` (NCCL's rings there are bound by the NICs). A level with under two
    usable rows is left out.

    >>> def ms(op, n, b, hosts, lat, bw):  # a ring all-gather's time, by the model
    ...     layout = Layout(n, hosts, n // hosts)
    ...     levels = {"intra-host": Level(4e11, step_latency_s=3e-6),
    ...               "inter-host": Level(bw, step_latency_s=lat)}
    ...     size = b if op == "all-gather" else b // n
    ...     return 1e3 * _ring_simple(op, size, layout, levels)
    >>> rows = [{"op": "all-gather", "devices": n, "bytes": b, "hosts": h,
    ...          "ms": ms("all-gather", n, b, h, 12e-6, 4.5e10)}
    ...         for n, h in ((8, 1), (16, 2)) for b in (2**16, 2**22, 2**28)]
    >>> {k: (round(t * 1e6, 2), round(bw / 1e9, 2)) for k, (t, bw) in fit_levels(rows).items()}
    {'intra-host': (3.0, 400.0), 'inter-host': (12.0, 45.0)}
    """
    usable = [
        r
        for r in rows
        if "ms" in r
        and "error" not in r
        and r.get("op") in _RINGS
        and int(r.get("devices", 0)) > 1
        and r.get("bytes")
    ]
    base = BASE_LATENCY_S[("ring", "Simple")]
    within: list[tuple[float, float, float]] = []
    across: list[tuple[dict[str, float], dict[str, float], float]] = []
    for r in usable:
        n, hosts = int(r["devices"]), int(r.get("hosts", 1))
        op, buffer = str(r["op"]), float(r["bytes"])
        size = buffer / n if op == "reduce-scatter" else buffer  # the result, per GPU
        layout = Layout(n, hosts, n // hosts)
        moved, steps = _ring_bytes(op, size, layout), _steps(op, "ring", layout)
        t = float(r["ms"]) * 1e-3 - base
        if t <= 0:
            continue
        if hosts == 1:
            within.append((steps["intra-host"], moved["intra-host"], t))
        else:
            across.append((moved, steps, t))
    out: dict[str, tuple[float, float]] = {}
    fit = _fit_line(within) if len(within) >= 2 else None
    if fit is not None:
        out["intra-host"] = (fit[0], 1 / fit[1])
    if len(across) >= 2 and "intra-host" in out:
        latency = out["intra-host"][0]
        points = [
            (s["inter-host"], m["inter-host"], t - s["intra-host"] * latency) for m, s, t in across
        ]
        fit = _fit_line([p for p in points if p[2] > 0])
        if fit is not None:
            out["inter-host"] = (fit[0], 1 / fit[1])
    return out


def _ring_simple(op: str, size: float, layout: Layout, levels: Mapping[str, Level]) -> float:
    """One run's seconds by the ring Simple model alone (what ``fit_levels`` inverts)."""
    moved, steps = _ring_bytes(op, size, layout), _steps(op, "ring", layout)
    latency = BASE_LATENCY_S[("ring", "Simple")] + sum(
        c * levels[k].step(k, "ring", "Simple") for k, c in steps.items()
    )
    return latency + max(v / levels[k].bandwidth for k, v in moved.items() if v)


__all__ = [
    "LEVELS",
    "Layout",
    "Level",
    "LevelPrice",
    "fit_levels",
    "layout_of",
    "network_levels",
    "price_collective",
]
