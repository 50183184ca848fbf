"""The GPT's recomputing norm and GELU against JAX's autodiff, and the bf16 residual stream.

Tolerances (documented in docs/guides/gpt.md): the recomputing layers equal autodiff's to
float32 rounding (values and gradients within 1e-5 relative); a bf16 residual stream,
against the float32 one under the same bf16 compute, moves the loss by less than 0.01
nats per byte (benchmarks/residual_numerics.py measures it over training steps).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from shardax.models import gpt
from shardax.models.elementwise import RMSNorm, gelu, reference_rms_norm, rms_norm
from shardax.train.precision import cast_floating

CFG = dict(layers=1, d_model=32, heads=4, max_seq_len=16)
_MAKE = nnx.jit(gpt.make_gpt, static_argnames=("cfg",))  # one program, not eager inits


def test_rms_norm_and_gelu_equal_autodiff_in_value_and_gradient():
    x = jax.random.normal(jax.random.key(0), (4, 8, 32)) * 3
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(1), (32,))
    dy = jax.random.normal(jax.random.key(2), (4, 8, 32))

    @jax.jit
    def both(x, scale, dy):
        out = []
        for ours, plain, args in [
            (rms_norm, reference_rms_norm, (x, scale)),
            (gelu, jax.nn.gelu, (x,)),
        ]:
            y, vjp = jax.vjp(ours, *args)
            want, want_vjp = jax.vjp(plain, *args)
            out.append(((y, *vjp(dy)), (want, *want_vjp(dy))))
        return out

    for got, want in both(x, scale, dy):
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_matches_flax_and_keeps_bf16_with_float32_statistics():
    x = jax.random.normal(jax.random.key(0), (2, 16)).astype(jnp.bfloat16) * 100
    with nnx.use_eager_sharding(False):
        ours = RMSNorm(16, nnx.Rngs(0))
    flax = nnx.RMSNorm(16, rngs=nnx.Rngs(0))
    assert ours(x).dtype == jnp.bfloat16
    # flax's is float32 here (a bf16 input, float32 scale); ours in bf16, one rounding away
    want = flax(x).astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_allclose(ours(x).astype(jnp.float32), want, rtol=8e-3)
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(ours)))
    assert shapes == jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(flax)))


def lm_loss(model, batch):
    logits = model(batch).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch).mean()


def loss_and_grads(cfg, dtype):
    """The loss and gradients of ``cfg``'s GPT (seed 0) with its params in ``dtype``,
    as ``precision`` casts them for the step."""
    graphdef, params = nnx.split(_MAKE(cfg=cfg))
    batch = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % 256

    def loss(p):
        return lm_loss(nnx.merge(graphdef, cast_floating(p, dtype)), batch)

    return jax.jit(jax.value_and_grad(loss))(params)


def test_gpt_options_keep_the_params_and_the_loss():
    base_cfg = gpt.GPTConfig(**CFG)
    base_loss, base_grads = loss_and_grads(base_cfg, jnp.float32)
    recompute = gpt.GPTConfig(**CFG, elementwise="recompute")
    loss, grads = loss_and_grads(recompute, jnp.float32)
    assert jax.tree.structure(grads) == jax.tree.structure(base_grads)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    bf16_loss, _ = loss_and_grads(base_cfg, jnp.bfloat16)
    both = gpt.GPTConfig(**CFG, residual="bf16", elementwise="recompute")
    loss, _ = loss_and_grads(both, jnp.bfloat16)
    assert loss != bf16_loss and abs(float(loss) - float(bf16_loss)) < 0.01


def test_the_residual_stream_is_bf16_between_blocks():
    model = nnx.eval_shape(lambda: gpt.make_gpt(gpt.GPTConfig(**CFG, residual="bf16")))
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    graphdef, stacked = nnx.split(model.blocks)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
    out = jax.eval_shape(lambda p, x: nnx.merge(graphdef, p)(x), one, x)
    assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("residual", "fp16", "GPTConfig.residual must be one of ('fp32', 'bf16'), got 'fp16'"),
        ("elementwise", "fused", "GPTConfig.elementwise must be one of ('autodiff', "
                                 "'recompute'), got 'fused'"),
    ],
)  # fmt: skip
def test_bad_options_are_named(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpt.GPTConfig(**CFG, **{field: value})
