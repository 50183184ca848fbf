"""make_train_step: every framework and every mode computes the same training."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from train_models import (
    FRAMEWORKS,
    IN,
    OUT,
    batches,
    count_compiles,
    leaves,
    make_loss,
    make_state,
    pytree_apply,
)

import shardax as sx

MODES = ("single", "jit", "shard_map", "pmap")


def train(framework, mesh, mode, data, *, loss_fn=None, **kwargs):
    step = sx.make_train_step(loss_fn or make_loss(framework), mesh=mesh, mode=mode, **kwargs)
    state = step.shard(make_state(framework))
    history = []
    for batch in data:
        state, metrics = step(state, batch)
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def assert_params_close(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(leaves(actual), leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_mode_matches_single_after_five_steps(framework, mesh):
    data = batches(5)
    reference, ref_history = train(framework, mesh, "single", data)
    assert ref_history[-1]["loss"] < ref_history[0]["loss"]
    for mode in ("jit", "shard_map", "pmap"):
        state, history = train(framework, mesh, mode, data)
        assert int(state.step) == 5
        assert_params_close(state.params, reference.params)
        np.testing.assert_allclose(
            [h["loss"] for h in history], [h["loss"] for h in ref_history], rtol=1e-5
        )


@pytest.mark.parametrize(("framework", "mode"), [("pytree", "jit"), ("nnx", "shard_map")])
def test_accumulate_matches_one_big_batch(framework, mesh, mode):
    data = batches(3)
    expected, expected_history = train(framework, mesh, mode, data)
    state, history = train(framework, mesh, mode, data, accumulate=2)
    assert_params_close(state.params, expected.params)
    np.testing.assert_allclose(history[-1]["mae"], expected_history[-1]["mae"], rtol=1e-5)


@functools.cache
def single_on_real_examples():
    """The reference for the masked tests: one device, padding removed."""
    real = [{k: v[b["mask"]] for k, v in b.items() if k != "mask"} for b in masked_batches()]
    state, history = train("pytree", sx.make_mesh({"data": -1}), "single", real)
    return real, state.params, history


def masked_batches():
    """Padded batches: device 0's slice is all padding, and padding holds garbage."""
    data = batches(3, mask=True, seed=1)
    for batch in data:
        batch["mask"][:4] = False
        batch["x"][~batch["mask"]] = 1e3
        batch["y"][~batch["mask"]] = -1e3
    return data


@pytest.mark.parametrize(
    ("mode", "accumulate"), [("jit", 1), ("shard_map", 1), ("pmap", 1), ("shard_map", 2)]
)
def test_masked_examples_do_not_count(mesh, mode, accumulate):
    real, expected_params, expected_history = single_on_real_examples()
    state, history = train("pytree", mesh, mode, masked_batches(), accumulate=accumulate)
    assert_params_close(state.params, expected_params)
    for h, e in zip(history, expected_history, strict=True):
        np.testing.assert_allclose([h["loss"], h["mae"]], [e["loss"], e["mae"]], rtol=1e-5)
    # The first step's metrics are the means over the real examples, computed in NumPy.
    params = jax.tree.map(np.asarray, make_state("pytree").params)
    err = np.asarray(pytree_apply(params, real[0]["x"])) - real[0]["y"]
    np.testing.assert_allclose(history[0]["loss"], np.mean(err**2), rtol=1e-5)
    np.testing.assert_allclose(history[0]["mae"], np.mean(np.abs(err)), rtol=1e-5)


def dropout_loss(model, batch, rng):
    x = sx.train.dropout(rng, batch["x"], 0.5)
    return jnp.mean((model(x) - batch["y"]) ** 2)


def test_per_example_keys_do_not_depend_on_devices_or_microbatches(mesh):
    data = batches(3)
    expected, _ = train("pytree", mesh, "single", data, loss_fn=dropout_loss)
    for mode, accumulate in [("jit", 1), ("shard_map", 1), ("pmap", 1), ("jit", 4)]:
        state, _ = train("pytree", mesh, mode, data, loss_fn=dropout_loss, accumulate=accumulate)
        assert_params_close(state.params, expected.params)
    no_dropout, _ = train("pytree", mesh, "single", data)
    assert not np.allclose(leaves(no_dropout.params)[0], leaves(expected.params)[0])


def test_example_keys_fold_in_step_then_index():
    key = jax.random.key(3)
    keys = sx.train.example_keys(key, jnp.int32(5), jnp.arange(4))
    for i in range(4):
        want = jax.random.fold_in(jax.random.fold_in(key, 5), i)
        np.testing.assert_array_equal(jax.random.key_data(keys[i]), jax.random.key_data(want))


@pytest.mark.parametrize("mode", MODES)
def test_one_compilation_over_a_hundred_steps(mesh, mode):
    data = batches(4)
    step = sx.make_train_step(make_loss("nnx"), mesh=mesh, mode=mode)
    state = step.shard(make_state("nnx"))
    with count_compiles() as compiles:
        for i in range(100):
            state, metrics = step(state, data[i % 4])
        jax.block_until_ready(metrics)
    assert int(state.step) == 100
    assert len(compiles) == 1


@pytest.mark.parametrize("mode", ["jit", "single", "shard_map", "pmap"])
def test_state_buffers_are_donated(mesh, mode):
    batch = batches(1)[0]
    for donate in (True, False):
        step = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode=mode, donate=donate)
        state = step.shard(make_state("pytree"))
        new_state, _ = step(state, batch)
        assert state.params["w1"].is_deleted() == donate
        assert not new_state.params["w1"].is_deleted()


@pytest.mark.parametrize("mode", ["jit", "single", "shard_map", "pmap"])
def test_donation_never_deletes_the_users_arrays(mesh, mode):
    from shardax.train.program import unalias

    source = make_state("pytree")  # committed to device 0, as a freshly built model is
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode=mode)
    state = step.shard(source)
    step(state, batches(1)[0])
    for leaf in jax.tree.leaves(source):
        assert not leaf.is_deleted()
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaf))  # still readable
    # Only leaves that share a buffer with the source are copied.
    same = {"a": jax.device_put(jnp.ones(4), jax.devices()[0])}
    other = {"a": jax.device_put(jnp.ones(4), jax.devices()[1])}
    assert unalias(same, same)["a"] is not same["a"]
    assert unalias(same, other)["a"] is other["a"]


def test_fsdp_plan_places_state_and_matches_single(mesh):
    plan = sx.fsdp(mesh, min_size=1)
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, plan=plan)
    state = step.shard(make_state("pytree", optax.adam(1e-2)))
    data = batches(3)
    for batch in data:
        state, _ = step(state, batch)
    specs = {k: v.sharding.spec for k, v in state.params.items()}
    assert specs == {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P()}
    assert state.params["w1"].addressable_shards[0].data.shape == (IN, 2)
    assert state.opt_state[0].mu["w1"].sharding.spec == P(None, "data")
    single = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode="single")
    expected = single.shard(make_state("pytree", optax.adam(1e-2)))
    for batch in data:
        expected, _ = single(expected, batch)
    assert_params_close(state.params, expected.params, atol=1e-5)


def test_compiled_jit_step_takes_the_plan_and_the_batch_sharding(mesh):
    plan = sx.fsdp(mesh, min_size=1)
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, plan=plan)
    state = step.shard(make_state("pytree"))
    compiled = step.lower(state, batches(1)[0]).compile()
    (state_in, batch_in), _ = compiled.input_shardings
    assert batch_in["x"].spec == P("data") and batch_in["y"].spec == P("data")
    assert state_in.params["w1"].spec == P(None, "data")
    state_out, metrics_out = compiled.output_shardings
    assert state_out.params["w1"].spec == P(None, "data") and metrics_out["loss"].spec == P()


@pytest.mark.parametrize("mode", ["jit", "single", "shard_map"])
def test_model_state_updates_like_one_device(mesh, mode):
    class Norm(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(IN, OUT, rngs=rngs)
            self.norm = nnx.BatchNorm(OUT, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.linear(x))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def run(mode):
        step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode)
        state = step.shard(sx.TrainState.create(Norm(nnx.Rngs(0)), optax.sgd(0.1)))
        state, _ = step(state, batches(1)[0])
        return nnx.to_pure_dict(state.model_state)["norm"]

    stats, expected = run(mode), run("single")
    assert not np.allclose(expected["mean"], 0)
    # The running mean is linear in the batch mean: equal shards average to the global one.
    np.testing.assert_allclose(stats["mean"], expected["mean"], rtol=1e-5, atol=1e-7)
    if mode != "shard_map":  # jit normalizes over the global batch, like one device
        np.testing.assert_allclose(stats["var"], expected["var"], rtol=1e-5)


def test_linen_batch_stats_are_model_state(mesh):
    class Norm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(nn.Dense(OUT)(x))

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    module = Norm()
    variables = module.init(jax.random.key(0), jnp.ones((1, IN)))
    step = sx.make_train_step(loss_fn, mesh=mesh)
    state = step.shard(sx.TrainState.from_linen(module, variables, optax.sgd(0.1)))
    batch = batches(1)[0]
    state, _ = step(state, batch)
    dense = variables["params"]["Dense_0"]
    h = batch["x"] @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    mean = state.model_state["batch_stats"]["BatchNorm_0"]["mean"]
    np.testing.assert_allclose(mean, 0.01 * h.mean(0), rtol=1e-4, atol=1e-7)  # momentum 0.99


# -- bad input -------------------------------------------------------------------------


def test_non_scalar_loss_is_an_error(mesh):
    def loss_fn(model, batch):
        return (model(batch["x"]) - batch["y"]) ** 2

    step = sx.make_train_step(loss_fn, mesh=mesh)
    with pytest.raises(
        TypeError,
        match=r"scalar loss .* got an array of shape \(32, 2\) and dtype float32",
    ):
        step(step.shard(make_state("pytree")), batches(1)[0])


def test_batch_not_divisible_by_the_data_axis_names_both_and_the_way_out(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    batch = batches(1, size=30)[0]
    with pytest.raises(
        ValueError,
        match=r"global batch 30 is not divisible by the data axis "
        r"size 8\..*drop the last 6 .* pad to 32 .*'mask'",
    ):
        step(step.shard(make_state("pytree")), batch)
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, accumulate=3)
    with pytest.raises(ValueError, match=r"global batch 32 .* size 8 × accumulate=3 = 24"):
        step(step.shard(make_state("pytree")), batches(1)[0])


def test_batch_leaves_disagreeing_on_size_are_named(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    batch = {"x": np.ones((32, IN), np.float32), "y": np.ones((24, OUT), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"disagree on the batch size.*'x': \(32, 4\), "
        r"'y': \(24, 2\)",
    ):
        step(step.shard(make_state("pytree")), batch)
    batch = {
        "x": np.ones((32, IN), np.float32),
        "y": np.ones((32, OUT), np.float32),
        "mask": np.ones(32, np.int32),
    }
    with pytest.raises(ValueError, match=r"batch\['mask'\] must be a boolean .* got dtype int32"):
        step(step.shard(make_state("pytree")), batch)


def test_unknown_mode_and_bad_arguments(mesh):
    with pytest.raises(
        ValueError,
        match=r"mode must be one of \['jit', 'shard_map', 'pmap', "
        r"'single'\], got 'pjit'",
    ):
        sx.make_train_step(make_loss("pytree"), mesh=mesh, mode="pjit")
    with pytest.raises(ValueError, match="accumulate must be an integer >= 1, got 0"):
        sx.make_train_step(make_loss("pytree"), mesh=mesh, accumulate=0)
    with pytest.raises(ValueError, match="data_axis 'batch' is not in the mesh"):
        sx.make_train_step(make_loss("pytree"), mesh=mesh, data_axis="batch")
    mesh2 = sx.make_mesh({"data": 4, "model": 2})
    with pytest.raises(ValueError, match="mode='pmap' maps over one axis"):
        sx.make_train_step(make_loss("pytree"), mesh=mesh2, mode="pmap")
    with pytest.raises(ValueError, match="plan 'replicate' is over mesh"):
        sx.make_train_step(make_loss("pytree"), mesh=mesh, plan=sx.replicate(mesh2))


@pytest.mark.parametrize("mode", ["shard_map", "pmap"])
def test_mapped_modes_reject_sharded_plans(mesh, mode):
    step = sx.make_train_step(
        make_loss("pytree"), mesh=mesh, mode=mode, plan=sx.fsdp(mesh, min_size=1)
    )
    with pytest.raises(
        ValueError,
        match=rf"mode='{mode}' .* only a replicating plan; plan "
        r"'fsdp' gives leaf 'params/b1' with shape \(16,\) the sharding P\('data',\)",
    ):
        step.shard(make_state("pytree"))


def test_jit_step_accepts_a_state_of_a_new_structure(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    batch = batches(1)[0]
    state, _ = step(step.shard(make_state("pytree")), batch)
    other, _ = step(step.shard(make_state("pytree", optax.adam(1e-3))), batch)
    state, _ = step(state, batch)
    assert int(state.step) == 2 and int(other.step) == 1


def test_explicit_axis_meshes_train_like_auto_ones(mesh):
    explicit = sx.make_mesh({"data": -1}, axis_types=jax.sharding.AxisType.Explicit)
    data = batches(2)
    expected, _ = train("nnx", mesh, "single", data)
    for mode in MODES:
        state, _ = train("nnx", explicit, mode, data)
        assert_params_close(state.params, expected.params)
    # A plain model's x @ w with w split over "data" has no sharding in types: JAX's
    # error, with a note on what to change (no silent switch to Auto axes).
    with pytest.raises(Exception, match="dot_general") as error:
        train("nnx", explicit, "jit", data, plan=sx.fsdp(explicit, min_size=1))
    assert "has Explicit axes ['data']" in "".join(error.value.__notes__)


class NNXDropoutFirst(nnx.Module):
    def __init__(self, rngs):
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.linear = nnx.Linear(64, 1, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.linear(self.drop(x))


class LinenDropoutFirst(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, use_bias=False)(nn.Dropout(0.5, deterministic=False)(x))


@pytest.mark.parametrize(
    ("framework", "mode"), [("nnx", "shard_map"), ("nnx", "pmap"), ("linen", "shard_map")]
)
def test_framework_rng_draws_different_masks_on_each_device(mesh, framework, mode):
    # One example per device, all equal: with one shared mask, about half the kernel
    # would get no gradient; with a mask per device, almost none.
    def loss_fn(model, batch):
        return jnp.mean(model(batch["x"]) ** 2)

    if framework == "nnx":
        state = sx.TrainState.create(NNXDropoutFirst(nnx.Rngs(0)), optax.sgd(0.1))
    else:
        module = LinenDropoutFirst()
        variables = module.init(jax.random.key(0), jnp.ones((1, 64)))
        state = sx.TrainState.from_linen(module, variables, optax.sgd(0.1))
    before = leaves(state.params)[0].copy()
    keys_before = [
        np.asarray(jax.random.key_data(k))
        for k in jax.tree.leaves(state.model_state)
        if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
    ]
    # rng_per_device=True: the NNX Rngs held by the model draw per device, as asked.
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode, rng_per_device=True)
    state, _ = step(step.shard(state), {"x": np.ones((8, 64), np.float32)})
    unchanged = int(np.sum(leaves(state.params)[0] == before))
    assert unchanged < 8, f"{unchanged} of 64 kernel entries got no gradient"
    keys_after = [
        np.asarray(jax.random.key_data(k))
        for k in jax.tree.leaves(state.model_state)
        if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
    ]
    assert len(keys_after) == len(keys_before)  # NNX keys come back unfolded
    for a, b in zip(keys_after, keys_before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_loss_fn_output_shapes_are_checked(mesh):
    def three(model, batch):
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, {}, {}

    def aux_named_loss(model, batch):
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, {"loss": loss}

    for loss_fn, error, match in [
        (three, TypeError, "loss or \\(loss, aux\\), got a tuple of 3 items"),
        (aux_named_loss, ValueError, "aux metrics must not have a 'loss' entry"),
    ]:
        step = sx.make_train_step(loss_fn, mesh=mesh, mode="single")
        with pytest.raises(error, match=match):
            step(step.shard(make_state("pytree")), batches(1)[0])


def test_single_mode_refuses_a_sharding_plan_and_bad_seeds_are_named(mesh):
    with pytest.raises(ValueError, match=r"mode='single' .* no sharding plan; got plan 'fsdp'"):
        sx.make_train_step(make_loss("pytree"), mesh=mesh, plan=sx.fsdp(mesh), mode="single")
    step = sx.make_train_step(
        make_loss("pytree"), mesh=mesh, plan=sx.replicate(mesh), mode="single"
    )
    assert step.mode == "single"
    params, apply_fn = {"w": np.zeros((4, 2), np.float32)}, lambda p, x: x @ p["w"]
    tx = optax.sgd(0.1)
    a = sx.TrainState.from_params(params, apply_fn, tx, rng=np.int64(3))
    b = sx.TrainState.from_params(params, apply_fn, tx, rng=3)
    np.testing.assert_array_equal(a.rng, b.rng)
    with pytest.raises(TypeError, match=r"rng must be an integer seed.*got shape \(3,\)"):
        sx.TrainState.from_params(params, apply_fn, tx, rng=np.zeros(3, np.uint32))


def test_accumulated_integer_aux_is_a_float_mean_not_rounded_to_zero():
    from shardax.train.accumulate import microbatched

    def fn(model_state, batch, keys, rng):
        return None, jnp.mean(batch["x"]), {"n": jnp.int32(batch["x"].shape[0])}, model_state

    _, loss, aux, _ = microbatched(fn, 2)(None, {"x": jnp.arange(8.0)}, None, jax.random.key(0))
    assert float(loss) == 3.5 and aux["n"].dtype == jnp.float32 and float(aux["n"]) == 4.0
