"""The step's update statistics: grad norm, param norm and learning rate, in every mode."""

import functools

import jax
import numpy as np
import optax
import pytest
from train_models import batches, make_loss, make_state, pytree_apply

import shardax as sx
from shardax.train.stats import DEFAULT_STATS, STATS, learning_rate

MODES = ("single", "jit", "shard_map", "pmap")


def numpy_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in tree)))


def single_device_grads(params, batch):
    """Plain JAX on one device, no shardax: the reference gradients."""
    loss_fn = make_loss("pytree")
    grads = jax.jit(jax.grad(lambda p: loss_fn(functools.partial(pytree_apply, p), batch)[0]))(
        jax.device_put(params, jax.devices()[0])
    )
    return jax.tree.leaves(jax.device_get(grads))


@pytest.mark.parametrize(("mode", "accumulate"), [*((m, 1) for m in MODES), ("jit", 2)])
def test_grad_and_param_norm_equal_numpys_over_single_device_grads(mode, accumulate):
    mesh = sx.make_mesh({"data": -1})
    step = sx.make_train_step(
        make_loss("pytree"), mesh=mesh, mode=mode, accumulate=accumulate, stats=STATS
    )
    state = step.shard(make_state("pytree"))
    for batch in batches(2, mask=True):
        before = jax.device_get(state.params)
        state, metrics = step(state, batch)
        grads = single_device_grads(before, batch)
        assert metrics["grad_norm"].dtype == np.float32
        np.testing.assert_allclose(float(metrics["grad_norm"]), numpy_norm(grads), rtol=1e-5)
        np.testing.assert_allclose(
            float(metrics["param_norm"]), numpy_norm(jax.tree.leaves(state.params)), rtol=1e-5
        )
    assert "learning_rate" not in metrics  # plain optax.sgd holds no learning rate


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_learning_rate_comes_from_the_injected_schedule(mode):
    schedule = optax.linear_schedule(0.1, 0.01, transition_steps=4)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    step = sx.make_train_step(make_loss("pytree"), mesh=sx.make_mesh({"data": -1}), mode=mode)
    state = step.shard(make_state("pytree", tx))
    rates = []
    for batch in batches(5):
        state, metrics = step(state, batch)
        rates.append(float(metrics["learning_rate"]))
    # the rate each update used: schedule(0) for the first
    np.testing.assert_allclose(rates, [float(schedule(i)) for i in range(5)], rtol=1e-6)


def test_learning_rate_is_found_inside_a_chain_and_none_without_injection():
    params = {"w": np.ones(3, np.float32)}
    chained = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)
    )
    np.testing.assert_allclose(float(learning_rate(chained.init(params))), 3e-3, rtol=1e-6)
    assert learning_rate(optax.adam(3e-3).init(params)) is None


@pytest.mark.parametrize("stats", [(), ("param_norm",), DEFAULT_STATS])
def test_stats_picks_what_the_step_returns(stats):
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    step = sx.make_train_step(make_loss("pytree"), mesh=sx.make_mesh({"data": -1}), stats=stats)
    _, metrics = step(step.shard(make_state("pytree", tx)), batches(1)[0])
    assert set(metrics) & set(STATS) == set(stats)
    assert step.stats == stats


def test_default_stats_are_the_free_learning_rate_only():
    step = sx.make_train_step(make_loss("pytree"), mesh=sx.make_mesh({"data": -1}))
    assert step.stats == ("learning_rate",) and step.stats_every == 1


def test_stats_every_computes_norms_on_its_steps_in_one_program():
    step = sx.make_train_step(
        make_loss("pytree"), mesh=sx.make_mesh({"data": -1}), stats=STATS, stats_every=2
    )
    state = step.shard(make_state("pytree"))
    seen = []
    for i, batch in enumerate(batches(4), 1):
        before = jax.device_get(state.params)
        compiles = sx.runtime.compile_stats().compiles
        state, metrics = step(state, batch)
        if i > 1:  # the one compiled step serves both kinds of step
            assert sx.runtime.compile_stats().compiles == compiles
        norm = float(metrics["grad_norm"])
        seen.append(np.isnan(norm))
        if i % 2 == 0:
            grads = single_device_grads(before, batch)
            np.testing.assert_allclose(norm, numpy_norm(grads), rtol=1e-5)
            assert np.isfinite(float(metrics["param_norm"]))
    assert seen == [True, False, True, False]
    with pytest.raises(ValueError, match="stats_every"):
        sx.make_train_step(make_loss("pytree"), mesh=sx.make_mesh({"data": -1}), stats_every=0)


@pytest.mark.parametrize(
    ("stats", "match"),
    [
        (("grad_norm", "weight_norm"), r"stats \['weight_norm'\] unknown: the step can return"),
        ("grad_norm", r"stats must be a tuple of names .* got 'grad_norm'"),
    ],
)
def test_bad_stats_name_the_value(stats, match):
    with pytest.raises(ValueError, match=match):
        sx.make_train_step(make_loss("pytree"), mesh=sx.make_mesh({"data": -1}), stats=stats)


def test_aux_metrics_may_not_take_the_stats_names():
    def loss_fn(model, batch):
        loss, _ = make_loss("pytree")(model, batch)
        return loss, {"grad_norm": loss}

    step = sx.make_train_step(loss_fn, mesh=sx.make_mesh({"data": -1}))
    with pytest.raises(ValueError, match=r"must not use the names \['grad_norm'\]"):
        step(step.shard(make_state("pytree")), batches(1)[0])
