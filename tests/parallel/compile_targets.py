"""Compile-only devices for the tests marked ``compile_only``: an 8×H100 node and a TPU
v5e slice from ``jax.experimental.topologies``, built without the hardware. Each helper
skips the test, naming the missing package, where the compile extras are not installed."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

# One H100 SXM (compute capability 9.0, 132 SMs, 80 GB): shardax's own datasheet figures.
H100_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


# Several test processes on one machine (CI legs, people): libtpu's single-process
# lockfile is for real chips; a compile-only topology needs none.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def require(module: str, package: str) -> None:
    """Skips the test, naming ``package``, when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"compile-only target needs {package} (pip install {package})")


def _topology(**kwargs) -> list:
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(**kwargs).devices)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        pytest.skip(f"compile-only {kwargs.get('platform')} target unavailable here: {e}")


@functools.cache
def _h100(n: int) -> tuple:
    return tuple(_topology(topology_name="", platform="cuda", topology=f"1 x 1 x {n}",
                           target_config=H100_CONFIG))  # fmt: skip


@functools.cache
def _tpu(name: str) -> tuple:
    return tuple(_topology(topology_name=name, platform="tpu"))


def h100(n: int = 8) -> list:
    """``n`` compile-only H100 devices of one host (skipped without jax-cuda12-plugin)."""
    require("jax_cuda12_plugin", "jax-cuda12-plugin")
    require("nvidia.cudnn", "nvidia-cudnn-cu12")
    return list(_h100(n))


def tpu(name: str = "v5e:2x2") -> list:
    """The compile-only devices of TPU topology ``name`` (skipped without libtpu)."""
    require("libtpu", "libtpu")
    return list(_tpu(name))
