"""sx.verify on your own step with a closed-over optax transformation (no nnx.Optimizer):
the gradient of a bias before a normalisation is rounding noise that Adam turns into
±lr; the one-device step's own spread over row-permuted batches is its noise floor."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardax as sx

P = jax.sharding.PartitionSpec
ROWS, IN, HIDDEN = 16, 6, 8
RNG = np.random.default_rng(0)
BATCH = {
    "x": RNG.normal(size=(ROWS, IN)).astype(np.float32),
    "y": RNG.normal(size=(ROWS, 2)).astype(np.float32),
}


class EqxBN(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(IN, HIDDEN, key=k1)  # a bias, then BatchNorm
        self.norm = eqx.nn.BatchNorm(HIDDEN, "batch", mode="batch")
        self.head = eqx.nn.Linear(HIDDEN, 2, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.linear(x), state)
        return self.head(jax.nn.relu(h)), state


def eqx_step_for(optim, scale=1.0):
    """Equinox's own way: eqx.filter_jit, the optax transformation closed over."""

    @eqx.filter_jit
    def step(model, state, opt_state, batch):
        def loss_fn(model):
            out, new = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
                batch["x"], state
            )
            return jnp.mean((out - batch["y"]) ** 2), new

        (loss, new), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        updates = jax.tree.map(lambda u: scale * u, updates)
        return eqx.apply_updates(model, updates), new, opt_state, loss

    return step


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: optax.lion(1e-3),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_equinox_bias_before_batchnorm_has_no_false_alarm(mesh, name):
    optim = OPTIMIZERS[name]()
    model, state = eqx.nn.make_with_state(EqxBN)(jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    placed = sx.prepare(model, state, opt_state, mesh=mesh)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(eqx_step_for(optim), placed, batch, steps=2)
    assert report.ok, str(report)
    assert "row-permuted" in report.judged


def test_equinox_step_that_doubles_the_update_is_caught(mesh):
    optim = optax.adam(1e-2)
    model, state = eqx.nn.make_with_state(EqxBN)(jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    placed = sx.prepare(model, state, opt_state, mesh=mesh)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    good = eqx_step_for(optim)
    doubled = eqx_step_for(optim, scale=2.0)

    def step(model, state, opt_state, batch):  # a bug: twice the update when distributed
        spread = len(batch["x"].sharding.device_set)
        return (doubled if spread > 1 else good)(model, state, opt_state, batch)

    report = sx.verify(step, placed, batch)
    assert not report.ok, str(report)
    # the weights have real gradients: their floor is rounding, the doubling is not
    bad = {d.path for d in report.diffs}
    assert {"state/0/linear/weight", "state/0/head/weight"} <= bad, str(report)


# -- a plain pytree step, a hand-written normalisation after a biased linear layer ----------


def forward(params, x):
    h = x @ params["w"] + params["b"]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
    return jnp.tanh(h) @ params["head"]


def loss_of(params, batch):
    return jnp.mean((forward(params, batch["x"]) - batch["y"]) ** 2)


TX = optax.adam(1e-2)


@jax.jit
def pytree_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_of)(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def pytree_state(mesh):
    k1, k2 = jax.random.split(jax.random.key(1))
    params = {
        "w": jax.random.normal(k1, (IN, HIDDEN)),
        "b": jnp.zeros(HIDDEN),
        "head": jax.random.normal(k2, (HIDDEN, 2)),
    }
    return sx.prepare(params, TX.init(params), mesh=mesh)


def test_plain_pytree_step_with_closed_over_adam_has_no_false_alarm(mesh):
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(pytree_step, pytree_state(mesh), batch, steps=2)
    assert report.ok, str(report)


def own_shard_map_step(mesh, per_device):
    """A user's jitted step computing ``(loss, grads)`` with ``per_device`` in their own
    shard_map (batch split over ``data``), then the closed-over optax update."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False
        )(params, batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def test_shard_map_step_that_applies_each_devices_own_gradient_is_caught(mesh):
    """No all-reduce: each device updates with its own gradient (and keeps device 0's)."""
    unreduced_step = own_shard_map_step(mesh, jax.value_and_grad(loss_of))
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(unreduced_step, pytree_state(mesh), batch, reference=pytree_step)
    assert not report.ok, str(report)


def test_per_device_normalisation_in_own_shard_map_step_with_adam_is_caught(mesh):
    """The normalisation's statistics are each device's own: the floor (the one-device
    step's spread over reorderings) does not hide it. (The cause is not named here: with
    Adam closed over, the slices' updates do not average to the update.)"""

    def per_device(params, batch):
        return jax.lax.pmean(jax.value_and_grad(loss_of)(params, batch), "data")

    sharded_step = own_shard_map_step(mesh, per_device)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(sharded_step, pytree_state(mesh), batch, reference=pytree_step)
    assert not report.ok, str(report)
    assert "state/0/w" in {d.path for d in report.diffs}, str(report)
