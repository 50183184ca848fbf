"""``sx.keep_plan``: after N steps of the user's own jitted step (no ``out_shardings``),
every leaf ``sx.prepare`` placed keeps its plan's sharding, the memory per device stays
the plan's, and the numbers equal one device: zero1, fsdp and TP rules, with an
``nnx.Optimizer`` loop under ``nnx.jit``, an Equinox model under ``eqx.filter_jit`` and a
``flax.training`` TrainState under ``jax.jit``.
"""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import shardax as sx

STEPS = 10
TX = optax.adam(1e-2)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 32, 16)).astype(np.float32)
    return [{"x": x[i], "y": np.sin(x[i][:, :4])} for i in range(STEPS)]


PLACED = []  # (shardings, bytes per device) of each loop's state right after sx.prepare


def snapshot(tree):
    return [x.sharding for x in jax.tree.leaves(tree)], per_device(tree)


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


# --- the three loops, as their frameworks' examples write them ---------------------------


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.down = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.down(self.norm(nnx.relu(self.up(x))))


def nnx_loop(mesh, plan, wrap):
    model = NnxMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    if mesh is not None:
        model, optimizer = sx.prepare(model, optimizer, mesh=mesh, plan=plan)
        PLACED.append(snapshot((nnx.state(model), nnx.state(optimizer))))

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: mse(m(batch["x"]), batch["y"]))(model)
        optimizer.update(model, grads)
        return loss

    step = wrap(train_step, nnx.jit)
    losses = [float(step(model, optimizer, b)) for b in data()]
    return losses, (nnx.state(model), nnx.state(optimizer))


class EqxMLP(eqx.Module):
    up: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(16, 64, key=k1)
        self.norm = eqx.nn.LayerNorm(64)
        self.down = eqx.nn.Linear(64, 4, key=k2)

    def __call__(self, x):
        return jax.vmap(lambda r: self.down(self.norm(jax.nn.relu(self.up(r)))))(x)


def eqx_loop(mesh, plan, wrap):
    model = EqxMLP(jax.random.key(0))
    opt_state = TX.init(eqx.filter(model, eqx.is_array))
    if mesh is not None:
        model, opt_state = sx.prepare(model, opt_state, mesh=mesh, plan=plan)
        PLACED.append(snapshot((eqx.filter(model, eqx.is_array), opt_state)))

    def train_step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(lambda m: mse(m(batch["x"]), batch["y"]))(model)
        updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    step = wrap(train_step, eqx.filter_jit)
    losses = []
    for b in data():
        model, opt_state, loss = step(model, opt_state, b)
        losses.append(float(loss))
    return losses, (eqx.filter(model, eqx.is_array), opt_state)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(nn.relu(nn.Dense(64, name="up")(x)))
        return nn.Dense(4, name="down")(h)


def linen_loop(mesh, plan, wrap):
    module = LinenMLP()
    params = module.init(jax.random.key(0), np.zeros((1, 16), np.float32))["params"]
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=TX)
    if mesh is not None:
        state = sx.prepare(state, mesh=mesh, plan=plan)
        PLACED.append(snapshot((state.params, state.opt_state)))

    def train_step(state, batch):
        def loss_fn(p):
            return mse(state.apply_fn({"params": p}, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    step = wrap(train_step, jax.jit)
    losses = []
    for b in data():
        state, loss = step(state, b)
        losses.append(float(loss))
    return losses, (state.params, state.opt_state)


LOOPS = {"nnx": nnx_loop, "eqx": eqx_loop, "linen": linen_loop}
TP = [  # the first layer's output and the second's input over "model"
    (r"up/(kernel|weight)", P(None, "model")),
    (r"down/(kernel|weight)", P("model", None)),
]


def plans(mesh_2d):
    return {
        "zero1": sx.zero1(mesh_2d, min_size=1),
        "fsdp": sx.fsdp(mesh_2d, min_size=1),
        "tp": sx.rules(mesh_2d, TP),
    }


def under(fn, jit):
    return jit(sx.keep_plan(fn))


def per_device(tree):
    """Bytes each device holds, from the arrays' own shards (the largest device)."""
    out = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return max(out.values())


@pytest.fixture(scope="module")
def one_device():
    return {name: loop(None, None, lambda f, jit: jit(f)) for name, loop in LOOPS.items()}


@pytest.mark.parametrize("framework", LOOPS)
@pytest.mark.parametrize("plan_name", ["zero1", "fsdp", "tp"])
def test_plan_holds_after_steps(framework, plan_name, mesh_2d, one_device):
    losses, state = LOOPS[framework](mesh_2d, plans(mesh_2d)[plan_name], under)
    ref_losses, ref_state = one_device[framework]
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    shardings, nbytes = PLACED[-1]
    leaves = jax.tree.leaves(state)
    for x, planned in zip(leaves, shardings, strict=True):  # every leaf on its plan
        assert x.sharding.is_equivalent_to(planned, x.ndim), (x.sharding, planned)
    assert per_device(state) == nbytes  # the plan's memory per device after 10 steps
    if plan_name == "zero1":  # params replicated, optimizer state split
        assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state[0]))
        assert not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state[1]))
    if plan_name == "tp":
        assert any("model" in str(x.sharding.spec) for x in jax.tree.leaves(state[0]))


def test_over_the_jit_names_the_drift_once_and_puts_it_back(mesh_2d, monkeypatch):
    """Without keep_plan under the jit, zero1's params leave their plan after one step:
    keep_plan over the jit names each moved leaf once, and puts it back. It walks the
    arguments and the output's structure once, not on each of the 10 steps."""
    import shardax.train.keep as keep

    walks = []
    for name in ("variables", "_out_plan"):
        real = getattr(keep, name)
        monkeypatch.setattr(keep, name, lambda *a, _n=name, _f=real: walks.append(_n) or _f(*a))
    plan = sx.zero1(mesh_2d, min_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, (params, _) = nnx_loop(mesh_2d, plan, lambda f, jit: sx.keep_plan(jit(f)))
    messages = [str(w.message) for w in caught if "sx.keep_plan" in str(w.message)]
    assert any("up/kernel left its plan" in m for m in messages), messages
    assert len(messages) == len(set(messages))  # once per leaf, not per step
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
    # the model's and the optimizer's Variables, and the loss's structure: once each
    assert sorted(walks) == ["_out_plan", "variables", "variables"], walks


def test_describe_shows_plan_against_actual(mesh_2d):
    model = NnxMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    model, optimizer = sx.prepare(model, optimizer, mesh=mesh_2d, plan=sx.zero1(mesh_2d))
    moved = jax.device_put(model.up.kernel[...], sx.fsdp(mesh_2d, min_size=1)(model.up.kernel[...]))
    model.up.kernel.set_value(moved)
    rows = {r.path: r for r in sx.describe(model).rows}
    assert rows["up/kernel/value"].planned == P() and rows["up/kernel/value"].spec != P()
    assert rows["down/kernel/value"].planned is None  # on its plan: nothing to show
    assert "up/kernel" in str(sx.describe(model))
