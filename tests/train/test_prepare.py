"""``sx.prepare``: the user's own loop, untouched, on 8 devices equals 1 device.

Each loop is written as its framework's own examples write it (flax's NNX MNIST
example, flax.training with logical annotations, Equinox's ``filter_jit``); only the
``sx.prepare`` line is added. Small models and 5 steps: few compiles.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardax as sx

STEPS = 5


def batches(n=STEPS, size=32):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(size, 16)).astype(np.float32),
            "y": rng.integers(0, 8, size=size).astype(np.int32),
        }
        for _ in range(n)
    ]


def assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def assert_sharded(x, spec, mesh):
    """``x`` has ``spec`` and each device holds its slice."""
    assert x.sharding.spec == spec, (x.sharding.spec, spec)
    expected = x.sharding.shard_shape(x.shape)
    assert len(x.addressable_shards) == mesh.size
    assert all(s.data.shape == expected for s in x.addressable_shards)


# --- NNX: nnx.Optimizer and an @nnx.jit step, as in flax's examples ----------------------


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, logits


@nnx.jit
def train_step(model, optimizer, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)  # noqa: RUF059 (flax's example)
    optimizer.update(model, grads)
    return loss


def nnx_loop(model, optimizer, data):
    return [float(train_step(model, optimizer, batch)) for batch in data]


def new_nnx():
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


@pytest.fixture(scope="module")
def nnx_reference():
    model, optimizer = new_nnx()
    losses = nnx_loop(model, optimizer, batches())
    return losses, nnx.state(model, nnx.Param)


def _plans():
    dp = sx.make_mesh({"data": 8})
    tp = sx.make_mesh({"data": 4, "model": 2})
    tp_rules = sx.rules(tp, [("linear1/kernel", P(None, "model")), ("linear2/kernel", P("model"))])
    return {
        # plan, mesh, spec of linear1.kernel (16, 64), spec of its Adam mu
        "replicate": (sx.replicate(dp), dp, P(), P()),
        "fsdp": (sx.fsdp(dp, min_size=64), dp, P(None, "data"), P(None, "data")),
        "zero1": (sx.zero1(dp, min_size=64), dp, P(), P(None, "data")),
        "fsdp+tp": (sx.plan.fsdp_over(tp_rules, min_size=64), tp, P("data", "model"), P("data", "model")),  # noqa: E501
    }  # fmt: skip


@pytest.mark.parametrize("name", ["replicate", "fsdp", "zero1", "fsdp+tp"])
def test_nnx_loop_untouched_equals_one_device(name, nnx_reference):
    plan, mesh, param_spec, mu_spec = _plans()[name]
    model, optimizer = new_nnx()
    same = sx.prepare(model, optimizer, mesh=mesh, plan=plan)
    assert same[0] is model and same[1] is optimizer
    assert_sharded(model.linear1.kernel.get_value(), param_spec, mesh)
    mu = optimizer.opt_state[0].mu
    assert_sharded(mu["linear1"]["kernel"].get_value(), mu_spec, mesh)
    assert optimizer.step.get_value().sharding.spec == P()
    with sx.prepare(iter(batches()), mesh=mesh) as data:
        losses = nnx_loop(model, optimizer, data)
    assert_close(losses, nnx_reference[0])
    assert_close(nnx.state(model, nnx.Param), nnx_reference[1])
    assert int(optimizer.step.get_value()) == STEPS


def test_nnx_loop_on_an_explicit_mesh(nnx_reference):
    mesh = sx.make_mesh({"data": 8}, axis_types=AxisType.Explicit)
    model, optimizer = new_nnx()
    model, optimizer = sx.prepare(model, optimizer, mesh=mesh)
    kernel = model.linear1.kernel.get_value()
    assert jax.typeof(kernel).sharding.mesh.axis_types == (AxisType.Explicit,)
    with jax.set_mesh(mesh):
        losses = nnx_loop(model, optimizer, sx.prepare(iter(batches()), mesh=mesh))
    assert_close(losses, nnx_reference[0])


def test_model_and_optimizer_and_optimizer_sharding_metadata():
    mesh = sx.make_mesh({"data": 8})
    with nnx.use_eager_sharding(False):
        model = nnx.Linear(
            16, 64, rngs=nnx.Rngs(0), kernel_metadata={"optimizer_sharding": (None, "data")}
        )
        both = nnx.ModelAndOptimizer(model, optax.adam(1e-3))
    assert sx.prepare(both, mesh=mesh) is both  # its own model comes along
    assert both.model.kernel.get_value().sharding.spec == P()
    assert_sharded(both.opt_state[0].nu["kernel"].get_value(), P(None, "data"), mesh)  # fmt: skip


def test_train_state_from_nnx_optimizer_under_make_train_step(nnx_reference):
    mesh = sx.make_mesh({"data": 8})
    model, optimizer = new_nnx()
    state = sx.TrainState.create(model, optimizer)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=64))
    state = step.shard(state)
    losses = []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert_close(losses, nnx_reference[0])
    state.write_to(model, optimizer)
    assert_close(nnx.state(model, nnx.Param), nnx_reference[1])
    assert int(optimizer.step.get_value()) == STEPS
    again = sx.TrainState.create(model, optimizer)
    assert_close((again.params, again.opt_state), (state.params, state.opt_state))


# --- Linen: flax.training's TrainState, logical annotations through sx.from_linen ------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        x = nn.relu(x)
        return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)


@jax.jit
def linen_step(state, batch):
    def loss(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value


def linen_state():
    model = LinenMLP()
    variables = model.init(jax.random.key(0), jnp.ones((1, 16)))
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2)
    )
    return variables, state


def linen_loop(state, data):
    losses = []
    for batch in data:
        state, loss = linen_step(state, batch)
        losses.append(float(loss))
    return state, losses


def test_linen_flax_training_loop_with_logical_annotations():
    _, state = linen_state()
    assert state.step == 0  # a Python int
    reference, expected = linen_loop(state, batches())
    mesh = sx.make_mesh({"data": 4, "model": 2})
    variables, state = linen_state()
    plan = sx.from_linen(mesh, variables, {"embed": None, "mlp": "model"})
    state = sx.prepare(state, mesh=mesh, plan=plan)
    assert isinstance(state, train_state.TrainState)
    kernel = state.params["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned)
    assert_sharded(kernel.value, P(None, "model"), mesh)
    assert_sharded(state.opt_state[0].mu["Dense_1"]["kernel"].value, P("model", None), mesh)
    state, losses = linen_loop(state, sx.prepare(iter(batches()), mesh=mesh))
    assert_close(losses, expected)
    assert_close(nn.unbox(state.params), nn.unbox(reference.params))


# --- Equinox: (model, opt_state) and an eqx.filter_jit step -----------------------------


optim = optax.adam(1e-2)


@eqx.filter_jit
def eqx_step(model, opt_state, batch):
    def loss(model):
        logits = jax.vmap(model)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    value, grads = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def eqx_loop(data):
    model = eqx.nn.MLP(16, 8, 64, 1, key=jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    return model, opt_state


def test_equinox_filter_jit_loop():
    mesh = sx.make_mesh({"data": 8})
    runs = []
    for placed in (False, True):
        model, opt_state = eqx_loop(None)
        data = batches()
        if placed:
            plan = sx.fsdp(mesh, min_size=64)
            model, opt_state = sx.prepare(model, opt_state, mesh=mesh, plan=plan)
            assert isinstance(model, eqx.nn.MLP)
            assert_sharded(model.layers[0].weight, P("data", None), mesh)
            assert_sharded(opt_state[0].mu.layers[0].weight, P("data", None), mesh)
            data = sx.prepare(iter(data), mesh=mesh)
        losses = []
        for batch in data:
            model, opt_state, loss = eqx_step(model, opt_state, batch)
            losses.append(float(loss))
        runs.append((losses, eqx.filter(model, eqx.is_array)))
    assert_close(runs[1][0], runs[0][0])
    assert_close(runs[1][1], runs[0][1])


def test_pytrees_and_the_defaults():
    params = {"w": np.ones((64, 8), np.float32), "b": np.zeros(8, np.float32)}
    opt_state = optax.adam(1e-3).init(params)
    params, opt_state = sx.prepare(params, opt_state)  # all devices on "data", replicated
    assert params["w"].sharding.spec == P() and len(params["w"].sharding.device_set) == 8
    mesh = sx.make_mesh({"data": 8})
    params, opt_state = sx.prepare(params, opt_state, mesh=mesh, plan=sx.zero1(mesh, min_size=64))
    assert params["w"].sharding.spec == P()
    assert_sharded(opt_state[0].mu["w"], P("data", None), mesh)
