"""An Equinox model with its ``eqx.nn.State`` (BatchNorm, SpectralNorm), as Equinox's
stateful example writes it: ``TrainState.create(model, tx, state=state)`` and
``loss_fn(model, state, batch) -> (loss, new_state)``."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardax as sx

TX = optax.adam(1e-2)


class Net(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    sn: eqx.nn.SpectralNorm
    out: eqx.nn.Linear

    def __init__(self, key, mode):
        k1, k2, k3 = jax.random.split(key, 3)
        # No bias before BatchNorm (as one writes a conv + BatchNorm): its gradient is zero
        # in exact arithmetic, and Adam would turn the rounding noise into full steps of
        # either sign, so 8 devices (another order of sums) would leave one device by ~1e-3
        # in "ema" mode. Equinox's own step on 8 devices does the same (not the step's doing).
        self.lin = eqx.nn.Linear(8, 16, use_bias=False, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode=mode)
        self.sn = eqx.nn.SpectralNorm(eqx.nn.Linear(16, 16, key=k2), "weight", key=k3)
        self.out = eqx.nn.Linear(16, 1, key=k3)

    def __call__(self, x, state):
        h, state = self.bn(self.lin(x), state)
        h, state = self.sn(jax.nn.relu(h), state)
        return self.out(h), state


def loss_fn(model, state, batch):
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = batched(batch["x"], state)
    return jnp.mean((pred - batch["y"]) ** 2), state


def data(n=4):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(32, 8)).astype(np.float32),
            "y": rng.normal(size=(32, 1)).astype(np.float32),
        }
        for _ in range(n)
    ]


def equinox_loop(mode):
    """Equinox's own step, on one device."""
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), mode)
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt_state, batch):
        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state, batch)
        updates, opt_state = TX.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    losses = []
    for batch in data():
        model, state, opt_state, loss = step(model, state, opt_state, batch)
        losses.append(float(loss))
    return losses, state


@pytest.mark.parametrize("mode", ["ema", "batch"])
def test_state_advances_as_equinox_step(mode, mesh):
    ref_losses, ref_state = equinox_loop(mode)
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), mode)
    train_state = sx.TrainState.create(model, TX, state=state)
    one = sx.make_train_step(loss_fn, mesh=mesh, mode="single")
    s, losses = one.shard(train_state), []
    for batch in data():
        s, metrics = one(s, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(
        jax.tree.leaves(s.model_state["state"]), jax.tree.leaves(ref_state), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-6)
    # the state advanced (BatchNorm statistics, SpectralNorm's vectors)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True)
    )
    # under jit on 8 devices the losses and the state (BatchNorm's statistics, SpectralNorm's
    # vectors) are one device's
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=64), mode="jit")
    s, losses = step.shard(train_state), []
    for batch in data():
        s, metrics = step(s, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(s.model_state["state"]), jax.tree.leaves(ref_state), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-5)


@pytest.mark.parametrize("how", [{"mode": "shard_map"}, {"mode": "pmap"}, {"accumulate": 2}])
def test_mapped_modes_and_accumulation_are_refused_by_name(how, mesh):
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), "batch")
    train_state = sx.TrainState.create(model, TX, state=state)
    step = sx.make_train_step(loss_fn, mesh=mesh, **how)
    with pytest.raises(ValueError, match=r"eqx.nn.State .* not supported with"):
        step(step.shard(train_state), data(1)[0])


def test_loss_fn_and_state_must_agree(mesh):
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), "batch")
    with_state = sx.TrainState.create(model, TX, state=state)
    without = sx.TrainState.create(model, TX)
    plain = sx.make_train_step(lambda model, batch: 0.0, mesh=mesh)
    with pytest.raises(TypeError, match="second parameter, named 'state'"):
        plain(plain.shard(with_state), data(1)[0])
    stateful = sx.make_train_step(loss_fn, mesh=mesh)
    with pytest.raises(TypeError, match="has none"):
        stateful(stateful.shard(without), data(1)[0])
    with pytest.raises(TypeError, match=r"must be an eqx\.nn\.State"):
        sx.TrainState.create(model, TX, state={"a": 1})


def test_donated_step_with_the_state_written_back_from_aux(mesh):
    """The state returned as aux and written back by hand into the train state, which the
    next step donates (was: BlockHostUntilReady() on a donated buffer, from the step's own
    wait on the metrics of 4 steps back)."""

    def aux_loss(model, state, batch):
        loss, state = loss_fn(model, state, batch)
        return (loss, {"state": state}), state

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), "batch")
    step = sx.make_train_step(aux_loss, mesh=mesh, donate=True)
    s = step.shard(sx.TrainState.create(model, TX, state=state))
    losses = []
    for batch in data() * 2:
        s, metrics = step(s, batch)
        s = s.replace(model_state={**s.model_state, "state": metrics["state"]})
        losses.append(float(metrics["loss"]))
    assert s.model_state["state"].get(model.bn.batch_counter) == 8
    np.testing.assert_allclose(losses[:4], equinox_loop("batch")[0], rtol=1e-5)


def test_prepare_places_the_state_with_its_model():
    """Keep-your-loop: sx.prepare(model, state, opt_state) sees the eqx.nn.State where a
    TrainState holds it (model_state/state/...), not as another model's params."""
    from jax.sharding import PartitionSpec as P

    mesh = sx.make_mesh({"data": 4, "model": 2})
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), "ema")
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))
    rules = [(r"lin/weight", P("model", None)), (r"out/weight", P(None, "model"))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # was: each rule "gives no leaf its spec", twice
        model, state, opt_state = sx.prepare(
            model, state, opt_state, mesh=mesh, plan=sx.rules(mesh, rules)
        )
    assert model.lin.weight.sharding.spec == P("model", None)
    assert opt_state[0].mu.lin.weight.sharding.spec == P("model", None)
    assert isinstance(state, eqx.nn.State)
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.mesh == mesh and leaf.sharding.is_fully_replicated
    with pytest.warns(UserWarning, match=r"'model_state/state/1/0'") as caught:
        sx.prepare(state, mesh=mesh, plan=sx.rules(mesh, [(r"nothing", P())]))
    assert "params/" not in str(caught[0].message)


def test_describe_names_each_part_and_the_state_by_its_layer():
    """sx.describe((model, state, opt_state)) labels the parts by what they are and the
    eqx.nn.State's entries by the layer that owns them, not by position."""
    mesh = sx.make_mesh({"data": 8})
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0), "ema")
    opt_state = TX.init(eqx.filter(model, eqx.is_inexact_array))
    placed = sx.prepare(model, state, opt_state, mesh=mesh)
    paths = [row.path for row in sx.describe(placed).rows]
    assert paths[:2] == ["model/lin/weight", "model/bn/weight"]
    states = [p for p in paths if p.startswith("state/")]
    assert states[:3] == [
        "state/bn.ema_first_time_index",
        "state/bn.ema_state_index/0",
        "state/bn.ema_state_index/1",
    ], states
    assert any(p.startswith("state/sn.") for p in states)
    assert paths[-1].startswith("opt_state/0/nu/")
    # in a TrainState the same entries read model_state/state/<layer>
    ts = sx.TrainState.create(model, TX, state=state)
    assert "model_state/state/bn.ema_state_index/0" in [r.path for r in sx.describe(ts).rows]
    # two models in one tuple: the parts keep their positions
    assert sx.describe((model, model)).rows[0].path == "0/lin/weight"
