"""sx.verify: the distributed step against one device. It fails with the right cause
named where the sharded run is not one device's (per-device token means without a mask,
device-folded dropout, bf16 under a too-tight tolerance), and raises no false alarm on
the plans × modes the suite trains. BatchNorm normalizes over the global batch in every
mode, in NNX, Linen and Equinox, with one model definition."""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from train_models import (
    IN,
    NNXMLP,
    OUT,
    batches,
    count_compiles,
    leaves,
    lm_state,
    make_loss,
    make_state,
    padded_token_batches,
)

import shardax as sx

BATCH = batches(1, size=16)[0]


# -- no false alarm ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("framework", "mode", "plan", "kwargs"),
    [
        ("nnx", "jit", "fsdp", {"steps": 2, "accumulate": 2}),
        ("linen", "jit", "zero2", {}),
        ("linen", "shard_map", None, {"accumulate": 2}),
        ("equinox", "jit", "zero1", {}),
        ("pytree", "jit", None, {"precision": "bf16"}),
        ("pytree", "shard_map", None, {"precision": "fp16", "steps": 2}),
    ],
)
def test_plans_and_modes_pass(mesh, framework, mode, plan, kwargs):
    if plan is not None:
        plan = getattr(sx, plan)(mesh, **({"min_size": 1} if plan == "fsdp" else {}))
    steps = kwargs.pop("steps", 1)
    step = sx.make_train_step(make_loss(framework), mesh=mesh, mode=mode, plan=plan, **kwargs)
    state = step.shard(make_state(framework, optax.adam(1e-2)))
    before = leaves(state)
    report = sx.verify(step, state, batches(1, size=16, mask=True)[0], steps=steps)
    assert report.ok, str(report)
    assert report.cause is None and report.first_step is None and report.compared > 0
    # The state it was given is unchanged, and (once: a compilation) still usable by the
    # donating step.
    for x, y in zip(leaves(state), before, strict=True):
        np.testing.assert_array_equal(x, y)
    if framework == "linen" and mode == "shard_map":
        step(state, BATCH)


def test_report_prints_a_table_and_names_the_worst_leaf(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, mode="single")
    report = sx.verify(step, make_state("pytree"), BATCH)
    text = str(report)
    assert "sx.verify: ok" in text and "max rel diff" in text and report.worst.path in text
    assert set(report.to_dict()) >= {"ok", "worst", "first_step", "cause", "seconds"}


def test_explicit_mesh_with_the_models_own_shardings():
    from test_explicit import Block, Sharding, data, loss_fn

    mesh = sx.make_mesh({"data": 4, "model": 2}, axis_types=AxisType.Explicit)
    with jax.set_mesh(mesh):
        model = Block(Sharding.fsdp_tp(), nnx.Rngs(0))
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=1))
    report = sx.verify(step, step.shard(sx.TrainState.create(model, optax.adam(1e-2))), data(1)[0])
    assert report.ok, str(report)
    assert report.reference.startswith("TFRT_CPU_0") or "0" in report.reference


def test_pipeline_gpt_and_its_cost_is_two_compilations():
    from shardax.models import gpt

    cfg = gpt.GPTConfig(layers=2, d_model=16, heads=2, max_seq_len=8, pipeline_microbatches=2)
    tokens = np.random.default_rng(0).integers(0, 256, size=(8, 9)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def lm_loss(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    mesh = sx.make_mesh({"data": 4, "stage": 2})
    model = gpt.make_gpt(cfg)
    step = sx.make_train_step(lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, "pipeline"))
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
    with count_compiles() as compiles:
        report = sx.verify(step, state, batch)
    assert report.ok, str(report)
    assert len(compiles) <= 2, len(compiles)  # the two step programs, nothing else


def test_auto_plan_picks_once_and_the_step_then_trains(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, plan="auto")
    state = make_state("pytree")
    report = sx.verify(step, state, BATCH)
    assert report.ok and step.auto_report is not None
    _, metrics = step(state, BATCH)  # places the unplaced state on the picked plan
    assert np.isfinite(float(metrics["loss"]))


# -- must fail, with the cause named ------------------------------------------------------


def weighted_token_loss(model, batch):
    """lm1b's loss: a per-device token mean, its weights in a field the step cannot see."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        model(batch["tokens"]), batch["targets"]
    )
    return (losses * batch["weights"]).sum() / batch["weights"].sum()


def test_per_device_token_mean_without_a_mask_is_named(mesh):
    data = padded_token_batches(1, size=16)[0]
    batch = {"tokens": data["tokens"], "targets": data["targets"]}
    batch["weights"] = data["mask"].astype(np.float32)
    step = sx.make_train_step(weighted_token_loss, mesh=mesh, mode="shard_map")
    report = sx.verify(step, lm_state(), batch)
    assert not report.ok and report.first_step == 1
    assert report.cause == "per-device means weighted equally", str(report)
    assert "mask" in report.hint and "likely cause: per-device means" in str(report)
    # The fix the report names: a mask leaf, the loss unchanged.
    assert sx.verify(step, lm_state(), {**batch, "mask": data["mask"]}).ok


def test_dropout_from_framework_rng_under_shard_map_is_named(mesh):
    # the zoo's nnx_dropout (which passes under jit): the same reference program
    step = sx.make_train_step(ce_loss, mesh=mesh, mode="shard_map", rng_per_device=True)
    report = sx.verify(step, zoo_state("nnx_dropout", OPTIMIZERS["adam"]()), image_batch())
    assert not report.ok and report.cause == "device-folded RNG", str(report)


def test_bf16_against_a_too_tight_tolerance_is_reduced_precision(mesh):
    # the pytree bf16 case of test_plans_and_modes_pass, batch included: the same programs
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh, precision="bf16")
    state = make_state("pytree", optax.adam(1e-2))
    report = sx.verify(step, state, batches(1, size=16, mask=True)[0], rtol=1e-7)
    assert not report.ok and report.cause == "reduced precision", str(report)
    assert "bf16" in report.hint


def test_reference_that_does_not_fit_says_so():
    from shardax.train.verification import _out_of_memory, _too_big

    error = _too_big("cuda:0", 4096, RuntimeError("RESOURCE_EXHAUSTED: Out of memory"))
    assert "one device (cuda:0)" in str(error) and "smaller probe batch" in str(error)
    assert _out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: while allocating"))


# -- BatchNorm: the global batch in every mode, three frameworks (the zoo below: NNX,
# Linen and Equinox BatchNorm under jit, shard_map and pmap) -------------------------------


class LinenNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.BatchNorm(use_running_average=False)(nn.Dense(OUT)(x))


def norm_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_batchnorm_written_for_pmap_runs_under_jit(mesh):
    """A layer whose axis_name names the data axis (written for pmap) works under jit."""

    class PmapNorm(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.linear = nnx.Linear(IN, OUT, rngs=rngs)
            self.norm = nnx.BatchNorm(OUT, axis_name="data", rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.norm(self.linear(x))

    state = sx.TrainState.create(PmapNorm(nnx.Rngs(0)), optax.sgd(0.1))
    assert sx.verify(sx.make_train_step(norm_loss, mesh=mesh), state, BATCH).ok


# -- your own step function (keep your loop) ------------------------------------------------


def nnx_objects(mesh):
    model = NNXMLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    return nnx.merge(graphdef, jax.device_put(state, sx.fsdp(mesh, min_size=1)(state)))


@nnx.jit(donate_argnums=(0, 1))
def nnx_train_step(model, optimizer, batch):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_own_nnx_step_with_placed_objects(mesh):
    model, optimizer = nnx_objects(mesh)
    before = leaves(nnx.state(model))
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(nnx_train_step, (model, optimizer), batch, steps=2)
    assert report.ok, str(report)
    # the optimizer's gradients against one device's, its update against the optimizer
    # applied to the distributed gradients
    assert any(d.path.startswith("optimizer/0/") for d in report.diffs)
    for x, y in zip(leaves(nnx.state(model)), before, strict=True):  # not donated, not changed
        np.testing.assert_array_equal(x, y)


def test_own_donating_step_runs_on_one_copy_of_the_state_a_step(mesh, monkeypatch):
    """Your state is copied once, then each step runs on one copy of the state the last
    step gave (nnx_train_step donates it); the start stays the evidence."""
    from shardax.train.verification import function

    copies, real = [], function.copied
    monkeypatch.setattr(
        function,
        "copied",
        lambda args, put: copies.append(put is function.fresh) or real(args, put),
    )
    model, optimizer = nnx_objects(mesh)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(nnx_train_step, (model, optimizer), batch, steps=3)
    assert report.ok, str(report)
    assert copies.count(True) == 1 + 3  # on the device: yours once, then one a step


@nnx.jit(static_argnums=3)
def repeated_update_step(model, optimizer, batch, times):
    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    for _ in range(times):
        optimizer.update(model, grads)
    return loss


def test_an_update_that_is_not_the_optimizers_is_named(mesh):
    """A step whose update depends on the placement (a learning rate scaled by the device
    count, done by applying the update once per extra device group): the gradients are one
    device's, the params and optimizer state are neither one device's nor the optimizer's."""

    def scaled_step(model, optimizer, batch):
        spread = len(batch["x"].sharding.device_set)
        return repeated_update_step(model, optimizer, batch, 2 if spread > 1 else 1)

    model, optimizer = nnx_objects(mesh)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(scaled_step, (model, optimizer), batch)
    assert not report.ok and report.cause == "update not the optimizer's", str(report)
    assert report.worst.path.startswith("optimizer/0/"), str(report)
    assert all("/grads/" not in d.path for d in report.diffs)


COUNTER = [0]


@jax.jit
def counted_step(params, batch, count):
    def loss(params):
        return count * jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def test_a_step_that_reads_a_global_counter_is_named_impure_on_cpu(mesh):
    def impure_step(params, batch):
        COUNTER[0] += 1  # a bug: the loss depends on how often the step ran
        return counted_step(params, batch, jnp.float32(COUNTER[0]))

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.device_put({"w": jnp.ones((IN, OUT))}, replicated)
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(impure_step, params, batch)
    assert not report.ok and report.cause == "impure step", str(report)
    assert "Python global" in report.hint and "xla_gpu" not in report.hint


def test_own_shard_map_step_with_batchnorm_needs_a_reference_and_names_the_cause(mesh):
    """A functional step written with shard_map: the per-device BatchNorm it computes is
    found against the user's own one-device step."""
    module = LinenNorm()
    variables = module.init(jax.random.key(0), jnp.ones((2, IN)))

    def grads_of(variables, batch):
        def loss(params):
            out, _ = module.apply(
                {**variables, "params": params}, batch["x"], mutable=["batch_stats"]
            )
            return jnp.mean((out - batch["y"]) ** 2)

        return jax.value_and_grad(loss)(variables["params"])

    def update(variables, loss_grads):
        loss, grads = loss_grads
        params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads)
        return {**variables, "params": params}, loss

    P = jax.sharding.PartitionSpec

    @jax.jit
    def sharded_step(variables, batch):
        def per_device(variables, batch):
            return jax.lax.pmean(grads_of(variables, batch), "data")

        # check_vma=False: the gradients of the replicated params are each device's own
        # (with it, JAX sums them over the devices before the pmean)
        mapped = jax.shard_map(
            per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False
        )
        return update(variables, mapped(variables, batch))

    @jax.jit
    def one_device_step(variables, batch):
        return update(variables, grads_of(variables, batch))

    report = sx.verify(sharded_step, variables, BATCH, reference=one_device_step, mesh=mesh)
    assert not report.ok and report.cause == "per-device BatchNorm statistics", str(report)


def test_bad_arguments_are_named(mesh):
    step = sx.make_train_step(make_loss("pytree"), mesh=mesh)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        sx.verify(step, make_state("pytree"), BATCH, steps=0)
    with pytest.raises(TypeError, match="reference= and mesh= are for your own step"):
        sx.verify(step, make_state("pytree"), BATCH, reference=lambda s, b: s)
    with pytest.raises(
        TypeError, match=r"train step \(sx.make_train_step\) or your own step function, got int"
    ):
        sx.verify(3, make_state("pytree"), BATCH)


# -- the model zoo: no false alarm from rounding noise, the right cause for real faults ---
#
# A bias before BatchNorm has a gradient of rounding noise (~1e-9, its sign set by the order
# of the sums) that Adam, AdamW and Lion turn into a step of ±lr. verify compares the
# gradients with one device's and the update with the optimizer applied to the distributed
# gradients, so that noise is no difference.

ROWS, PIXELS, CHANNELS = 16, 4, 2


def image_batch(size: int = ROWS) -> dict:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(size, PIXELS, PIXELS, CHANNELS)).astype(np.float32)
    return {"x": x, "y": (x.mean((1, 2, 3)) > 0).astype(np.int32)}


def token_batch(size: int = ROWS) -> dict:
    tokens = np.random.default_rng(4).integers(0, 11, size=(size, 5)).astype(np.int32)
    return {"x": tokens, "y": np.roll(tokens, -1, axis=1)}


class ConvBN(nnx.Module):
    """CIFAR-style: a conv with a bias, BatchNorm, relu, pooled, a linear head."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(CHANNELS, 8, (3, 3), rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.norm(self.conv(x))).mean((1, 2)))


class Normed(nnx.Module):
    """An MLP with a bias before a norm layer (BatchNorm, LayerNorm or RMSNorm)."""

    def __init__(self, norm: str, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(PIXELS * PIXELS * CHANNELS, 16, rngs=rngs)
        kinds = {"batch": nnx.BatchNorm, "layer": nnx.LayerNorm, "rms": nnx.RMSNorm}
        self.norm = kinds[norm](16, rngs=rngs)
        self.head = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.norm(self.linear(x.reshape(x.shape[0], -1)))))


class Tied(nnx.Module):
    """Embeddings tied to the output projection."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(11, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.embed.attend(self.norm(self.embed(tokens)))


class DroppedNNX(nnx.Module):
    """nnx.Dropout with its own nnx.Rngs: typed key leaves in the model state."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.net = Normed("layer", rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net(self.drop(x))


class LinenConvBN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.BatchNorm(use_running_average=False)(nn.Conv(8, (3, 3))(x))
        return nn.Dense(2)(nn.relu(h).mean((1, 2)))


class EqxBN(eqx.Module):
    """Equinox's stateful example, small: a Linear with a bias, BatchNorm, a head."""

    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    head: eqx.nn.Linear
    state: eqx.nn.State

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(PIXELS * PIXELS * CHANNELS, 16, key=k1)
        self.norm = eqx.nn.BatchNorm(16, "batch", mode="batch")
        self.head = eqx.nn.Linear(16, 2, key=k2)
        self.state = eqx.nn.State(self.norm)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.linear)(x.reshape(x.shape[0], -1))
        norm = jax.vmap(self.norm, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return jax.vmap(self.head)(jax.nn.relu(norm(h, self.state)[0]))


def ce_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def mlp_apply(params, x):
    return jnp.tanh(x.reshape(x.shape[0], -1) @ params["w"] + params["b"]) @ params["out"]


def dropout_rng_loss(model, batch, rng):
    """Dropout with the step's rng argument: one key per example, the same in every mode."""
    logits = model(sx.train.dropout(rng, batch["x"], 0.3))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def zoo_state(name: str, tx) -> sx.TrainState:
    if name == "linen_conv_bn":
        variables = LinenConvBN().init(jax.random.key(0), image_batch(2)["x"])
        return sx.TrainState.from_linen(LinenConvBN(), variables, tx)
    if name == "equinox_bn":
        return sx.TrainState.create(EqxBN(jax.random.key(0)), tx)
    if name == "dropout_rng":
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {
            "w": jax.random.normal(k1, (PIXELS * PIXELS * CHANNELS, 16)) / 6,
            "b": jnp.zeros(16),
            "out": jax.random.normal(k2, (16, 2)) / 4,
        }
        return sx.TrainState.from_params(params, mlp_apply, tx)
    models = {
        "conv_bn": lambda: ConvBN(nnx.Rngs(0)),
        "mlp_bn": lambda: Normed("batch", nnx.Rngs(0)),
        "layernorm": lambda: Normed("layer", nnx.Rngs(0)),
        "rmsnorm": lambda: Normed("rms", nnx.Rngs(0)),
        "tied_embed": lambda: Tied(nnx.Rngs(0)),
        "nnx_dropout": lambda: DroppedNNX(nnx.Rngs(0, dropout=1)),
    }
    return sx.TrainState.create(models[name](), tx)


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-4),
    "adafactor": lambda: optax.adafactor(1e-2),
}


# A covering design, not the product: every model, optimizer and mode at least once, and
# BatchNorm with Adam in every mode.
@pytest.mark.parametrize(
    ("model", "tx", "mode"),
    [
        ("conv_bn", "adam", "jit"),
        ("mlp_bn", "adam", "pmap"),
        ("linen_conv_bn", "adam", "shard_map"),
        ("mlp_bn", "adamw", "shard_map"),
        ("equinox_bn", "adamw", "jit"),
        ("equinox_bn", "lion", "pmap"),
        ("equinox_bn", "sgd_momentum", "shard_map"),
        ("layernorm", "adafactor", "shard_map"),
        ("rmsnorm", "sgd_momentum", "pmap"),
        ("tied_embed", "adamw", "jit"),
        ("dropout_rng", "adam", "pmap"),
        ("nnx_dropout", "adam", "jit"),
    ],
)
def test_zoo_has_no_false_alarm(mesh, model, tx, mode):
    loss = dropout_rng_loss if model == "dropout_rng" else ce_loss
    batch = token_batch() if model == "tied_embed" else image_batch()
    step = sx.make_train_step(loss, mesh=mesh, mode=mode)
    steps = 2 if (model, tx) in (("conv_bn", "adam"), ("mlp_bn", "adam")) else 1
    report = sx.verify(step, zoo_state(model, OPTIMIZERS[tx]()), batch, steps=steps)
    assert report.ok, str(report)
    assert report.compared > 0 and "distributed gradients" in report.judged


def own_conv_bn_loop(mesh, place: str):
    """The nnx.Optimizer loop as flax's examples write it, placed with sx.prepare or with
    plain jax.device_put."""
    model = ConvBN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    if place == "prepare":
        model, optimizer = sx.prepare(model, optimizer, mesh=mesh)
    else:
        graphdef, state = nnx.split((model, optimizer))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        model, optimizer = nnx.merge(graphdef, jax.device_put(state, replicated))
    return model, optimizer


@nnx.jit
def conv_train_step(model, optimizer, batch):
    def loss_fn(model):
        return ce_loss(model, batch)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("place", ["prepare", "device_put"])
def test_own_nnx_optimizer_loop_with_batchnorm_and_adam_has_no_false_alarm(mesh, place):
    model, optimizer = own_conv_bn_loop(mesh, place)
    batch = sx.distribute_batch(image_batch(), sx.batch_sharding(mesh))
    report = sx.verify(conv_train_step, (model, optimizer), batch, steps=2)
    assert report.ok, str(report)
    assert any(d.path.startswith("optimizer/0/grads/") for d in report.diffs)


def test_own_step_with_nnx_rngs_compares_the_keys_by_their_data(mesh):
    model = DroppedNNX(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    model, optimizer = sx.prepare(model, optimizer, mesh=mesh)
    batch = sx.distribute_batch(image_batch(), sx.batch_sharding(mesh))
    report = sx.verify(conv_train_step, (model, optimizer), batch)
    assert report.ok, str(report)
    keys = [d for d in report.diffs if "key" in d.path]
    assert report.compared > 0 and all(d.limit == 0 for d in keys)


def test_accumulation_that_changes_the_update_is_named(mesh):
    """BatchNorm normalizes each microbatch: the step's accumulation is not one device over
    the whole batch, and the reference never accumulates."""
    step = sx.make_train_step(ce_loss, mesh=mesh, accumulate=2)  # the zoo's mlp_bn, adamw
    report = sx.verify(step, zoo_state("mlp_bn", OPTIMIZERS["adamw"]()), image_batch())
    assert not report.ok and report.cause == "accumulation changes the update", str(report)
    assert "first difference" in str(report)


def graph_loss(model, batch):
    """A graph batch: each row is a node, its sender indexes the whole batch's nodes."""
    params = model()
    messages = batch["nodes"][batch["senders"]] @ params["w"]
    pred = jnp.tanh(batch["nodes"] @ params["self"] + messages)
    return sx.masked_mean(((pred - batch["y"]) ** 2).sum(-1), batch.get("mask"))


def graph_state() -> sx.TrainState:
    k1, k2 = jax.random.split(jax.random.key(2))
    params = {"w": jax.random.normal(k1, (3, 2)), "self": jax.random.normal(k2, (3, 2))}
    return sx.TrainState.from_params(params, lambda p: p, optax.adam(1e-2))


def test_rows_that_are_not_independent_examples_are_named(mesh):
    rng = np.random.default_rng(5)
    batch = {
        "nodes": rng.normal(size=(ROWS, 3)).astype(np.float32),
        "senders": rng.permutation(ROWS).astype(np.int32),
        "y": rng.normal(size=(ROWS, 2)).astype(np.float32),
    }
    state = graph_state()
    step = sx.make_train_step(graph_loss, mesh=mesh, mode="shard_map")
    report = sx.verify(step, state, batch)
    assert not report.ok and report.cause == "rows are not independent examples", str(report)
    # A mask does not make them independent; under jit the step sees the whole batch.
    batch["mask"] = np.arange(ROWS) % 5 != 0
    report = sx.verify(step, state, batch)
    assert not report.ok and report.cause == "rows are not independent examples", str(report)
    assert sx.verify(sx.make_train_step(graph_loss, mesh=mesh), state, batch).ok


def test_no_known_cause_says_what_it_compared_and_where(mesh):
    """An Equinox jit step (as Equinox's examples write it) whose loss depends on how many
    devices hold the batch: a jit step has no per-device means, and none is named."""
    model = eqx.nn.MLP(IN, OUT, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
    optim = optax.sgd(0.1)

    def make_step(model, opt_state, batch):
        # a bug: the loss depends on how many devices hold the batch
        return jitted_step(model, opt_state, batch, len(batch["x"].sharding.device_set))

    @eqx.filter_jit
    def jitted_step(model, opt_state, batch, spread):
        def loss_fn(model):
            return spread * jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    batch = sx.distribute_batch(BATCH, sx.batch_sharding(mesh))
    report = sx.verify(make_step, (model, opt_state), batch)
    assert not report.ok and report.cause is None, str(report)
    assert "Compared what the step returned" in report.hint
    assert report.worst.where() in report.hint and "distributed" in report.hint


def test_leaves_whose_shapes_differ_are_named_with_their_shapes():
    """flax's pmap examples return per-device metrics: a pmap step on 8 devices gives
    shape (8,) where its one-device pmap reference gives (1,). The report names the leaf
    and both shapes, not only an infinite difference."""

    def per_device(params, batch):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2)
        )(params)
        grads, loss = jax.lax.pmean((grads, loss), "batch")
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params, {"loss": loss}

    def pmap_step(devices):
        mapped = jax.pmap(per_device, axis_name="batch", devices=devices)

        def step(params, batch):
            n = len(devices)
            copies = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), params)
            sliced = jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
            params, metrics = mapped(copies, sliced)
            return jax.tree.map(lambda x: x[0], params), metrics  # metrics stay per device

        return step

    params = {"w": jnp.ones((IN, OUT))}
    report = sx.verify(
        pmap_step(jax.devices()), params, BATCH, reference=pmap_step(jax.devices()[:1])
    )
    assert not report.ok and report.worst.path == "returned/loss", str(report)
    assert report.worst.shapes == ((8,), (1,))
    assert "shape (8,) distributed, (1,) on one device" in report.worst.where()
    assert "returned/loss: (8,) distributed, (1,) on one device" in report.hint
    assert "shape (8,) distributed" in str(report)
