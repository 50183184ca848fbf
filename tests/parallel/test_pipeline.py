"""sx.pipeline: GPipe and circular schedules over a "stage" axis, against plain scans.

Every pipelined run is compared with the same model trained on one device (where
``sx.pipeline`` is the plain ``lax.scan``), over several Adam steps.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cli.main import main as cli
from shardax.parallel.gpipe import scan_layers

IN, D, OUT, L, BATCH, STEPS = 4, 8, 2, 8, 16, 3


def layer(p: dict, h: jax.Array) -> jax.Array:
    return jnp.tanh(h @ p["w"] + p["b"])


def make_params(layers: int = L) -> dict:
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "embed": jax.random.normal(k[0], (IN, D)) / 2,
        "blocks": {
            "w": jax.random.normal(k[1], (layers, D, D)) / np.sqrt(D),
            "b": jax.random.normal(k[2], (layers, D)) / 4,
        },
        "head": jax.random.normal(k[3], (D, OUT)) / np.sqrt(D),
    }


def pytree_apply(params: dict, x: jax.Array, *, microbatches: int = 4, repeats: int = 1):
    h = sx.pipeline(
        layer, params["blocks"], x @ params["embed"], microbatches=microbatches, repeats=repeats
    )
    return h @ params["head"]


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return jnp.tanh(self.linear(h))


class NNXModel(nnx.Module):
    """Blocks stacked by nnx.vmap; sx.pipeline applies them from their split state."""

    def __init__(self, rngs: nnx.Rngs, repeats: int = 1) -> None:
        self.embed = nnx.Linear(IN, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> NNXBlock:
            return NNXBlock(rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(D, OUT, rngs=rngs)
        self.repeats = repeats

    def __call__(self, x: jax.Array) -> jax.Array:
        graphdef, params = nnx.split(self.blocks)
        h = sx.pipeline(
            lambda p, h: nnx.merge(graphdef, p)(h),
            params,
            self.embed(x),
            microbatches=4,
            repeats=self.repeats,
        )
        return self.head(h)


class EqxModel(eqx.Module):
    """Blocks stacked by eqx.filter_vmap; their arrays are the stacked params."""

    embed: eqx.nn.Linear
    blocks: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Linear(IN, D, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, D, key=k))(jax.random.split(k2, L))
        self.head = eqx.nn.Linear(D, OUT, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        params, static = eqx.partition(self.blocks, eqx.is_array)
        h = jax.vmap(self.embed)(x)
        h = sx.pipeline(
            lambda p, h: jnp.tanh(jax.vmap(eqx.combine(p, static))(h)), params, h, microbatches=4
        )
        return jax.vmap(self.head)(h)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def data(steps: int = STEPS) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(BATCH, IN)).astype(np.float32),
            "y": rng.normal(size=(BATCH, OUT)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def train(state, step, batches):
    state = step.shard(state)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def mesh(stage_mesh):
    """This module's tests run on the pipeline mesh (conftest's ``stage_mesh``)."""
    return stage_mesh


def stage_plan(mesh, pattern: str = r"blocks"):
    return sx.rules(mesh, [(pattern, P("stage"))])


_REFERENCE: dict[str, tuple] = {}


def assert_trained_alike(make_state, mesh, plan, leaves=lambda p: p, same_as: str = "") -> None:
    """Trains with ``plan`` and on one device (the plain scan); runs naming the same
    ``same_as`` model share the one-device run."""
    batches = data(1) * STEPS  # one batch, so the loss must fall
    if same_as not in _REFERENCE:
        single = sx.make_train_step(loss_fn, mesh=mesh, mode="single")
        reference = train(make_state(), single, batches)
        if same_as:
            _REFERENCE[same_as] = reference
    else:
        reference = _REFERENCE[same_as]
    ref, ref_losses = reference
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan)
    state, losses = train(make_state(), step, batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
        leaves(state.params),
        leaves(ref.params),
    )
    return state, step


@pytest.mark.parametrize(("repeats", "microbatches"), [(1, 4), (2, 8)])
def test_pytree_pipeline_trains_like_one_device(mesh, repeats, microbatches):
    def make_state():
        return sx.TrainState.from_params(
            make_params(),
            lambda p, x: pytree_apply(p, x, microbatches=microbatches, repeats=repeats),
            optax.adam(1e-2),
        )

    state, step = assert_trained_alike(make_state, mesh, stage_plan(mesh), same_as="pytree")
    # Each device holds only its stage's layers: L/S of them, the same on both data rows.
    for leaf in jax.tree.leaves(state.params["blocks"]):
        assert leaf.sharding.spec == P("stage")
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {L // 4}
    for leaf in jax.tree.leaves(state.opt_state):
        if getattr(leaf, "ndim", 0) == 3:
            assert leaf.sharding.spec == P("stage")
    # Activations move stage to stage; the stacked params are never gathered.
    hlo = step.lower(state, data(1)[0]).compile().as_text()
    assert re.search(r"collective-permute(-start)?\(", hlo)
    assert not re.search(r"all-gather(-start)?\(", hlo)


def test_nnx_pipeline_trains_like_one_device(mesh):
    plan = stage_plan(mesh)
    assert_trained_alike(
        lambda: sx.TrainState.create(NNXModel(nnx.Rngs(0), repeats=2), optax.adam(1e-2)),
        mesh,
        plan,
        leaves=lambda p: nnx.to_pure_dict(p) if hasattr(nnx, "to_pure_dict") else p,
    )


def test_equinox_pipeline_trains_like_one_device(mesh):
    assert_trained_alike(
        lambda: sx.TrainState.create(EqxModel(jax.random.key(0)), optax.adam(1e-2)),
        mesh,
        stage_plan(mesh),
    )


def test_pipeline_composes_with_fsdp_and_tensor_parallel_layers():
    """FSDP over "data" and TP over "model" inside each pipelined layer."""
    mesh = sx.make_mesh({"data": 2, "stage": 2, "model": 2})

    def tp_layer(p, h):
        h = sx.constrain(h @ p["w"], P("data", "model"))
        return jnp.tanh(h + p["b"])

    def apply(p, x):
        h = sx.pipeline(tp_layer, p["blocks"], x @ p["embed"], microbatches=2, repeats=2)
        return h @ p["head"]

    plan = sx.rules(
        mesh,
        [(r"blocks/w", P("stage", "data", "model")), (r"blocks/b", P("stage", "model"))],
    )
    state, _ = assert_trained_alike(
        lambda: sx.TrainState.from_params(make_params(), apply, optax.adam(1e-2)), mesh, plan
    )
    w = state.params["blocks"]["w"]
    assert {s.data.shape for s in w.addressable_shards} == {(L // 2, D // 2, D // 2)}


@pytest.mark.parametrize("shape", [{"data": 8}, {"data": 2, "stage": 1, "model": 4}])
def test_without_a_stage_axis_it_is_the_plain_scan(shape):
    params, x = make_params(), jnp.asarray(data(1)[0]["x"])
    blocks, h = params["blocks"], x @ params["embed"]
    expect = scan_layers(layer, blocks, h)
    fn = jax.jit(lambda b, h: sx.pipeline(layer, b, h, microbatches=3))
    with jax.sharding.set_mesh(sx.make_mesh(shape)):
        got = fn(blocks, h)
        hlo = fn.lower(blocks, h).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expect))
    assert "collective-permute" not in hlo
    # No mesh at all (single-device mode): the scan too.
    np.testing.assert_array_equal(np.asarray(fn(blocks, h)), np.asarray(expect))


@pytest.mark.parametrize(
    ("layers", "batch", "kwargs", "message"),
    [
        (6, 16, {}, "L=6 is not divisible by stages S=4 (mesh axis 'stage') × repeats=1 = 4"),
        (
            8,
            16,
            {"repeats": 4},
            "L=8 is not divisible by stages S=4 (mesh axis 'stage') × repeats=4 = 16",
        ),
        (
            8,
            12,
            {},
            "batch on each data shard (batch 12 / data 2 = 6) is not divisible by microbatches=4",
        ),
        (8, 16, {"microbatches": 2}, "microbatches=2 is less than the number of stages S=4"),
        (
            8,
            16,
            {"axis": "pipe"},
            "axis 'pipe' is not in the mesh, whose axes are {'data': 2, 'stage': 4}",
        ),
        (8, 16, {"microbatches": 0}, "microbatches must be an integer >= 1, got 0"),
        (8, 16, {"repeats": 1.5}, "repeats must be an integer >= 1, got 1.5"),
    ],
)
def test_errors_name_the_rule_and_the_sizes(mesh, layers, batch, kwargs, message):
    blocks = {"w": jax.ShapeDtypeStruct((layers, D, D), jnp.float32)}
    h = jax.ShapeDtypeStruct((batch, D), jnp.float32)
    kwargs = {"microbatches": 4, **kwargs}
    with jax.sharding.set_mesh(mesh), pytest.raises(ValueError, match=re.escape(message)):
        jax.eval_shape(lambda b, h: sx.pipeline(layer, b, h, **kwargs), blocks, h)


def test_stacked_leaves_must_share_the_layer_count():
    blocks = {"w": jnp.ones((8, D, D)), "b": jnp.ones((4, D))}
    with pytest.raises(
        ValueError, match=r"same leading \(layer\) size, got \['b'\]: 4, \['w'\]: 8"
    ):
        sx.pipeline(layer, blocks, jnp.ones((4, D)), microbatches=1)


@pytest.mark.parametrize(("repeats", "microbatches"), [(1, 4), (2, 8)])
def test_explicit_axes_mesh_gives_the_scan_gradients(repeats, microbatches):
    """On a jax.make_mesh mesh (Explicit axes) the sharding is in the types throughout."""
    mesh = jax.make_mesh(
        (2, 4), ("data", "stage"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    params, x = make_params(), jnp.asarray(data(1)[0]["x"])
    blocks, h = params["blocks"], x @ params["embed"]

    def loss(blocks, h, pipelined=True):
        if pipelined:
            h = sx.pipeline(layer, blocks, h, microbatches=microbatches, repeats=repeats)
        else:
            h = scan_layers(layer, blocks, h)
        return jnp.sum(h**2)

    expect = jax.grad(loss)(blocks, h, pipelined=False)
    with jax.sharding.set_mesh(mesh):
        placed = jax.device_put(blocks, P("stage"))
        got = jax.jit(jax.grad(loss))(placed, jax.device_put(h, P("data")))
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expect), strict=True):
        assert g.sharding.spec[0] == "stage"
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


# --- the GPT job, pipelined ---------------------------------------------------------------

GPT_TINY = ["train", "--model", "gpt", "--layers", "4", "--d-model", "16", "--heads", "2",
            "--seq-len", "16", "--batch-size", "8", "--steps", "2", "--eval-every", "2",
            "--json"]  # fmt: skip


def test_gpt_pipelined_gives_the_unpipelined_losses():
    """The GPT of `shardax train --model gpt`, its blocks pipelined over data=2 × stage=4
    (plan "pipeline"), against the same model unpipelined on data=8."""
    from shardax.models import gpt

    sizes = {"layers": 4, "d_model": 16, "heads": 2, "max_seq_len": 16}
    plain_cfg = gpt.GPTConfig(**sizes, scan_layers=True)
    piped_cfg = gpt.GPTConfig(**sizes, pipeline_microbatches=4)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(STEPS, 8, 17)).astype(np.int32)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]

    def lm_loss(model, batch):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def run(cfg, mesh, plan_name):
        model = gpt.make_gpt(cfg, seed=0)
        step = sx.make_train_step(lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, plan_name))
        state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return state, losses

    _, plain = run(plain_cfg, sx.make_mesh({"data": 8}), "replicate")
    state, piped = run(piped_cfg, sx.make_mesh({"data": 2, "stage": 4}), "pipeline")
    np.testing.assert_allclose(piped, plain, rtol=1e-5)
    up = state.params["blocks"]["mlp"]["up"][...]
    assert up.sharding.spec == P("stage", None, None)
    assert {s.data.shape[0] for s in up.addressable_shards} == {1}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--plan", "pipeline", "--mesh", "data=8"],
            "--plan pipeline needs a mesh with a 'stage' axis, got --mesh data=8",
        ),
        (
            ["--plan", "pipeline", "--mesh", "data=1,stage=8"],
            "the number of layers L=4 is not divisible by stages S=8",
        ),
        (
            ["--plan", "pipeline", "--mesh", "data=2,stage=2", "--microbatches", "3"],
            "the batch on each data shard (batch 8 / data 2 = 4) is not divisible by "
            "microbatches=3",
        ),
        (["--pipeline-repeats", "2"], "--pipeline-repeats needs --microbatches"),
    ],
)
def test_cli_gpt_pipeline_usage_errors(argv, message, capsys):
    assert cli([*GPT_TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# --- 1F1B ---------------------------------------------------------------------------------


def head_loss(p, h, y):
    return jnp.mean((h @ p - y) ** 2)


def test_1f1b_equals_gpipe_and_its_activation_memory_does_not_grow_with_m(mesh):
    params = make_params()
    blocks, head = params["blocks"], params["head"]
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(32, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, OUT)), jnp.float32)

    def gpipe(blocks, x, head, y, m=8):
        return head_loss(head, sx.pipeline(layer, blocks, x, microbatches=m), y)

    def one_f_one_b(blocks, x, head, y, m=8):
        return sx.pipeline_1f1b(layer, blocks, x, head_loss, head, y, microbatches=m)

    grad = jax.value_and_grad(one_f_one_b, argnums=(0, 1, 2))
    expect = jax.value_and_grad(gpipe, argnums=(0, 1, 2))(blocks, x, head, y)  # plain scans
    np.testing.assert_allclose(grad(blocks, x, head, y)[0], expect[0], rtol=1e-5)
    placed = jax.device_put(blocks, NamedSharding(mesh, P("stage")))
    temp = {}
    with jax.sharding.set_mesh(mesh):
        got = jax.jit(grad)(placed, x, head, y)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, expect
        )
        assert got[1][0]["w"].sharding.spec == P("stage")
        for name, fn in (("gpipe", gpipe), ("1f1b", one_f_one_b)):
            for m in (4, 16):
                rows = jax.ShapeDtypeStruct((16 * m, D), jnp.float32)
                out = jax.ShapeDtypeStruct((16 * m, OUT), jnp.float32)
                f = jax.jit(jax.grad(lambda b, x, h, y, fn=fn, m=m: fn(b, x, h, y, m)))
                compiled = f.lower(placed, rows, head, out).compile()
                temp[name, m] = compiled.memory_analysis().temp_size_in_bytes
    # GPipe keeps every microbatch's activations for the backward pass; 1F1B at most 2S-1
    # stage inputs, plus the M-sized input and its gradient.
    gpipe_growth = temp["gpipe", 16] - temp["gpipe", 4]
    f1b_growth = temp["1f1b", 16] - temp["1f1b", 4]
    assert f1b_growth < gpipe_growth / 3, temp
    assert temp["1f1b", 16] < temp["gpipe", 16] / 2, temp
