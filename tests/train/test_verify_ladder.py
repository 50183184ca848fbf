"""sx.verify's cause ladder is one list that both paths (a train step and your own step
function) run through: a cause added to it in one place is named for either."""

import functools
import itertools

import jax
import jax.numpy as jnp
import optax
import pytest
from train_models import IN, OUT, batches

import shardax as sx
from shardax.train.verification import causes

BATCH = batches(1, size=16)[0]


def fake_cause(evidence: causes.Evidence):
    """A cause of one's own, on the evidence every path gives: the worst leaf, the leaves
    that differed, what the side compared, and the step run again from where it started
    (the same: these steps are deterministic)."""
    assert evidence.worst in evidence.bad and evidence.side.judged
    assert evidence.agrees(evidence.side.rerun(evidence.run), evidence.run.got)
    return "fake cause", f"{evidence.worst.path} differs ({evidence.side.what})"


@pytest.fixture
def ladder_with_a_fake_cause(monkeypatch):
    monkeypatch.setattr(causes, "LADDER", (fake_cause, *causes.LADDER))


def test_a_cause_added_to_the_ladder_is_named_for_a_train_step(mesh, ladder_with_a_fake_cause):
    traced = itertools.count(1)  # a bug: each compiled program scales the loss differently

    def loss_fn(model, batch):
        scale = float(next(traced))
        return scale * jnp.mean((batch["x"] @ model()["w"] - batch["y"]) ** 2)

    state = sx.TrainState.from_params({"w": jnp.ones((IN, OUT))}, lambda p: p, optax.sgd(0.1))
    step = sx.make_train_step(loss_fn, mesh=mesh)
    report = sx.verify(step, state, BATCH)
    assert not report.ok and report.cause == "fake cause", str(report)
    assert report.hint.startswith(report.worst.path) and "TrainStep" in report.hint
    assert "likely cause: fake cause" in str(report)


def test_a_cause_added_to_the_ladder_is_named_for_your_own_step(mesh, ladder_with_a_fake_cause):
    @functools.partial(jax.jit, donate_argnums=0)
    def scaled(params, batch, scale):
        loss, grads = jax.value_and_grad(
            lambda p: scale * jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
        )(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    def own_step(params, batch):  # a bug: the loss depends on how many devices hold it
        return scaled(params, batch, float(len(batch["x"].sharding.device_set)))

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.device_put({"w": jnp.ones((IN, OUT))}, replicated)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    # two steps, the first differs: its evidence outlives the second, which donates
    report = sx.verify(own_step, params, batch, steps=2)
    assert not report.ok and report.first_step == 1 and report.cause == "fake cause"
    assert report.hint == f"{report.worst.path} differs (own_step)"
