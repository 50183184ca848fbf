"""benchmarks/gpu/torch_gpt.py, the GPU benchmark's PyTorch reference: the same model as
shardax's reference GPT (the same loss from the same weights), and its run on the CPU.

torch is not a shardax dependency: without it (CI) these tests skip.
"""

import dataclasses
import importlib.util
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def torch_gpt():
    path = Path(__file__).parents[1] / "benchmarks" / "gpu" / "torch_gpt.py"
    spec = importlib.util.spec_from_file_location("benchmarks_torch_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_torch_gpt_is_shardax_gpt(torch_gpt):
    """The torch GPT holding a shardax GPT's weights computes its logits and loss (fp32);
    its parameter counts are gpt.param_count's, its init the same stds."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from shardax.models import gpt

    cfg = gpt.GPTConfig(layers=2, d_model=32, heads=4, max_seq_len=16)
    model = gpt.make_gpt(cfg, seed=0)
    tokens = np.random.default_rng(0).integers(0, 256, (3, 17)).astype(np.int32)
    with jax.default_matmul_precision("highest"):
        logits = model(jnp.asarray(tokens[:, :-1])).astype(jnp.float32)
        want = float(optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.asarray(tokens[:, 1:])).mean())  # fmt: skip
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    got = torch_gpt.loss_from_shardax_params(params, tokens, cfg)
    assert got == pytest.approx(want, rel=1e-5), (got, want)  # measured: 8e-8
    # The logits, tighter: tanh vs exact gelu moves the loss only 3e-6 (relative), the
    # logits 4e-4; RMSNorm's epsilon 1e-5 for 1e-6 moves them 4e-5 (measured: 1.4e-6).
    torch_logits = torch_gpt.logits_from_shardax_params(params, tokens[:, :-1], cfg)
    np.testing.assert_allclose(torch_logits, np.asarray(logits), rtol=0, atol=1e-5)
    # the config as a dict and the batch as one, as benchmarks/gpu/session.py passes them
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    assert torch_gpt.loss_from_shardax_params(params, batch, dataclasses.asdict(cfg)) == got

    torch_model = torch_gpt.GPT(torch_gpt._config(cfg))
    counts = torch_gpt.param_counts(torch_model)
    assert counts == (gpt.param_count(model), gpt.param_count(model, embeddings=False))
    loaded = torch_gpt._shardax_model(params, cfg)
    for (name, fresh), (_, theirs) in zip(torch_model.named_parameters(),
                                          loaded.named_parameters(), strict=True):  # fmt: skip
        if name.endswith("scale"):
            assert torch.equal(fresh, theirs), name  # ones
        else:
            assert float(fresh.detach().std()) == pytest.approx(
                float(theirs.detach().std()), rel=0.15
            ), name

    # a parameter left over or missing is refused, not ignored
    with pytest.raises(ValueError, match="not mirrored"):
        torch_gpt.loss_from_shardax_params({**params, "extra": np.zeros(2)}, tokens, cfg)
    with pytest.raises(ValueError, match="mirrors positions='rotary' only"):
        torch_gpt.loss_from_shardax_params(params, tokens, {**dataclasses.asdict(cfg),
                                                            "positions": "learned"})  # fmt: skip


def _check(out, compiled):
    assert out["framework"] == "torch" and out["platform"] == "cpu"
    assert out["config"]["compile"] is compiled and len(out["step_seconds"]) == 2
    assert out["seconds_per_step"] > 0 and out["tokens_per_s"] > 0
    assert out["params"] - out["non_embedding_params"] == 256 * out["config"]["d_model"]
    assert 5.0 < out["first_loss"] < 6.5 and np.isfinite(out["last_loss"])  # ~ln 256 = 5.55
    assert out["sdpa_backend"] != "unknown"


def test_torch_gpt_runs_on_cpu(torch_gpt):
    shape = dict(layers=1, d_model=32, heads=2, seq_len=16, batch=2)
    out = torch_gpt.run(**shape, steps=2, warmup=1, compile=False)
    _check(out, compiled=False)
    assert out["config"]["mode"] is None


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile (inductor) on the CPU needs a C++ compiler")  # fmt: skip
def test_torch_gpt_compiles_on_cpu(torch_gpt, capsys):
    out = torch_gpt.main(["--size", "tiny", "--layers", "1", "--steps", "2", "--warmup", "1",
                          "--json"])  # fmt: skip
    _check(out, compiled=True)
    assert out["config"]["mode"] == "default" and out["compile_seconds"] > 0
    assert '"framework": "torch"' in capsys.readouterr().out
