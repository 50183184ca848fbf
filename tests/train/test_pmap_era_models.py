"""Models written for pmap, trained by the step unmodified (issue 42's outside programs):

- a Linen ResNet-style model whose BatchNorm names pmap's axis (``axis_name="batch"``, as
  flax's ImageNet example) on ``sx.make_mesh({"data": -1})``: the name is taken as the data
  axis, so jit, shard_map and pmap train as the same model does on one device; an NNX
  BatchNorm alike; a name the model's own ``nn.vmap`` binds stays its own; an unbound name
  that is another mesh axis is refused by name.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardax as sx

TX = optax.sgd(0.1, momentum=0.9)


class ResidualBlock(nn.Module):
    """conv-BN-relu-conv-BN, plus the input: flax examples' style."""

    filters: int
    norm: functools.partial

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
        y = nn.relu(self.norm()(y))
        y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        return nn.relu(x + y)


class TinyResNet(nn.Module):
    axis_name: str | None = "batch"
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=self.axis_name,
        )
        x = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        x = ResidualBlock(8, norm)(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


def batches(n=2, size=16):
    rng = np.random.default_rng(0)
    return [
        {
            "image": rng.normal(size=(size, 6, 6, 3)).astype(np.float32),
            "label": rng.integers(0, 10, size).astype(np.int32),
        }
        for _ in range(n)
    ]


def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


@jax.jit
def init_variables():
    """TinyResNet's variables, built under one jit (eagerly, every initialiser's ops were
    compiled one by one; the tests ask for them again)."""
    x = jnp.zeros((1, 6, 6, 3), jnp.float32)
    return TinyResNet(axis_name=None).init(jax.random.key(0), x, train=False)


@pytest.fixture(scope="module")
def one_device():
    """The same model's own loop on one device (no axis name: the batch is whole)."""
    model, variables = TinyResNet(axis_name=None), init_variables()
    params, stats = variables["params"], variables["batch_stats"]
    opt_state, losses = TX.init(params), []

    @jax.jit
    def step(params, stats, opt_state, batch):
        def loss(p):
            logits, new = model.apply(
                {"params": p, "batch_stats": stats}, batch["image"], mutable=["batch_stats"]
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            return ce.mean(), new["batch_stats"]

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value

    for batch in batches():
        params, stats, opt_state, value = step(params, stats, opt_state, batch)
        losses.append(float(value))
    return losses, stats


@pytest.mark.parametrize("mode", ["jit", "shard_map", "pmap"])
def test_a_pmap_era_linen_batchnorm_trains_as_on_one_device(mode, one_device):
    mesh = sx.make_mesh({"data": -1})
    step = sx.make_train_step(loss_fn, mesh=mesh, mode=mode)
    state = step.shard(sx.TrainState.from_linen(TinyResNet(), init_variables(), TX))
    losses = []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, one_device[0], rtol=2e-5)
    stats = jax.tree.leaves(state.model_state["batch_stats"])
    for a, b in zip(stats, jax.tree.leaves(one_device[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


class NNXNet(nnx.Module):
    def __init__(self, axis_name, rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.linear(x))))


def nnx_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_a_pmap_era_nnx_batchnorm_trains_as_on_one_device(mode, mesh):
    rng = np.random.default_rng(1)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    data = [{"x": normal(16, 4), "y": normal(16, 1)} for _ in range(2)]
    results = {}
    for name, axis, step_mesh, step_mode in [
        ("one", None, sx.make_mesh({"data": 1}), "single"),
        ("pmap-era", "batch", mesh, mode),
    ]:
        step = sx.make_train_step(nnx_loss, mesh=step_mesh, mode=step_mode)
        state = step.shard(sx.TrainState.create(NNXNet(axis, nnx.Rngs(0)), optax.sgd(0.1)))
        losses = []
        for batch in data:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results[name] = losses
    np.testing.assert_allclose(results["pmap-era"], results["one"], rtol=2e-5)


class PerExample(nn.Module):
    """BatchNorm under the model's own nn.vmap, whose axis it names: not a pmap name."""

    @nn.compact
    def __call__(self, x):
        def one(module, x):
            return nn.BatchNorm(use_running_average=False, axis_name="batch")(x)

        vmapped = nn.vmap(
            one,
            variable_axes={"params": None, "batch_stats": None},
            split_rngs={"params": False},
            axis_name="batch",
        )
        return nn.Dense(1)(vmapped(self, x))


def test_a_name_the_models_own_vmap_binds_is_kept(mesh):
    x = np.random.default_rng(2).normal(size=(16, 4)).astype(np.float32)
    variables = PerExample().init(jax.random.key(0), x)
    apply = lambda v: PerExample().apply(v, x, mutable=["batch_stats"])[0]  # noqa: E731
    want = jnp.mean(apply(variables) ** 2)
    step = sx.make_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), mesh=mesh)
    _, metrics = step(step.shard(sx.TrainState.from_linen(PerExample(), variables, TX)), {"x": x})
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)


def test_an_unbound_name_of_another_mesh_axis_is_refused(mesh_2d):
    step = sx.make_train_step(loss_fn, mesh=mesh_2d)
    model = TinyResNet(axis_name="model")
    state = step.shard(sx.TrainState.from_linen(model, init_variables(), TX))
    refused = r"BatchNorm '.*BatchNorm_0' has axis_name='model'.* axes: \["
    with pytest.raises(ValueError, match=refused):
        step(state, batches(1)[0])


# -- a Linen module with its own RNG stream (flax's seq2seq decoder: make_rng("lstm")) ------


class NoisyDecoderCell(nn.Module):
    """An LSTM cell that samples its next input from a stream of its own."""

    features: int = 8
    vocab: int = 5

    @nn.compact
    def __call__(self, carry, x):
        carry, h = nn.OptimizedLSTMCell(self.features)(carry, x)
        logits = nn.Dense(self.vocab)(h)
        token = jax.random.categorical(self.make_rng("lstm"), logits)
        return carry, (logits, jax.nn.one_hot(token, self.vocab))


class Seq2Seq(nn.Module):
    @nn.compact
    def __call__(self, inputs):  # (batch, time, vocab)
        cell = NoisyDecoderCell()
        carry = nn.OptimizedLSTMCell(8, parent=None).initialize_carry(
            jax.random.key(0), inputs[:, 0].shape
        )
        logits, x = [], inputs[:, 0]
        for t in range(inputs.shape[1]):
            carry, (step_logits, sampled) = cell(carry, x)
            logits.append(step_logits)
            x = jnp.where(t % 2 == 0, inputs[:, t], sampled)  # half teacher-forced
        return jnp.stack(logits, axis=1)


def seq_loss(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy(logits, batch["inputs"]).mean()


@jax.jit
def seq2seq_variables(inputs):
    """Seq2Seq's variables (its "lstm" stream drawn too), built under one jit."""
    return Seq2Seq().init({"params": jax.random.key(1), "lstm": jax.random.key(2)}, inputs)


def seq_batches(n=2, size=16, time=4):
    rng = np.random.default_rng(3)
    tokens = [rng.integers(0, 5, (size, time)) for _ in range(n)]
    return [{"inputs": np.eye(5, dtype=np.float32)[t]} for t in tokens]


def test_a_linen_module_with_its_own_rng_stream_trains_as_on_one_device(mesh):
    """Each stream the module asks for is bound: "lstm" to fold_in(step_rng, crc32("lstm"))
    (shardax.train.model.linen_rngs), the same on 8 devices as in the program's own loop on one."""
    import zlib

    model = Seq2Seq()
    data = seq_batches()
    variables = seq2seq_variables(data[0]["inputs"])
    key = jax.random.key(7)

    @jax.jit
    def update(params, opt_state, batch, lstm):
        def loss(p):
            logits = model.apply({"params": p}, batch["inputs"], rngs={"lstm": lstm})
            return optax.softmax_cross_entropy(logits, batch["inputs"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params, opt_state, want = variables["params"], TX.init(variables["params"]), []
    for i, batch in enumerate(data):  # the program's own loop, with the documented keys
        lstm = jax.random.fold_in(jax.random.fold_in(key, i), zlib.crc32(b"lstm"))
        params, opt_state, value = update(params, opt_state, batch, lstm)
        want.append(float(value))

    for step_mesh, mode in [(mesh, "jit"), (sx.make_mesh({"data": 1}), "single")]:
        step = sx.make_train_step(seq_loss, mesh=step_mesh, mode=mode)
        state = step.shard(sx.TrainState.from_linen(model, variables, TX, rng=key))
        got = []
        for batch in data:
            state, metrics = step(state, batch)
            got.append(float(metrics["loss"]))
        np.testing.assert_allclose(got, want, rtol=2e-5)


def test_a_linen_stream_is_refused_by_name_where_devices_would_draw_their_own(mesh):
    model, data = Seq2Seq(), seq_batches(1)
    variables = seq2seq_variables(data[0]["inputs"])
    step = sx.make_train_step(seq_loss, mesh=mesh, mode="shard_map")
    state = step.shard(sx.TrainState.from_linen(model, variables, TX))
    with pytest.raises(ValueError, match=r"make_rng\('lstm'\).*rng_per_device=True"):
        step(state, data[0])


# -- BatchNorm's running statistics under accumulate=k: one momentum step per update -------


def test_running_statistics_take_one_momentum_step_under_accumulate(mesh):
    """Under accumulate=2 the running mean moves once (0.9, not 0.81) and equals one
    device's over the whole batch; the running variance is the mean of the microbatches'."""
    batch = batches(1)[0]
    model, variables = TinyResNet(axis_name=None), init_variables()
    stats = {}
    for k in (1, 2):
        step = sx.make_train_step(loss_fn, mesh=mesh, accumulate=k)
        state = step.shard(sx.TrainState.from_linen(model, variables, TX))
        state, _ = step(state, batch)
        stats[k] = state.model_state["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(stats[2]["mean"], stats[1]["mean"], rtol=1e-5, atol=1e-7)
    _, new = model.apply(variables, batch["image"][0::2], mutable=["batch_stats"])
    _, new_odd = model.apply(variables, batch["image"][1::2], mutable=["batch_stats"])
    var = (
        new["batch_stats"]["BatchNorm_0"]["var"] + new_odd["batch_stats"]["BatchNorm_0"]["var"]
    ) / 2
    np.testing.assert_allclose(stats[2]["var"], var, rtol=1e-5)
