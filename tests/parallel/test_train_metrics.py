"""weighted_mean and masked_mean: one metric reduction for jit, shard_map and pmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx

VALUES = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], np.float32)
COUNTS = np.array([3, 0, 1, 4, 2, 2, 0, 5], np.float32)


def expected():
    return np.sum(VALUES * COUNTS) / np.sum(COUNTS)


def test_weighted_mean_in_shard_map_matches_numpy(mesh):
    f = jax.shard_map(
        lambda v, w: sx.parallel.weighted_mean({"m": v[0], "n": 2 * v[0]}, w[0], "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=False,
    )
    out = f(VALUES, COUNTS)
    np.testing.assert_allclose(out["m"], expected(), rtol=1e-6)
    np.testing.assert_allclose(out["n"], 2 * expected(), rtol=1e-6)


def test_weighted_mean_in_pmap_matches_numpy_and_equal_weights_are_pmean():
    out = jax.pmap(lambda v, w: sx.parallel.weighted_mean(v, w, "data"), axis_name="data")(
        VALUES, COUNTS
    )
    np.testing.assert_allclose(out, np.full(8, expected()), rtol=1e-6)
    out = jax.pmap(lambda v: sx.parallel.weighted_mean(v, None, "data"), axis_name="data")(VALUES)
    np.testing.assert_allclose(out, np.full(8, VALUES.mean()), rtol=1e-6)


def test_weighted_mean_under_jit_returns_global_values(mesh):
    values = sx.distribute_batch(VALUES, sx.batch_sharding(mesh))
    out = jax.jit(lambda v: sx.parallel.weighted_mean(sx.masked_mean(v, v > 4), jnp.float32(4)))(
        values
    )
    np.testing.assert_allclose(out, VALUES[VALUES > 4].mean(), rtol=1e-6)


def test_weighted_mean_with_no_weight_anywhere_is_zero(mesh):
    f = jax.shard_map(
        lambda v: sx.parallel.weighted_mean(v[0], jnp.float32(0), "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=False,
    )
    assert float(f(VALUES)) == 0.0


def test_weighted_mean_names_an_unbound_axis(mesh):
    f = jax.shard_map(
        lambda v: sx.parallel.weighted_mean(v[0], jnp.float32(1), "batch"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(NameError, match="axis name 'batch' is unbound"):
        f(VALUES)


def test_masked_mean():
    values = jnp.array([[1.0, 3.0], [5.0, 7.0], [100.0, 100.0]])
    mask = jnp.array([True, True, False])
    assert float(sx.masked_mean(values, mask)) == 4.0
    assert float(sx.masked_mean(values, jnp.zeros(3, bool))) == 0.0
    assert float(sx.masked_mean(values)) == pytest.approx(np.mean(values))
    with pytest.raises(ValueError, match=r"values have shape \(3, 2\), mask has shape \(2,\)"):
        sx.masked_mean(values, mask[:2])


def test_dropout_keeps_expectation_and_uses_one_key_per_example():
    keys = sx.train.example_keys(jax.random.key(0), 0, jnp.arange(512))
    out = sx.train.dropout(keys, jnp.ones((512, 16)), 0.25)
    assert set(np.unique(np.asarray(out)).tolist()) <= {0.0, float(np.float32(1) / 0.75)}
    assert abs(float(out.mean()) - 1.0) < 0.05
    again = sx.train.dropout(keys[:4], jnp.ones((4, 16)), 0.25)
    np.testing.assert_array_equal(again, out[:4])
    with pytest.raises(ValueError, match=r"rate must be in \[0, 1\), got 1.0"):
        sx.train.dropout(keys, jnp.ones((512, 16)), 1.0)
