"""The benchmarks' CPU paths, and the pieces they measure with (mfu, causal_ring, ring order)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def load(name):
    """``benchmarks/<name>.py`` as a module, importing its ``_common`` as the script does."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mfu_benchmark_runs_the_tiny_gpt_on_cpu(capsys):
    mfu = load("mfu")
    out = mfu.run(["--steps", "2", "--warmup", "1", "--layers", "1"])
    assert out["size"] == "tiny" and out["platform"] == "cpu" and out["devices"] == 8
    assert out["config"]["precision"] == "bf16" and out["config"]["plan"] == "fsdp"
    assert out["tokens_per_s_per_device"] > 0 and out["mfu"] == "n/a"
    # no fused kernel on the CPU: auto compiles to the dense path, read from the HLO
    assert out["config"]["kernel"] == "auto" and out["attention_kernel"] == "dense"
    assert out["compile_seconds"] > 0
    n, cfg = out["non_embedding_params"], out["config"]
    per_token = 6 * n + 6 * cfg["layers"] * cfg["seq_len"] * cfg["d_model"]
    assert out["model_flops_per_step"] == per_token * cfg["batch"] * cfg["seq_len"]
    # XLA counts the masked half of the attention, the optimizer and the rest, too.
    assert out["xla_flops_per_step"] > out["model_flops_per_step"]
    mfu.main(["--steps", "1", "--warmup", "1", "--layers", "1"])
    assert "tokens/s per device" in capsys.readouterr().out


def test_mfu_1b_config_is_about_a_billion_parameters():
    mfu = load("mfu")
    c = mfu.SIZES["1b"]
    assert 1.0e9 < 12 * c["layers"] * c["d_model"] ** 2 < 1.4e9
    assert c["d_model"] // c["heads"] == 128
    with pytest.raises(SystemExit):
        mfu.parser().parse_args(["--size", "7b"])


def test_causal_ring_work_per_device_is_even_under_zigzag():
    """The ring's own visibility rule: contiguous leaves device C-1 all the work;
    zig-zag gives each device (2C+1)/(4C) of the full attention."""
    ring = load("causal_ring")
    assert ring.work_per_device(4, 64, "contiguous") == [0.25, 0.5, 0.75, 1.0]
    assert ring.work_per_device(4, 64, "zigzag") == [9 / 16] * 4
    assert ring.work_per_device(8, 64, "zigzag") == [17 / 32] * 8


def test_ring_sends_each_block_before_computing_with_it():
    """benchmarks/context_parallel.py's schedule check on the causal ring's compiled HLO,
    where the block's compute sits in the branches of the skipping conds."""
    import jax
    import jax.numpy as jnp

    from shardax.parallel.context import attention

    lead = load("context_parallel").ring_permutes_lead
    mesh = jax.make_mesh((4,), ("context",), devices=jax.devices()[:4])
    z = jnp.zeros((1, 64, 2, 8))
    for layout in ("contiguous", "zigzag:4"):
        fwd = jax.jit(lambda q, k, v, layout=layout: attention(
            q, k, v, causal=True, impl="ring", layout=layout))  # fmt: skip
        with jax.set_mesh(mesh):
            ok, pairs = lead(fwd.lower(z, z, z).compile().as_text())
        assert ok and pairs, layout


def test_fp8_numerics_benchmark_trains_both_precisions_on_the_same_batches():
    out = load("fp8_numerics").run(
        load("fp8_numerics").parse_args(["--steps", "2", "--layers", "1", "--d-model", "32"])
    )
    bf16, fp8 = out["rows"]
    assert (bf16["precision"], fp8["precision"]) == ("bf16", "fp8")
    # the same init and batch: the first losses differ by fp8's rounding only
    assert abs(fp8["first_loss"] - bf16["first_loss"]) < 0.05
    assert out["val_gap"] == fp8["val_loss"] - bf16["val_loss"]


def test_residual_numerics_benchmark_runs_each_variant_on_the_same_batches():
    bench = load("residual_numerics")
    out = bench.run(
        bench.parse_args(["--steps", "1", "--layers", "1", "--d-model", "16", "--seq-len", "16"])
    )
    rows = out["rows"]
    assert [(r["residual"], r["elementwise"]) for r in rows] == list(bench.VARIANTS)
    # the same init and batch: the first losses differ by the residual's rounding only
    assert all(abs(r["first_loss"] - rows[0]["first_loss"]) < 0.01 for r in rows)
    assert (
        rows[0]["val_gap"] == 0.0
        and rows[1]["val_gap"] == rows[1]["val_loss"] - rows[0]["val_loss"]
    )
