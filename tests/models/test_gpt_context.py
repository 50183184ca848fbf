"""``shardax train --model gpt`` over a context axis (ring, all_gather; --window, --pack)
and an expert axis: 5 steps on ``data=2,context=4`` / ``data=2,expert=4`` give the
losses of ``data=8`` for the same model and batches."""

import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardax as sx
from shardax.cli.main import main as cli
from shardax.data.text import LMBatches, batch_layout, lm_batch, zigzag_batch
from shardax.models import gpt
from shardax.parallel import unzigzag, zigzag

TINY = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "4",
        "--seq-len", "32", "--batch-size", "8", "--steps", "5", "--eval-every", "5"]  # fmt: skip
CONTEXT = ["--mesh", "data=2,context=4"]


@functools.cache
def _run(*argv: str, root: str) -> dict:
    name = "-".join(a.strip("-").replace("=", "").replace(",", "") for a in argv) or "base"
    run_dir = f"{root}/{name}"
    assert cli(["train", "--json", *TINY, *argv, "--log-every", "1", "--run-dir", run_dir]) == 0
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    summary["metrics.jsonl"] = Path(run_dir, "metrics.jsonl").read_text()
    return summary


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("runs"))
    return lambda *argv: _run(*argv, root=root)


def losses(summary: dict) -> np.ndarray:
    return np.array([h["train_loss"] for h in summary["history"]])


@pytest.mark.parametrize("impl", ["ring", "all_gather"])
def test_context_parallel_losses_equal_data_only(train, impl, capsys):
    ref = train()
    out = train(*CONTEXT, "--attention", impl)
    assert out["mesh"] == {"data": 2, "context": 4} and len(out["history"]) == 5
    assert out["model_config"]["attention"] == impl
    assert out["model_config"]["layout"] == "zigzag:4"  # the C the batches were reordered for
    np.testing.assert_allclose(losses(out), losses(ref), rtol=1e-5)
    capsys.readouterr()


@pytest.mark.parametrize("flag", [("--window", "4"), ("--pack",)], ids=["window", "pack"])
def test_window_and_pack_change_the_loss_and_agree_across_meshes(train, flag, capsys):
    ref = train()
    data = train(*flag)
    # --verify (once: its one-device reference compiles the model again): the zig-zag
    # batch against one device (exit 1 if it differs)
    verify = ("--verify",) if flag[0] == "--window" else ()
    context = train(*flag, *CONTEXT, "--attention", "ring", *verify)
    assert np.abs(losses(data) - losses(ref)).max() > 1e-3  # the mask changes the model
    np.testing.assert_allclose(losses(context), losses(data), rtol=1e-5)
    capsys.readouterr()


def test_moe_losses_equal_data_only_and_aux_metrics_are_reported(train, capsys):
    """At the default capacity (1.25), so tokens are dropped: the drops are the same on
    both meshes (gates are ranked in steps, so roundoff cannot reorder them), and the
    run says how many."""
    moe = ("--experts", "8", "--top-k", "2", "--moe-every", "1")
    data = train(*moe)
    expert = train(*moe, "--mesh", "data=2,expert=4")
    assert expert["mesh"] == {"data": 2, "expert": 4}
    np.testing.assert_allclose(losses(expert), losses(data), rtol=1e-5)
    drops = [h["dropped_fraction"] for h in expert["history"]]
    assert drops == [h["dropped_fraction"] for h in data["history"]] and min(drops) > 0
    for h in expert["history"]:
        assert 1.0 <= h["balance_loss"] < 8.0
    assert expert["moe"]["balance_coef"] == 0.01 and expert["moe"]["top_k"] == 2
    assert expert["moe"]["dropped_fraction"] > 0
    assert '"train/balance_loss"' in expert["metrics.jsonl"]  # what TensorBoard gets too
    assert '"train/dropped_fraction"' in expert["metrics.jsonl"]
    assert re.search(r"loss \d\.\d{4} drop \d+\.\d% balance \d\.\d{3}", capsys.readouterr().err)


def test_bad_context_and_expert_options(capsys):
    from shardax.cli.train_gpt import BALANCE_COEF

    assert BALANCE_COEF == 1e-2
    assert cli(["train", *TINY, "--top-k", "2"]) == 2
    assert "--top-k needs --experts" in capsys.readouterr().err
    bad = ["--mesh", "data=2,context=4", "--attention", "ulysses", "--heads", "2"]
    assert cli(["train", *TINY, *bad, "--d-model", "16"]) == 2
    assert "--heads 2 is not divisible by its size 4" in capsys.readouterr().err
    assert cli(["train", *TINY, "--mesh", "data=2,context=4", "--seq-len", "12"]) == 2
    assert "not divisible by 2 × the context axis size 4" in capsys.readouterr().err


def test_packed_batches_and_zigzag_positions():
    data = np.arange(10_000, dtype=np.int64).astype(np.uint8)
    batch = lm_batch(data, 4, 32, seed=0, step=1, pack=True)
    seg, pos = batch["segment_ids"], batch["positions"]
    assert seg.shape == pos.shape == (4, 32) and (seg.max(axis=1) > 0).any()
    for row_seg, row_pos in zip(seg, pos, strict=True):
        starts = np.flatnonzero(np.diff(row_seg)) + 1
        assert (row_pos[starts] == 0).all() and row_pos[0] == 0
    np.testing.assert_array_equal(batch["inputs"][:, 1:][pos[:, 1:] > 0],
                                  batch["targets"][:, :-1][pos[:, 1:] > 0])  # fmt: skip
    zz = zigzag_batch(batch, 4)
    assert zz["positions"][0, :4].tolist() == pos[0, :4].tolist()
    assert zz["positions"][0, 4:8].tolist() == pos[0, 28:32].tolist()
    assert batch_layout(4) == LMBatches(data, 4, 32, 0, context=4).layout == "zigzag:4"
    assert batch_layout(1) == LMBatches(data, 4, 32, 0).layout == "contiguous"


def test_the_model_refuses_a_batch_reordered_for_another_context_size():
    """A batch zig-zagged for C=4 with layout "zigzag:4": the GPT on one device gives the
    contiguous batch's logits (its positions and mask are C=4's), and on context=2 it is
    refused by name rather than masked wrongly."""
    model = nnx.jit(lambda: gpt.make_gpt(gpt.GPTConfig(layers=1, d_model=16, heads=2,
                                                       max_seq_len=16)))()  # fmt: skip
    tokens = jnp.arange(64).reshape(4, 16) % 7
    zz, _ = zigzag(tokens, 4)
    want = nnx.jit(lambda m, t: m(t))(model, tokens)
    got = nnx.jit(lambda m, t: m(t, layout="zigzag:4"))(model, zz)
    np.testing.assert_allclose(unzigzag(np.asarray(got), 4), want, rtol=1e-5, atol=1e-5)
    with (
        jax.set_mesh(sx.make_mesh({"data": 4, "context": 2})),
        pytest.raises(ValueError, match=r"layout='zigzag:4' says .* 4 devices of axis "
                      r"'context', but it has size 2 here"),
    ):  # fmt: skip
        nnx.jit(lambda m, t: m(t, layout="zigzag:4"))(model, zz)
