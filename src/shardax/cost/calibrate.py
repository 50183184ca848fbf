"""Measure this GPU's kernels: the tables the per-op cost model prices a compiled step with.

``shardax calibrate --out FILE`` runs ``tables()`` on the first device and writes them;
``shardax plan --target ... --calibration FILE`` (or
``sx.cost.calibration.register(sx.cost.calibration.load(FILE))``) then prices steps for
that device kind with them. The shipped H100 and H200 tables (``shardax/cost/tables/``)
were measured this way. Nine tables, each a list of JSON rows:

- ``gemm``: bf16 matrix products ``(m, k) @ (k, n)`` with fp32 accumulation, by shape:
  the GPT's own projections at 8k tokens, their backward shapes, and a square ladder;
  TFLOP/s is ``2·m·n·k`` over the median time.
- ``gemm_f32``: fp32 ``(m, k) @ (k, n)`` at JAX's default precision, a few shapes.
- ``gemm_f32_cublas``: the same with XLA's Triton GEMMs off, so cuBLAS runs them: what a
  step compiled with ``xla_gpu_enable_triton_gemm=False`` runs (the cost model prices a
  cuBLAS call's fp32 GEMM by these rows, dtype ``"f32-cublas"``).
- ``gemm_fp8``: fp8 GEMMs (E4M3 operands, dtype ``"f8"``) at the bf16 table's shapes, on a
  GPU with fp8 tensor cores only; elsewhere ``{"skipped": why}`` (``shardax.cost.calibrate_fp8``).
- ``stream``: elementwise passes over large arrays (copy, scale, a bf16 → fp32 convert),
  GB/s counting bytes read plus bytes written.
- ``reduce``: row and column reductions of a ``(65536, 2048)`` array (a norm's shape),
  and softmax over its rows (plain, causal-masked, forward + backward: a dense
  attention's fp32 scores).
- ``attention``: ``jax.nn.dot_product_attention`` (cuDNN on a GPU, XLA elsewhere),
  forward and forward + backward, causal and not; TFLOP/s counts ``4·b·s²·h·d``
  forward (``2.5×`` that for the backward), halved when causal.
- ``launch``: the host's dispatch of one jitted call, and the device's cost per kernel
  in a chain of kernels XLA cannot fuse (``lax.optimization_barrier`` between them).
- ``collectives``: all-reduce, all-gather and reduce-scatter over all of this process's
  devices (one host: NVLink on a GPU server) from 64 KiB to 256 MiB per device, with the
  bytes each device sends; ``shardax.cost.calibration`` fits each op's latency and
  bandwidth to them. Empty on one device.

Every time is the median of ``repeats`` calls after one warm-up; calls are dispatched
back to back, so the host's dispatch overlaps the device's work, as in training. A GPU
takes about a minute; ``quick`` measures small shapes (a smoke test, e.g. on a CPU).

>>> out = tables(quick=True)  # doctest: +SKIP
>>> [name for name in out if isinstance(out[name], list)]  # doctest: +SKIP
['gemm', 'gemm_f32', 'gemm_f32_cublas', 'stream', 'reduce', 'attention', 'collectives', 'launch']
>>> out["gemm_fp8"]  # on a CPU  # doctest: +SKIP
{'skipped': 'fp8 matmuls need fp8 tensor cores ...'}
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from shardax.cost.calibrate_fp8 import fp8_skipped, gemm_fp8
from shardax.cost.hlo import collectives as collectives_in
from shardax.cost.network import named_network

GPT_TOKENS = 8192
"""Rows of the GPT's projections: 4 sequences of 2048 tokens, the default step."""


def gemm_shapes(quick: bool = False) -> list[tuple[int, int, int]]:
    """``(m, n, k)`` of the GPT's matmuls (d 2048, MLP 8192, 8k tokens: forward, then the
    weight gradients' shapes), and a square ladder; a few small ones with ``quick``."""
    if quick:
        return [(256, 256, 256), (512, 256, 128)]
    t, d, f = GPT_TOKENS, 2048, 8192
    forward = [(t, d, d), (t, f, d), (t, d, f)]  # q/k/v/out, up, down
    weight_grads = [(d, d, t), (d, f, t), (f, d, t)]
    square = [(s, s, s) for s in (1024, 2048, 4096, 8192)]
    skinny = [(t, 256, d), (2 * t, 3 * d, d)]  # the head over a 256-byte vocabulary; fused qkv
    return forward + weight_grads + square + skinny


def attention_shapes(quick: bool = False) -> list[tuple[int, int, int, int]]:
    """``(batch, seq, heads, head_dim)``: the GPT's (4 × 2048, 16 heads of 128), longer
    sequences at the same tokens, and head_dim 64."""
    if quick:
        return [(2, 64, 2, 32)]
    return [(4, 2048, 16, 128), (1, 8192, 16, 128), (4, 2048, 32, 64)]


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()`` (which returns arrays), over ``repeats`` calls
    dispatched back to back after one warm-up; blocks on the last."""
    jax.block_until_ready(fn())
    times = []
    out = None
    for _ in range(repeats):
        began = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - began)
    del out
    return statistics.median(times)


def _pipelined_seconds(fn: Callable[[], Any], calls: int, rounds: int = 3) -> float:
    """Seconds per call of ``fn`` with ``calls`` dispatched back to back (the host's
    dispatch hidden behind the device), the median over ``rounds``."""
    jax.block_until_ready(fn())
    per_call = []
    for _ in range(rounds):
        began = time.perf_counter()
        outs = [fn() for _ in range(calls)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - began) / calls)
        del outs
    return statistics.median(per_call)


def gemm(
    shapes: Sequence[tuple[int, int, int]],
    calls: int = 20,
    dtype: str = "bf16",
    cublas: bool = False,
) -> list[dict[str, Any]]:
    """``(m, k) @ (k, n)`` per shape: bf16 → bf16 with fp32 accumulation, or fp32 → fp32
    at JAX's default precision (what an fp32 model's matmuls run at); ``cublas``: with
    XLA's Triton GEMMs off (the row's dtype gets ``-cublas``)."""
    operand = {"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype]
    rows = []
    for m, n, k in shapes:
        keys = jax.random.split(jax.random.key(m * 7 + n * 3 + k), 2)
        a = jax.random.normal(keys[0], (m, k), operand)
        b = jax.random.normal(keys[1], (k, n), operand)
        options = {"xla_gpu_enable_triton_gemm": False} if cublas else None
        f = jax.jit(
            lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype),
            compiler_options=options,
        )
        seconds = _pipelined_seconds(lambda f=f, a=a, b=b: f(a, b), calls)
        kind, tflops = dtype + ("-cublas" if cublas else ""), 2.0 * m * n * k / seconds / 1e12
        rows.append({"m": m, "n": n, "k": k, "dtype": kind, "ms": seconds * 1e3, "tflops": tflops})
        del a, b
    return rows


def fp32_gemm_shapes(quick: bool = False) -> list[tuple[int, int, int]]:
    """``(m, n, k)`` of the fp32 table: the GPT's projections and two squares."""
    if quick:
        return [(256, 256, 256)]
    t, d, f = GPT_TOKENS, 2048, 8192
    return [(t, d, d), (t, f, d), (d, f, t), (4096, 4096, 4096), (8192, 8192, 8192)]


def _causal_softmax(x: Any) -> Any:
    """Softmax over the last axis with row ``r`` seeing columns ``<= r % width`` (a causal
    score matrix's rows, stacked)."""
    rows, cols = x.shape
    row = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) % cols
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return jax.nn.softmax(jnp.where(col <= row, x, -jnp.inf), axis=-1)


def reduce(rows: int, width: int = 2048, calls: int = 20) -> list[dict[str, Any]]:
    """Row reductions of a ``(rows, width)`` array (a norm's or a softmax's shape): GB/s
    of bytes read plus written."""
    x32 = jax.random.normal(jax.random.key(2), (rows, width), jnp.float32)
    x16 = x32.astype(jnp.bfloat16)

    def squares(x):
        return jnp.square(x.astype(jnp.float32)).sum(-1)

    def rms_norm(x):
        scale = jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
        return (x * scale).astype(x.dtype)

    def softmax_fwd_bwd(x):
        return jax.vjp(lambda x: jax.nn.softmax(x, axis=-1), x)[1](x)[0]

    cases = [
        ("row sum fp32", jax.jit(lambda x: x.sum(-1)), x32, 4),
        ("row sum of squares bf16->fp32", jax.jit(squares), x16, 2),
        ("rms norm bf16", jax.jit(rms_norm), x16, 4),
        ("column sum fp32", jax.jit(lambda x: x.sum(0)), x32, 4),
        # a dense attention's scores (fp32, a row per query): softmax, causal-masked, and
        # forward + backward (reads x, writes y; reads y and the cotangent, writes dx)
        ("softmax fp32", jax.jit(lambda x: jax.nn.softmax(x, axis=-1)), x32, 8),
        ("causal softmax fp32", jax.jit(_causal_softmax), x32, 8),
        ("softmax fp32 fwd+bwd", jax.jit(softmax_fwd_bwd), x32, 20),
    ]
    out = []
    for name, f, x, bytes_per in cases:
        seconds = _pipelined_seconds(lambda f=f, x=x: f(x), calls)
        n = rows * width
        row = {"op": name, "rows": rows, "width": width, "bytes": bytes_per * n}
        out.append({**row, "ms": seconds * 1e3, "gbs": bytes_per * n / seconds / 1e9})
    del x32, x16
    return out


def stream(elements: int, calls: int = 20) -> list[dict[str, Any]]:
    """Elementwise passes over ``elements`` values: GB/s of bytes read plus written."""
    x32 = jax.random.normal(jax.random.key(1), (elements,), jnp.float32)
    x16 = x32.astype(jnp.bfloat16)
    cases = [
        ("scale fp32", jax.jit(lambda x: x * 1.0001), x32, 8),
        ("add fp32", jax.jit(lambda x: x + x[::-1]), x32, 8),
        ("convert bf16->fp32", jax.jit(lambda x: x.astype(jnp.float32)), x16, 6),
        ("scale bf16", jax.jit(lambda x: x * 1.0001), x16, 4),
    ]
    rows = []
    for name, f, x, bytes_per in cases:
        seconds = _pipelined_seconds(lambda f=f, x=x: f(x), calls)
        row = {"op": name, "elements": elements, "bytes": bytes_per * elements}
        rows.append({**row, "ms": seconds * 1e3, "gbs": bytes_per * elements / seconds / 1e9})
    del x32, x16
    return rows


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of ``softmax(q kᵀ) v``: ``4·b·s²·h·d``, halved when causal.

    >>> attention_flops(1, 4, 1, 2, causal=False)
    128.0
    """
    return 4.0 * batch * seq * seq * heads * head_dim / (2 if causal else 1)


def attention(shapes: Sequence[tuple[int, int, int, int]], calls: int = 10) -> list[dict[str, Any]]:
    """``jax.nn.dot_product_attention`` forward and forward + backward per shape, causal
    and not; the implementation is cuDNN on a GPU, XLA elsewhere."""
    gpu = jax.devices()[0].platform == "gpu"
    impl = "cudnn" if gpu else "xla"
    rows = []
    for b, s, h, d in shapes:
        shape = {"batch": b, "seq": s, "heads": h, "head_dim": d}
        keys = jax.random.split(jax.random.key(s + h + d), 3)
        q, k, v = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)
        for causal in (True, False):

            def fwd(q, k, v, causal=causal):
                return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)

            def fwd_bwd(q, k, v, fwd=fwd):
                return jax.grad(
                    lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)
                )(q, k, v)

            flops = attention_flops(b, s, h, d, causal)
            for name, f, work in (("fwd", fwd, flops), ("fwd+bwd", fwd_bwd, 3.5 * flops)):
                jitted = jax.jit(f)
                try:
                    seconds = _pipelined_seconds(lambda j=jitted, a=(q, k, v): j(*a), calls)
                except Exception as e:  # a kernel the device lacks: say so, keep going
                    rows.append({**shape, "causal": causal, "pass": name, "error": str(e)[:300]})
                    continue
                row = {**shape, "causal": causal, "pass": name, "impl": impl}
                rows.append({**row, "ms": seconds * 1e3, "tflops": work / seconds / 1e12})
    return rows


def launch(chain: int = 200, calls: int = 50) -> list[dict[str, Any]]:
    """The host's dispatch of a trivial jitted call (called and waited for one at a time),
    and the device's time per kernel in a chain of ``chain`` unfusable kernels."""
    x = jnp.ones((1024,), jnp.float32)
    one = jax.jit(lambda x: x + 1)

    def chained(x, n):
        for _ in range(n):
            x = jax.lax.optimization_barrier(x * 1.0001 + 1)
        return x

    long, short = jax.jit(lambda x: chained(x, chain)), jax.jit(lambda x: chained(x, 1))
    dispatch = median_seconds(lambda: one(x), calls)
    t_long = _pipelined_seconds(lambda: long(x), 10)
    t_short = _pipelined_seconds(lambda: short(x), 10)
    per_kernel = max(t_long - t_short, 0.0) / (chain - 1) * 1e6
    each = f"per kernel, a chain of {chain} unfusable kernels in one program"
    rows = [
        ("dispatch_waited", "dispatch of one jitted call, waited for", dispatch * 1e6),
        ("per_kernel", each, per_kernel),
        ("one_kernel_program", "one program of one kernel, back to back", t_short * 1e6),
    ]
    return [{"key": key, "what": what, "us": us} for key, what, us in rows]


COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter")
"""The collectives ``collectives`` measures (those FSDP and data parallelism run)."""


def collective_sizes(quick: bool = False) -> list[int]:
    """Bytes per device of each collective measured: 64 KiB to 256 MiB, ×4 apart (fp32
    buffers); two small ones with ``quick``."""
    return [2**12, 2**16] if quick else [2**k for k in range(16, 29, 2)]


def collectives(sizes: Sequence[int], calls: int = 10) -> list[dict[str, Any]]:
    """``COLLECTIVE_OPS`` over all of this process's devices (one host's, NVLink on a GPU
    server) at each size of ``sizes`` (bytes of each device's buffer): ms per call and
    the bytes each device sends, read from the compiled program as the cost model reads
    a step's (``shardax.cost.hlo.collectives``), so a fit of these rows prices a step's
    collectives in the same bytes; each row says over how many ``hosts``. Launched over
    several hosts (``shardax launch``: one process per host), the same again over every
    process's devices, across hosts: the rows ``shardax.cost.network.fit_levels`` fits
    the network's level to. Empty with one device."""
    rows = _collectives_over(jax.local_devices(), 1, sizes, calls)
    if jax.process_count() > 1:
        rows += _collectives_over(jax.devices(), jax.process_count(), sizes, calls)
    return rows


def _collectives_over(
    devices: Sequence[Any], hosts: int, sizes: Sequence[int], calls: int
) -> list[dict[str, Any]]:
    """``collectives``' rows over ``devices`` (on ``hosts`` hosts)."""

    n = len(devices)
    if n < 2:
        return []
    mesh = Mesh(np.asarray(devices), ("x",))
    ops = {
        "all-reduce": lambda x: jax.lax.psum(x, "x"),
        "all-gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
    }
    rows = []
    for op in COLLECTIVE_OPS:
        for size in sizes:
            elements = max(size // 4, n)
            elements -= elements % n  # reduce-scatter splits each device's buffer n ways
            split = PartitionSpec("x")
            f = jax.jit(
                jax.shard_map(ops[op], mesh=mesh, in_specs=split, out_specs=split, check_vma=False)
            )
            x = jax.make_array_from_callback(
                (n * elements,),
                jax.sharding.NamedSharding(mesh, split),
                lambda index, e=elements: jnp.ones((e,), jnp.float32),
            )
            row = {"op": op, "devices": n, "hosts": hosts, "bytes": 4 * elements}
            try:
                compiled = f.lower(x).compile()
                sent = sum(c.sent_bytes for c in collectives_in(compiled.as_text(), n))
                seconds = _pipelined_seconds(lambda f=compiled, x=x: f(x), calls)
            except Exception as e:  # an op the backend lacks: say so, keep going
                rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            finally:
                del x
            ms, busbw = seconds * 1e3, sent / seconds / 1e9
            rows.append({**row, "sent_bytes": sent, "ms": ms, "busbw_gbs": busbw})
    return rows


def tables(quick: bool = False, network: str | None = None) -> dict[str, Any]:
    """All the tables, each run on its own so one failing leaves the others; errors are
    kept as ``{"error": ...}``, a table this device cannot measure as ``{"skipped": why}``
    (``gemm_fp8`` without fp8 tensor cores: ``fp8_skipped``). ``network``: the named
    network between the hosts measured over (``shardax.cost.network.named_network``),
    recorded so that the collectives' inter-host fit replaces that network's documented
    figures."""

    parts: dict[str, Callable[[], Any]] = {
        "gemm": lambda: gemm(gemm_shapes(quick)),
        "gemm_f32": lambda: gemm(fp32_gemm_shapes(quick), dtype="f32"),
        "gemm_f32_cublas": lambda: gemm(fp32_gemm_shapes(quick), dtype="f32", cublas=True),
        "gemm_fp8": lambda: gemm_fp8(gemm_shapes(quick), _pipelined_seconds),
        "stream": lambda: stream(2**16 if quick else 2**28),
        "reduce": lambda: reduce(64 if quick else 65536),
        "attention": lambda: attention(attention_shapes(quick)),
        "collectives": lambda: collectives(collective_sizes(quick)),
        "launch": lambda: launch(20 if quick else 200),
    }
    device = jax.devices()[0]
    skipped = {"gemm_fp8": fp8_skipped(device)}
    out: dict[str, Any] = {
        "device": str(device.device_kind),
        "platform": str(device.platform),
        "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
        "source": f"shardax calibrate on one {device.device_kind}",
        "quick": quick,
    }
    if jax.process_count() > 1:
        out["source"] = (
            f"shardax calibrate on {jax.process_count()} hosts of "
            f"{jax.local_device_count()} {device.device_kind}"
        )
    if network is not None:
        out["network"] = named_network(network).name
    for name, make in parts.items():
        began = time.perf_counter()
        if skipped.get(name):  # nothing this device measures would price that table
            out[name], out[f"{name}_seconds"] = {"skipped": skipped[name]}, 0.0
            continue
        try:
            out[name] = make()
        except Exception as e:  # keep the session going: the other tables still count
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        out[f"{name}_seconds"] = time.perf_counter() - began
    return out


def summary(calib: dict[str, Any]) -> dict[str, float | None]:
    """The ceilings a floor is computed from: the best bf16 GEMM rate (TFLOP/s) and the
    best stream bandwidth (GB/s) measured, and the best fp8 GEMM rate; None where not
    measured (fp8: skipped on this device, or no row timed)."""

    def best(table: str, key: str) -> float | None:
        rows = calib.get(table)
        if not isinstance(rows, list):
            return None
        return max((r[key] for r in rows if key in r), default=None)

    return {
        "matmul_tflops": best("gemm", "tflops"),
        "bandwidth_gbs": best("stream", "gbs"),
        "fp8_matmul_tflops": best("gemm_fp8", "tflops"),
    }
