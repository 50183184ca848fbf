"""The GPT's elementwise layers with backward passes that recompute from their inputs
(``jax.custom_vjp``): ``rms_norm`` and ``gelu``, and ``RMSNorm``, the NNX module;
``GPTConfig(elementwise="recompute")`` uses them.

Both compute in float32 and return their input's dtype (a bf16 residual stream's norm
statistics are float32, as nanochat's). Under ``jax.grad`` each saves only its inputs
for the backward pass, which recomputes the rest, a few FLOPs per element that XLA
fuses into the gradient's own pass over the same bytes:

- ``gelu(h)``: autodiff of ``jax.nn.gelu`` (the tanh form) makes the forward fusion write
  a second tensor of the MLP's width for the backward pass, and the backward read it
  back beside ``h``; saving ``h`` alone (the up-projection's output, in memory anyway)
  drops both. On a compile-only H100 this is 13% of the GPT's elementwise bytes at
  d_model 2048 (``docs/results.md``).
- ``rms_norm(x, scale)``: saves ``x``, ``scale`` and the reciprocal RMS (one float32
  per row). XLA already fuses autodiff's RMSNorm as tightly (the same bytes on that
  H100: a forward pass that reads ``x`` twice, a backward that reads ``x`` and ``dy``
  twice; a one-pass kernel would save about 1.3% of the 1.21B step by the per-op model),
  so this one states the float32 statistics and the saved state; it is not faster.

Every operation is a ``jnp`` one, so they run (and are sharded) wherever XLA runs: the
CPU, a GPU, a TPU, under any plan; no Pallas kernel, no new dependency.

>>> x = jnp.arange(8.0).reshape(2, 4).astype(jnp.bfloat16)
>>> rms_norm(x, jnp.ones(4)).dtype
dtype(bfloat16)
>>> bool(jnp.all(rms_norm(x, jnp.ones(4)) == reference_rms_norm(x, jnp.ones(4))))
True
>>> float(jax.grad(lambda h: gelu(h).sum())(jnp.float32(1.0)))  # doctest: +ELLIPSIS
1.0829...
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

EPSILON = 1e-6
"""``nnx.RMSNorm``'s default epsilon, kept so the two give the same result."""


def _inverse_rms(xf: jax.Array, epsilon: float) -> jax.Array:
    return jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + epsilon)


def reference_rms_norm(x: jax.Array, scale: jax.Array, epsilon: float = EPSILON) -> jax.Array:
    """The plain expression of ``rms_norm`` (float32 statistics, the result in ``x``'s
    dtype), differentiated by JAX's autodiff."""
    xf = x.astype(jnp.float32)
    y = xf * _inverse_rms(xf, epsilon) * scale.astype(jnp.float32)
    return y.astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, epsilon: float = EPSILON) -> jax.Array:
    """RMSNorm of ``x`` over its last axis times ``scale`` (``(x.shape[-1],)``), its
    statistics in float32, the result in ``x``'s dtype; the backward pass recomputes
    them from ``x`` (see the module).

    >>> rms_norm(jnp.ones((2, 3)), jnp.full(3, 2.0))[0].tolist()  # doctest: +ELLIPSIS
    [1.99999..., 1.99999..., 1.99999...]
    """
    return reference_rms_norm(x, scale, epsilon)


def _norm_forward(x: jax.Array, scale: jax.Array, epsilon: float) -> tuple[jax.Array, tuple]:
    r = _inverse_rms(x.astype(jnp.float32), epsilon)
    y = x.astype(jnp.float32) * r * scale.astype(jnp.float32)
    return y.astype(x.dtype), (x, scale, r)


def _norm_backward(epsilon: float, saved: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``dx = r · (g - x̂ · mean(g · x̂))`` with ``g = dy · scale``, ``x̂ = x · r``
    recomputed from ``x`` and ``r`` the saved reciprocal RMS (one float32 per row:
    recomputing it would read ``x`` once more); ``dscale = Σ dy · x̂`` over every axis
    but the last."""
    x, scale, r = saved
    xf = x.astype(jnp.float32)
    x_hat = xf * r
    dyf = dy.astype(jnp.float32)
    g = dyf * scale.astype(jnp.float32)
    dx = r * (g - x_hat * jnp.mean(g * x_hat, axis=-1, keepdims=True))
    dscale = jnp.sum(dyf * x_hat, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_norm_forward, _norm_backward)


def _gelu32(h: jax.Array) -> jax.Array:
    return jax.nn.gelu(h.astype(jnp.float32))


@jax.custom_vjp
def gelu(h: jax.Array) -> jax.Array:
    """``jax.nn.gelu(h)`` (the tanh form) computed in float32, in ``h``'s dtype; the
    backward pass saves only ``h`` and recomputes the derivative from it.

    >>> gelu(jnp.zeros(2, jnp.bfloat16)).dtype
    dtype(bfloat16)
    """
    return _gelu32(h).astype(h.dtype)


def _gelu_forward(h: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu(h), h


def _gelu_backward(h: jax.Array, dg: jax.Array) -> tuple[jax.Array]:
    # The barrier keeps XLA from merging the recomputation with the forward pass's (CSE),
    # which would save the forward's float32 tanh for the backward pass after all.
    _, vjp = jax.vjp(_gelu32, jax.lax.optimization_barrier(h))
    return (vjp(dg.astype(jnp.float32))[0].astype(h.dtype),)


gelu.defvjp(_gelu_forward, _gelu_backward)


class RMSNorm(nnx.Module):
    """``rms_norm`` over the last axis with a learned ``scale`` (ones, logical axis
    ``"embed"``), the state of ``nnx.RMSNorm(features)``: the same tree, so a checkpoint
    or plan of one fits the other.

    >>> with nnx.use_eager_sharding(False):  # logical names, no mesh: as make_gpt builds
    ...     norm = RMSNorm(4, nnx.Rngs(0))
    >>> norm(jnp.ones((2, 4), jnp.bfloat16)).dtype
    dtype(bfloat16)
    """

    def __init__(self, features: int, rngs: nnx.Rngs) -> None:
        init = nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))
        self.scale = nnx.Param(init(rngs.params(), (features,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], EPSILON)
