"""Token-weighted losses: a (batch, seq) mask gives the same update in every mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_models import (
    leaves,
    lm_loss,
    lm_losses_numpy,
    lm_state,
    make_loss,
    make_state,
    padded_token_batches,
)

import shardax as sx


def run(mesh, mode, data, **kwargs):
    step = sx.make_train_step(lm_loss, mesh=mesh, mode=mode, **kwargs)
    state = step.shard(lm_state())
    history = []
    for batch in data:
        state, metrics = step(state, batch)
        history.append([float(metrics["loss"]), float(metrics["accuracy"])])
    return state, history


def test_every_mode_and_accumulation_weight_devices_by_their_real_tokens(mesh):
    data = padded_token_batches(2)
    # The devices' slices hold different numbers of real tokens.
    counts = data[0]["mask"].reshape(8, -1).sum(1)
    assert len(set(counts.tolist())) > 2
    reference, ref_history = run(mesh, "single", data)
    # The first loss is the mean over the real tokens, computed in NumPy.
    params = jax.tree.map(np.asarray, lm_state().params)
    losses = lm_losses_numpy(params, data[0])
    np.testing.assert_allclose(ref_history[0][0], losses[data[0]["mask"]].mean(), rtol=1e-5)
    for mode, accumulate in [
        ("jit", 1),
        ("shard_map", 1),
        ("pmap", 1),
        ("jit", 2),
    ]:
        state, history = run(mesh, mode, data, accumulate=accumulate)
        for a, e in zip(leaves(state.params), leaves(reference.params), strict=True):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(history, ref_history, rtol=1e-5)


def test_masked_mean_over_tokens():
    values = jnp.arange(12.0).reshape(2, 3, 2)
    mask = jnp.array([[True, True, False], [True, False, False]])
    expected = np.asarray(values)[np.asarray(mask)].mean()
    np.testing.assert_allclose(sx.masked_mean(values, mask), expected)
    np.testing.assert_allclose(sx.masked_mean(values, jnp.zeros((2, 3), bool)), 0.0)
    with pytest.raises(
        ValueError,
        match=r"mask must cover the leading axes.*values have shape "
        r"\(2, 3, 2\), mask has shape \(3, 2\)",
    ):
        sx.masked_mean(values, jnp.ones((3, 2), bool))


def test_masks_that_do_not_lead_with_the_batch_shape_are_named(mesh):
    step = sx.make_train_step(lm_loss, mesh=mesh)
    state = step.shard(lm_state())
    batch = padded_token_batches(1)[0]
    bad = {
        "one token too many": np.ones((16, 7), bool),
        "transposed": np.ones((6, 16), bool),
        "not boolean": np.ones((16, 6), np.int32),
    }
    for what, mask in bad.items():
        with pytest.raises(
            ValueError,
            match=r"batch\['mask'\] must be a boolean array whose "
            r"shape leads the batch's",
        ) as info:
            step(state, {**batch, "mask": mask})
        assert str(np.shape(mask)) in str(info.value), what
    # A (batch, seq) mask must lead the shape of some other leaf.
    mlp = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    x, y = np.ones((8, 4), np.float32), np.ones((8, 2), np.float32)
    with pytest.raises(ValueError, match=r"\(batch,\) = \(8,\).*got dtype bool and shape \(8, 3\)"):
        mlp(mlp.shard(make_state("pytree")), {"x": x, "y": y, "mask": np.ones((8, 3), bool)})
