"""Mixed precision: bf16 compute with float32 params and optimizer, fp16 loss scaling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_models import FRAMEWORKS, batches, leaves, make_loss, make_state

import shardax as sx
from shardax.train.precision import LossScaleState, adjust_loss_scale, resolve


def recording(tx, seen):
    """``tx``, recording the dtypes of the gradients it is given (at trace time)."""

    def update(grads, state, params=None):
        seen.extend(x.dtype for x in jax.tree.leaves(grads))
        return tx.update(grads, state, params)

    return optax.GradientTransformation(tx.init, update)


def run(framework, mesh, mode, precision, data, tx=None, loss_fn=None, **kwargs):
    loss_fn = loss_fn or make_loss(framework)
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode, precision=precision, **kwargs)
    state = step.shard(make_state(framework, tx))
    history = []
    for batch in data:
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bf16_computes_in_bf16_and_keeps_float32_params_and_optimizer(framework, mesh):
    seen_inputs, seen_grads = [], []
    base = make_loss(framework)

    def loss_fn(model, batch):
        seen_inputs.append(batch["x"].dtype)
        return base(model, batch)

    tx = recording(optax.sgd(0.1), seen_grads)
    data = batches(1)
    state, history = run(framework, mesh, "jit", "bf16", data, tx=tx, loss_fn=loss_fn)
    assert set(seen_inputs) == {jnp.dtype(jnp.bfloat16)}
    assert seen_grads and set(seen_grads) == {jnp.dtype(jnp.float32)}
    floating = [x for x in jax.tree.leaves((state.params, state.opt_state)) if x.dtype.kind == "f"]
    assert floating and {x.dtype for x in floating} == {jnp.dtype(jnp.float32)}
    assert np.isfinite(history[-1]["loss"])
    # The same training as float32, up to bfloat16 rounding.
    expected, _ = run(framework, mesh, "jit", "fp32", data, tx=optax.sgd(0.1))
    for a, e in zip(leaves(state.params), leaves(expected.params), strict=True):
        np.testing.assert_allclose(a, e, rtol=0.05, atol=0.02)
    assert not all(
        np.array_equal(a, e)
        for a, e in zip(leaves(state.params), leaves(expected.params), strict=True)
    )


def test_every_mode_and_accumulation_agree_in_bf16(mesh):
    precision, data = "bf16", batches(2)
    reference, ref_history = run("pytree", mesh, "single", precision, data)
    for mode, accumulate in [("jit", 2), ("shard_map", 2), ("pmap", 1)]:
        state, history = run("pytree", mesh, mode, precision, data, accumulate=accumulate)
        for a, e in zip(leaves(state.params), leaves(reference.params), strict=True):
            np.testing.assert_allclose(a, e, rtol=0.02, atol=2e-3)
        np.testing.assert_allclose(history[-1]["loss"], ref_history[-1]["loss"], rtol=0.02)


def small_loss(model, batch):
    """Output cotangents of 1e-8: below float16's smallest subnormal (6e-8)."""
    return 1e-8 * jnp.sum(model(batch["x"]).astype(jnp.float32))


def test_fp16_loss_scaling_keeps_gradients_that_float16_would_flush(mesh):
    data, mode = batches(1), "jit"
    tx = optax.sgd(1e5)
    start = make_state("pytree", tx).params
    fp32, _ = run("pytree", mesh, mode, "fp32", data, tx=tx, loss_fn=small_loss)
    unscaled = sx.Precision(compute_dtype=jnp.float16)
    flushed, _ = run("pytree", mesh, mode, unscaled, data, tx=tx, loss_fn=small_loss)
    scaled, history = run("pytree", mesh, mode, "fp16", data, tx=tx, loss_fn=small_loss)
    # b2's gradient is 1e-8 per example: 32 examples move it by 0.032 at lr 1e5.
    np.testing.assert_allclose(fp32.params["b2"] - start["b2"], -0.032, rtol=1e-5)
    np.testing.assert_array_equal(flushed.params["b2"], start["b2"])
    for name in start:
        np.testing.assert_allclose(scaled.params[name], fp32.params[name], rtol=1e-2, atol=1e-4)
    assert history[0]["loss_scale"] == 2.0**15


@pytest.mark.parametrize(("mode", "accumulate"), [("jit", 1), ("shard_map", 2), ("pmap", 1)])
def test_fp16_skips_a_non_finite_step_and_adapts_the_scale(mesh, mode, accumulate):
    scaling = sx.train.LossScaling(initial=2.0**10, period=2)
    precision = sx.Precision(compute_dtype=jnp.float16, loss_scaling=scaling)
    step = sx.make_train_step(
        make_loss("pytree"), mesh=mesh, mode=mode, precision=precision, accumulate=accumulate
    )
    state = step.shard(make_state("pytree", optax.adam(1e-2)))
    assert state.loss_scale.scale.dtype == jnp.float32 and float(state.loss_scale.scale) == 1024
    good, bad = batches(1)[0], dict(batches(1)[0])
    bad["x"] = bad["x"].copy()
    bad["x"][3] = 1e5  # inf in float16
    scales = []
    for batch in (good, good, bad):
        before = jax.tree.map(np.asarray, (state.params, state.opt_state))
        state, metrics = step(state, batch)
        scales.append(float(metrics["loss_scale"]))
    assert not np.isfinite(float(metrics["loss"]))
    # The skipped step: params and optimizer state unchanged, the step counted.
    for a, b in zip(leaves((state.params, state.opt_state)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(state.step) == 3
    # Two finite steps double the scale (period=2); the non-finite one halves it.
    assert scales == [1024.0, 2048.0, 1024.0]
    assert float(state.loss_scale.scale) == 1024.0


def test_adjust_loss_scale_follows_the_schedule():
    scaling = sx.train.LossScaling(initial=4.0, period=3, factor=2.0, minimum=1.0)
    state = LossScaleState(jnp.float32(4.0), jnp.int32(0))
    out = []
    for finite in [True, True, True, True, False, False, False, False]:
        state = adjust_loss_scale(state, jnp.bool_(finite), scaling)
        out.append((float(state.scale), int(state.good_steps)))
    assert out == [
        (4.0, 1),
        (4.0, 2),
        (8.0, 0),
        (8.0, 1),
        (4.0, 0),
        (2.0, 0),
        (1.0, 0),
        (1.0, 0),  # never below the minimum
    ]


def test_param_dtype_is_where_the_state_keeps_its_params(mesh):
    precision = sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    step = sx.make_train_step(make_loss("nnx"), mesh=mesh, precision=precision)
    state = step.shard(make_state("nnx"))
    bf16 = {jnp.dtype(jnp.bfloat16)}

    def moments(state):  # Adam's mu and nu: the optimizer state's non-scalar leaves
        return {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim}

    assert {x.dtype for x in jax.tree.leaves(state.params)} == bf16 == moments(state)
    abstract = step.abstract(jax.eval_shape(lambda: make_state("nnx")))
    assert {x.dtype for x in jax.tree.leaves(abstract.params)} == bf16 == moments(abstract)
    state, metrics = step(state, batches(1)[0])
    assert {x.dtype for x in jax.tree.leaves(state.params)} == bf16 == moments(state)
    assert metrics["loss"].dtype == jnp.float32
    # A transformation that computes its moments in f32 (mu_dtype) gets them back in the
    # state's dtypes: the second step's inputs are the first's, nothing recompiles.
    state = step.shard(make_state("nnx", optax.adam(1e-2, mu_dtype=jnp.float32)))
    before = jax.tree.map(lambda x: x.dtype, state.opt_state)
    for batch in batches(2):
        state, _ = step(state, batch)
        assert jax.tree.map(lambda x: x.dtype, state.opt_state) == before


def test_bad_precisions_are_named(mesh):
    loss_fn = make_loss("pytree")
    with pytest.raises(
        ValueError, match=r"precision must be one of \['fp32', 'bf16', 'fp16', 'fp8'\] .*'int8'"
    ):
        sx.make_train_step(loss_fn, mesh=mesh, precision="int8")
    with pytest.raises(TypeError, match=r"or an sx.Precision, got dtype"):
        sx.make_train_step(loss_fn, mesh=mesh, precision=jnp.dtype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"Precision.compute_dtype must be a floating dtype"):
        sx.make_train_step(loss_fn, mesh=mesh, precision=sx.Precision(compute_dtype=jnp.int8))
    with pytest.raises(
        ValueError, match=r"LossScaling: factor must be a finite number > 1, got 1.0"
    ):
        sx.train.LossScaling(factor=1.0)
    with pytest.raises(TypeError, match=r"Precision.loss_scaling must be an sx.train.LossScaling"):
        sx.make_eval_step(loss_fn, mesh=mesh, precision=sx.Precision(loss_scaling=(8.0, 2)))
    assert resolve("bf16") == sx.Precision(compute_dtype=jnp.bfloat16)
