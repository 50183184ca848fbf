"""precision="fp8": the fp8 matmul's numerics against its dequantized operands (XLA:CPU
widens the fp8 values, so these are the GPU's numerics), and the routing of every
framework's dense layers (NNX, Linen, Equinox, the GPT) through it, with refusals by name."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_models import batches, make_loss, make_state

import shardax as sx
from shardax.models import gpt
from shardax.parallel.fp8 import E4M3, E5M2, fp8_dot_general, fp8_matmul, quantize
from shardax.train.precision import resolve

DENSE = (((1,), (0,)), ((), ()))


def dequantized(x, dtype):
    q, scale = quantize(x, dtype)
    return q.astype(jnp.float32) * scale


def test_quantize_scales_by_the_tensor_amax_and_keeps_zeros_and_nonfinite():
    x = jnp.array([0.25, -3.0, 1.5])
    q, scale = quantize(x, E4M3)
    assert q.dtype == E4M3 and float(scale) == np.float32(3.0) / np.float32(448)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0
    assert float(quantize(jnp.zeros(3), E5M2)[1]) == 1.0
    q, scale = quantize(jnp.array([1.0, jnp.nan]), E4M3)
    assert float(scale) == 1.0 and bool(jnp.isnan(q.astype(jnp.float32))[1])
    for dtype in (E4M3, E5M2):  # an overflow stays non-finite: never clipped to the top
        q, _ = quantize(jnp.array([1.0, jnp.inf, -jnp.inf]), dtype)
        assert not bool(jnp.isfinite(q.astype(jnp.float32)[1:]).any()), (dtype, q)


def test_fp8_matmul_and_its_gradients_are_exact_products_of_the_quantized_operands():
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (16, 32), jnp.bfloat16)
    w = (jax.random.normal(kw, (32, 8)) * 0.1).astype(jnp.bfloat16)
    g = jax.random.normal(kg, (16, 8), jnp.bfloat16)
    y, vjp = jax.vjp(fp8_matmul, x, w)
    dx, dw = vjp(g)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    qx, qw, qg = dequantized(x, E4M3), dequantized(w, E4M3), dequantized(g, E5M2)
    for got, want in ((y, qx @ qw), (dx, qg @ qw.T), (dw, qx.T @ qg)):
        np.testing.assert_allclose(np.float32(got), np.asarray(want), rtol=8e-3, atol=1e-6)
    # and close to the bf16 product: E4M3 keeps 3 mantissa bits
    exact = x.astype(jnp.float32) @ w.astype(jnp.float32)
    assert float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact)) < 0.06


def test_fp8_dot_general_reshapes_dense_contractions_and_refuses_others():
    x, w = jnp.ones((2, 3, 4, 5)), jnp.ones((4, 5, 6))
    y = fp8_dot_general(x, w, (((2, 3), (0, 1)), ((), ())))
    assert y.shape == (2, 3, 6) and float(y[0, 0, 0]) == pytest.approx(20.0, rel=1e-6)
    with pytest.raises(ValueError, match=r"dense contractions only.*\(\(1,\), \(0,\)\)"):
        fp8_dot_general(x, w, (((1,), (0,)), ((), ())))


def test_the_fp8_policy_is_bf16_compute_with_fp8_matmuls_and_checks_its_fields():
    policy = resolve("fp8")
    assert policy.compute_dtype == jnp.bfloat16 and policy.matmul == "fp8"
    with pytest.raises(ValueError, match=r"Precision.matmul must be one of .*got 'int8'"):
        resolve(sx.Precision(matmul="int8"))
    with pytest.raises(TypeError, match=r"Precision\.keep must be a tuple"):
        resolve(sx.Precision(matmul="fp8", keep="head"))


def fp8_ops(step, state, batch):
    """How many fp8 values the step's lowered program names (0: no fp8 matmul)."""
    return step.lower(state, batch).as_text().count("f8E4M3FN")


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_each_frameworks_dense_layers_train_in_fp8_and_keep_leaves_them(framework, mesh):
    data = batches(3)
    loss = make_loss(framework)
    runs = {}
    for name, precision in {
        "bf16": "bf16",
        "fp8": "fp8",
        "kept": sx.Precision(compute_dtype=jnp.bfloat16, matmul="fp8", keep=(".",)),
    }.items():
        step = sx.make_train_step(loss, mesh=mesh, precision=precision)
        state = step.shard(make_state(framework))
        ops = fp8_ops(step, state, data[0])
        for batch in data:
            state, metrics = step(state, batch)
        runs[name] = ops, float(metrics["loss"])
    assert runs["fp8"][0] > 0 and runs["bf16"][0] == runs["kept"][0] == 0
    assert runs["kept"][1] == runs["bf16"][1]
    assert abs(runs["fp8"][1] - runs["bf16"][1]) < 0.05 * runs["bf16"][1] + 1e-3


def test_unsupported_layer_kinds_are_refused_by_kind_and_path(mesh):
    class ConvNet(nnx.Module):
        def __init__(self):
            self.conv = nnx.Conv(1, 2, (3,), rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.conv(x)

    class LinenConvNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(2, (3,), name="stem")(x)

    def loss(model, batch):
        out = jax.vmap(model)(batch["x"]) if isinstance(model, eqx.Module) else model(batch["x"])
        return jnp.mean(out**2)

    module = LinenConvNet()
    x = jnp.ones((8, 5, 1))
    cases = {
        "nnx.Conv layers, found at 'conv'": sx.TrainState.create(ConvNet(), optax.sgd(0.1)),
        "nn.Conv layers, found at 'stem'": sx.TrainState.from_linen(
            module, module.init(jax.random.key(0), x), optax.sgd(0.1)
        ),
        "eqx.nn.Conv1d layers, found at 'layers/0'": sx.TrainState.create(
            eqx.nn.Sequential([eqx.nn.Conv1d(5, 2, 1, key=jax.random.key(0))]), optax.sgd(0.1)
        ),
    }
    for message, state in cases.items():
        step = sx.make_train_step(loss, mesh=mesh, precision="fp8")
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            step(step.shard(state), {"x": x})
    kept = sx.Precision(compute_dtype=jnp.bfloat16, matmul="fp8", keep=("conv",))
    step = sx.make_train_step(loss, mesh=mesh, precision=kept)
    step(step.shard(cases["nnx.Conv layers, found at 'conv'"]), {"x": x})


def test_the_gpt_runs_its_block_matmuls_in_fp8_its_head_in_bf16_and_resumes_bitwise(mesh):
    cfg = gpt.GPTConfig(layers=1, d_model=32, heads=2, max_seq_len=16)
    tokens = jax.random.randint(jax.random.key(0), (8, 17), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def lm_loss(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    step = sx.make_train_step(lm_loss, mesh=mesh, precision="fp8")

    def fresh():
        return step.shard(sx.TrainState.create(gpt.make_gpt(cfg), optax.adam(1e-3)))

    state = fresh()
    hlo = step.lower(state, batch).as_text()
    # 6 block matmuls (q, k, v, out, up, down), each forward + two gradients
    fp8_dots = [line for line in hlo.splitlines() if "dot_general" in line and "f8E" in line]
    assert len(fp8_dots) == 18
    head = [line for line in hlo.splitlines() if "dot_general" in line and "x256xbf16>" in line]
    assert head and not any("f8E" in line for line in head)
    # current scaling carries nothing in the state (the state is bf16's, leaf for leaf),
    # so a step from a restored state is the step from the saved one, bitwise
    bf16 = sx.make_train_step(lm_loss, mesh=mesh, precision="bf16")
    like = bf16.shard(sx.TrainState.create(gpt.make_gpt(cfg), optax.adam(1e-3)))
    assert jax.tree.structure(like) == jax.tree.structure(state)
    one, _ = step(state, batch)
    again, _ = step(fresh(), batch)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(again), strict=True)
    )


def test_fp8_trains_on_explicit_axes_with_the_layers_out_sharding():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)

    class Block(nnx.Module):
        def __init__(self, rngs):
            meta = {"out_sharding": P("data", "model")}
            self.up = nnx.Linear(8, 16, use_bias=False, kernel_metadata=meta, rngs=rngs)

        def __call__(self, x):
            return self.up(x, out_sharding=P("data", "model"))

    def loss(model, batch):
        return jnp.mean(model(batch["x"]).astype(jnp.float32) ** 2)

    batch = {"x": np.ones((16, 8), np.float32)}
    losses = {}
    for precision in ("bf16", "fp8"):
        with jax.set_mesh(mesh):
            model = Block(nnx.Rngs(0))
        step = sx.make_train_step(loss, mesh=mesh, precision=precision)
        _, metrics = step(step.shard(sx.TrainState.create(model, optax.sgd(0.1))), batch)
        losses[precision] = float(metrics["loss"])
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.05)
