"""sx.explain on seeded mistakes in models written as their frameworks' examples write them
(NNX with nnx.Linear, Linen's params, an Equinox module), on 8 CPU devices: each named
with the right line of this file (a transpose's all-to-all and an involuntary full
rematerialization at the sx.constrain asking for them), and the out-of-memory one with a
fix that compiles and fits (its batch gathers counted as the plan's). The placement seeds
(an embedding 8 does not divide, a misspelt rule, a 2-axis mesh's idle axis) get fixes
sx.explain compiles; the reshape's and the transpose's source fixes, applied as their
suggestions say, compile with no unasked collective, and the jnp.ones row's (a jnp.pad)
leaves only the shift's own boundary rows moving. The built-in GPT
under fsdp+tp lists no unasked collective (zero1: test_plan_explain.py;
fsdp: tests/compile/test_explain_targets.py)."""

import inspect

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cost.remats import OP, absorb
from shardax.cost.reshards import Reshard
from shardax.models import gpt
from shardax.train.explanation.placement import placement

JAX = tuple(int(x) for x in jax.__version__.split(".")[:2])

HERE = __file__


def line_of(fn, text):
    """``file:line`` of the line of ``fn`` holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return f"{HERE}:{start + next(i for i, s in enumerate(lines) if text in s)}"


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batch_of(rows, width):
    return {"x": jax.ShapeDtypeStruct((rows, width), jnp.float32),
            "y": jax.ShapeDtypeStruct((rows, width), jnp.float32)}  # fmt: skip


class Wide(nnx.Module):
    """An MLP whose wide hidden activation is saved for the backward pass (no remat)."""

    def __init__(self, rngs):
        self.up = nnx.Linear(64, 2048, rngs=rngs)
        self.down = nnx.Linear(2048, 64, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.up(x))  # the saved activation
        return self.down(h)


def nnx_state(cls):
    return nnx.eval_shape(lambda: sx.TrainState.create(cls(nnx.Rngs(0)), optax.adam(1e-3)))


def test_out_of_memory_names_the_activation_and_a_fix_that_compiles_fits(mesh):
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    state, batch = nnx_state(Wide), batch_of(512, 64)
    # the peak fills the budget: no headroom, it does not fit (the program the search's
    # fsdp x 1 candidate finds in the compilation cache)
    budget = sx.estimate(step, state, batch).memory["peak"]
    report = sx.explain(step, state, batch, budget=budget, accumulate=(1, 4), plans=("fsdp",))
    assert report.fits is False
    # XLA:CPU gathers the batch rows, not up's kernel, for the matmul with the split
    # kernel: the plan's gather of the smaller side, no surprise
    assert report.unasked == (), [(c.op, c.source) for c in report.unasked]
    assert any(c.implied.startswith("a matmul's operand") for c in report.collectives)
    saved = [b for b in report.memory.buffers if b.kind == "activation"]
    assert saved and saved[0].source == line_of(Wide.__call__, "the saved activation")
    assert saved[0].bytes == 512 * 2048 * 4 // 8  # one device's share of it
    assert report.fixes, report
    top = report.fixes[0]
    assert top.accumulate == 4 and top.peak_bytes <= 0.9 * budget
    plan = {"fsdp": sx.fsdp, "zero1": sx.zero1, "zero2": sx.zero2}[top.plan](mesh)
    fixed = sx.make_train_step(mse, mesh=mesh, plan=plan, accumulate=top.accumulate)
    assert sx.estimate(fixed, state, batch).memory["peak"] <= 0.9 * budget  # compiled again
    assert "--accumulate 4" in top.flags and "accumulate=4" in top.code
    assert report.to_dict()["fixes"][0]["name"] == top.name
    assert "does not fit" in str(report)
    if report.memory.by_kind().get("optimizer state"):  # what offloading it would free
        (note,) = [n for n in report.notes if n.startswith("host offload of the optimizer")]
        assert "on XLA:CPU that memory is the host's" in note


class Transposed(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.proj(x))
        t = sx.constrain(h.T, P("data", None))  # batch was dim 0; after .T it is dim 1
        return jnp.tanh(t).T


def test_a_transpose_that_forces_an_all_to_all_names_the_model_lines(mesh):
    cls = Transposed
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    report = sx.explain(step, nnx_state(cls), batch_of(64, 64), fixes=False)
    lines, start = inspect.getsourcelines(cls.__call__)
    mine = {f"{HERE}:{start + i}" for i in range(len(lines))}
    found = [c for c in report.unasked if c.source in mine]
    assert found, [(c.op, c.source, c.what) for c in report.unasked]
    assert {c.op for c in found} == {"all-to-all"}
    line = found[0].source
    # named at the sx.constrain that asks for the move (the fix goes there), the moved
    # value's own line kept in made
    assert {c.source for c in found} == {line_of(cls.__call__, "sx.constrain")}
    assert all(c.made in mine and c.made != line for c in found)
    assert all(c.axes == ("data",) and c.sent_bytes > 0 for c in found)
    assert all("sx.constrain" in c.suggestion for c in found)
    assert line in str(report)


class Heads(nnx.Module):
    """Heads split by a constraint to their last dimension over both axes: the
    partitioner cannot reach it from the batch's split by an all-to-all."""

    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        h = self.proj(x).reshape(x.shape[0], 8, 8)
        h = sx.constrain(h, P(None, None, ("data", "model")))  # meant: P("data", None, None)
        return jnp.tanh(h).reshape(x.shape[0], 64)


def test_an_involuntary_full_rematerialization_is_named_at_the_constraint(mesh_2d):
    step = sx.make_train_step(mse, mesh=mesh_2d, plan=sx.fsdp(mesh_2d))
    report = sx.explain(step, nnx_state(Heads), batch_of(64, 64), fixes=False)
    found = [c for c in report.unasked if c.op == "full rematerialization"]
    line = line_of(Heads.__call__, "meant: P(")
    assert found and found[0].source == line, [(c.op, c.source) for c in report.unasked]
    remat = found[0]
    assert remat.before == "P(None, None, ('data', 'model'))" and remat.shape == (64, 8, 8)
    assert remat.after.startswith("P('data'") and remat.made.startswith(HERE)
    assert remat.bytes == 64 * 64 * 4 and 0 < remat.sent_bytes < remat.bytes
    assert "sx.constrain" in remat.suggestion and line in str(report)
    # XLA rebuilds the array with an all-gather of its full shape: that gather is the
    # remat's row (its bytes, counted once), not a second unasked one
    carriers = ("all-gather", "all-reduce")
    twins = [c for c in report.collectives if c.op in carriers and c.shape == remat.shape]
    assert twins == [], [(c.op, c.shape, c.name) for c in twins]
    assert all(r.sent_bytes == 7 / 8 * 64 * 64 * 4 for r in found)  # (n-1)/n of it, n = 8


class Embedder(eqx.Module):
    """An Equinox embedding whose vocabulary (1001) and width (36) 8 does not divide."""

    embed: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(1001, 36, key=k1)
        self.head = eqx.nn.Linear(36, 64, key=k2)

    def __call__(self, x):
        return jax.vmap(self.head)(jax.vmap(self.embed)(x[:, 0].astype(jnp.int32)))


def test_an_embedding_the_axis_does_not_divide_is_named_with_a_padding_that_compiles(mesh):
    state = sx.TrainState.create(Embedder(jax.random.key(0)), optax.sgd(0.1))
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    report = sx.explain(step, state, batch_of(64, 64))
    leaves = {leaf.path: leaf for leaf in report.placement.leaves}
    weight = next(leaf for path, leaf in leaves.items() if "embed" in path)
    assert weight.shape == (1001, 36) and weight.ways == 1 and weight.meant == 8
    assert weight.why == "no dimension of (1001, 36) is divisible by data (8)"
    assert 8 in report.placement.share("parameter")  # the head's kernel is split
    assert report.to_dict()["placement"]["leaves"]
    # the fix, compiled: the vocabulary padded to 1008 rows (not the width to 40)
    (fix,) = [f for f in report.placement_fixes if weight.path in f.name]
    assert fix.name == f"pad {weight.path} to (1008, 36) (was (1001, 36))" and fix.peak_bytes > 0
    assert report.to_dict()["placement_fixes"][0]["name"] == fix.name
    assert "placement fixes, each compiled" in str(report)
    # applied as the user would (a model of 1008 rows), the leaf is split 8 ways
    padded = eqx.tree_at(lambda m: m.embed, Embedder(jax.random.key(0)),
                         eqx.nn.Embedding(1008, 36, key=jax.random.key(1)))  # fmt: skip
    state = sx.TrainState.create(padded, optax.sgd(0.1))
    again = sx.explain(step, state, batch_of(64, 64), fixes=False)
    assert not [leaf for leaf in again.placement.leaves if "embed" in leaf.path]


class NNXEmbedder(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(1001, 36, rngs=rngs)
        self.head = nnx.Linear(36, 64, rngs=rngs)

    def __call__(self, x):
        return self.head(self.embed(x[:, 0].astype(jnp.int32)))


class LinenEmbedder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.Embed(1001, 36)(x[:, 0].astype(jnp.int32)))


def test_a_padding_is_compiled_for_nnx_and_named_where_linen_refuses_it(mesh):
    """NNX takes the padded table; Linen checks a parameter's shape against its module, so
    the padding does not compile there and a note says so (no fix offered unproven)."""
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    report = sx.explain(step, nnx_state(NNXEmbedder), batch_of(64, 64))
    names = [f.name for f in report.placement_fixes]
    assert names == ["pad params['embed']['embedding'].value to (1008, 36) (was (1001, 36))"]
    module = LinenEmbedder()
    variables = module.init(jax.random.key(0), jnp.zeros((2, 64)))
    state = sx.TrainState.from_linen(module, variables, optax.adam(1e-3))
    report = sx.explain(step, state, batch_of(64, 64))
    assert report.placement_fixes == ()
    (note,) = [n for n in report.notes if n.startswith("placement fix")]
    assert note.startswith(
        "placement fix \"pad params['Embed_0']['embedding'] to (1008, 36) (was (1001, 36))\" "
        "was tried and does not compile: ScopeParamShapeError"
    ), note


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(64)(nn.relu(nn.Dense(256)(x)))


def test_a_rule_that_matches_nothing_and_an_idle_axis_are_named(mesh_2d):
    variables = jax.eval_shape(LinenMLP().init, jax.random.key(0), jnp.zeros((1, 64)))
    plan = sx.rules(
        mesh_2d, [(r"Dense_0/kernel", P(None, "model")), (r"Dense_9/kernel", P("model", None))]
    )  # a misspelt path
    with pytest.warns(UserWarning, match="rules\\[1\\]"):
        report = placement(variables, plan)
    assert any("rules[1]" in n for n in report.notes)
    assert report.idle_axes == ("data",)  # no parameter byte is split over data
    assert not report.ok


def test_a_rule_that_matches_nothing_gets_the_nearest_path_compiled():
    """In a step, the misspelt rule's fix is the rule with the path of the leaf it was
    meant for (Dense_1's kernel: Dense_0's is an earlier rule's), compiled; the data axis
    that splits nothing gets FSDP over it, compiled too."""
    mesh = sx.make_mesh({"data": 4, "model": 2})
    module = LinenMLP()
    variables = module.init(jax.random.key(0), jnp.zeros((1, 64)))
    state = sx.TrainState.from_linen(module, variables, optax.adam(1e-3))
    plan = sx.rules(
        mesh, [(r"Dense_0/kernel", P(None, "model")), (r"Dense_9/kernel", P("model", None))]
    )
    step = sx.make_train_step(mse, mesh=mesh, plan=plan)
    with pytest.warns(UserWarning, match="rules\\[1\\]"):
        report = sx.explain(step, state, batch_of(64, 64))
    names = [f.name for f in report.placement_fixes]
    assert names == ["FSDP over data too", "rules[1] matching 'Dense_1/kernel'"], names
    rule = report.placement_fixes[1]
    assert (
        rule.code
        == "sx.rules(mesh, [..., ('Dense_1/kernel', P('model', None)), ...])  # was rules[1]"
    )
    fixed = sx.rules(
        mesh, [(r"Dense_0/kernel", P(None, "model")), (r"Dense_1/kernel", P("model", None))]
    )
    assert not placement(state, fixed).notes  # applied, the rule gives its leaf a spec
    assert placement(state, sx.plan.fsdp_over(plan, axis="data")).idle_axes == ()


def test_a_2_axis_mesh_whose_fsdp_uses_one_axis_is_named_with_a_fix_that_compiles():
    mesh = sx.make_mesh({"replica": 2, "fsdp": 4})
    state = nnx_state(Wide)
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh, axis="fsdp"),
                              data_axis=("replica", "fsdp"))  # fmt: skip
    report = sx.explain(step, state, batch_of(64, 64))
    assert report.placement.idle_axes == ("replica",)
    assert report.placement.meant["parameter"] == 4
    assert "'replica' (2) splits no parameter" in str(report.placement)
    (fix,) = report.placement_fixes
    assert fix.name == "FSDP over replica too" and fix.plan == "fsdp+fsdp"
    assert fix.code.startswith("sx.plan.fsdp_over(plan, axis='replica')")
    # applied: every parameter byte the plan split 4 ways is split 8 ways, and the compiled
    # peak is below the step's own (the state is split twice as many ways)
    plan = sx.plan.fsdp_over(sx.fsdp(mesh, axis="fsdp"), axis="replica")
    assert placement(state, plan).meant["parameter"] == 8
    assert fix.peak_bytes < report.peak_bytes


GPT = gpt.GPTConfig(layers=1, d_model=64, heads=4, max_seq_len=64)


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


# zero1: tests/explain/test_plan_explain.py (the CLI's GPT); fsdp: on 8xH100, tests/compile/
@pytest.mark.parametrize(("name", "shape"), [("fsdp+tp", {"data": 4, "model": 2})])
def test_the_gpt_under_its_plans_lists_no_unasked_collective(name, shape):
    mesh = sx.make_mesh(shape)
    model = nnx.eval_shape(lambda: gpt.make_gpt(GPT))
    state = nnx.eval_shape(lambda: sx.TrainState.create(gpt.make_gpt(GPT), optax.adam(1e-3)))
    step = sx.make_train_step(lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, name))
    tokens = jax.ShapeDtypeStruct((16, 64), jnp.int32)
    report = sx.explain(step, state, {"inputs": tokens, "targets": tokens}, fixes=False)
    assert report.unasked == (), [(c.op, c.source, c.what) for c in report.unasked]
    assert any(c.implied for c in report.collectives)
    assert report.placement.ok or not report.placement.idle_axes


class Shifted(nnx.Module):
    """Each row sees the one before it: a row of jnp.ones, built whole outside the plan, is
    put before the batch, and every row moves one place across the shards."""

    def __init__(self, rngs):
        self.up = nnx.Linear(64, 512, rngs=rngs)
        self.down = nnx.Linear(512, 64, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.up(x))
        before = jnp.concatenate([jnp.ones((1, 512)), h[:-1]], axis=0)  # built whole
        return self.down(h * before)


class TimeMajor(nnx.Module):
    """Six steps of 64 features per row, read time-major with a reshape where a transpose
    was meant: the batch's split is dropped."""

    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, x):
        steps = x.reshape(6, x.shape[0], 64)  # meant: jnp.swapaxes(x.reshape(-1, 6, 64), 0, 1)
        return jnp.tanh(self.proj(steps)).mean(0)


# (rows, width): rows that no parameter has (an FSDP gather would be implied)
@pytest.mark.parametrize(("cls", "text", "ops", "shape"), [
    (Shifted, "built whole", {"collective-permute"}, (512, 64)),
    (TimeMajor, "meant: jnp.swapaxes", {"all-gather"}, (64, 384)),
])  # fmt: skip
def test_an_activation_built_outside_the_plan_and_a_reshape_are_named(mesh, cls, text, ops,
                                                                        shape):  # fmt: skip
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    batch = {"x": jax.ShapeDtypeStruct(shape, jnp.float32),
             "y": jax.ShapeDtypeStruct((shape[0], 64), jnp.float32)}  # fmt: skip
    report = sx.explain(step, nnx_state(cls), batch, fixes=False)
    line = line_of(cls.__call__, text)
    found = [c for c in report.unasked if c.source == line]
    if JAX >= (0, 12):  # XLA:CPU of JAX 0.12 moves the time-major rows by a permute there
        ops = {"collective-permute"} if cls is TimeMajor else ops
    assert found and ops <= {c.op for c in found}, [(c.op, c.source) for c in report.unasked]
    assert all(c.axes == ("data",) and c.sent_bytes > 0 and c.suggestion for c in found)
    assert any(u["source"] == line for u in report.to_dict()["unasked"])
    joined = [c for c in found if c.what.endswith("concatenate") and c.op != "collective-permute"]
    assert all("jnp.pad" in c.suggestion for c in joined)  # the fix ShiftedFixed applies


def test_each_remat_takes_the_gather_of_its_own_pass_and_leaves_the_others():
    """``absorb`` without a compile: two remats (forward, backward) and the HLO's gathers
    listed backward first; each remat takes its own pass's carrier (bytes, runs), and a
    gather of another shape, or one the plan asks for, stays a row of its own."""

    def row(op, what, runs=1, shape=(64, 8, 8), implied=""):
        axes, sent = ("data", "model"), 14336.0 * runs
        return Reshard(op, axes, 16384, sent, runs, shape, "f32", "m.py:3", what, "", "", implied)

    forward, backward = row(OP, "jit(f)/jvp()/tanh"), row(OP, "jit(f)/transpose(jvp())/c")
    gathers = (
        row("all-gather", "jit(f)/transpose(jvp())/reshape", runs=2),
        row("all-gather", "jit(f)/jvp()/reshape", runs=3),
        row("all-gather", "jit(f)/jvp()/dot", shape=(64, 64)),
        row("all-gather", "jit(f)/jvp()/w", implied="the plan's gather of a sharded parameter"),
    )
    rows = absorb((forward, backward), gathers)
    folded = [(r.op, r.runs, r.sent_bytes) for r in rows[:2]]
    assert folded == [(OP, 3, 3 * 14336.0), (OP, 2, 2 * 14336.0)]
    assert rows[2:] == gathers[2:]
    assert absorb((forward,), ()) == (forward,)  # no carrier: the log's figures


class TimeMajorFixed(TimeMajor):
    """TimeMajor with the fix its report names: the batch's split kept (a transpose)."""

    def __call__(self, x):
        steps = jnp.swapaxes(x.reshape(x.shape[0], 6, 64), 0, 1)
        return jnp.tanh(self.proj(steps)).mean(0)


class TransposedFixed(Transposed):
    """Transposed with its constraint to the layout the transpose gives (the fix its
    report names: one layout for the op's input and output)."""

    def __call__(self, x):
        h = jnp.tanh(self.proj(x))
        t = sx.constrain(h.T, P(None, "data"))  # the batch, now dimension 1, stays split
        return jnp.tanh(t).T


@pytest.mark.parametrize(("cls", "rows"), [(TimeMajorFixed, 384), (TransposedFixed, 64)])
def test_the_fix_a_reshard_names_compiles_with_no_unasked_collective(mesh, cls, rows):
    """The seeds' source fixes, applied as the suggestions say: the step compiles and
    the collectives the plan did not ask for are gone."""
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    batch = {"x": jax.ShapeDtypeStruct((64, rows), jnp.float32),
             "y": jax.ShapeDtypeStruct((64, 64), jnp.float32)}  # fmt: skip
    report = sx.explain(step, nnx_state(cls), batch, fixes=False)
    assert report.unasked == (), [(c.op, c.source) for c in report.unasked]


class ShiftedFixed(Shifted):
    """Shifted with the fix its report names: the shift made with jnp.pad (the pad's
    constant is the row of ones), so only the rows at the shard boundaries move."""

    def __call__(self, x):
        h = jnp.tanh(self.up(x))
        before = jnp.pad(h[:-1], ((1, 0), (0, 0)), constant_values=1.0)
        return self.down(h * before)


def test_the_fix_for_a_row_built_whole_leaves_only_the_boundary_rows_moving(mesh):
    """The jnp.ones seed's fix, applied as its suggestion says: the step compiles, its
    all-to-alls are gone, and what is left is one 512-wide f32 row per shard and pass
    (the shift itself reads across the boundary), 50 times fewer bytes than before."""
    step = sx.make_train_step(mse, mesh=mesh, plan=sx.fsdp(mesh))
    batch = batch_of(512, 64)
    before, after = (
        sx.explain(step, nnx_state(cls), batch, fixes=False).unasked
        for cls in (Shifted, ShiftedFixed)
    )
    assert {c.op for c in after} == {"collective-permute"}, [(c.op, c.what) for c in after]
    assert all(c.sent_bytes <= 512 * 4 for c in after)
    assert all(c.source == line_of(ShiftedFixed.__call__, "jnp.pad") for c in after)
    sent = lambda rows: sum(c.sent_bytes for c in rows)  # noqa: E731
    assert sent(before) >= 50 * sent(after), (sent(before), sent(after))
