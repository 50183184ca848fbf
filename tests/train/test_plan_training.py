"""Training with plans is allclose to single-device training on the same data.

``sx.make_train_step(..., plan=...)`` (optimizer state following the params) against a
plain ``jax.jit`` Adam loop on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx

STEPS = 3


def mlp_init(key, sizes):
    """Seed 002's MLP: a list of (W, b) pairs."""
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (
            jax.random.normal(k, (a, b)) / jnp.sqrt(a),
            jax.random.normal(jax.random.fold_in(k, 1), (b,)),
        )
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params, batch):
    return jnp.mean(jnp.sum((mlp_apply(params, batch["x"]) - batch["y"]) ** 2, axis=-1))


def batches(sizes, n=STEPS, batch=32):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch, sizes[0])).astype(np.float32),
            "y": rng.normal(size=(batch, sizes[-1])).astype(np.float32),
        }
        for _ in range(n)
    ]


def train_single(loss_fn, params, data, tx):
    """The reference: a plain ``jax.jit`` Adam loop on one device."""

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, loss

    state = jax.device_put({"params": params, "opt_state": tx.init(params)}, jax.devices()[0])
    losses = []
    for batch in data:
        state, loss = jax.jit(step)(state, jax.device_put(batch, jax.devices()[0]))
        losses.append(float(loss))
    return state, losses


def train_sharded(step, state, data):
    """``sx.make_train_step`` with a plan: its ``state`` comes from ``step.init``."""
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_same_training(single, sharded):
    (s1, l1), (s2, l2) = single, sharded
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for ref, got in ((s1["params"], s2.params), (s1["opt_state"], s2.opt_state)):
        ref, got = jax.tree.leaves(ref), jax.tree.leaves(got)
        assert len(ref) == len(got)
        for a, b in zip(ref, got, strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def mlp_apply(params, x):
    for w, b in params[:-1]:
        x = jnp.maximum(x @ w + b, 0)
    w, b = params[-1]
    return x @ w + b


def model_loss(model, batch):
    """``loss_fn(model, batch)`` for make_train_step: ``model = partial(mlp_apply, params)``."""
    return jnp.mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1))


def test_fsdp_training_matches_single_device():
    mesh = sx.make_mesh({"data": 8})
    sizes = (16, 64, 64, 8)
    data, tx = batches(sizes), optax.adam(1e-2)
    step = sx.make_train_step(model_loss, mesh=mesh, plan=sx.fsdp(mesh, min_size=256))
    # Initialise straight onto the plan: each device builds only its shards.
    state = step.init(
        lambda key: sx.TrainState.from_params(mlp_init(key, sizes), mlp_apply, tx),
        jax.random.key(0),
    )
    w = state.params[1][0]
    assert w.sharding.spec == P("data", None)
    assert {s.data.shape for s in w.addressable_shards} == {(8, 64)}
    single = train_single(mlp_loss, mlp_init(jax.random.key(0), sizes), data, tx)
    sharded = train_sharded(step, state, data)
    state = sharded[0]
    assert state.params[1][0].sharding.spec == P("data", None)
    assert state.opt_state[0].mu[1][0].sharding.spec == P("data", None)
    assert state.opt_state[0].count.sharding.spec == P()
    assert_same_training(single, sharded)


def test_seed_002_four_by_two_layout_matches_single_device():
    mesh = sx.make_mesh({"data": 4, "model": 2})
    sizes = (16, 64, 64, 64, 8)
    data, tx = batches(sizes), optax.adam(1e-2)
    # Seed 002: W2 and b2 split on their columns over "model", W3 on its rows; anchored
    # rules name params paths only, and Adam's mu/nu follow them all the same.
    plan = sx.rules(
        mesh,
        [
            (r"^params/1/0$", P(None, "model")),
            (r"^params/1/1$", P("model")),
            (r"^params/2/0$", P("model", None)),
        ],
    )
    step = sx.make_train_step(model_loss, mesh=mesh, plan=plan)
    params = mlp_init(jax.random.key(1), sizes)
    single = train_single(mlp_loss, params, data, tx)
    sharded = train_sharded(
        step, step.shard(sx.TrainState.from_params(params, mlp_apply, tx)), data
    )
    state = sharded[0]
    w2, w3 = state.params[1][0], state.params[2][0]
    assert w2.sharding.spec == P(None, "model") and w3.sharding.spec == P("model", None)
    assert {s.data.shape for s in w2.addressable_shards} == {(64, 32)}
    assert {s.data.shape for s in w3.addressable_shards} == {(32, 64)}
    nu = state.opt_state[0].nu
    assert nu[1][0].sharding.spec == P(None, "model") and nu[2][0].sharding.spec == P("model", None)
    assert state.params[0][0].sharding.spec == P()
    assert_same_training(single, sharded)


class AnnotatedMLP(nnx.Module):
    """Annotated once with logical names; the axis rules place it on a mesh."""

    def __init__(self, rngs):
        init, part = nnx.initializers.lecun_normal(), nnx.with_partitioning
        self.up = nnx.Linear(
            16,
            64,
            kernel_init=part(init, ("embed", "mlp")),
            bias_init=part(nnx.initializers.normal(), ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(64, 8, kernel_init=part(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.down(sx.constrain(nnx.relu(self.up(x)), P("batch", "mlp")))


@pytest.mark.parametrize(
    ("mesh_shape", "rules", "up_spec"),
    [
        (
            {"data": 4, "model": 2},
            {"batch": "data", "embed": None, "mlp": "model"},
            P(None, "model"),
        ),
        ({"data": 8}, {"batch": "data", "embed": "data", "mlp": None}, P("data", None)),
    ],
)
def test_nnx_annotated_model_matches_single_device(mesh_shape, rules, up_spec):
    mesh = sx.make_mesh(mesh_shape)
    model = _build()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        pred = nnx.merge(graphdef, params)(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    data, tx = batches((16, 8)), optax.adam(1e-2)
    single = train_single(loss_fn, params, data, tx)

    def model_loss_nnx(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    with sx.plan.axis_rules(rules):  # read when the plan is built and when the step traces
        step = sx.make_train_step(model_loss_nnx, mesh=mesh, plan=sx.from_nnx(mesh, model))
        state = step.init(lambda: sx.TrainState.create(_build(), tx))
        sharded = train_sharded(step, state, data)
    up = sharded[0].params["up"]["kernel"].get_value()
    assert up.sharding.spec == up_spec
    assert {s.data.shape for s in up.addressable_shards} == {
        tuple(d // (mesh.shape[a] if a else 1) for d, a in zip((16, 64), up_spec, strict=True))
    }
    assert sharded[0].opt_state[0].mu["up"]["kernel"].get_value().sharding.spec == up_spec
    assert_same_training(single, sharded)


def _build():
    with nnx.use_eager_sharding(False):
        return AnnotatedMLP(nnx.Rngs(0))


@pytest.mark.parametrize("mode", ["single", "shard_map", "pmap"])
def test_step_init_in_other_modes(mode):
    mesh = sx.make_mesh({"data": 8})
    tx = optax.adam(1e-2)
    step = sx.make_train_step(model_loss, mesh=mesh, mode=mode)
    state = step.init(
        lambda key: sx.TrainState.from_params(mlp_init(key, (16, 32, 8)), mlp_apply, tx),
        jax.random.key(0),
    )
    w = state.opt_state[0].nu[0][0]
    expected = 1 if mode == "single" else 8
    assert len(w.sharding.device_set) == expected and w.sharding.is_fully_replicated
    state, metrics = step(state, batches((16, 8), n=1)[0])
    assert np.isfinite(float(metrics["loss"]))


def test_step_init_checks_mapped_modes_before_allocating():
    mesh = sx.make_mesh({"data": 8})
    step = sx.make_train_step(
        model_loss, mesh=mesh, mode="shard_map", plan=sx.fsdp(mesh, min_size=1)
    )
    with pytest.raises(ValueError, match="only a replicating plan"):
        step.init(
            lambda: sx.TrainState.from_params({"w": jnp.ones((8, 8))}, mlp_apply, optax.sgd(1))
        )
