"""NNX models that hold ``nnx.Rngs``, as flax's examples write them, on 8 devices.

Two models: an MLP with ``nnx.Dropout(rngs=...)``, and a small VAE that draws its noise
from its own ``nnx.Rngs`` (``self.rngs.noise()``). Each goes through ``sx.describe``,
``sx.prepare`` + the user's ``@nnx.jit`` step (against the same loop on one device),
``make_train_step`` (against a one-device mesh), and a checkpoint round trip, with its
key leaves (``key<fry>``) named, placed replicated and restored exactly.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.plan.tree import path_str

STEPS = 3


class DropoutMLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 64, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.linear2 = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def mlp_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class VAE(nnx.Module):
    def __init__(self, rngs):
        self.encoder = nnx.Linear(16, 2 * 8, rngs=rngs)
        self.decoder = nnx.Linear(8, 16, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        mean, logvar = jnp.split(self.encoder(x), 2, axis=-1)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(self.rngs.noise(), mean.shape)
        return self.decoder(z), mean, logvar


def vae_loss(model, batch):
    recon, mean, logvar = model(batch["x"])
    kl = -0.5 * jnp.mean(1 + logvar - mean**2 - jnp.exp(logvar))
    return jnp.mean((recon - batch["x"]) ** 2) + kl


MODELS = {
    "dropout": (lambda: DropoutMLP(nnx.Rngs(0)), mlp_loss, ["dropout/rngs/key"]),
    "vae": (lambda: VAE(nnx.Rngs(0, noise=1)), vae_loss, ["rngs/default/key", "rngs/noise/key"]),
}


def batches():
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(32, 16)).astype(np.float32),
            "y": rng.integers(0, 8, size=32).astype(np.int32),
        }
        for _ in range(STEPS)
    ]


def keys_of(tree):
    """``{path: key data}`` of every typed key leaf of ``tree``."""
    return {
        path_str(p): np.asarray(jax.random.key_data(x))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
        if sx.plan.is_key(x)
    }


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if sx.plan.is_key(x):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def user_loop(model, optimizer, loss_fn, data):
    """flax's NNX example: nnx.Optimizer and an @nnx.jit step."""

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, batch)) for batch in data]


def new(name):
    make, loss_fn, key_paths = MODELS[name]
    model = make()
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), loss_fn, key_paths


@pytest.fixture(scope="module", params=list(MODELS))
def one_device(request):
    model, optimizer, loss_fn, _ = new(request.param)
    losses = user_loop(model, optimizer, loss_fn, batches())
    return request.param, losses, nnx.state(model)


def test_describe_names_the_rngs_keys(one_device):
    name = one_device[0]
    model, optimizer, _, key_paths = new(name)
    rows = {r.path.removesuffix("/value"): r for r in sx.describe(model).rows}
    for path in key_paths:
        assert (rows[path].dtype, rows[path].shape, rows[path].bytes) == ("key<fry>", (), 8)
        assert rows[path.replace("/key", "/count")].dtype == "uint32"
    train_state = sx.TrainState.create(model, optimizer)  # an nnx.Optimizer where tx goes
    assert "key<fry>" in str(sx.describe(train_state))


def test_prepare_and_the_users_nnx_jit_step_equal_one_device(one_device, mesh):
    name, losses, state = one_device
    model, optimizer, loss_fn, key_paths = new(name)
    model, optimizer = sx.prepare(model, optimizer, mesh=mesh, plan=sx.fsdp(mesh, min_size=64))
    if name == "dropout":
        assert model.linear1.kernel.get_value().sharding.spec == P(None, "data")
    for x in jax.tree.leaves(nnx.state(model)):
        if sx.plan.is_key(x):
            assert x.sharding.is_fully_replicated and len(x.addressable_shards) == 8
    rows = {r.path.removesuffix("/value"): r for r in sx.describe(model).rows}
    assert all(rows[p].spec == P() for p in key_paths)
    with sx.prepare(iter(batches()), mesh=mesh) as data:
        placed_losses = user_loop(model, optimizer, loss_fn, data)
    np.testing.assert_allclose(placed_losses, losses, rtol=1e-5)
    assert_same(nnx.state(model), state)
    assert set(keys_of(nnx.state(model))) == set(keys_of(state)) and len(keys_of(state)) >= 1


@pytest.mark.parametrize("name", list(MODELS))
def test_make_train_step_and_checkpoint_round_trip(name, mesh, tmp_path):
    model, _, loss_fn, _ = new(name)
    one = sx.make_mesh({"data": 1}, devices=jax.devices()[:1])
    results, steps = {}, {}
    for label, m, plan in (
        ("one", one, sx.fsdp(one, min_size=64)),
        ("eight", mesh, sx.fsdp(mesh, min_size=64)),
        ("auto", mesh, "auto"),  # auto's plan functions see the keys too
    ):
        step = steps[label] = sx.make_train_step(loss_fn, mesh=m, plan=plan)
        state = sx.TrainState.create(new(name)[0], optax.adam(1e-2))
        state = state if plan == "auto" else step.shard(state)
        for batch in batches():
            state, metrics = step(state, batch)
        results[label] = (state, float(metrics["loss"]))
    one_state, one_loss = results["one"]
    for label in ("eight", "auto"):
        got, loss = results[label]
        np.testing.assert_allclose(loss, one_loss, rtol=1e-5)
        assert_same(got.params, one_state.params)
        assert keys_of(got) and keys_of(got).keys() == keys_of(one_state).keys()
        for path, x in jax.tree_util.tree_leaves_with_path(got):
            if sx.plan.is_key(x):
                assert x.sharding.is_fully_replicated, (label, path_str(path))
    state = results["eight"][0]
    # Saved and restored onto the state's own shardings: keys exact, still keys.
    sx.save_checkpoint(tmp_path / "fn", state, step=STEPS)
    restored = sx.restore_checkpoint(tmp_path / "fn", like=state).state
    abstract = jax.tree.map(  # no arrays: ShapeDtypeStructs with shardings, keys too
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    from_abstract = sx.restore_checkpoint(tmp_path / "fn", like=abstract).state
    with sx.CheckpointManager(tmp_path / "manager") as manager:
        manager.save(STEPS, {"model": nnx.state(model)})
        from_manager = manager.restore({"model": nnx.state(model)}).state["model"]
    for got, want in ((restored, state), (from_abstract, state), (from_manager, nnx.state(model))):
        assert keys_of(got).keys() == keys_of(want).keys()
        for path, data in keys_of(want).items():
            np.testing.assert_array_equal(keys_of(got)[path], data)
        assert_same(got, want, rtol=0, atol=0)
        for x in jax.tree.leaves(got):
            if sx.plan.is_key(x):
                assert str(x.dtype) == "key<fry>" and x.sharding.is_fully_replicated
    # The restored state trains on as the saved one does (the "eight" step, compiled).
    step = steps["eight"]
    _, going_on = step(state, batches()[0])
    _, resumed = step(restored, batches()[0])
    assert float(resumed["loss"]) == float(going_on["loss"])


def test_model_rng_under_accumulate_and_shard_map_is_refused(mesh):
    """The VAE draws its noise from its own nnx.Rngs: accumulate=2 would advance them once
    per microbatch (refused, naming the key and the way out); shard_map folds them per
    device (refused, unless rng_per_device=True); jit with accumulate=1 is one
    device's (no word)."""
    state = sx.TrainState.create(VAE(nnx.Rngs(0, noise=1)), optax.adam(1e-2))
    batch = batches()[0]
    accumulated = sx.make_train_step(vae_loss, mesh=mesh, accumulate=2)
    with pytest.raises(
        ValueError, match=r"model_state/rngs/noise/key\).*accumulate=2(?s:.*)'step_rng'"
    ):
        accumulated(accumulated.shard(state), batch)
    mapped = sx.make_train_step(vae_loss, mesh=mesh, mode="shard_map")
    with pytest.raises(ValueError, match=r"model_state/rngs/noise/key\).*mode='shard_map'"):
        mapped(mapped.shard(state), batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jitted = sx.make_train_step(vae_loss, mesh=mesh)
        jitted(jitted.shard(state), batch)
