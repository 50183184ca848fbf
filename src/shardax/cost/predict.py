"""A predicted step time from a compiled step's figures: the model, named and stated.

**Model ``roofline+links``** (every figure it gives is a prediction, not a measurement):

- compute: the step's matmul FLOPs per device (counted from the compiled HLO) at
  ``compute_efficiency`` × the datasheet's dense bf16 peak;
- memory-bound work: the bytes the device's memory moves per step at the datasheet's HBM
  bandwidth (the backend's ``bytes accessed`` where it reports one, else every argument,
  output and temporary byte written once and read once);
- collectives: the bytes each device sends per step (ring algorithms, from the HLO's
  replica groups) over each link at that link's bandwidth: within a host (NVLink, ICI)
  or between hosts (InfiniBand, DCN);
- without overlap the step is ``max(compute, memory) + Σ links``; with perfect overlap
  (collectives hidden behind compute, as XLA's latency-hiding scheduler aims for) it is
  ``max(compute, memory, slowest link)``. The truth lies between.

From the step time: tokens/s per device, model TFLOP/s per device and MFU (model FLOPs
over the datasheet peak, as MaxText and PaLM count them).

>>> p = predict_step(flops=6e14, hbm_bytes=1e11, link_bytes={"intra-host": 2e10},
...                  peak_flops=1e15, hbm_bandwidth=3e12, link_bandwidth={"intra-host": 4e11},
...                  compute_efficiency=0.5, tokens=16384, model_flops=5e14)
>>> round(p.compute_s, 3), round(p.overlapped_s, 3), round(p.serial_s, 3)
(1.2, 1.2, 1.25)
>>> round(p.mfu(overlap=True), 3)
0.417
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardax.checks import as_float

MODEL_NAME = "roofline+links"
DEFAULT_COMPUTE_EFFICIENCY = 0.6
"""The fraction of the datasheet's dense bf16 peak the matmuls are assumed to reach: an
assumption, stated in every report (``compute_efficiency=`` changes it)."""
LINKS = ("intra-host", "inter-host", "inter-slice")


def check_links(links: Mapping[str, float] | None) -> dict[str, float]:
    """``links`` (bytes/s per link name), each name one of ``LINKS`` and each
    bandwidth a finite number > 0; an unknown name or a zero bandwidth would leave that
    link's collectives out of the time without a word.

    >>> check_links({"inter-host": 5e10})
    {'inter-host': 50000000000.0}
    """
    if links is None:
        return {}
    if not isinstance(links, Mapping):
        raise TypeError(f"links must be a dict {{link: bytes/s}}, got {type(links).__name__}")
    for name in links:
        if name not in LINKS:
            raise ValueError(
                f"links names {name!r}, which is not a link; the links are "
                f"{', '.join(map(repr, LINKS))} ('intra-host': NVLink or ICI; 'inter-host': "
                "InfiniBand, or ICI within a TPU slice; 'inter-slice': DCN)"
            )
    return {k: as_float(f"links[{k!r}] (bytes/s)", v, above=0) for k, v in links.items()}


def check_figures(
    tokens: Any, model_flops: Any, links: Any
) -> tuple[float | None, float | None, dict[str, float]]:
    """``sx.estimate``'s given figures checked: ``tokens`` and ``model_flops`` per step
    finite and > 0 (a negative count predicted negative tokens/s and MFU), ``links`` by
    ``check_links``; None stays None (the default is derived)."""
    return (
        None if tokens is None else as_float("tokens (per step)", tokens, above=0),
        None if model_flops is None else as_float("model_flops (per step)", model_flops, above=0),
        check_links(links),
    )


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """The predicted time of one step on one device, and what it is made of (seconds).

    Attributes:
        model: the model's name (``MODEL_NAME``) and its assumption.
        compute_s: matmul FLOPs at ``compute_efficiency`` × peak.
        memory_s: HBM bytes at HBM bandwidth.
        link_s: seconds per link (``"intra-host"``, ``"inter-host"``, ``"inter-slice"``);
            None for a link whose bandwidth is not known.
        tokens: tokens per step over all devices; devices: how many.
        model_flops: model FLOPs per step over all devices (None: not given).
        peak_flops: the datasheet peak of one device.
    """

    model: str
    compute_s: float
    memory_s: float
    link_s: dict[str, float | None]
    tokens: float | None
    devices: int
    model_flops: float | None
    peak_flops: float

    @property
    def overlapped_s(self) -> float:
        """Collectives hidden behind compute: ``max(compute, memory, slowest link)``."""
        links = [t for t in self.link_s.values() if t is not None]
        return max([self.compute_s, self.memory_s, *links])

    @property
    def serial_s(self) -> float:
        """No overlap: ``max(compute, memory) + Σ links``."""
        links = [t for t in self.link_s.values() if t is not None]
        return max(self.compute_s, self.memory_s) + sum(links)

    def step_s(self, overlap: bool = True) -> float:
        """The predicted step time, with or without overlap."""
        return self.overlapped_s if overlap else self.serial_s

    def tokens_per_s_per_device(self, overlap: bool = True) -> float | None:
        """Predicted tokens/s per device (None without ``tokens``)."""
        if self.tokens is None:
            return None
        return self.tokens / self.devices / self.step_s(overlap)

    def model_tflops_per_device(self, overlap: bool = True) -> float | None:
        """Predicted model TFLOP/s per device (None without ``model_flops``)."""
        if self.model_flops is None:
            return None
        return self.model_flops / self.devices / self.step_s(overlap) / 1e12

    def mfu(self, overlap: bool = True) -> float | None:
        """Predicted model FLOPs utilisation (None without ``model_flops``)."""
        tflops = self.model_tflops_per_device(overlap)
        return None if tflops is None else tflops * 1e12 / self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the parts, then each figure with overlap and without
        (``Estimate.to_dict`` files it under ``roofline_guide``: a rough guide)."""
        out: dict[str, Any] = {
            "model": self.model,
            "compute_s": self.compute_s,
            "memory_s": self.memory_s,
            "link_s": dict(self.link_s),
        }
        for overlap, key in ((True, "overlapped"), (False, "serial")):
            out[f"step_s_{key}"] = self.step_s(overlap)
            out[f"tokens_per_s_per_device_{key}"] = self.tokens_per_s_per_device(overlap)
            out[f"model_tflops_per_device_{key}"] = self.model_tflops_per_device(overlap)
            out[f"mfu_{key}"] = self.mfu(overlap)
        return out


def predict_step(
    *,
    flops: float,
    hbm_bytes: float,
    link_bytes: Mapping[str, float],
    peak_flops: float,
    hbm_bandwidth: float,
    link_bandwidth: Mapping[str, float | None],
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY,
    tokens: float | None = None,
    model_flops: float | None = None,
    devices: int = 1,
) -> StepPrediction:
    """The step time of model ``MODEL_NAME`` (see the module) for one device's
    ``flops`` (matmul FLOPs per step), ``hbm_bytes`` and the bytes it sends over each link
    (``link_bytes``), on a device of ``peak_flops``, ``hbm_bandwidth`` and
    ``link_bandwidth`` (bytes/s per link name). ``tokens`` and ``model_flops`` are per
    step over all ``devices``. A link with bytes but no bandwidth is reported as None
    (not counted in the time): the report says so."""
    as_float("flops", flops, minimum=0)
    as_float("hbm_bytes", hbm_bytes, minimum=0)
    peak_flops = as_float("peak_flops", peak_flops, above=0)
    hbm_bandwidth = as_float("hbm_bandwidth", hbm_bandwidth, above=0)
    efficiency = as_float("compute_efficiency", compute_efficiency, above=0)
    if efficiency > 1:
        raise ValueError(f"compute_efficiency must be in (0, 1], got {compute_efficiency!r}")
    link_s: dict[str, float | None] = {}
    for link, sent in link_bytes.items():
        if not sent:
            continue
        bandwidth = link_bandwidth.get(link)
        link_s[link] = None if not bandwidth else sent / bandwidth
    return StepPrediction(
        model=f"{MODEL_NAME}: compute at {efficiency:.0%} of peak",
        compute_s=flops / (efficiency * peak_flops),
        memory_s=hbm_bytes / hbm_bandwidth,
        link_s=link_s,
        tokens=tokens,
        devices=devices,
        model_flops=model_flops,
        peak_flops=peak_flops,
    )


def link_of(process_indices: set[int], slice_indices: set[int]) -> str:
    """The link a collective's group crosses: ``"inter-slice"`` over several slices (DCN),
    ``"inter-host"`` over several processes (hosts), else ``"intra-host"``.

    >>> link_of({0, 1}, {0}), link_of({0}, {0})
    ('inter-host', 'intra-host')
    """
    if len(slice_indices) > 1:
        return "inter-slice"
    return "inter-host" if len(process_indices) > 1 else "intra-host"


def host_share(op: str, group: int, per_host: int) -> float:
    """The share of a device's sent bytes (``Collective.sent_bytes``) that leave its host,
    for a collective over ``group`` devices of which ``per_host`` are on each host (the
    fewest any host holds: those GPUs carry the most), on GPU servers whose GPUs each
    have their own NIC (HGX/DGX: NCCL runs its rings over every NIC).

    A ring collective (all-gather, reduce-scatter, all-reduce: one ring per NIC, each
    entering and leaving a host once) crosses between hosts at one GPU of each host per
    ring, so each of a host's ``g`` GPUs carries one ring's traffic between hosts: ``1/g``
    of what it sends; the rest moves within the host (NVLink). An all-to-all sends
    ``(n-g)/(n-1)`` of its bytes to other hosts; a permute, all. With one device per
    host the share is 1: every byte crosses; with the whole group on one host, 0.

    >>> host_share("all-gather", 128, 8), host_share("all-gather", 16, 1)
    (0.125, 1.0)
    """
    n, g = int(group), max(int(per_host), 1)
    if n <= 1 or g >= n:
        return 0.0
    if op in ("all-gather", "reduce-scatter", "all-reduce"):
        return 1 / g
    if op in ("all-to-all", "ragged-all-to-all"):
        return (n - g) / (n - 1)
    return 1.0


def wire_seconds(
    link_bytes: Mapping[str, float], link_bandwidth: Mapping[str, float | None]
) -> float | None:
    """Seconds to move ``link_bytes`` (bytes per link name) when the links carry their
    shares at once: the slowest link's; None when a link with bytes has no bandwidth.

    >>> wire_seconds({"inter-host": 5e9, "intra-host": 9e9}, {"inter-host": 5e10,
    ...                                                       "intra-host": 4.5e11})
    0.1
    """
    out = 0.0
    for link, sent in link_bytes.items():
        if not sent:
            continue
        bandwidth = link_bandwidth.get(link)
        if not bandwidth:
            return None
        out = max(out, sent / bandwidth)
    return out
