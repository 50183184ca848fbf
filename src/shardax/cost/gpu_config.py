"""XLA's GPU target configs: what a compile-only GPU target's compiler is told of its GPU,
written from the GPU's row of the table of accelerators.

>>> from shardax.cost.accelerators import named
>>> h100 = named("H100")
>>> "  core_count: 132" in gpu_target_config(h100.device_kind, h100.spec).splitlines()
True
"""

from __future__ import annotations

from shardax.cost.accelerators import gpu_targets
from shardax.cost.datasheet import HardwareSpec

CUDA_VERSIONS = {
    "driver_version": "13.0.0",
    "runtime_version": "12.8.0",
    "compile_time_toolkit_version": "12.8.0",
}
"""The CUDA versions a GPU target claims (``gpu_device_info``): those of the device specs
the jax-cuda12 plugin ships (XLA's ``gpu_specs``), the versions a pip install runs."""


def gpu_target_config(kind: str, spec: HardwareSpec) -> str:
    """XLA's ``GpuTargetConfigProto`` in text form for a GPU of ``kind`` whose datasheet row
    is ``spec`` (its ``GpuArch`` and memory figures), one field per line: what
    [`target`][shardax.target] compiles with."""
    arch = spec.gpu
    if arch is None:
        raise ValueError(f"spec must have a GpuArch (spec.gpu) to describe {kind!r}, got {spec}")
    major, minor = arch.compute_capability
    fields = [
        ("threads_per_block_limit", 1024),
        ("threads_per_warp", 32),
        ("shared_memory_per_block", 48 * 1024),
        ("shared_memory_per_core", arch.shared_memory_per_sm),
        ("threads_per_core_limit", 2048),
        ("core_count", arch.sm_count),
        ("fpus_per_core", arch.fpus_per_sm),
        ("block_dim_limit_x", 2**31 - 1),
        ("block_dim_limit_y", 65535),
        ("block_dim_limit_z", 65535),
        ("memory_bandwidth", int(spec.hbm_bandwidth)),
        ("l2_cache_size", arch.l2_cache_bytes),
        ("clock_rate_ghz", arch.clock_ghz),
        ("device_memory_size", int(spec.memory_bytes)),
        ("shared_memory_per_block_optin", arch.shared_memory_per_block_optin),
    ]
    lines = [
        f"# {kind}: written by shardax/cost/gpu_config.py from its row of the table of",
        "# accelerators (shardax/cost/accelerators.py).",
        "gpu_device_info {",
        *(f"  {k}: {v}" for k, v in fields),
        "  cuda_compute_capability {",
        f"    major: {major}",
        *([f"    minor: {minor}"] if minor else []),
        "  }",
        "  registers_per_core_limit: 65536",
        "  registers_per_block_limit: 65536",
        # The CUDA versions of the jax-cuda12 plugin's own device specs: without them XLA
        # takes the runtime for CUDA 0 and gates version-dependent rewrites off (cuBLASLt's
        # fp8 GEMMs, which need CUDA 12, ran as f16 GEMMs over upcast fp8 operands).
        *(f'  {k}: "{v}"' for k, v in CUDA_VERSIONS.items()),
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {",
        "  major: 9",
        "  minor: 8",
        "}",
        f'device_description_str: "{kind}"',
    ]
    return "\n".join(lines) + "\n"


def gpu_target_configs() -> dict[str, str]:
    """``{file name: text}`` of the config of every GPU a target's name may give
    (``"h100.txtpb"``), for reading: [`target`][shardax.target] writes its own."""
    return {
        f"{row.kind.lower()}.txtpb": gpu_target_config(row.device_kind, row.spec)
        for row in gpu_targets()
        if row.spec is not None
    }
