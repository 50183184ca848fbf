"""The networks between GPU hosts: each GPU's share of its host's NICs, by name.

A GPU cluster has two levels: NVLink within a host (``"intra-host"``), the NICs between
hosts (``"inter-host"``). A named ``Network`` gives the second level's figures: each GPU's
share of its host's NIC bandwidth (one way) and its sources. A target names its network
(``sx.target("16x8xH100", network="ib-ndr")``), else takes its GPU kind's default (its row's
``network`` in ``shardax.cost.accelerators``); the report says which it used. Collectives
over them are priced level by level as NCCL runs them (``shardax.cost.nccl``).

>>> named_network("dgx-h100").nic_bandwidth
50000000000.0
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from shardax.checks import public, received
from shardax.cost.accelerators import ACCELERATORS, accelerator_of, named, platform_of

Gbps = 1e9 / 8
"""Bytes/s of one Gb/s."""


@public("sx.cost.Network")
@dataclasses.dataclass(frozen=True)
class Network:
    """A named network between GPU hosts: each GPU's share of its host's NICs.

    Attributes:
        name: the name targets spell (``"ib-ndr"``).
        title: what it is (``"DGX H100/H200: 8 x 400 Gb/s InfiniBand NDR per host"``).
        host_gbps: the host's NIC bandwidth for GPU traffic, Gb/s one way.
        gpus_per_host: the GPUs of the host that share it.
        source: where the figures come from.
        aliases: other spellings (a cloud shape: ``"a3-megagpu-8g"``).
        latency_scale: the network's per-step latency over NCCL's ``NET`` row (1: NCCL's
            own figures, modelled on InfiniBand).
        fitted: None for documented figures; else the calibration whose fitted per-level
            figures these are (``with_fitted``).
        step_latency_s: a fitted per-step latency between hosts (ring, Simple); None:
            NCCL's, times ``latency_scale``.
    """

    name: str
    title: str
    host_gbps: float
    gpus_per_host: int
    source: str
    aliases: tuple[str, ...] = ()
    latency_scale: float = 1.0
    fitted: str | None = None
    step_latency_s: float | None = None

    @property
    def nic_bandwidth(self) -> float:
        """Bytes/s one way of one GPU's share of the host's NICs.

        >>> NETWORKS["gcp-a3-mega"].nic_bandwidth
        25000000000.0
        """
        return self.host_gbps * Gbps / self.gpus_per_host

    def describe(self) -> str:
        """One line for a report: name, figures, and whether documented or fitted.

        >>> NETWORKS["ib-ndr"].describe()  # doctest: +ELLIPSIS
        'ib-ndr (DGX H100/H200: 8 x 400 Gb/s InfiniBand NDR per host): 50 GB/s per GPU ...'
        """
        how = f"fitted ({self.fitted})" if self.fitted else f"documented ({self.source})"
        return (
            f"{self.name} ({self.title}): {self.nic_bandwidth / 1e9:.4g} GB/s per GPU "
            f"between hosts, {how}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able), with the per-GPU bandwidth."""
        return {**dataclasses.asdict(self), "nic_bandwidth": self.nic_bandwidth}


_DGX = (
    "NVIDIA DGX H100/H200 user guide: eight single-port ConnectX-7 400 Gb/s InfiniBand "
    "NDR adapters for the compute fabric, one per GPU"
)
NETWORKS: dict[str, Network] = {n.name: n for n in (
    Network("ib-ndr", "DGX H100/H200: 8 x 400 Gb/s InfiniBand NDR per host", 3200, 8, _DGX,
            ("dgx-h100", "dgx-h200", "dgx-b200")),
    Network("ib-hdr", "DGX A100: 8 x 200 Gb/s InfiniBand HDR per host", 1600, 8,
            "NVIDIA DGX A100 user guide: eight ConnectX-6 200 Gb/s HDR adapters, one per GPU",
            ("dgx-a100",)),
    Network("gcp-a3-high", "GCP A3 High: 4 x 200 Gb/s GPUDirect-TCPX NICs per host", 800, 8,
            "cloud.google.com/compute/docs/gpus (a3-highgpu-8g: 1,000 Gb/s, of which 4 x 200 "
            "Gb/s GPU NICs; one NIC per two GPUs) and .../gpudirect (GPUDirect-TCPX)",
            ("a3-highgpu-8g", "a3-high")),
    Network("gcp-a3-mega", "GCP A3 Mega: 8 x 200 Gb/s GPUDirect-TCPXO NICs per host", 1600, 8,
            "cloud.google.com/compute/docs/gpus (a3-megagpu-8g: 1,800 Gb/s, of which 8 x 200 "
            "Gb/s GPU NICs, one per GPU) and .../gpudirect (GPUDirect-TCPXO)",
            ("a3-megagpu-8g", "a3-mega")),
    Network("gcp-a3-ultra", "GCP A3 Ultra: 8 x 400 Gb/s ConnectX-7 RoCE NICs per host", 3200, 8,
            "cloud.google.com/compute/docs/gpus (a3-ultragpu-8g: 3,600 Gb/s, of which 8 x 400 "
            "Gb/s ConnectX-7 RDMA over RoCE, one per GPU)", ("a3-ultragpu-8g", "a3-ultra")),
    Network("aws-p5-efa", "AWS p5.48xlarge: 3,200 Gb/s EFA per host", 3200, 8,
            "aws.amazon.com/ec2/instance-types/p5 (p5.48xlarge: 8 x H100, 3,200 Gbps EFAv2)",
            ("p5.48xlarge", "p5")),
    Network("aws-p5e-efa", "AWS p5e.48xlarge: 3,200 Gb/s EFA per host", 3200, 8,
            "aws.amazon.com/ec2/instance-types/p5 (p5e.48xlarge: 8 x H200, 3,200 Gbps EFA)",
            ("p5e.48xlarge", "p5e", "p5en.48xlarge", "p5en")),
    Network("ethernet-100g", "generic Ethernet: one 100 Gb/s NIC per host shared by 8 GPUs",
            100, 8, "a definition, not a product: one 100 GbE NIC per 8-GPU host, TCP "
            "sockets (no GPUDirect RDMA); per-step latency assumed 2x NCCL's NET row",
            ("ethernet",), latency_scale=2.0),
)}  # fmt: skip
"""The named networks, by name (each with its source)."""

DEFAULT_NETWORKS: dict[str, str] = {
    row.kind: row.network for row in ACCELERATORS.values() if row.network is not None
}
"""Each GPU kind's network when a target names none (a view of the table's ``network``)."""


def _spellings() -> dict[str, str]:
    out = {}
    for n in NETWORKS.values():
        for spelling in (n.name, *n.aliases):
            out[spelling.lower()] = n.name
    return out


@public("sx.cost.named_network")
def named_network(name: str | Network) -> Network:
    """The network ``name`` (a name of ``NETWORKS`` or an alias: a cloud shape such as
    ``"a3-megagpu-8g"`` or ``"p5.48xlarge"``, case-insensitive); a ``Network`` passes
    through. An unknown name is refused, naming the known ones.

    >>> named_network("a3-megagpu-8g").name
    'gcp-a3-mega'
    >>> named_network("myrinet")
    Traceback (most recent call last):
    ...
    ValueError: sx.cost.named_network: network must be one of 'ib-ndr', ..., got 'myrinet'
    """
    if isinstance(name, Network):
        return name
    found = _spellings().get(name.strip().lower()) if isinstance(name, str) else None
    if found is None:
        shapes = [
            a for n in NETWORKS.values() for a in n.aliases if ("-" in a and "gpu" in a) or "." in a
        ]
        raise ValueError(
            f"network must be one of {', '.join(map(repr, NETWORKS))} (or a cloud shape: "
            f"{', '.join(shapes)}), got {received(name)}"
        )
    return NETWORKS[found]


def default_network(kind: str) -> Network | None:
    """The network of a GPU kind (``"H100"``, a row of ``shardax.cost.accelerators``) when
    its target names none.

    >>> default_network("H200").name, default_network("L4")
    ('ib-ndr', None)
    """
    row = named(kind)
    return None if row is None or row.network is None else NETWORKS[row.network]


_TARGET_NETWORKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The network of each GPU target's compile-only client (``sx.target`` fills it)."""


def remember_network(client: Any, network: Network) -> None:
    """Records ``network`` as that of the target whose devices' client is ``client``."""
    _TARGET_NETWORKS[client] = network


def network_of(device: Any) -> tuple[Network | None, str]:
    """The network of ``device``'s hosts and why: its target's (named, or its kind's
    default), else its GPU kind's default (a live cluster: shardax cannot see its NICs),
    else None (a CPU, a TPU, a kind with no default).

    >>> from types import SimpleNamespace
    >>> n, why = network_of(SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3"))
    >>> n.name, why
    ('ib-ndr', 'the default for H100 (sx.target(..., network=NAME) names another)')
    """
    try:
        found = _TARGET_NETWORKS.get(device.client)
    except (AttributeError, TypeError):
        found = None
    if found is not None:
        return found, "the target's"
    if platform_of(device) != "gpu":
        return None, "not a GPU"
    row = accelerator_of(device)
    kind = row.kind if row is not None else str(getattr(device, "device_kind", ""))
    network = default_network(kind)
    if network is None:
        return None, f"no default network for {kind}"
    return network, f"the default for {kind} (sx.target(..., network=NAME) names another)"


def with_fitted(network: Network, calibration: Any) -> Network:
    """``network`` with a calibration's fitted inter-host figures where it measured them
    on this network (``calibration.network == network.name``), else ``network``."""
    levels = {k: (lat, bw) for k, lat, bw in getattr(calibration, "levels", ()) or ()}
    if getattr(calibration, "network", None) != network.name or "inter-host" not in levels:
        return network
    latency, bandwidth = levels["inter-host"]
    return dataclasses.replace(
        network,
        host_gbps=bandwidth * network.gpus_per_host / Gbps,
        step_latency_s=latency,
        fitted=calibration.name,
    )


__all__ = [
    "DEFAULT_NETWORKS",
    "NETWORKS",
    "Network",
    "default_network",
    "named_network",
    "network_of",
    "remember_network",
    "with_fitted",
]
