"""Typed PRNG keys (``jax.random.key``, the state of every ``nnx.Rngs``) are leaves like
any other: described (``key<fry>``, the bytes of their key data), and placed replicated by
every plan, whatever its rule says for their shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx

KEY = jax.random.key(0)


def tree():
    return {
        "params": {"w": jnp.ones((16, 64)), "b": jnp.ones(64)},
        "key": KEY,  # one key, rank 0
        "keys": jax.random.split(KEY, 8),  # a key per layer: rank 1, divisible by 8
    }


def test_is_key_dtype_name_and_itemsize():
    abstract = jax.eval_shape(lambda: jax.random.split(KEY, 8))
    assert sx.plan.is_key(KEY) and sx.plan.is_key(abstract)
    assert not sx.plan.is_key(jax.random.PRNGKey(0))  # raw uint32 key data is an array
    assert not sx.plan.is_key(np.ones(2)) and not sx.plan.is_key(3)
    assert sx.plan.dtype_name(abstract) == "key<fry>" == str(KEY.dtype)
    assert sx.plan.itemsize(KEY) == jax.random.key_data(KEY).nbytes == 8
    rbg = jax.random.key(0, impl="rbg")
    assert sx.plan.itemsize(rbg) == jax.random.key_data(rbg).nbytes == 16
    assert sx.plan.itemsize(np.ones(2, np.float16)) == 2


def test_describe_names_keys_and_counts_their_key_data(mesh):
    placed = sx.shard(tree(), sx.fsdp(mesh, min_size=1))
    for report in (sx.describe(placed), sx.describe(jax.eval_shape(tree), sx.fsdp(mesh))):
        rows = {r.path: r for r in report.rows}
        assert (rows["key"].dtype, rows["key"].shape, rows["key"].bytes) == ("key<fry>", (), 8)
        assert rows["keys"].dtype == "key<fry>" and rows["keys"].bytes == 64
        assert rows["keys"].bytes_per_device == 64 and rows["keys"].spec in (P(), P(None))
        assert "key<fry>" in str(report)
    assert sx.describe({"k": KEY}).rows[0].spec is None  # unplaced, as any leaf


@pytest.mark.parametrize(
    "make",
    [
        lambda m: sx.replicate(m),
        lambda m: sx.fsdp(m, min_size=1),
        lambda m: sx.zero1(m, min_size=1),
        lambda m: sx.zero2(m, min_size=1),
        lambda m: sx.rules(m, [(".*", P("data"))]),  # a rule that matches every leaf
        lambda m: sx.plan.fsdp_over(sx.rules(m, [("keys", P("data"))]), min_size=1),
    ],
    ids=["replicate", "fsdp", "zero1", "zero2", "rules", "fsdp_over"],
)
def test_every_plan_places_keys_replicated_and_keeps_their_data(make, mesh):
    plan = make(mesh)
    state = tree()
    specs = plan.specs(state)
    assert specs["key"] == P() and specs["keys"] == P()
    placed = sx.shard(state, plan)
    for name in ("key", "keys"):
        assert sx.plan.is_key(placed[name]) and placed[name].sharding.is_fully_replicated
        assert len(placed[name].addressable_shards) == 8
        np.testing.assert_array_equal(
            jax.random.key_data(placed[name]), jax.random.key_data(state[name])
        )
    assert sx.plan.validate(state, plan) == []
