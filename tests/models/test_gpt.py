"""The reference GPT: plans from its logical axes, remat, FLOPs, the corpus, the CLI job."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cli.main import main as cli
from shardax.cost.flops import compiled_flops
from shardax.data.text import LMBatches, lm_batch, load_corpus, stdlib_files
from shardax.models import gpt

CFG = gpt.GPTConfig(layers=2, d_model=32, heads=4, max_seq_len=16)
# One block is enough where the test is not about the layer stack: each extra unrolled block
# is compiled again.
ONE_BLOCK = gpt.GPTConfig(layers=1, d_model=32, heads=4, max_seq_len=16)


_MAKE = nnx.jit(gpt.make_gpt, static_argnames=("cfg", "remat"))


def make(cfg, remat="none"):
    """``gpt.make_gpt(cfg, remat=remat)`` built under one ``nnx.jit``: the same model, but one
    compiled program instead of an eager one per initialiser (seconds for each new config),
    traced once per config and policy (the tests ask for the same ones again)."""
    return _MAKE(cfg=cfg, remat=remat)


def abstract(cfg):
    """The model's shapes and annotations only (``nnx.eval_shape``), as the CLI plans it."""
    return nnx.eval_shape(lambda: gpt.make_gpt(cfg))


def lm_loss(model, batch):
    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def tokens(batch=8, seq=16, seed=0):
    return jax.tree.map(jnp.asarray, lm_batch(np.arange(4096, dtype=np.uint8), batch, seq, seed, 1))


def shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


# --- plans from the logical axes ---------------------------------------------------------


@pytest.mark.parametrize("name", ["tp", "fsdp+tp"])
def test_tp_plans_split_columns_then_rows(name):
    mesh = sx.make_mesh({"data": 4, "model": 2})
    model = make(ONE_BLOCK)
    step = sx.make_train_step(lm_loss, mesh=mesh, plan=gpt.plan(mesh, model, name))
    state = step.shard(sx.TrainState.create(model, optax.adam(1e-3)))
    p = state.params
    fsdp = "data" if name == "fsdp+tp" else None
    L, d, h, k, m = 1, 32, 4, 8, 128
    # Megatron: q/k/v and mlp/up split their output columns (heads, mlp) over "model" ...
    assert p["blocks"]["attn"]["q"][...].sharding.spec == P(None, fsdp, "model", None)
    assert shard_shapes(p["blocks"]["attn"]["q"][...]) == {(L, d // (4 if fsdp else 1), h // 2, k)}
    assert p["blocks"]["mlp"]["up"][...].sharding.spec == P(None, fsdp, "model")
    # ... attn/out and mlp/down their input rows, so one all-reduce joins each pair.
    assert p["blocks"]["attn"]["out"][...].sharding.spec == P(None, "model", None, fsdp)
    assert p["blocks"]["mlp"]["down"][...].sharding.spec == P(None, "model", fsdp)
    assert shard_shapes(p["blocks"]["mlp"]["down"][...]) == {(L, m // 2, d // (4 if fsdp else 1))}
    assert p["embed"]["embedding"][...].sharding.spec == P("model", fsdp)
    assert p["head"][...].sharding.spec == P(fsdp, "model")
    # Adam's moments follow the params.
    mu = state.opt_state[0].mu
    assert mu["blocks"]["mlp"]["up"][...].sharding.spec == P(None, fsdp, "model")
    if name == "tp":
        return
    # Same numbers as one device.
    batch = tokens()
    ref = sx.make_train_step(lm_loss, mesh=mesh, mode="single")
    ref_state = ref.shard(sx.TrainState.create(make(ONE_BLOCK), optax.adam(1e-3)))
    for _ in range(2):
        state, m = step(state, batch)
        ref_state, r = ref(ref_state, batch)
        np.testing.assert_allclose(float(m["loss"]), float(r["loss"]), rtol=2e-5)


def test_fsdp_plan_shards_embed_over_data():
    mesh = sx.make_mesh({"data": 8})
    model = abstract(CFG)
    shardings = gpt.plan(mesh, model, "fsdp")(nnx.state(model, nnx.Param))
    assert shardings["blocks"]["attn"]["q"].get_value().spec == P(None, "data", None, None)
    assert shardings["blocks"]["norm1"]["scale"].get_value().spec == P(None, "data")
    assert shardings["head"].get_value().spec == P("data", None)


def test_split_batch_splits_over_every_data_axis():
    """HSDP: over ("replica", "data") each device holds its own rows, not the whole
    host's batch (the residual stream of a 70B over 32 hosts would be 32× larger)."""
    mesh = sx.make_mesh({"replica": 2, "data": 4})
    with jax.sharding.set_mesh(mesh):
        y = jax.jit(gpt.split_batch)(jnp.zeros((8, 4, 16)))
    assert y.sharding.spec == P(("replica", "data"))
    assert shard_shapes(y) == {(1, 4, 16)}


def test_plan_errors_name_the_sizes():
    model = abstract(gpt.GPTConfig(layers=1, d_model=24, heads=3, max_seq_len=8))
    with pytest.raises(ValueError, match=r"splits heads=3 over mesh axis 'model' of size 2"):
        gpt.plan(sx.make_mesh({"data": 4, "model": 2}), model, "tp")
    with pytest.raises(ValueError, match=r"has no 'model' axis"):
        gpt.plan(sx.make_mesh({"data": 8}), model, "tp")
    with pytest.raises(ValueError, match=r"heads=5 must divide d_model=32"):
        gpt.GPTConfig(d_model=32, heads=5)
    with pytest.raises(ValueError, match=r"GPTConfig.kernel must be .* got 'flash'"):
        gpt.GPTConfig(kernel="flash")
    # the kernel reaches sx.attention: splash is refused there, naming why, at 8 tokens
    splash = dataclasses.replace(ONE_BLOCK, kernel="splash")
    with pytest.raises(ValueError, match=r"kernel='splash' cannot compute .* not multiples of 128"):
        nnx.eval_shape(lambda: gpt.make_gpt(splash)(jnp.zeros((1, 8), jnp.int32)))
    with pytest.raises(ValueError, match=r"sequence length 32 is above the model's max_seq_len 16"):
        abstract(CFG)(jnp.zeros((1, 32), jnp.int32))  # checked before any parameter is used


def test_stacked_layers_are_a_layer_fn_and_leading_dim_params():
    model = make(CFG)
    layer_fn, stacked = model.layers()
    assert {x.shape[0] for x in jax.tree.leaves(stacked)} == {CFG.layers}
    scanned = make(gpt.GPTConfig(**{**vars(CFG), "scan_layers": True}))

    @nnx.jit  # one program, not one per op
    def outputs(model, scanned, stacked, inputs):
        x = model.embed(inputs)
        for i in range(CFG.layers):
            x = layer_fn(jax.tree.map(lambda a, i=i: a[i], stacked), x)
        return model.norm(x) @ model.head[...], model(inputs), scanned(inputs)

    want, got, got_scanned = outputs(model, scanned, stacked, tokens()["inputs"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_scanned, want, rtol=1e-5, atol=1e-5)


# --- remat -------------------------------------------------------------------------------


def test_remat_policies_give_the_same_loss_and_grads():
    batch = tokens()
    results = {}
    for policy in sx.parallel.REMAT_POLICIES:
        model = make(ONE_BLOCK, remat=policy)
        results[policy] = jax.jit(nnx.value_and_grad(lm_loss))(model, batch)
    loss, grads = results["none"]
    for policy, (other_loss, other_grads) in results.items():
        np.testing.assert_allclose(other_loss, loss, rtol=1e-6, err_msg=policy)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=policy)


def test_remat_wraps_functions_nnx_and_equinox_modules():
    import equinox as eqx

    x = jnp.ones((2, 3))
    fn = lambda w, x: jnp.tanh(x @ w).sum()  # noqa: E731
    w = jnp.eye(3)
    np.testing.assert_allclose(jax.grad(sx.remat(fn, "full"))(w, x), jax.grad(fn)(w, x))
    layer = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(sx.remat(layer, "dots")(x), layer(x))
    elayer = eqx.nn.Linear(3, 3, key=jax.random.key(0))
    wrapped = sx.remat(elayer, "dots_no_batch")
    g = eqx.filter_grad(lambda m: m(x[0]).sum())(wrapped)
    assert jax.tree.leaves(g)  # still a pytree of the module's arrays
    assert sx.remat(fn, "none") is fn
    with pytest.raises(ValueError, match=r"remat policy must be one of .* got 'everything'"):
        sx.remat(fn, "everything")
    with pytest.raises(TypeError, match=r"block must be a function.*got 3"):
        sx.remat(3, "full")


def test_remat_lowers_compiled_temporary_memory():
    batch = tokens(batch=16, seq=16)
    # In lax.scan: XLA:CPU's scheduler keeps remat's savings only inside a loop body.
    # CFG's sizes (2 layers are a loop too), so its initialisation is compiled already.
    cfg = gpt.GPTConfig(**{**vars(CFG), "scan_layers": True})
    temp = {}
    for policy in ("none", "full"):
        model = make(cfg, remat=policy)
        graphdef, params = nnx.split(model)

        def loss(params, batch, graphdef=graphdef):
            return lm_loss(nnx.merge(graphdef, params), batch)

        compiled = jax.jit(jax.grad(loss)).lower(params, batch).compile()
        temp[policy] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["none"]


# --- FLOPs -------------------------------------------------------------------------------


def test_compiled_flops_agree_with_the_6n_estimate():
    cfg = CFG  # initialised once for the other tests; its ratio is ~1.08
    model = make(cfg)
    graphdef, params = nnx.split(model)
    batch = tokens(batch=8, seq=16)

    def grad(params, batch):
        return jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), batch))(params)

    flops = compiled_flops(jax.jit(grad).lower(params, batch).compile())
    estimate = gpt.flops_per_token(cfg, 16, gpt.param_count(model, embeddings=False)) * 8 * 16
    # XLA also counts softmax, norms, GELU and the loss: a few percent above the matmuls.
    assert 1.0 <= flops / estimate < 1.15


# --- corpus ------------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_holds_out_files():
    assert stdlib_files() == stdlib_files()
    corpus = load_corpus(max_bytes=300_000)
    assert corpus.train.size + corpus.val.size == 300_000 and corpus.val.size > 0
    assert 2.0 < corpus.unigram_entropy() < np.log(256)
    loader = LMBatches(corpus.train, 4, 8, seed=1)
    first = [next(loader) for _ in range(3)]
    loader.set_state({"step": 1})
    np.testing.assert_array_equal(next(loader)["inputs"], first[1]["inputs"])
    np.testing.assert_array_equal(first[0]["inputs"][:, 1:], first[0]["targets"][:, :-1])


def test_user_data_and_paths_without_text(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    corpus = load_corpus(tmp_path / "a.txt")
    assert corpus.source.endswith("a.txt") and corpus.val.size > 0
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"--data .*bin: no text found"):
        load_corpus(tmp_path / "bin")
    with pytest.raises(ValueError, match=r"--data .*nowhere: no such file"):
        load_corpus(tmp_path / "nowhere")


# --- the CLI job -------------------------------------------------------------------------

TINY = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2",
        "--seq-len", "16", "--batch-size", "8"]  # fmt: skip


# The job's own options: the JSON summary's run is the reference the resumed runs repeat.
JOB = ["train", "--json", *TINY, "--eval-every", "2", "--plan", "fsdp+tp"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """One 4-step run of JOB (its run directory, and a function that returns its JSON
    summary from stdout), shared by the summary and resume tests."""
    run_dir = tmp_path_factory.mktemp("gpt") / "a"
    done = {}

    def summary(capsys):
        if not done:
            assert cli([*JOB, "--steps", "4", "--run-dir", str(run_dir)]) == 0
            done.update(json.loads(capsys.readouterr().out))
        return done

    return run_dir, summary


def test_cli_gpt_json_summary(four_steps, capsys):
    run_dir, summary = four_steps
    out = summary(capsys)
    assert out["model"] == "gpt" and out["mesh"] == {"data": 4, "model": 2}
    assert [h["step"] for h in out["history"]] == [1, 2, 3, 4]
    assert all("train_loss" in h for h in out["history"])
    assert ["val_loss" in h for h in out["history"]] == [False, True, False, True]
    assert out["val_loss"] == out["history"][-1]["val_loss"]
    assert out["unigram_entropy"] > 2
    assert out["flops_per_step"] > 0 and out["tflops_per_s_per_device"] > 0
    assert out["mfu"] == "n/a" and out["tokens_per_s"] > 0
    assert 1.0 <= out["flops_estimate_ratio"] < 1.3
    assert out["param_specs"]["params/blocks/mlp/up/value"] == "P(None, 'data', 'model')"
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(900)  # up to three CLI runs: slow only on a heavily shared machine
def test_cli_gpt_save_every_and_resume(four_steps, tmp_path, capsys):
    out = four_steps[1](capsys)  # 4 steps uninterrupted
    # Stop after 3 steps with a checkpoint every 2 (and at the end), resume to 4.
    ckpt = str(tmp_path / "ckpt")
    save = ["--save-every", "2", "--checkpoint-dir", ckpt]
    assert cli([*JOB, "--steps", "3", *save, "--run-dir", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    with sx.CheckpointManager(ckpt) as manager:
        assert manager.all_steps() == [2, 3]
    assert cli([*JOB, "--steps", "4", *save, "--resume", "--run-dir", str(tmp_path / "c")]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["resumed_from_step"] == 3
    for a, b in zip(out["history"], resumed["history"], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        if "val_loss" in a:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "300"], "--seq-len 300 is above the model's maximum sequence length "
                               "--max-seq-len 256"),
        (["--heads", "3"], "--heads 3 must divide --d-model 16"),
        (["--heads", "2", "--plan", "tp", "--mesh", "data=2,model=4"],
         "splits heads=2 over mesh axis 'model' of size 4"),
        (["--epochs", "2"], "--epochs: only for --model mlp"),
        (["--save-every", "2"], "--save-every 2 needs --checkpoint-dir"),
    ],
)  # fmt: skip
def test_cli_gpt_bad_input(argv, message, capsys):
    assert cli(["train", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_data_without_text(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert cli(["train", *TINY, "--data", str(tmp_path / "empty.txt")]) == 2
    assert f"--data {tmp_path / 'empty.txt'}: no text found" in capsys.readouterr().err
    assert cli(["train", "--steps", "3"]) == 2
    assert "--steps: only for --model gpt" in capsys.readouterr().err
