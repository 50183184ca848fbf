"""fp8 matmuls: per-tensor direct quantization, E4M3 forward and E5M2 gradients.

``fp8_dot_general`` is a drop-in ``dot_general`` (the hook of ``nnx.Linear``, Linen's
``nn.Dense`` and the GPT's projections) for dense contractions: each operand is quantized
once to ``float8_e4m3fn`` with one scale per tensor, the ``dot_general`` runs on the fp8
arrays themselves (``preferred_element_type`` the compute dtype), and the product is
multiplied by the two scales. The backward pass, a ``jax.custom_vjp``, quantizes the
output gradient to ``float8_e5m2`` (more range, less precision: gradients span more
decades than activations) and runs both gradient matmuls in fp8 as well
(E5M2 × E4M3; E5M2 × E5M2 has no tensor-core path on Hopper).

**Direct, not quantize-dequantize.** Flax's legacy ``Fp8DotGeneralOp`` hands XLA
``dot(dequantize(q_x), dequantize(q_w))`` and relies on the GPU compiler to match the
pattern back into an fp8 GEMM; where it does not, the GEMM runs in bf16 over dequantized
values with the quantization's cost on top (marin-community/marin#6660). Here the operands
of every ``dot_general`` are fp8 arrays, so XLA's GPU compiler emits cuBLASLt fp8 GEMMs
(``__cublas$lt$matmul$f8``) or nothing at all: ``tests/compile/test_fp8_targets.py``
checks it on an 8xH100 target. This is flax's ``Fp8DirectDotGeneralOp`` pattern.

**Current scaling, not delayed.** Each scale is ``amax(|x|) / max(fp8)`` of the tensor
being quantized, in the same step (torchao's "tensorwise" dynamic recipe, the one measured
faster at 1B). Delayed scaling (scales from an amax history of earlier steps, Transformer
Engine's and flax's default) saves one reduction per tensor, but carries per-layer
histories in the train state, needs an overwrite-with-gradient rule past the optimizer,
and clips a tensor whose range grew since the history: a loss spike turns into saturation.
The reduction is a memory-bound pass that XLA fuses with the quantization, and current
scaling has no state, so a resume is bitwise by construction (nothing to save).

On a CPU (and any backend without fp8 GEMMs) XLA computes the fp8 dots by widening the
fp8 values: the numerics are the GPU's (the same rounding of every operand), the speed
is not.

>>> x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.full((8, 3), 0.5, jnp.bfloat16)
>>> fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32)[0]
Array([4., 4., 4.], dtype=float32)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from shardax.checks import public

E4M3 = jnp.float8_e4m3fn
"""The forward pass's fp8 dtype (activations and weights): max 448, 3 mantissa bits."""
E5M2 = jnp.float8_e5m2
"""The gradients' fp8 dtype: max 57344, 2 mantissa bits."""


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(q, scale)``: ``x ≈ q · scale`` with ``q`` in the fp8 ``dtype`` and one float32
    ``scale`` for the whole tensor, ``amax(|x|) / max(dtype)`` (current scaling; 1 for an
    all-zero or non-finite ``x``, whose non-finite values stay non-finite in ``q``).

    >>> q, scale = quantize(jnp.array([1.0, -896.0]), E4M3)
    >>> q.dtype, float(scale), q.astype(jnp.float32).tolist()
    (dtype(float8_e4m3fn), 2.0, [0.5, -448.0])
    """
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / top, jnp.float32(1))
    wide = x.astype(jnp.float32) / scale
    # clipped where finite; an inf stays non-finite (E4M3 has no inf: it reads as NaN), so
    # an overflow is not hidden from a finite-loss check or a loss scaler
    q = jnp.where(jnp.isfinite(wide), jnp.clip(wide, -top, top), wide).astype(dtype)
    return q, scale


def _explicit_spec(x: jax.Array) -> Any:
    """``x``'s ``PartitionSpec`` where its type carries one (a mesh with Explicit axes),
    else None: the result shardings JAX's own rules would give the transposed products."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return None
    return sharding.spec


def _dot(
    a: jax.Array, b: jax.Array, contract: tuple[int, int], out: Any, spec: Any = None
) -> jax.Array:
    """The 2D ``dot_general`` of fp8 ``a`` and ``b`` over dims ``contract``, in ``out``,
    sharded as ``spec`` (on Explicit axes; None: as JAX infers it)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=out, out_sharding=spec)


def _spec(rows_of: Any, row: int, cols_of: Any, col: int) -> Any:
    """``PartitionSpec(rows_of[row], cols_of[col])`` of two specs, None if either is."""
    if rows_of is None or cols_of is None:
        return None
    pad = lambda spec: (*spec, None, None)  # noqa: E731
    return jax.sharding.PartitionSpec(pad(rows_of)[row], pad(cols_of)[col])


@jax.custom_vjp
def fp8_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` for 2D ``x`` (M, K) and ``w`` (K, N) as one fp8 GEMM, in ``x``'s dtype
    (the compute dtype); its gradients are fp8 GEMMs too (module docstring)."""
    return _forward(x, w)[0]


def _forward(x: jax.Array, w: jax.Array) -> tuple[jax.Array, Any]:
    out = jnp.result_type(x, w)
    qx, sx = quantize(x, E4M3)
    qw, sw = quantize(w, E4M3)
    xs, ws = _explicit_spec(x), _explicit_spec(w)
    y = (_dot(qx, qw, (1, 0), jnp.float32, _spec(xs, 0, ws, 1)) * (sx * sw)).astype(out)
    # fp8 residuals: the backward pass reads a quarter of fp32's (half of bf16's) bytes
    return y, (qx, sx, qw, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _backward(res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    qx, sx, qw, sw, x_zero, w_zero = res
    qg, sg = quantize(g, E5M2)
    xs, ws = _explicit_spec(qx), _explicit_spec(qw)  # the gradients sharded as the operands
    dx = _dot(qg, qw, (1, 1), jnp.float32, _spec(xs, 0, xs, 1)) * (sg * sw)  # g · wᵀ: (M, K)
    dw = _dot(qx, qg, (0, 0), jnp.float32, _spec(ws, 0, ws, 1)) * (sx * sg)  # xᵀ · g: (K, N)
    return dx.astype(x_zero.dtype), dw.astype(w_zero.dtype)


fp8_matmul.defvjp(_forward, _backward)


def dense_contraction(lhs_ndim: int, rhs_ndim: int, dimension_numbers: Any) -> int | None:
    """``k`` when ``dimension_numbers`` contract ``lhs``'s last ``k`` dims with ``rhs``'s
    first ``k`` in order and batch none (a dense layer: ``x @ w`` over reshaped operands),
    else None.

    >>> dense_contraction(3, 3, (((2,), (0,)), ((), ())))
    1
    >>> dense_contraction(3, 3, (((1,), (0,)), ((), ()))) is None
    True
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc = tuple(int(d) % lhs_ndim for d in lc), tuple(int(d) % rhs_ndim for d in rc)
    k = len(lc)
    if lb or rb or not k or lc != tuple(range(lhs_ndim - k, lhs_ndim)) or rc != tuple(range(k)):
        return None
    return k


@public("sx.parallel.fp8_dot_general")
def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    **kwargs: Any,
) -> jax.Array:
    """``jax.lax.dot_general`` of a dense contraction as fp8 GEMMs (module docstring): a
    ``dot_general`` hook for ``nnx.Linear(dot_general=...)`` and
    ``nn.Dense(dot_general=...)`` (``precision="fp8"`` sets it on the layers it covers;
    set it yourself on a layer of your own, e.g. under ``precision="bf16"``). ``lhs``
    contracts its trailing dims with ``rhs``'s leading ones, no batch dims (a dense
    layer's ``x @ w``); other contractions are refused, naming the dims. ``precision`` is
    ignored (fp8 has one); the result is in ``preferred_element_type``, else in the
    operands' result type.

    >>> y = fp8_dot_general(jnp.ones((2, 5, 4)), jnp.ones((4, 3)), (((2,), (0,)), ((), ())))
    >>> y.shape, y.dtype
    ((2, 5, 3), dtype('float32'))
    """
    del precision  # the accumulation precision is the fp8 GEMM's
    out_sharding = kwargs.pop("out_sharding", None)  # flax layers pass it on Explicit axes
    k = dense_contraction(lhs.ndim, rhs.ndim, dimension_numbers)
    if k is None:
        raise ValueError(
            "fp8 matmuls cover dense contractions only (lhs's trailing dims with rhs's "
            f"leading dims, no batch dims), got dimension_numbers={dimension_numbers} for "
            f"shapes {lhs.shape} and {rhs.shape}"
        )
    batch, out = lhs.shape[: lhs.ndim - k], rhs.shape[k:]
    inner = math.prod(lhs.shape[lhs.ndim - k :])
    y = fp8_matmul(lhs.reshape(-1, inner), rhs.reshape(inner, -1))
    dtype = preferred_element_type or jnp.result_type(lhs, rhs)
    y = y.reshape(*batch, *out).astype(dtype)
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)
