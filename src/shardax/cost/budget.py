"""The memory budget a JAX program is planned in: the share of a GPU's memory JAX's
allocator takes, and what a device (live, or a target's) offers.

A kind's row says its rule (``shardax.cost.accelerators.BUDGETS``): on a GPU
(``"allocator"``) JAX compiles each program within its allocator's limit, a share of the
memory; a compile-only target plans in the same share, so a step compiles as it would run.

>>> gpu_memory_fraction(0.95)
0.95
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from typing import Any

import jax

from shardax.cost.hardware import device_spec

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
"""The memory fraction of each GPU target's compile-only client (``remember_fraction``)."""


def remember_fraction(client: Any, fraction: float) -> None:
    """Records ``fraction`` as the memory fraction of the target whose devices' client is
    ``client`` ([`target`][shardax.target] calls it)."""
    _TARGET_FRACTIONS[client] = fraction


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
