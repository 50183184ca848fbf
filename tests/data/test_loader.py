"""sx.batches: deterministic, process-sharded, uneven-batch policies, exact resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.data.policy import fit_batch, num_batches, pad_batch

N = 37


@pytest.fixture
def data():
    return {"x": np.arange(N * 3, dtype=np.float32).reshape(N, 3), "y": np.arange(N)}


def global_batches(data, process_count, **kw):
    """Each simulated process reads its share; concatenated, in process order."""
    loaders = [
        sx.batches(data, process_index=p, process_count=process_count, **kw)
        for p in range(process_count)
    ]
    out = []
    for shares in zip(*loaders, strict=True):
        out.append(jax.tree.map(lambda *xs: np.concatenate(xs), *shares))
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        jax.tree.map(np.testing.assert_array_equal, x, y)


@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_global_batch_is_the_same_whatever_the_process_count(data, policy):
    kw = dict(batch_size=8, shuffle=True, seed=7, policy=policy, num_epochs=2)
    one = global_batches(data, 1, **kw)
    assert len(one) == 2 * (4 if policy == "drop" else 5)
    assert_same(global_batches(data, 2, **kw), one)
    assert_same(global_batches(data, 4, **kw), one)


def test_each_process_reads_only_its_share(data):
    share = sx.batches(data, 8, process_index=1, process_count=4, policy="drop")
    first = next(share)
    assert first["x"].shape == (2, 3) and first["y"].tolist() == [2, 3]


def test_deterministic_per_seed_and_epoch_and_covers_every_example(data):
    a = [b["y"] for b in sx.batches(data, 8, shuffle=True, seed=3, policy="pad", num_epochs=2)]
    b = [b["y"] for b in sx.batches(data, 8, shuffle=True, seed=3, policy="pad", num_epochs=2)]
    assert_same(a, b)
    first, second = np.concatenate(a[:5])[:N], np.concatenate(a[5:])[:N]
    assert sorted(first.tolist()) == list(range(N)) == sorted(second.tolist())
    assert not np.array_equal(first, second)  # a new order each epoch
    other = next(sx.batches(data, 8, shuffle=True, seed=4, policy="pad"))["y"]
    assert not np.array_equal(other, a[0])
    plain = next(sx.batches(data, 8, policy="drop"))["y"]
    assert plain.tolist() == list(range(8))


def test_pad_adds_a_mask_to_every_batch_and_zero_rows(data):
    out = list(sx.batches(data, 8, policy="pad"))
    assert [b["x"].shape for b in out] == [(8, 3)] * 5
    assert [int(b["mask"].sum()) for b in out] == [8, 8, 8, 8, 5]
    assert out[-1]["mask"].dtype == bool and out[-1]["mask"].tolist() == [True] * 5 + [False] * 3
    np.testing.assert_array_equal(out[-1]["y"], [32, 33, 34, 35, 36, 0, 0, 0])
    # Across 4 processes, process 3 holds only padding in the last batch.
    last = list(sx.batches(data, 8, policy="pad", process_index=3, process_count=4))[-1]
    assert last["mask"].tolist() == [False, False] and last["x"].shape == (2, 3)


def test_padded_batches_give_the_masked_mean_and_compile_once(data):
    mesh = sx.make_mesh({"data": -1})
    mean = jax.jit(lambda b: jnp.sum(b["x"][:, 0] * b["mask"]) / jnp.sum(b["mask"]))
    for local in sx.batches(data, 16, policy="pad"):
        batch = sx.global_batch(local, mesh, global_size=16)
        assert batch["mask"].sharding.spec == P("data")
        real = local["x"][local["mask"], 0]
        np.testing.assert_allclose(float(mean(batch)), real.mean(), rtol=1e-6)
    assert mean._cache_size() == 1


def test_uneven_error_names_the_sizes(data):
    with pytest.raises(
        ValueError, match=r"37 examples do not split into batches of 8.*would have 5"
    ):
        sx.batches(data, 8)
    assert len(list(sx.batches(data, 8, policy="drop"))) == 4


def test_resume_mid_epoch_equals_uninterrupted(data):
    kw = dict(shuffle=True, seed=11, policy="pad", num_epochs=3)
    uninterrupted = list(sx.batches(data, 8, **kw))
    first = sx.batches(data, 8, **kw)
    head = [next(first) for _ in range(7)]  # into the second epoch
    state = first.get_state()
    assert (state["epoch"], state["index"]) == (1, 2)
    resumed = sx.batches(data, 8, **kw)
    resumed.set_state(state)
    assert_same(head + list(resumed), uninterrupted)
    # The state is global: two processes resume it and still build the same batches.
    shares = [sx.batches(data, 8, process_index=p, process_count=2, **kw) for p in (0, 1)]
    for s in shares:
        s.set_state(state)
    rest = [jax.tree.map(lambda *x: np.concatenate(x), a, b) for a, b in zip(*shares, strict=True)]
    assert_same(head + rest, uninterrupted)


def test_state_checks_what_it_depends_on(data):
    state = sx.batches(data, 8, policy="drop", seed=1).get_state()
    with pytest.raises(ValueError, match="saved with seed=1, but this loader has seed=2"):
        sx.batches(data, 8, policy="drop", seed=2).set_state(state)
    with pytest.raises(ValueError, match=r"index in \[0, 4\), got epoch=0, index=9"):
        sx.batches(data, 8, policy="drop", seed=1).set_state({"epoch": 0, "index": 9})


def test_bad_arguments_are_named(data):
    with pytest.raises(ValueError, match="batch_size 8 is not divisible by process_count 3"):
        sx.batches(data, 8, policy="drop", process_index=0, process_count=3)
    with pytest.raises(ValueError, match=r"process_index=2 and process_count=2"):
        sx.batches(data, 8, policy="drop", process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"differ in their number of rows: \{'x': 37, 'y': 36\}"):
        sx.batches({"x": data["x"], "y": data["y"][:-1]}, 8, policy="drop")
    with pytest.raises(ValueError, match="policy='pad' adds a top-level 'mask' leaf"):
        sx.batches((data["x"],), 8, policy="pad")
    with pytest.raises(ValueError, match="policy must be one of"):
        sx.batches(data, 8, policy="truncate")


def test_policy_functions():
    assert num_batches(10, 4, "drop") == 2 and num_batches(10, 4, "pad") == 3
    assert num_batches(8, 4, "error") == 2
    assert fit_batch({"x": np.ones(3)}, 4, "drop") is None
    padded = fit_batch({"x": np.ones(4)}, 4, "pad")
    assert padded["mask"].all() and padded["x"].shape == (4,)
    with pytest.raises(ValueError, match="already has one"):
        pad_batch({"x": np.ones(3), "mask": np.ones(3, bool)}, 4)
    with pytest.raises(ValueError, match="5 examples, more than the batch size 4"):
        fit_batch({"x": np.ones(5)}, 4, "pad")
