"""The fp8 GEMM table of ``shardax calibrate`` (``shardax.cost.calibrate``): ``gemm_fp8``.

Its rows are fp8 GEMMs at the bf16 table's shapes, dtype ``"f8"``: E4M3 × E4M3 operands
quantized beforehand, fp32 accumulation, the two per-tensor scales applied in the epilogue
and a bf16 result (the forward GEMM of ``sx.parallel.fp8_dot_general``; its quantizations
are elementwise kernels, which the stream rows price). Each row names the operand dtypes
XLA's compiled GEMM took, and is an error where it took no fp8 (a bf16 GEMM over widened
values, the trap of marin-community/marin#6660, would price fp8 as bf16).

Only a GPU with fp8 tensor cores (compute capability 8.9 or above: Ada, Hopper, Blackwell)
measures them. Elsewhere the table is ``{"skipped": why}`` (``fp8_skipped``): a CPU, or an
older GPU, widens fp8 operands before the product, so a rate measured there is the wide
GEMM's and would price nothing; ``shardax calibrate --quick`` on a CPU says so and goes on.
Until a kind has these rows, the per-op model prices an fp8 GEMM at the datasheet's fp8
peak over bf16 (``shardax.cost.kernel_prices.FP8_GEMM_FACTOR``, 2) times the measured bf16
rate of the nearest shape, and its report says which it used (``StepCost``'s
``fp8_datasheet_flops`` and ``fp8_measured_flops``).

>>> from types import SimpleNamespace as Device
>>> fp8_skipped(Device(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0"))
>>> "compute capability 8.0" in fp8_skipped(
...     Device(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0"))
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from shardax.cost.kernel_prices import gemm_shape
from shardax.cost.ops import FUSIONS, HloIndex, classify

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with fp8 tensor cores (Ada; Hopper is 9.0)."""


def fp8_unsupported(device: Any) -> str | None:
    """Why ``device`` has no fp8 matmuls (None: it has): not a GPU (a CPU, a TPU: no TPU
    shardax knows has an fp8 matrix unit), or a GPU below compute capability
    ``FP8_CAPABILITY`` (an A100). Read from ``device.compute_capability``, which a
    ``sx.target``'s compile-only GPUs report too.

    >>> from types import SimpleNamespace as Device
    >>> fp8_unsupported(Device(platform="tpu", device_kind="TPU v4"))[-37:]
    '8.9+); these are tpu devices (TPU v4)'
    """
    platform = str(getattr(device, "platform", "")).lower()
    need = (
        f"fp8 matmuls need fp8 tensor cores (an NVIDIA GPU of compute capability "
        f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+)"
    )
    if platform not in ("gpu", "cuda"):
        return f"{need}; these are {platform} devices ({device.device_kind})"
    found = str(getattr(device, "compute_capability", "") or "")
    try:
        capability = tuple(int(x) for x in found.split(".")[:2])
    except ValueError:
        capability = ()
    if len(capability) == 2 and capability < FP8_CAPABILITY:
        return f"{need}; these are {device.device_kind}, compute capability {found}"
    return None


def fp8_skipped(device: Any) -> str | None:
    """Why ``device`` measures no fp8 GEMM rows (None: it does): ``fp8_unsupported``'s
    reason, where XLA widens fp8 operands for the product, so a rate measured there is a
    wide GEMM's and prices nothing.

    >>> from types import SimpleNamespace as Device
    >>> fp8_skipped(Device(platform="cpu", device_kind="cpu"))[:44]
    'fp8 matmuls need fp8 tensor cores (an NVIDIA'
    """
    why = fp8_unsupported(device)
    if why is None:
        return None
    return (
        f"{why}: XLA widens fp8 operands before the product there, so a rate measured "
        "here would be a wide GEMM's and prices nothing"
    )


def gemm_operand_dtypes(hlo: str) -> list[str]:
    """The operand dtype of each GEMM of a compiled program's text (a cuBLAS call's, or
    the dot a Triton GEMM fusion calls), as the per-op model reads it."""
    index = HloIndex(hlo)
    fused = {i.called for i in index.by_name.values() if i.called and i.opcode in FUSIONS}
    out = []
    for comp, instrs in index.by_comp.items():
        if comp in fused:
            continue
        for instr in instrs.values():
            flops = index.flops(instr) if classify(instr) == "gemm" else 0
            if flops:
                out.append(gemm_shape(index, instr, flops)[3])
    return out


def gemm_fp8(
    shapes: Sequence[tuple[int, int, int]],
    seconds_of: Callable[[Callable[[], Any], int], float],
    calls: int = 20,
) -> list[dict[str, Any]]:
    """``(m, k) @ (k, n)`` per shape as an fp8 GEMM (the ``gemm_fp8`` table of the module
    docstring): E4M3 operands, fp32 accumulation, both scales in the epilogue, bf16 out,
    timed by ``seconds_of(fn, calls)`` (``shardax.cost.calibrate``'s pipelined timer). A
    row whose compiled GEMM did not take fp8 operands is an error naming what it took."""
    e4m3 = jnp.float8_e4m3fn
    rows = []
    for m, n, k in shapes:
        keys = jax.random.split(jax.random.key(m * 5 + n * 11 + k), 2)
        a = jax.random.normal(keys[0], (m, k), jnp.bfloat16).astype(e4m3)
        b = jax.random.normal(keys[1], (k, n), jnp.bfloat16).astype(e4m3)
        scales = jnp.float32(0.5), jnp.float32(0.25)

        def product(a, b, sa, sb):
            out = jax.lax.dot_general(
                a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            return (out * (sa * sb)).astype(jnp.bfloat16)

        f = jax.jit(product).lower(a, b, *scales).compile()
        row: dict[str, Any] = {"m": m, "n": n, "k": k, "dtype": "f8"}
        taken = sorted(set(gemm_operand_dtypes(f.as_text())))
        row["operands"] = ",".join(taken) or "no GEMM"
        if not any(t.startswith("f8") for t in taken):
            rows.append(
                {
                    **row,
                    "error": f"XLA compiled no fp8 GEMM here: its GEMMs took "
                    f"{row['operands']}, so this row would price fp8 as "
                    "a wider GEMM",
                }
            )
            continue
        seconds = seconds_of(lambda f=f, a=a, b=b, s=scales: f(a, b, *s), calls)
        rows.append({**row, "ms": seconds * 1e3, "tflops": 2.0 * m * n * k / seconds / 1e12})
        del a, b
    return rows
