"""What a datasheet says of one accelerator: the figures of a row of the table of
accelerators (``shardax.cost.accelerators``).

>>> spec = HardwareSpec(peak_flops=989e12, hbm_bandwidth=3350e9, memory_bytes=80 * GiB)
>>> round(spec.critical_intensity)
295
"""

from __future__ import annotations

import dataclasses

from shardax.checks import public

KiB = 1024
MiB = 1024**2
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class GpuArch:
    """What XLA's GPU compiler needs to know of a GPU beyond its datasheet figures: the
    fields of the target configs that [`shardax.cost.target`][shardax.target] compiles for
    (``shardax.cost.gpu_config.gpu_target_config``).

    Attributes:
        compute_capability: CUDA compute capability, ``(major, minor)``.
        sm_count: streaming multiprocessors.
        clock_ghz: boost clock in GHz.
        l2_cache_bytes: L2 cache bytes.
        shared_memory_per_sm: shared memory bytes per multiprocessor.
        shared_memory_per_block_optin: shared memory bytes a block may opt in to.
        fpus_per_sm: FP32 units per multiprocessor.
    """

    compute_capability: tuple[int, int]
    sm_count: int
    clock_ghz: float
    l2_cache_bytes: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    fpus_per_sm: int = 128


@public("sx.cost.HardwareSpec")
@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """Public datasheet figures of one accelerator, for roofline estimates and targets.

    Attributes:
        peak_flops: dense bf16 FLOP/s of one device (no sparsity).
        hbm_bandwidth: bytes/s of one device's high-bandwidth memory.
        memory_bytes: bytes of memory on one device.
        ici_bandwidth: bytes/s one way per device over the fast links: NVLink within a
            GPU host, ICI within a TPU slice (the datasheets' bidirectional figure halved).
            None where not known.
        dcn_bandwidth: bytes/s one way per device over the slower network: InfiniBand
            between GPU hosts (the NIC bandwidth of a reference 8-GPU server, per GPU),
            DCN between TPU slices. None where not known.
        source: where the figures come from.
        gpu: the GPU's compiler description (``GpuArch``) for GPU targets, else None.
    """

    peak_flops: float
    hbm_bandwidth: float
    memory_bytes: float
    ici_bandwidth: float | None = None
    dcn_bandwidth: float | None = None
    source: str = ""
    gpu: GpuArch | None = None

    @property
    def critical_intensity(self) -> float:
        """FLOPs per byte at which compute and memory time are equal (peak ÷ bandwidth)."""
        return self.peak_flops / self.hbm_bandwidth


@dataclasses.dataclass(frozen=True)
class TpuSlices:
    """The slices of a TPU generation as Cloud names them.

    Attributes:
        prefix: libtpu's topology name (``"v5p"``).
        cores_per_chip: what a slice's name counts: 2 on v5p, whose names count TensorCores;
            1 on v5e/v6e, whose names count chips.
        topologies: the chip layout of a single slice, by chip count (Cloud's shapes).
        one_host: the chips of the largest slice one host holds alone, laid out 2x4x1
            (v5e-8, v6e-8); 0 where libtpu's default hosts serve every size.
    """

    prefix: str
    cores_per_chip: int
    topologies: dict[int, str]
    one_host: int = 0
