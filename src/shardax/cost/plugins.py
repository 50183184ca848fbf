"""The compilers of compile-only targets: JAX's CUDA plugin and libtpu, readied on a machine
without the devices, and the devices of a topology they give.

Both need JAX >= 0.12 (Python 3.12+) and Linux: ``pip install 'shardax[gpu-compile]'``
(JAX's CUDA plugin; no driver or GPU needed) or ``pip install 'shardax[tpu-compile]'``
(libtpu).

>>> installed("shardax"), installed("no_such_package.sub")
(True, False)
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
import sys
from typing import Any

import jax

from shardax.runtime import compat

GPU_EXTRA = "pip install 'shardax[gpu-compile]'"
TPU_EXTRA = "pip install 'shardax[tpu-compile]'"


def require_jax_012(name: str) -> None:
    version = tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2])
    if version < (0, 12):
        raise RuntimeError(
            f"target {name!r} needs JAX >= 0.12 (Python 3.12+) to compile for devices that are "
            f"not present; this is JAX {jax.__version__} on Python {sys.version.split()[0]}. "
            "Use Python 3.12+, then pip install 'shardax[gpu-compile]' or "
            "'shardax[tpu-compile]'"
        )


def installed(module: str) -> bool:
    """Whether ``module`` (dotted, e.g. ``"jax_plugins.xla_cuda12"``) can be imported."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def cuda_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def prepare_cuda_plugin() -> str | None:
    """Lets JAX's CUDA plugin register its compiler on a machine without an NVIDIA driver.

    The plugin checks the CUDA libraries when JAX first looks for backends; without a
    driver the check fails and the plugin registers nothing, so no GPU target can be made.
    The check is skipped when ``JAX_PLATFORMS`` names platforms without CUDA, or when
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK`` is set. This sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``
    only where that is safe: JAX's backends have not started, neither variable is set, and
    no driver (``libcuda.so.1``) can be loaded, so there is no GPU whose libraries the check
    would protect (JAX then falls back to the CPU, as it would anyway). Returns the variable
    it set, or None; [`target`][shardax.target] removes it again once the plugin has registered, so
    it does not reach the rest of the program or its subprocesses.
    """
    if compat.backends_are_initialized() or os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        return None
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or ""
    if platforms and not {"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}:
        return None
    if cuda_driver_present():
        return None
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def gpu_devices(name: str, topology: str, config: str) -> list[Any]:
    """The compile-only GPUs of target ``name``: ``topology`` (``"1 x <hosts> x <GPUs per
    host>"``) of the GPU that ``config`` (a ``GpuTargetConfigProto`` text) describes."""
    from jax.experimental import topologies  # not loaded by import shardax

    if not installed("jax_plugins.xla_cuda12"):
        raise ImportError(
            f"target {name!r} compiles for GPUs through JAX's CUDA plugin, which is not "
            f"installed; install it with: {GPU_EXTRA} (jax-cuda12-plugin, jax-cuda12-pjrt "
            "and nvidia-cudnn-cu12; Linux)"
        )
    skipped = prepare_cuda_plugin()
    try:
        desc = topologies.get_topology_desc(
            "", platform="cuda", topology=topology, target_config=config
        )
    except NotImplementedError as e:
        raise RuntimeError(
            f"target {name!r} needs JAX's CUDA plugin registered, and it is not: JAX's backends "
            "started before sx.target could skip the plugin's CUDA version check, which fails "
            "on a machine without an NVIDIA driver. Set JAX_PLATFORMS=cpu (or "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) in the environment before Python starts, or "
            "call sx.target before the first JAX computation or jax.devices()"
        ) from e
    finally:  # the plugin has registered (or failed to): the check's skip is not needed now
        if skipped is not None:
            os.environ.pop(skipped, None)
    return list(desc.devices)


LIBTPU_LOCK = "/tmp/libtpu_lockfile"
"""The lock libtpu takes when it loads, so that two processes do not drive one TPU."""
ALLOW_MULTIPLE_LIBTPU = "ALLOW_MULTIPLE_LIBTPU_LOAD"


def tpu_chips_attached() -> bool:
    """Whether this machine has TPU chips: a Google PCI device (vendor ``0x1ae0``, as JAX's
    own check reads it) or an ``/dev/accel*`` device."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == "0x1ae0":
                    return True
        except OSError:
            continue
    return bool(glob.glob("/dev/accel*"))


def prepare_libtpu() -> str | None:
    """Lets libtpu load for a compile-only target while another process has it loaded.

    libtpu takes ``LIBTPU_LOCK`` when it initialises and refuses to load while another
    process holds it (advising ``sudo rm`` of a live process's lock). The lock guards the
    TPU chips, which a compile-only target never drives: so this sets
    ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (libtpu's own switch) where no chip could be driven,
    the variable being unset and this machine having no TPU chips
    (``tpu_chips_attached``); on a TPU machine the lock still protects the chips and
    [`target`][shardax.target] says what to do. Returns the variable it set, or None;
    [`target`][shardax.target] removes it once libtpu has loaded (the lock is read once,
    then), so it does not reach the rest of the program or its subprocesses.
    """
    if os.environ.get(ALLOW_MULTIPLE_LIBTPU) is not None or tpu_chips_attached():
        return None
    os.environ[ALLOW_MULTIPLE_LIBTPU] = "1"
    return ALLOW_MULTIPLE_LIBTPU


def _libtpu_locked(name: str, error: BaseException) -> RuntimeError | None:
    """shardax's words for libtpu's refusal to load beside another process (None for
    another error)."""
    if "libtpu_lockfile" not in str(error):
        return None
    return RuntimeError(
        f"target {name!r} loads libtpu, which refused: another process on this machine has "
        f"loaded it and holds its lock {LIBTPU_LOCK} (`lsof {LIBTPU_LOCK}` names it; do not "
        "delete the file, as libtpu's own message says, while that process lives). This "
        "machine has TPU chips, so shardax leaves the lock on. A compile-only target runs "
        f"nothing on the TPU: to compile beside the other process, set "
        f"{ALLOW_MULTIPLE_LIBTPU}=1 in the environment before the first sx.target (this process "
        "must then not run on this machine's TPU), or wait until the other process ends"
    )


def tpu_devices(name: str, topology: str, slices: int, one_host: bool) -> list[Any]:
    """The compile-only TPU chips of target ``name``: ``slices`` slices of ``topology``
    (``"v5p:4x4x4"``), on one host of 8 chips where ``one_host`` (v5e-8, v6e-8)."""
    from jax.experimental import topologies  # not loaded by import shardax

    if not installed("libtpu"):
        raise ImportError(
            f"target {name!r} compiles for TPUs through libtpu, which is not installed; "
            f"install it with: {TPU_EXTRA} (libtpu; Linux)"
        )
    options: dict[str, Any] = {}
    if slices > 1:
        options["num_slices"] = slices
    if one_host:
        options["chips_per_host_bounds"] = (2, 4, 1)
    allowed = prepare_libtpu()
    try:
        desc = topologies.get_topology_desc(topology, platform="tpu", **options)
    except RuntimeError as e:  # jax.errors.JaxRuntimeError
        locked = _libtpu_locked(name, e)
        if locked is None:
            raise
        raise locked from None
    finally:  # libtpu has loaded (or failed to): the lock is not read again
        if allowed is not None:
            os.environ.pop(allowed, None)
    return list(desc.devices)
