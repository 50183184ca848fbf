"""Targets: compile-only devices of a GPU node or cluster, or of a TPU slice, on any machine.

``sx.target("8xH100")`` gives the devices of a cluster you do not have, for compiling a step
ahead of time (``step.lower(state, batch).compile()`` with abstract inputs): their memory
per device, FLOPs and collectives, without an accelerator. Through JAX's
``jax.experimental.topologies``, with JAX's CUDA plugin (``pip install
'shardax[gpu-compile]'``) or libtpu (``pip install 'shardax[tpu-compile]'``); both need
JAX >= 0.12 (Python 3.12+) and Linux.

Names:

- GPUs: ``"<GPUs per host>x<GPU>"`` (one host) or ``"<hosts>x<GPUs per host>x<GPU>"``, for
  the GPUs of ``GPU_KINDS`` (H100, H200, B200, A100-80GB). A single number above
  ``GPUS_PER_HOST`` (8, the GPUs of an HGX/DGX server) is split into hosts of 8:
  ``"64xH100"`` is 8 hosts of 8; ``"4xH100"`` is one host of 4. A host holds at most
  ``HOST_GPUS`` of its kind (8), so ``"2x16xH100"`` is refused.
- TPU slices as Google Cloud names them: ``"v5p-N"`` counts TensorCores (2 per chip, so
  ``"v5p-128"`` is 64 chips), ``"v5e-N"``/``"v5litepod-N"`` and ``"v6e-N"`` count chips.
  ``"Kx<slice>"`` is K slices over the data-center network (multislice): ``"2xv5p-128"``.

>>> sx.target("8xH100")  # doctest: +SKIP
Target('8xH100': 8 x NVIDIA H100 80GB HBM3, 1 host x 8)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import glob
import importlib.resources
import importlib.util
import os
import re
import sys
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax

from shardax.checks import public
from shardax.cost.hardware import HardwareSpec, device_spec
from shardax.cost.network import Network, default_network, named_network, remember_network
from shardax.runtime import compat

GPUS_PER_HOST = 8
"""GPUs per host when a GPU target's name gives only a total (HGX/DGX servers hold 8)."""

GPU_KINDS: dict[str, str] = {
    "H100": "NVIDIA H100 80GB HBM3",
    "H200": "NVIDIA H200",
    "B200": "NVIDIA B200",
    "A100-80GB": "NVIDIA A100-SXM4-80GB",
}
"""The GPUs of a GPU target's name, and the device kind their devices report (SXM parts)."""

HOST_GPUS: dict[str, int] = {model: GPUS_PER_HOST for model in GPU_KINDS}
"""The GPUs of one host (one NVLink domain) of each GPU of ``GPU_KINDS``: 8 on the
HGX/DGX servers of all four, whose datasheet rows (NVLink, and InfiniBand per GPU) are
figures of such a server. A target's name may give fewer per host, never more: 16 H100s
in one NVLink domain is no machine the figures describe."""

JAX_MEMORY_FRACTION = 0.75
"""The share of a GPU's memory JAX's allocator takes when the environment names none
(``XLA_CLIENT_MEM_FRACTION``, or the older ``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""

MEMORY_FRACTION_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")

XLA_COMPILE_ONLY_SHARE = 0.8
"""The share of a target's ``device_memory_size`` that XLA:GPU plans a program in when
no device gives it an allocator's limit (``GetSchedulerMemoryLimit``, as with compile-only
devices). On a GPU, JAX compiles with its allocator's limit instead. XLA's own combine
heuristics read ``device_memory_size`` whole, so with XLA's default combine thresholds a
target combines up to 1.25x what the GPU would (shardax's ``"auto"`` sets them)."""


def gpu_memory_fraction(memory_fraction: float | None = None) -> float:
    """The share of a GPU's memory that a JAX process on it plans programs in:
    ``memory_fraction`` if given, else the environment's ``XLA_CLIENT_MEM_FRACTION`` (or
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``), else JAX's default ``JAX_MEMORY_FRACTION``.

    On a GPU, JAX compiles each program with its allocator's limit (that share of the
    memory) as XLA's memory budget: past it XLA rematerializes (recomputes activations),
    which costs time. A compile-only target plans with the same budget, so a step that
    fits only with ``XLA_CLIENT_MEM_FRACTION=0.95`` compiles as it would run with it.

    >>> gpu_memory_fraction(0.95)
    0.95
    """
    where, value = "memory_fraction", memory_fraction
    if memory_fraction is None:
        for variable in MEMORY_FRACTION_VARIABLES:
            if os.environ.get(variable):
                where, value = variable, os.environ[variable]
                break
        else:
            return JAX_MEMORY_FRACTION
    fraction = float("nan")
    if isinstance(value, str) and where != "memory_fraction":  # the environment's text
        with contextlib.suppress(ValueError):
            fraction = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        fraction = float(value)
    if not 0 < fraction <= 1:
        raise ValueError(
            f"sx.target: {where} is the share of each GPU's memory JAX's allocator takes, "
            f"a number in (0, 1] (JAX's default {JAX_MEMORY_FRACTION}); got {value!r}"
        )
    return fraction


def budgeted_gpu_config(config: str, memory_bytes: float, fraction: float) -> str:
    """``config`` (a ``GpuTargetConfigProto`` text) with its ``device_memory_size`` set so
    that the share XLA plans a compile-only program in (``XLA_COMPILE_ONLY_SHARE``) is
    ``fraction`` of ``memory_bytes``: the budget JAX gives XLA on the GPU itself.

    >>> budgeted_gpu_config("  device_memory_size: 100", 1000, 0.8)
    '  device_memory_size: 1000'
    """
    size = round(memory_bytes * fraction / XLA_COMPILE_ONLY_SHARE)
    new, found = re.subn(r"(?m)^(\s*device_memory_size:) \d+$", rf"\1 {size}", config)
    if found != 1:
        raise ValueError(f"config must hold one device_memory_size field; found {found}")
    return new


_TARGET_FRACTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The memory fraction of each GPU target's compile-only client (``target`` fills it)."""


def device_memory(device: Any = None) -> tuple[float, str] | None:
    """The bytes of ``device``'s memory that JAX's programs may use (default: the first
    of ``jax.devices()``), and where the figure comes from; None where nothing knows it.

    A live accelerator's allocator limit (``memory_stats()["bytes_limit"]``: on a GPU,
    ``XLA_CLIENT_MEM_FRACTION`` of its memory); a GPU target's ``memory_fraction`` of the
    datasheet's memory (what [`target`][shardax.target] compiled its programs in); else the
    datasheet's memory (a TPU, or a device with no allocator figure).

    >>> from types import SimpleNamespace
    >>> device_memory(SimpleNamespace(platform="gpu", device_kind="NVIDIA H200"))
    (150754820096.0, 'datasheet: 143,771 MiB')
    """
    device = jax.devices()[0] if device is None else device
    stats = _allocator_stats(device)
    if stats and stats.get("bytes_limit"):
        limit = float(stats["bytes_limit"])
        return limit, f"the allocator's limit: {limit / 2**20:,.0f} MiB"
    spec = device_spec(device)
    if spec is None:
        return None
    try:
        fraction = _TARGET_FRACTIONS.get(device.client)
    except (AttributeError, TypeError):  # no client, or one no weak reference can hold
        fraction = None
    hbm = float(spec.memory_bytes)
    if fraction is not None:
        return hbm * fraction, f"memory_fraction {fraction:g} of {hbm / 2**20:,.0f} MiB"
    return hbm, f"datasheet: {hbm / 2**20:,.0f} MiB"


def _allocator_stats(device: Any) -> dict[str, Any] | None:
    """``device``'s allocator figures; where it gives none (another process's device: only
    a process's own devices report them), those of this process's first device of its kind,
    so that every process plans in the same figure. None for a compile-only target device
    (no allocator, and no local device on its client), a CPU, or a kind not here."""
    try:
        stats = device.memory_stats()
    except (AttributeError, RuntimeError):  # compile-only, or not this process's
        stats = None
    if stats:
        return stats
    try:
        mine = device.client.local_devices()  # none on a compile-only client
        twin = next(d for d in mine if d.device_kind == device.device_kind and d != device)
        return twin.memory_stats()
    except (AttributeError, RuntimeError, StopIteration):
        return None


@dataclasses.dataclass(frozen=True)
class TpuFamily:
    """A TPU generation as Cloud names its slices: ``prefix`` (libtpu's topology name),
    ``kind`` (the device kind), ``cores_per_chip`` (what a slice name counts: 2 on v5p,
    whose names count TensorCores; 1 on v5e/v6e, whose names count chips) and the
    ``topologies`` of single slices by chip count (Cloud's documented shapes)."""

    prefix: str
    kind: str
    cores_per_chip: int
    topologies: dict[int, str]


_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
             256: "16x16"}  # fmt: skip
TPU_FAMILIES: dict[str, TpuFamily] = {
    # cloud.google.com/tpu/docs/v5p: slice shapes 2x2x1 (4 chips) to 16x16x24 (6144 chips).
    "v5p": TpuFamily("v5p", "TPU v5", 2, {
        4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
        256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16",
        6144: "16x16x24"}),
    # cloud.google.com/tpu/docs/v5e and /v6e: 2D slices of 1 to 256 chips.
    "v5e": TpuFamily("v5e", "TPU v5 lite", 1, _TORUS_2D),
    "v5litepod": TpuFamily("v5e", "TPU v5 lite", 1, _TORUS_2D),
    "v6e": TpuFamily("v6e", "TPU v6 lite", 1, _TORUS_2D),
}  # fmt: skip
"""The TPU generations of a TPU target's name (``"v5litepod"`` is v5e's Cloud name)."""

GPU_EXTRA = "pip install 'shardax[gpu-compile]'"
TPU_EXTRA = "pip install 'shardax[tpu-compile]'"
_EXAMPLES = "'8xH100', '2x8xH200', '64xB200', '8xA100-80GB', 'v5p-128', 'v5e-16', '2xv5p-128'"


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


def known_targets() -> list[str]:
    """Examples of every kind of name [`target`][shardax.target] takes (the rules are in its doc).

    >>> "v5p-128" in known_targets()
    True
    """
    gpus = [f"{n}x{g}" for g in GPU_KINDS for n in (8,)] + ["2x4xH100", "64xH100"]
    tpus = []
    for family, info in TPU_FAMILIES.items():
        tpus += [f"{family}-{c * info.cores_per_chip}" for c in sorted(info.topologies)]
    return gpus + tpus + ["2xv5p-128"]


def _unknown(name: str, why: str) -> ValueError:
    families = ", ".join(
        f"{f}-N (N in {sorted(c * i.cores_per_chip for c in i.topologies)})"
        for f, i in TPU_FAMILIES.items()
    )
    return ValueError(
        f"name must name a GPU cluster '<GPUs per host>x<GPU>' or '<hosts>x<GPUs per host>"
        f"x<GPU>' with GPU one of {sorted(GPU_KINDS)}, or a TPU slice {families}, with "
        f"'<K>x' before a TPU slice for K slices (e.g. {_EXAMPLES}); {why}, got {name!r}"
    )


def parse_target(name: str) -> dict[str, Any]:
    """What a target's name means, without building devices: ``platform``, ``kind``,
    ``hosts``/``devices_per_host`` (GPUs) or ``family``/``chips``/``slices`` (TPUs).

    >>> parse_target("64xH100")["hosts"], parse_target("v5p-128")["chips"]
    (8, 64)
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str such as '8xH100' or 'v5p-128', got {name!r}")
    text = name.strip()
    gpu = re.fullmatch(r"(?:(\d+)x)?(\d+)x([A-Za-z0-9-]+)", text)
    if gpu and gpu.group(3).upper() in {g.upper() for g in GPU_KINDS}:
        model = next(g for g in GPU_KINDS if g.upper() == gpu.group(3).upper())
        hosts, per_host = (int(gpu.group(1)), int(gpu.group(2))) if gpu.group(1) else (1, 0)
        if not gpu.group(1):
            total = int(gpu.group(2))
            if total <= GPUS_PER_HOST:
                per_host = total
            elif total % GPUS_PER_HOST:
                raise _unknown(name, f"{total} GPUs do not fill hosts of {GPUS_PER_HOST}; "
                               f"write '<hosts>x<GPUs per host>x{model}'")  # fmt: skip
            else:
                hosts, per_host = total // GPUS_PER_HOST, GPUS_PER_HOST
        if hosts < 1 or per_host < 1:
            raise _unknown(name, "the counts must be >= 1")
        if per_host > HOST_GPUS[model]:
            most, total = HOST_GPUS[model], hosts * per_host
            way = f"'<hosts>x<GPUs per host>x{model}' with at most {most} per host"
            if total % most == 0:
                way = f"'{total}x{model}' ({total // most} hosts of {most}), or " + way
            raise ValueError(
                f"name {name!r} puts {per_host} {model} GPUs on one host, but an HGX/DGX {model} "
                f"host (one NVLink domain, the server the datasheet's figures describe) "
                f"holds at most {most}; write {way}"
            )
        return {"platform": "gpu", "model": model, "kind": GPU_KINDS[model], "hosts": hosts,
                "devices_per_host": per_host}  # fmt: skip
    tpu = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)-(\d+)", text.lower())
    if tpu and tpu.group(2) in TPU_FAMILIES:
        info = TPU_FAMILIES[tpu.group(2)]
        slices, count = int(tpu.group(1) or 1), int(tpu.group(3))
        chips, odd = divmod(count, info.cores_per_chip)
        if odd or chips not in info.topologies:
            unit = "TensorCores (2 per chip)" if info.cores_per_chip == 2 else "chips"
            sizes = sorted(c * info.cores_per_chip for c in info.topologies)
            raise _unknown(name, f"{tpu.group(2)}-N counts {unit} and N must be one of {sizes}")
        if slices < 1:
            raise _unknown(name, "the number of slices must be >= 1")
        topology = f"{info.prefix}:{info.topologies[chips]}"
        return {"platform": "tpu", "family": tpu.group(2), "kind": info.kind, "chips": chips,
                "slices": slices, "topology": topology}  # fmt: skip
    raise _unknown(name, "this is neither")


CUDA_VERSIONS = {
    "driver_version": "13.0.0",
    "runtime_version": "12.8.0",
    "compile_time_toolkit_version": "12.8.0",
}
"""The CUDA versions a GPU target claims (``gpu_device_info``): those of the device specs
the jax-cuda12 plugin ships (XLA's ``gpu_specs``), the versions a pip install runs."""


def gpu_target_config(kind: str, spec: HardwareSpec) -> str:
    """XLA's ``GpuTargetConfigProto`` in text form for a GPU of ``kind`` whose datasheet row
    is ``spec`` (its ``GpuArch`` and memory figures): what the files of
    ``shardax/cost/targets/`` hold, one field per line.

    >>> h100 = device_spec(SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3"))
    >>> "  core_count: 132" in gpu_target_config("NVIDIA H100 80GB HBM3", h100).splitlines()
    True
    """
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
        f"# {kind}: written by shardax/cost/compile_target.py from shardax's datasheet",
        "# row (shardax/cost/hardware.py); regenerate with write_gpu_target_configs().",
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


def gpu_config_file(model: str) -> str:
    """The file name of ``model``'s target config in ``shardax/cost/targets/``.

    >>> gpu_config_file("A100-80GB")
    'a100-80gb.txtpb'
    """
    return f"{model.lower()}.txtpb"


def gpu_target_configs() -> dict[str, str]:
    """``{file name: text}`` of every GPU of ``GPU_KINDS``, from the datasheet table."""
    return {
        gpu_config_file(model): gpu_target_config(kind, _spec("gpu", kind))
        for model, kind in GPU_KINDS.items()
    }


def write_gpu_target_configs(directory: str | os.PathLike | None = None) -> list[str]:
    """Writes ``gpu_target_configs`` to ``directory`` (default: the package's
    ``targets/``); returns the paths written. Run after changing a GPU's datasheet row."""
    folder = Path(directory) if directory is not None else Path(__file__).parent / "targets"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for file, text in gpu_target_configs().items():
        (folder / file).write_text(text)
        paths.append(str(folder / file))
    return paths


def _spec(platform: str, kind: str) -> HardwareSpec:
    spec = device_spec(SimpleNamespace(platform=platform, device_kind=kind))
    assert spec is not None, kind  # every kind of GPU_KINDS / TPU_FAMILIES has a row
    return spec


def _require_jax_012(name: str) -> None:
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


def _cuda_driver_present() -> bool:
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
    if _cuda_driver_present():
        return None
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    return "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"


def _gpu_devices(name: str, parsed: dict[str, Any]) -> tuple[list[Any], str]:
    from jax.experimental import topologies  # not loaded by import shardax

    if not installed("jax_plugins.xla_cuda12"):
        raise ImportError(
            f"target {name!r} compiles for GPUs through JAX's CUDA plugin, which is not "
            f"installed; install it with: {GPU_EXTRA} (jax-cuda12-plugin, jax-cuda12-pjrt "
            "and nvidia-cudnn-cu12; Linux)"
        )
    file = gpu_config_file(parsed["model"])
    config = importlib.resources.files("shardax.cost").joinpath("targets", file).read_text()
    config = budgeted_gpu_config(config, _spec("gpu", GPU_KINDS[parsed["model"]]).memory_bytes,
                                 parsed["memory_fraction"])  # fmt: skip
    topology = f"1 x {parsed['hosts']} x {parsed['devices_per_host']}"
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
    return list(desc.devices), topology


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
    [`target`][shardax.target] removes it once libtpu has loaded (the lock is read once, then), so
    it
    does not reach the rest of the program or its subprocesses.
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


def _tpu_devices(name: str, parsed: dict[str, Any]) -> tuple[list[Any], str]:
    from jax.experimental import topologies  # not loaded by import shardax

    if not installed("libtpu"):
        raise ImportError(
            f"target {name!r} compiles for TPUs through libtpu, which is not installed; "
            f"install it with: {TPU_EXTRA} (libtpu; Linux)"
        )
    options: dict[str, Any] = {}
    if parsed["slices"] > 1:
        options["num_slices"] = parsed["slices"]
    if parsed["chips"] == 8 and parsed["kind"] != "TPU v5":
        options["chips_per_host_bounds"] = (2, 4, 1)  # v5e-8, v6e-8: one host of 8 chips
    allowed = prepare_libtpu()
    try:
        desc = topologies.get_topology_desc(parsed["topology"], platform="tpu", **options)
    except RuntimeError as e:  # jax.errors.JaxRuntimeError
        locked = _libtpu_locked(name, e)
        if locked is None:
            raise
        raise locked from None
    finally:  # libtpu has loaded (or failed to): the lock is not read again
        if allowed is not None:
            os.environ.pop(allowed, None)
    return list(desc.devices), parsed["topology"]


@public("sx.target")
def target(
    name: str, *, memory_fraction: float | None = None, network: str | Network | None = None
) -> Target:
    """Compile-only devices of the GPU cluster or TPU slice(s) ``name``, with their device
    kind, hosts (``process_index``), TPU slices (``slice_index``) and datasheet row.

    A GPU target's programs are planned in the memory a JAX process on that GPU gets:
    ``memory_fraction`` of it (default: ``XLA_CLIENT_MEM_FRACTION`` from the environment,
    else JAX's 0.75; ``gpu_memory_fraction`` in this module).
    XLA rematerializes a step that needs more, as it would on the GPU; pass the fraction
    the run will set (``memory_fraction=0.95``) to compile what it will run.

    Names: ``"8xH100"`` (one host of 8), ``"2x4xH100"`` (2 hosts of 4), ``"64xH100"`` (8
    hosts of ``GPUS_PER_HOST`` = 8), for H100, H200, B200 and A100-80GB; TPU slices as
    Cloud names them: ``"v5p-128"`` (v5p counts TensorCores, 2 per chip: 64 chips),
    ``"v5e-16"`` or ``"v5litepod-16"`` and ``"v6e-16"`` (16 chips), ``"2xv5p-128"`` (two
    slices). Each slice's chip layout is Cloud's documented shape for its size.

    Needs JAX >= 0.12 (Python 3.12+) on Linux, with ``pip install 'shardax[gpu-compile]'``
    for GPUs (JAX's CUDA plugin; no driver or GPU needed) or ``pip install
    'shardax[tpu-compile]'`` for TPUs (libtpu). On a machine without an NVIDIA driver the
    CUDA plugin registers only if its version check is skipped; when JAX's backends have
    not started yet this sets ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` in the environment for
    the plugin's registration only, and removes it after (``prepare_cuda_plugin`` says
    when that is safe); when they have, set
    ``JAX_PLATFORMS=cpu`` before Python starts (the error says so).

    ``network``: what joins a GPU target's hosts, a name of
    ``shardax.cost.network.NETWORKS`` or a cloud shape (``"ib-ndr"``, ``"gcp-a3-mega"``,
    ``"a3-megagpu-8g"``, ``"p5.48xlarge"``, ``"ethernet-100g"``); default: the GPU kind's
    DGX network (``DEFAULT_NETWORKS``: InfiniBand NDR for H100, H200 and B200, HDR for
    A100). Collectives across hosts are priced at its figures; an unknown name is refused.

    >>> target = sx.target("8xH100")  # doctest: +SKIP
    >>> mesh = sx.make_mesh({"data": 8}, devices=target)  # doctest: +SKIP
    >>> step.lower(abstract_state, abstract_batch).compile().memory_analysis()  # doctest: +SKIP
    """
    parsed = parse_target(name)
    if parsed["platform"] == "gpu":
        parsed["memory_fraction"] = gpu_memory_fraction(memory_fraction)
        chosen = default_network(parsed["model"]) if network is None else named_network(network)
    elif network is not None:
        raise ValueError(
            f"network names what joins GPU hosts (shardax.cost.network.NETWORKS); {name!r} is "
            f"a TPU slice, whose slices are joined by DCN; got network={network!r}"
        )
    elif memory_fraction is not None:
        raise ValueError(
            f"sx.target: memory_fraction is the share of a GPU's memory JAX's allocator "
            f"takes, for GPU targets; {name!r} is a TPU slice; got memory_fraction="
            f"{memory_fraction!r}"
        )
    _require_jax_012(name)
    make = _gpu_devices if parsed["platform"] == "gpu" else _tpu_devices
    devices, topology = make(name, parsed)
    if parsed.get("memory_fraction") is not None:
        _TARGET_FRACTIONS[devices[0].client] = parsed["memory_fraction"]
    if parsed["platform"] == "gpu" and chosen is not None:
        remember_network(devices[0].client, chosen)
    hosts = len({d.process_index for d in devices})
    return Target(
        name=name,
        platform=parsed["platform"],
        devices=tuple(devices),
        spec=_spec(parsed["platform"], str(devices[0].device_kind)),
        hosts=hosts,
        devices_per_host=len(devices) // hosts,
        slices=len({getattr(d, "slice_index", 0) for d in devices}),
        topology=topology,
        memory_fraction=parsed.get("memory_fraction"),
        network=chosen if parsed["platform"] == "gpu" else None,
    )
