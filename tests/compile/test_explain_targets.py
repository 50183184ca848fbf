"""``sx.explain`` on a compile-only 8xH100 node (``sx.target``, no GPU): seeded mistakes in
NNX models written as nnx.Linear's examples write them, each named with this file's line
(a transpose's all-to-all at its sx.constrain, an involuntary full rematerialization at
the constraint that asks for it, a row of jnp.ones put before the batch, a reshape that drops
the batch's split; an undivided embedding, an idle mesh axis and a rule that matches
nothing in the placement against intent).
The out-of-memory one (an un-rematerialized wide layer, in half of each GPU's memory) gets
fixes, each compiled, and its top fix compiled again fits and has its predicted time on
the report; the larger memory_fraction is among them. ``shardax plan --explain --target``
prints the tables for the built-in GPT. CI leg 3."""

import inspect
import json

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cli import plan_explain
from shardax.cli.main import build_parser

pytestmark = pytest.mark.compile_only("gpu")

HERE = __file__
ROWS = 2**24  # x 2048 x 4 bytes: two 16 GiB activations per device under FSDP over 8


def line_of(fn, text):
    lines, start = inspect.getsourcelines(fn)
    return f"{HERE}:{start + next(i for i, s in enumerate(lines) if text in s)}"


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 2048, rngs=rngs)
        self.down = nnx.Linear(2048, 64, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.up(x))  # the wide activation
        return self.down(h)


class Transposed(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.proj(x))
        t = sx.constrain(h.T, P("data", None))  # batch was dim 0; after .T it is dim 1
        return jnp.tanh(t).T


def state_of(cls):
    return nnx.eval_shape(lambda: sx.TrainState.create(cls(nnx.Rngs(0)), optax.adam(1e-3)))


def batch_of(rows):
    return {k: jax.ShapeDtypeStruct((rows, 64), jnp.float32) for k in ("x", "y")}


@pytest.fixture(scope="module")
def out_of_memory():
    """The wide layer's fsdp step on 8 H100 planned in half of each GPU's memory: its
    explanation with the fixes (fsdp x 1 or 4 microbatches, a larger memory_fraction)."""
    target = sx.target("8xH100", memory_fraction=0.5)
    mesh = sx.make_mesh({"data": 8}, devices=target)
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    report = sx.explain(step, state_of(Wide), batch_of(ROWS), accumulate=(1, 4), plans=("fsdp",))
    return report


def test_the_wide_layer_does_not_fit_and_names_its_line(out_of_memory):
    report = out_of_memory
    assert report.fits is False and report.budget == pytest.approx(0.5 * 81559 * 2**20)
    wide = [b for b in report.memory.buffers if b.bytes >= ROWS // 8 * 2048 * 4]
    assert wide and all(b.source == line_of(Wide.__call__, "the wide activation") for b in wide)
    assert "does not fit" in str(report)
    json.dumps(report.to_dict())
    if report.memory.by_kind().get("optimizer state"):  # a compile-only GPU lists no memories
        assert any("has a pinned_host memory space" in n for n in report.notes), report.notes


def test_the_top_fix_compiled_again_fits_and_its_time_is_on_the_report(out_of_memory):
    report = out_of_memory
    assert report.fixes, report
    names = [f.name for f in report.fixes]
    assert any(n.startswith("memory_fraction 0.9") for n in names), names
    assert any(f.accumulate == 4 for f in report.fixes), names
    top = report.fixes[0]
    assert top.predicted_s is not None and top.interval_s is not None
    assert f"{top.predicted_s * 1e3:.1f} ms" in str(report)
    if top.name.startswith("memory_fraction"):  # the same step in the larger budget
        fraction = float(top.flags.split()[-1])
        target = sx.target("8xH100", memory_fraction=fraction)
        mesh = sx.make_mesh({"data": 8}, devices=target)
        step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    else:
        mesh = sx.make_mesh({"data": 8}, devices=sx.target("8xH100", memory_fraction=0.5))
        step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh), accumulate=top.accumulate)
    fixed = sx.estimate(step, state_of(Wide), batch_of(ROWS))
    assert fixed.fits is True and fixed.memory["peak"] <= 0.9 * fixed.memory_budget


def test_a_transpose_that_forces_an_all_to_all_on_8_h100():
    mesh = sx.make_mesh({"data": 8}, devices=sx.target("8xH100"))
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    report = sx.explain(step, state_of(Transposed), batch_of(64), fixes=False)
    lines, start = inspect.getsourcelines(Transposed.__call__)
    mine = {f"{HERE}:{start + i}" for i in range(len(lines))}
    found = [c for c in report.unasked if c.source in mine]
    assert found and {c.op for c in found} == {"all-to-all"}, report
    assert all(c.axes == ("data",) and "sx.constrain" in c.suggestion for c in found)
    assert {c.source for c in found} == {line_of(Transposed.__call__, "sx.constrain")}


class Heads(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        h = self.proj(x).reshape(x.shape[0], 8, 8)
        h = sx.constrain(h, P(None, None, ("data", "model")))  # meant: P("data", None, None)
        return jnp.tanh(h).reshape(x.shape[0], 64)


def test_an_involuntary_full_rematerialization_on_8_h100():
    mesh = sx.make_mesh({"data": 4, "model": 2}, devices=sx.target("8xH100"))
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    report = sx.explain(step, state_of(Heads), batch_of(64), fixes=False)
    found = [c for c in report.unasked if c.op == "full rematerialization"]
    assert found, [(c.op, c.source) for c in report.unasked]
    assert found[0].source == line_of(Heads.__call__, "meant: P(")
    assert found[0].before == "P(None, None, ('data', 'model'))" and found[0].sent_bytes > 0
    twins = [c for c in report.collectives if c.shape == found[0].shape and c.op != found[0].op]
    assert not [c for c in twins if c.op.startswith(("all-gather", "all-reduce"))], twins


def test_plan_explain_on_the_target_lists_no_unasked_collective():
    argv = ["plan", "--explain", "--target", "8xH100", "--batch", "16", "--plan", "fsdp",
            "--layers", "1", "--d-model", "128", "--heads", "2", "--seq-len", "64",
            "--vocab", "256"]  # fmt: skip
    result, report = plan_explain.explained(build_parser().parse_args(argv))
    assert result["target"] == "8xH100" and result["mesh"] == {"data": 8}
    assert report.unasked == (), [(c.op, c.source, c.what) for c in report.unasked]
    assert report.fits is True and report.memory is not None
    text = str(report)
    assert "collectives the plan did not ask for: 0" in text and "placement against" in text


class Shifted(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 512, rngs=rngs)
        self.down = nnx.Linear(512, 64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.up(x))
        before = jnp.concatenate([jnp.ones((1, 512)), h[:-1]], axis=0)  # built whole
        return self.down(h * before)


class TimeMajor(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        steps = x.reshape(6, x.shape[0], 64)  # meant: jnp.swapaxes(x.reshape(-1, 6, 64), 0, 1)
        return jnp.tanh(self.proj(steps)).mean(0)


@pytest.mark.parametrize(("cls", "text", "shape"), [
    (Shifted, "built whole", (512, 64)), (TimeMajor, "meant: jnp.swapaxes", (64, 384)),
])  # fmt: skip
def test_an_activation_built_outside_the_plan_and_a_reshape_on_8_h100(cls, text, shape):
    mesh = sx.make_mesh({"data": 8}, devices=sx.target("8xH100"))
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    batch = {"x": jax.ShapeDtypeStruct(shape, jnp.float32),
             "y": jax.ShapeDtypeStruct((shape[0], 64), jnp.float32)}  # fmt: skip
    report = sx.explain(step, state_of(cls), batch, fixes=False)
    line = line_of(cls.__call__, text)
    found = [c for c in report.unasked if c.source == line]
    assert found, [(c.op, c.source, c.what) for c in report.unasked]
    assert all(c.axes == ("data",) and c.sent_bytes > 0 and c.suggestion for c in found)


class Embedder(nnx.Module):
    """A vocabulary (1001) and width (36) that 8 does not divide, and a head it does."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(1001, 36, rngs=rngs)
        self.head = nnx.Linear(36, 64, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def test_placement_on_8_h100_names_an_undivided_embedding_an_idle_axis_and_a_rule():
    from shardax.train.explanation.placement import placement

    devices = sx.target("8xH100")
    mesh = sx.make_mesh({"data": 8}, devices=devices)
    report = placement(state_of(Embedder), sx.fsdp(mesh, min_size=1))
    (leaf,) = [leaf for leaf in report.leaves if leaf.kind == "parameter"]
    assert leaf.shape == (1001, 36) and leaf.ways == 1 and leaf.meant == 8
    assert leaf.why == "no dimension of (1001, 36) is divisible by data (8)"
    hybrid = sx.make_mesh({"replica": 2, "fsdp": 4}, devices=devices)
    report = placement(state_of(Wide), sx.fsdp(hybrid, axis="fsdp"))
    assert report.idle_axes == ("replica",) and report.meant["parameter"] == 4
    with pytest.warns(UserWarning, match="rules\\[0\\]"):  # a misspelt path
        ruled = placement(state_of(Wide), sx.rules(mesh, [(r"upp/kernel", P(None, "data"))]))
    assert any("rules[0]" in n for n in ruled.notes) and not ruled.ok
