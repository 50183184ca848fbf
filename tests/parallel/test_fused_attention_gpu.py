"""sx.attention's cuDNN kernel against the dense path, numerically, on a real GPU.

CI has no GPU, so these skip there (the compile-only tests check the lowering); on a
machine with one, run them with the GPU visible (the suite defaults to the CPU):

    JAX_PLATFORMS=cuda,cpu uv run pytest -n 0 tests/parallel/test_fused_attention_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from shardax.cost.hlo import attention_kernel

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "gpu",
    reason="needs a GPU (JAX_PLATFORMS=cuda,cpu); the lowering is checked compile-only",
)

B, T, H = 2, 256, 4
MASKS = {
    "no mask": {},
    "causal": {"causal": True},
    "causal, window 64": {"causal": True, "window": (64, 0)},
    # Two packed documents per row, then padding (its own segment), as a batch would be.
    "segment_ids": {"segment_ids": np.repeat(np.array([[1, 2, 0, 0], [1, 1, 2, 3]]), T // 4, 1)},
    "causal, segment_ids": {
        "causal": True,
        "segment_ids": np.repeat(np.array([[1, 2, 3, 0], [1, 1, 1, 2]]), T // 4, 1),
    },
}


def _loss(kernel: str, masks: dict, cotangent: jax.Array):
    def loss(q, k, v):
        out = sx.attention(q, k, v, kernel=kernel, **masks)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _close(got: jax.Array, want: jax.Array, what: str) -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    # bf16 keeps 8 mantissa bits: both paths round; 2% of the largest entry bounds them.
    err = np.max(np.abs(got - want))
    assert err <= 2e-2 * np.max(np.abs(want)) + 1e-3, f"{what}: max |cudnn - dense| = {err}"


# (head_dim, kv_heads): grouped-query attention (2 kv heads for 4) in the last
@pytest.mark.parametrize("head_dim, kv_heads", [(64, H), (128, H), (64, 2)])
@pytest.mark.parametrize("name", list(MASKS))
def test_cudnn_equals_dense_forward_and_gradients(name, head_dim, kv_heads):
    masks = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in MASKS[name].items()}
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(s, (B, T, kv_heads, head_dim), jnp.bfloat16) for s in keys[1:3])
    cotangent = jax.random.normal(keys[3], (B, T, H, head_dim), jnp.float32)

    fused, dense = _loss("auto", masks, cotangent), _loss("dense", masks, cotangent)
    assert attention_kernel(fused.lower(q, k, v).compile().as_text()) == "cudnn", name
    assert attention_kernel(dense.lower(q, k, v).compile().as_text()) == "dense", name
    (_, out), grads = fused(q, k, v)
    (_, want_out), want_grads = dense(q, k, v)
    _close(out, want_out, f"{name} forward")
    for which, got, want in zip("qkv", grads, want_grads, strict=True):
        _close(got, want, f"{name} d{which}")


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_blocks_merged_by_their_lse_equal_whole_attention(causal):
    """The context ring's pieces on hardware, for C = 2 blocks: cuDNN's per-block outputs
    merged by their log-sum-exps equal whole attention, and each block's gradients at the
    merged output and log-sum-exp (``cudnn_block_grads``) add up to the whole's."""
    from shardax.parallel.fused import cudnn_block, cudnn_block_grads

    d, c = 128, 2
    keys = jax.random.split(jax.random.key(1), 4)
    q, k, v, dout = (jax.random.normal(s, (B, T, H, d), jnp.bfloat16) for s in keys)
    scale = d**-0.5
    qs, ks, vs, dos = (jnp.split(x, c, axis=1) for x in (q, k, v, dout))
    # query block i sees key blocks 0..i under causal (the diagonal one causally), else all
    seen = {i: [j for j in range(c) if not causal or j <= i] for i in range(c)}
    diag = {(i, j): causal and i == j for i in range(c) for j in range(c)}
    fwd = jax.jit(cudnn_block, static_argnames=("scale", "causal"))
    bwd = jax.jit(cudnn_block_grads, static_argnames=("scale", "causal"))

    outs, lses = [], []
    for i in range(c):
        parts = [fwd(qs[i], ks[j], vs[j], scale=scale, causal=diag[i, j]) for j in seen[i]]
        lse = jax.nn.logsumexp(jnp.stack([part[1] for part in parts]), axis=0)
        out = sum(o.astype(jnp.float32) * jnp.exp(o_lse - lse)[..., None] for o, o_lse in parts)
        outs.append(out.astype(jnp.bfloat16))
        lses.append(lse)

    want, vjp = jax.vjp(lambda q, k, v: sx.attention(q, k, v, causal=causal, kernel="dense"),
                        q, k, v)  # fmt: skip
    want_dq, want_dk, want_dv = vjp(dout)
    _close(jnp.concatenate(outs, 1), want, "merged forward")

    dq = [jnp.zeros(qs[0].shape, jnp.float32) for _ in range(c)]
    dk = [jnp.zeros(ks[0].shape, jnp.float32) for _ in range(c)]
    dv = [jnp.zeros(vs[0].shape, jnp.float32) for _ in range(c)]
    for i in range(c):
        for j in seen[i]:
            gq, gk, gv = bwd(qs[i], ks[j], vs[j], outs[i], lses[i], dos[i], scale=scale,
                             causal=diag[i, j])  # fmt: skip
            dq[i], dk[j], dv[j] = dq[i] + gq, dk[j] + gk, dv[j] + gv
    _close(jnp.concatenate(dq, 1), want_dq, "merged dq")
    _close(jnp.concatenate(dk, 1), want_dk, "merged dk")
    _close(jnp.concatenate(dv, 1), want_dv, "merged dv")
