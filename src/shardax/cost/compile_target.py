"""Targets: compile-only devices of a GPU node or cluster, or of a TPU slice, on any machine.

``sx.target("8xH100")`` gives the devices of a cluster you do not have, for compiling a step
ahead of time (``step.lower(state, batch).compile()`` with abstract inputs): their memory
per device, FLOPs and collectives, without an accelerator. Through JAX's
``jax.experimental.topologies``, with JAX's CUDA plugin (``pip install
'shardax[gpu-compile]'``) or libtpu (``pip install 'shardax[tpu-compile]'``); both need
JAX >= 0.12 (Python 3.12+) and Linux (``shardax.cost.plugins``).

The names (``shardax.cost.target_names``) give a kind of the table of accelerators
(``shardax.cost.accelerators``): its datasheet row, host size, memory budget and network.

>>> sx.target("8xH100")  # doctest: +SKIP
Target('8xH100': 8 x NVIDIA H100 80GB HBM3, 1 host x 8)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from shardax.checks import public
from shardax.cost.accelerators import named
from shardax.cost.budget import budgeted_gpu_config, gpu_memory_fraction, remember_fraction
from shardax.cost.datasheet import HardwareSpec
from shardax.cost.gpu_config import gpu_target_config
from shardax.cost.network import Network, default_network, named_network, remember_network
from shardax.cost.plugins import gpu_devices, require_jax_012, tpu_devices
from shardax.cost.target_names import parse_target


@public("sx.cost.Target")
@dataclasses.dataclass(frozen=True)
class Target(Sequence):
    """Compile-only devices of a named GPU cluster or TPU slice(s); a sequence of devices,
    so ``sx.make_mesh(spec, devices=target)`` takes it.

    Attributes:
        name: the name it was made from (``"8xH100"``).
        platform: ``"gpu"`` or ``"tpu"``.
        devices: the compile-only ``jax.Device`` objects, host by host (each device's
            ``process_index`` is its host; ``slice_index`` its TPU slice).
        spec: the device's datasheet row ([`shardax.cost.device_spec`][shardax.cost.device_spec]).
        hosts: hosts in all (processes of a launch).
        devices_per_host: devices on each host.
        slices: TPU slices (1 for GPUs and single-slice TPUs).
        topology: what ``jax.experimental.topologies.get_topology_desc`` was given.
        memory_fraction: the share of each GPU's memory its programs are planned in
            (None for TPUs).
        network: the network between its hosts (``shardax.cost.network``: the one
            named, else the GPU kind's default; None for TPUs).
    """

    name: str
    platform: str
    devices: tuple[Any, ...]
    spec: HardwareSpec
    hosts: int
    devices_per_host: int
    slices: int
    topology: str
    memory_fraction: float | None = None
    network: Network | None = None

    @property
    def device_kind(self) -> str:
        """The kind the devices report (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5"``)."""
        return str(self.devices[0].device_kind)

    def __len__(self) -> int:
        return len(self.devices)

    def __getitem__(self, index: Any) -> Any:
        return self.devices[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.devices)

    def __repr__(self) -> str:
        slices = f"{self.slices} slices x " if self.slices > 1 else ""
        hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
        network = f", network {self.network.name!r}" if self.network and self.hosts > 1 else ""
        return (
            f"Target({self.name!r}: {len(self)} x {self.device_kind}, {slices}{hosts} x "
            f"{self.devices_per_host}{network})"
        )


@public("sx.target")
def target(
    name: str, *, memory_fraction: float | None = None, network: str | Network | None = None
) -> Target:
    """Compile-only devices of the GPU cluster or TPU slice(s) ``name``, with their device
    kind, hosts (``process_index``), TPU slices (``slice_index``) and datasheet row.

    A GPU target's programs are planned in the memory a JAX process on that GPU gets:
    ``memory_fraction`` of it (default: ``XLA_CLIENT_MEM_FRACTION`` from the environment,
    else JAX's 0.75; ``shardax.cost.budget.gpu_memory_fraction``).
    XLA rematerializes a step that needs more, as it would on the GPU; pass the fraction
    the run will set (``memory_fraction=0.95``) to compile what it will run.

    Names: ``"8xH100"`` (one host of 8), ``"2x4xH100"`` (2 hosts of 4), ``"64xH100"`` (8
    hosts of 8, the kind's ``host_devices``), for H100, H200, B200 and A100-80GB; TPU slices as
    Cloud names them: ``"v5p-128"`` (v5p counts TensorCores, 2 per chip: 64 chips),
    ``"v5e-16"`` or ``"v5litepod-16"`` and ``"v6e-16"`` (16 chips), ``"2xv5p-128"`` (two
    slices). Each slice's chip layout is Cloud's documented shape for its size.

    Needs JAX >= 0.12 (Python 3.12+) on Linux, with ``pip install 'shardax[gpu-compile]'``
    for GPUs (JAX's CUDA plugin; no driver or GPU needed) or ``pip install
    'shardax[tpu-compile]'`` for TPUs (libtpu). On a machine without an NVIDIA driver the
    CUDA plugin registers only if its version check is skipped; when JAX's backends have
    not started yet this sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` in the environment for
    the plugin's registration only, and removes it after (``prepare_cuda_plugin`` of
    ``shardax.cost.plugins`` says when that is safe); when they have, set
    ``JAX_PLATFORMS=cpu`` before Python starts (the error says so).

    ``network``: what joins a GPU target's hosts, a name of
    ``shardax.cost.network.NETWORKS`` or a cloud shape (``"ib-ndr"``, ``"gcp-a3-mega"``,
    ``"a3-megagpu-8g"``, ``"p5.48xlarge"``, ``"ethernet-100g"``); default: the GPU kind's
    DGX network (its row's ``network``: InfiniBand NDR for H100, H200 and B200, HDR for
    A100). Collectives across hosts are priced at its figures; an unknown name is refused.

    >>> target = sx.target("8xH100")  # doctest: +SKIP
    >>> mesh = sx.make_mesh({"data": 8}, devices=target)  # doctest: +SKIP
    >>> step.lower(abstract_state, abstract_batch).compile().memory_analysis()  # doctest: +SKIP
    """
    parsed = parse_target(name)
    row = named(parsed["model"] if parsed["platform"] == "gpu" else parsed["family"])
    assert row is not None and row.spec is not None  # parse_target gives rows of the table
    if row.memory_budget == "allocator":
        parsed["memory_fraction"] = gpu_memory_fraction(memory_fraction)
    elif memory_fraction is not None:
        raise ValueError(
            f"sx.target: memory_fraction is the share of a GPU's memory JAX's allocator "
            f"takes, for GPU targets; {name!r} is a TPU slice; got memory_fraction="
            f"{memory_fraction!r}"
        )
    if parsed["platform"] == "gpu":
        chosen = default_network(row.kind) if network is None else named_network(network)
    elif network is not None:
        raise ValueError(
            f"network names what joins GPU hosts (shardax.cost.network.NETWORKS); {name!r} is "
            f"a TPU slice, whose slices are joined by DCN; got network={network!r}"
        )
    require_jax_012(name)
    if parsed["platform"] == "gpu":
        config = gpu_target_config(row.device_kind, row.spec)
        config = budgeted_gpu_config(config, row.spec.memory_bytes, parsed["memory_fraction"])
        topology = f"1 x {parsed['hosts']} x {parsed['devices_per_host']}"
        devices = gpu_devices(name, topology, config)
    else:
        topology = parsed["topology"]
        one_host = bool(row.tpu and parsed["chips"] == row.tpu.one_host)
        devices = tpu_devices(name, topology, parsed["slices"], one_host)
    if parsed.get("memory_fraction") is not None:
        remember_fraction(devices[0].client, parsed["memory_fraction"])
    if parsed["platform"] == "gpu" and chosen is not None:
        remember_network(devices[0].client, chosen)
    hosts = len({d.process_index for d in devices})
    return Target(
        name=name,
        platform=parsed["platform"],
        devices=tuple(devices),
        spec=row.spec,
        hosts=hosts,
        devices_per_host=len(devices) // hosts,
        slices=len({getattr(d, "slice_index", 0) for d in devices}),
        topology=topology,
        memory_fraction=parsed.get("memory_fraction"),
        network=chosen if parsed["platform"] == "gpu" else None,
    )
