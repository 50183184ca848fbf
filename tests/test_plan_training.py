"""Training with plans is allclose to single-device training on the same data.

A plain ``jax.jit`` step takes its state shardings from the plan (with optimizer
state following the params); the single-device run uses the same step on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
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
    x, y = batch["x"], batch["y"]
    for w, b in params[:-1]:
        x = jnp.maximum(x @ w + b, 0)
    w, b = params[-1]
    return jnp.mean(jnp.sum((x @ w + b - y) ** 2, axis=-1))


def batches(sizes, n=STEPS, batch=32):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch, sizes[0])).astype(np.float32),
            "y": rng.normal(size=(batch, sizes[-1])).astype(np.float32),
        }
        for _ in range(n)
    ]


def train(loss_fn, params, data, tx, plan=None, mesh=None):
    """Runs ``len(data)`` Adam steps; with ``plan``, state sharded by it, batch on "data"."""
    state = {"params": params, "opt_state": tx.init(params)}

    def step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
        }, loss

    if plan is None:
        device = jax.devices()[0]
        state, data = jax.device_put((state, data), device)
        jitted = jax.jit(step)
    else:
        shardings = sx.follow_params(plan)(state)
        state = jax.device_put(state, shardings)
        batch_sharding = NamedSharding(mesh, P("data"))
        data = [jax.device_put(b, batch_sharding) for b in data]
        jitted = jax.jit(
            step,
            in_shardings=(shardings, batch_sharding),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
    losses = []
    with jax.set_mesh(mesh) if mesh is not None else _null():
        for batch in data:
            state, loss = jitted(state, batch)
            losses.append(float(loss))
    return state, losses


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same_training(single, sharded):
    (s1, l1), (s2, l2) = single, sharded
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), s1, s2)


def test_fsdp_training_matches_single_device():
    mesh = sx.make_mesh({"data": 8})
    sizes = (16, 64, 64, 8)
    data = batches(sizes)
    tx = optax.adam(1e-2)
    plan = sx.fsdp(mesh, min_size=256)
    # Initialise straight onto the plan: each device builds only its shards.
    params = sx.init_sharded(mlp_init, plan, jax.random.key(0), sizes)
    assert params[1][0].sharding.spec == P("data", None)
    assert {s.data.shape for s in params[1][0].addressable_shards} == {(8, 64)}
    single = train(mlp_loss, mlp_init(jax.random.key(0), sizes), data, tx)
    sharded = train(mlp_loss, params, data, tx, plan, mesh)
    state = sharded[0]
    assert state["params"][1][0].sharding.spec == P("data", None)
    assert state["opt_state"][0].mu[1][0].sharding.spec == P("data", None)
    assert state["opt_state"][0].count.sharding.spec == P()
    assert_same_training(single, sharded)


def test_seed_002_four_by_two_layout_matches_single_device():
    mesh = sx.make_mesh({"data": 4, "model": 2})
    sizes = (16, 64, 64, 64, 8)
    data = batches(sizes)
    tx = optax.adam(1e-2)
    # Seed 002: W2 and b2 split on their columns over "model", W3 on its rows.
    plan = sx.rules(
        mesh, [(r"^1/0$", P(None, "model")), (r"^1/1$", P("model")), (r"^2/0$", P("model", None))]
    )
    params = mlp_init(jax.random.key(1), sizes)
    single = train(mlp_loss, params, data, tx)
    sharded = train(mlp_loss, params, data, tx, plan, mesh)
    state = sharded[0]
    w2, w3 = state["params"][1][0], state["params"][2][0]
    assert w2.sharding.spec == P(None, "model") and w3.sharding.spec == P("model", None)
    assert {s.data.shape for s in w2.addressable_shards} == {(64, 32)}
    assert {s.data.shape for s in w3.addressable_shards} == {(32, 64)}
    nu = state["opt_state"][0].nu
    assert nu[1][0].sharding.spec == P(None, "model") and nu[2][0].sharding.spec == P("model", None)
    assert state["params"][0][0].sharding.spec == P()
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
    with nnx.use_eager_sharding(False):
        model = AnnotatedMLP(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        pred = nnx.merge(graphdef, params)(batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    data, tx = batches((16, 8)), optax.adam(1e-2)
    single = train(loss_fn, params, data, tx)
    with sx.axis_rules(rules):
        sharded = train(loss_fn, params, data, tx, sx.from_nnx(mesh, model), mesh)
    up = sharded[0]["params"]["up"]["kernel"].get_value()
    assert up.sharding.spec == up_spec
    assert {s.data.shape for s in up.addressable_shards} == {
        tuple(d // (mesh.shape[a] if a else 1) for d, a in zip((16, 64), up_spec, strict=True))
    }
    assert sharded[0]["opt_state"][0].mu["up"]["kernel"].get_value().sharding.spec == up_spec
    assert_same_training(single, sharded)
