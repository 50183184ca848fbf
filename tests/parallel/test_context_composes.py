"""A user's own causal LM, written the way flax's NNX examples write one, calling
``sx.attention`` over a context axis: it composes with ``accumulate``, FSDP over the
data axis, TP over heads, ``sx.remat`` and ``sx.verify``, and trains as on ``data=8``.

A zig-zag batch needs the C it was reordered for: ``layout="zigzag:C"`` carries it, so
one device (``sx.verify``'s reference) computes what the mesh computes; bare
``layout="zigzag"`` (C from the mesh, warning once) is refused without a context axis,
except in ``laid_out_for``, where sx.verify's reference keeps the mesh's layout.
"""

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.parallel import context
from shardax.parallel.context import attention, laid_out_for, unzigzag, zigzag
from shardax.plan.tree import path_str

V, D, H, T, ROWS = 32, 32, 4, 32, 16


class CausalLM(nnx.Module):
    """Embedding, one pre-norm causal attention block (heads split over "model"), head."""

    def __init__(self, rngs: nnx.Rngs, layout: str = "contiguous", impl: str = "ring"):
        init = nnx.initializers.lecun_normal()
        cols = nnx.with_partitioning(init, (None, "model"))  # q, k, v: heads over "model"
        rows = nnx.with_partitioning(init, ("model", None))  # out: the heads come back
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.q, self.k, self.v = (
            nnx.Linear(D, D, use_bias=False, kernel_init=cols, rngs=rngs) for _ in range(3)
        )
        self.out = nnx.Linear(D, D, use_bias=False, kernel_init=rows, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)
        self.layout, self.impl = layout, impl

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        x = x + sx.remat(self.attend)(self.norm(x))
        return self.head(x)

    def attend(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = (f(x).reshape(b, t, H, D // H) for f in (self.q, self.k, self.v))
        y = attention(q, k, v, causal=True, impl=self.impl, layout=self.layout)
        return self.out(y.reshape(b, t, D))


def loss_fn(model, batch):
    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, V, size=(ROWS, T + 1)).astype(np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def train(mesh, layout: str, data: list, impl: str = "ring"):
    """Losses and final params of two steps: fsdp over "data" on top of the model's TP
    annotations, two microbatches per step."""
    with nnx.use_eager_sharding(False):
        model = CausalLM(nnx.Rngs(0), layout, impl)
    rules = {} if "model" in mesh.shape else {"model": None}  # data=8: replicate heads
    plan = sx.plan.fsdp_over(sx.from_nnx(mesh, model, rules), min_size=1)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, accumulate=2)
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
    losses = []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, state, losses


@pytest.fixture(scope="module")
def runs():
    data = batches(2)
    mesh = sx.make_mesh({"data": 2, "context": 2, "model": 2})
    zigged = [zigzag(b, 2)[0] for b in data]
    step, state, losses = train(mesh, "zigzag:2", zigged)
    _, ref_state, ref_losses = train(sx.make_mesh({"data": 8}), "contiguous", data)
    return mesh, step, state, losses, ref_state, ref_losses, zigged


def test_losses_and_params_equal_the_data_only_mesh(runs):
    _, _, state, losses, ref_state, ref_losses, _ = runs
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_the_plan_splits_heads_over_model_and_the_rest_over_data(runs):
    _, _, state, *_ = runs
    specs = {path_str(p): x for p, x in jax.tree.leaves_with_path(state.params)}
    q, out = specs["q/kernel/value"], specs["out/kernel/value"]
    assert q.sharding.spec == P("data", "model") and out.sharding.spec == P("model", "data")
    assert {s.data.shape for s in q.addressable_shards} == {(D // 2, D // 2)}
    # Adam's moments follow their param
    mu = {path_str(p): x for p, x in jax.tree.leaves_with_path(state.opt_state)}
    assert any(p.endswith("mu/q/kernel/value") and x.sharding.spec == P("data", "model")
               for p, x in mu.items())  # fmt: skip


@pytest.mark.parametrize("impl", ["ring", "all_gather", "ulysses"])
def test_verify_agrees_on_a_zigzag_context_mesh(runs, impl):
    mesh, step, *_, zigged = runs
    with nnx.use_eager_sharding(False):
        model = CausalLM(nnx.Rngs(0), "zigzag:2", impl)
    plan = sx.plan.fsdp_over(sx.from_nnx(mesh, model), min_size=1)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, accumulate=2)
    report = sx.verify(step, sx.TrainState.create(model, optax.adam(1e-2)), zigged[0])
    assert report.ok, str(report)
    assert report.steps == 1 and report.cause is None


def test_zigzag_without_the_context_axis_is_refused_not_guessed(monkeypatch):
    q = jax.random.normal(jax.random.key(0), (2, 16, 2, 8))
    with pytest.raises(ValueError, match=r"layout='zigzag' needs the context axis.*zigzag:C"):
        attention(q, q, q, causal=True, layout="zigzag")
    with (
        jax.set_mesh(sx.make_mesh({"data": 8})),
        pytest.raises(ValueError, match="axis 'context' has size 1 here"),
    ):
        jax.jit(lambda q: attention(q, q, q, causal=True, layout="zigzag"))(q)
    zq, _ = zigzag(q, 4)
    want = attention(q, q, q, causal=True, window=(5, 0))
    # "zigzag:4" says its C: one device, and a mesh without the context axis (jit), compute
    # what C=4 devices compute, with no laid_out_for.
    got = attention(zq, zq, zq, causal=True, window=(5, 0), layout="zigzag:4")
    np.testing.assert_allclose(unzigzag(np.asarray(got), 4), want, rtol=1e-5, atol=1e-6)
    with jax.set_mesh(sx.make_mesh({"data": 8})):
        got = jax.jit(lambda q: attention(q, q, q, causal=True, window=(5, 0), layout="zigzag:4"))(
            zq
        )
    np.testing.assert_allclose(unzigzag(np.asarray(got), 4), want, rtol=1e-5, atol=1e-6)
    # Bare "zigzag" inside laid_out_for: C=4 from the mesh, and a warning, once.
    monkeypatch.setattr(context, "_BARE_ZIGZAG_WARNED", False)
    with (
        laid_out_for(sx.make_mesh({"data": 2, "context": 4})),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        for _ in range(2):
            got = attention(zq, zq, zq, causal=True, window=(5, 0), layout="zigzag")
    said = [w for w in seen if issubclass(w.category, FutureWarning)]
    assert len(said) == 1 and said[0].filename == __file__, [str(w.message) for w in said]
    assert "pass layout='zigzag:C' (sx.parallel.zigzag_layout(C))" in str(said[0].message)
    np.testing.assert_allclose(unzigzag(np.asarray(got), 4), want, rtol=1e-5, atol=1e-6)
    with (
        pytest.raises(ValueError, match=r"not divisible by 8 \(2 × C=4"),
        laid_out_for(sx.make_mesh({"data": 2, "context": 4})),
    ):
        attention(q[:, :12], q[:, :12], q[:, :12], layout="zigzag")
    with pytest.raises(ValueError, match=r"not divisible by 8 \(2 × C=4, layout='zigzag:4'"):
        attention(q[:, :12], q[:, :12], q[:, :12], layout="zigzag:4")


def test_seq_axis_gives_each_device_its_part_of_each_sequence(runs, monkeypatch):
    """make_train_step(seq_axis="context"): the batch's sequences split over the context
    axis as well as its rows over data; the same losses, and sx.verify agrees (bare
    layout="zigzag" here: its reference keeps the mesh's C by laid_out_for, and it warns);
    a batch placed with sx.batch_sharding(mesh, seq_axis=...) is taken as it is."""
    mesh, _, _, losses, *_, zigged = runs
    with nnx.use_eager_sharding(False):
        model = CausalLM(nnx.Rngs(0), "zigzag")
    plan = sx.plan.fsdp_over(sx.from_nnx(mesh, model), min_size=1)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, accumulate=2, seq_axis="context")
    placed = step.place_batch(zigged[0])
    assert placed["inputs"].sharding.spec == P("data", "context")
    assert {s.data.shape for s in placed["inputs"].addressable_shards} == {(ROWS // 2, T // 2)}
    monkeypatch.setattr(context, "_BARE_ZIGZAG_WARNED", False)
    with pytest.warns(FutureWarning, match=r"layout='zigzag' takes C from the mesh"):
        assert sx.verify(step, sx.TrainState.create(model, optax.adam(1e-2)), zigged[0]).ok
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-2)))
    state, first = step(
        state, jax.device_put(zigged[0], sx.batch_sharding(mesh, seq_axis="context"))
    )
    state, second = step(state, zigged[1])  # NumPy: placed by the step
    np.testing.assert_allclose([float(first["loss"]), float(second["loss"])], losses, rtol=1e-5)
    evaluate = sx.make_eval_step(loss_fn, mesh=mesh, plan=plan, seq_axis="context")
    assert np.isfinite(float(evaluate(state, zigged[0])["loss"]))

    with pytest.raises(ValueError, match=r"'inputs' has 15 positions along dimension 1.*size 2"):
        step.place_batch({"inputs": np.zeros((16, 15), np.int32)})
    with pytest.raises(ValueError, match=r"sx.make_train_step: seq_axis splits .* mode='jit' only"):
        sx.make_train_step(loss_fn, mesh=mesh, mode="shard_map", seq_axis="context")
    with pytest.raises(ValueError, match=r"sx.make_train_step: seq_axis must be a mesh axis"):
        sx.make_train_step(loss_fn, mesh=mesh, seq_axis="seq")
