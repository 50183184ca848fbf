"""The GPU session script's CPU path (benchmarks/gpu/): every piece it runs on a lent GPU,
run here on the 8 simulated devices at the tiny shape, and the record it writes."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).parents[1] / "benchmarks" / "gpu"


@pytest.fixture(scope="module")
def gpu_modules():
    sys.path.insert(0, str(GPU))
    try:
        import jax_gpt
        import session

        from shardax.cost import calibrate

        yield calibrate, jax_gpt, session
    finally:
        sys.path.remove(str(GPU))


def test_shardax_and_hand_written_steps_train_the_same_model(gpu_modules):
    _, jax_gpt, session = gpu_modules
    base = session.base_config("tiny", 8)
    assert (base.layers, base.d_model, base.batch) == (2, 64, 16)
    ours = jax_gpt.run(base, steps=2, warmup=1, hlo=True)
    hand = jax_gpt.run(dataclasses.replace(base, impl="jit"), steps=2, warmup=1)
    # One fixed batch, the same initial weights: the same first loss (bf16 compute).
    assert ours["first_loss"] == pytest.approx(hand["first_loss"], rel=1e-2)
    assert ours["last_loss"] < ours["first_loss"] and hand["last_loss"] < hand["first_loss"]
    assert ours["plan"] == "fsdp" and ours["devices"] == 8 and ours["compiler_options"] == {}
    assert ours["attention_kernel"] == "dense" and "ENTRY" in ours["hlo_text"]
    n = ours["non_embedding_params"]
    per_token = 6 * n + 6 * base.layers * base.seq_len * base.d_model  # causal-halved
    assert ours["model_flops_per_step"] == per_token * base.tokens
    assert ours["executed_flops_per_step"] > ours["model_flops_per_step"]
    assert len(ours["step_seconds"]) == 2 and ours["mfu"] == "n/a"  # no peak on a CPU


def test_stage4_model_runs_its_mlp_in_float32_and_is_restored(gpu_modules):
    """The "before" row of the sweep: the GPT's MLP and head as stage 4 had them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shardax.models import gpt

    _, jax_gpt, _ = gpu_modules
    model = gpt.make_gpt(gpt.GPTConfig(layers=1, d_model=32, heads=2, max_seq_len=8))
    graphdef, state = nnx.split(model)
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)

    def dots(version):
        with jax_gpt.model_version(version):
            jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(
                bf16, jnp.zeros((1, 8), jnp.int32)
            )
        return [
            str(e.outvars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"
        ]

    assert "float32" in dots("stage4")
    # Today every projection runs in the compute dtype (attention's scores aside).
    assert dots("current").count("float32") <= 1
    with pytest.raises(ValueError, match="model must be"), jax_gpt.model_version("v3"):
        pass


def test_calibration_tables_and_ceilings(gpu_modules):
    calibrate, _, _ = gpu_modules
    tables = calibrate.tables(quick=True)
    for name in ("gemm", "gemm_f32", "stream", "reduce", "attention", "launch"):
        assert isinstance(tables[name], list) and tables[name], (name, tables[name])
    assert all(r["tflops"] > 0 for r in tables["gemm"] + tables["gemm_f32"])
    assert {r["dtype"] for r in tables["gemm_f32"]} == {"f32"}
    assert all(r["gbs"] > 0 for r in tables["reduce"])
    assert {r["pass"] for r in tables["attention"]} == {"fwd", "fwd+bwd"}
    ceilings = calibrate.summary(tables)
    assert ceilings["matmul_tflops"] == max(r["tflops"] for r in tables["gemm"])
    assert ceilings["bandwidth_gbs"] > 0
    assert calibrate.summary({"gemm": {"error": "x"}})["matmul_tflops"] is None


def test_session_assembles_ratios_and_markdown(gpu_modules, tmp_path):
    _, _, session = gpu_modules
    # 8192 tokens in 0.2 s at 0.3 MFU: 296.7 TFLOP/s of a 989 TFLOP/s peak
    step = {"seconds_per_step": 0.2, "tokens_per_s": 40_960.0, "mfu": 0.3, "first_loss": 5.6,
            "last_loss": 5.2, "compile_seconds": 10.0, "model_flops_per_step": 5.934e13,
            "model_tflops_per_s_per_device": 296.7,
            "config": {"batch": 4, "seq_len": 2048}}  # fmt: skip
    (tmp_path / "core.json").write_text(json.dumps({
        "device": "NVIDIA H200", "jax": "0.11.2", "shardax": step,
        "jit": {**step, "seconds_per_step": 0.198}}))  # fmt: skip
    torch = {"seconds_per_step": 0.16, "tokens_per_s": 51_200.0}
    (tmp_path / "torch.json").write_text(json.dumps({"torch": "2.11.0", "run": torch}))
    (tmp_path / "sweep.json").write_text(json.dumps([
        {"name": "dense", "label": "x", **step, "tokens_per_s": 30_000.0},
        {"name": "32k", "label": "y", "error": "RESOURCE_EXHAUSTED: out of memory"},
        {"name": "fp8", "label": "z", **step, "tokens_per_s": 49_152.0, "last_loss": 5.205,
         "predicted_over_measured": 0.9,
         "prediction": {"step_ms": 150.0, "low_ms": 140.0, "high_ms": 190.0, "made": "2026-12-02",
                        "jax": "0.12.0", "calibration": "calibrated: H200", "fp8": "datasheet",
                        "classes_ms": {"gemm": 60.0, "elementwise": 30.0}},
         "profile": {"sum_over_step": 0.97, "classes": {"gemm": {"ms_per_step": 70.0},
                                                        "elementwise": {"ms_per_step": 35.0}}}},
    ]))  # fmt: skip
    s = session.assemble(tmp_path, [{"stage": "core", "status": "ok", "seconds": 1.0}])
    assert s["ratios"]["shardax_over_jit_step_time"] == pytest.approx(0.2 / 0.198)
    assert s["ratios"]["shardax_over_torch_tokens_per_s"] == pytest.approx(0.8)
    assert s["torch"]["run"]["mfu"] == pytest.approx(0.375)  # same FLOPs per token, 1.25x
    assert s["sweep"][0]["tokens_per_s_vs_default"] == pytest.approx(30_000 / 40_960)
    text = session.markdown(s)
    assert "| shardax (default) | 200.0 | 40,960 | 30.0% |" in text
    assert "| torch.compile | 160.0 | 51,200 | 37.5% |" in text
    assert "torch.compile" in text and "RESOURCE_EXHAUSTED" in text
    assert s["ratios"]["fp8 over bf16 tokens_per_s"] == pytest.approx(1.2)
    assert s["ratios"]["fp8_loss_minus_bf16"] == pytest.approx(0.005)
    assert "| 150.0 (140.0–190.0), 0.900 |" in text
    assert "fp8 GEMMs priced by the datasheet rate" in text
    assert "| gemm | 60.00 | 70.00 |" in text and "| elementwise | 30.00 | 35.00 |" in text


def test_sweep_changes_one_thing_at_a_time(gpu_modules):
    _, _, session = gpu_modules
    base = session.base_config("1b", 1)
    assert (base.layers, base.d_model, base.heads, base.seq_len, base.batch) == (
        24,
        2048,
        16,
        2048,
        4,
    )
    for name, config in session.sweep_configs(base):
        changed = {f.name for f in dataclasses.fields(base)
                   if getattr(base, f.name) != getattr(config, f.name)}  # fmt: skip
        assert 1 <= len(changed) <= 2, (name, changed)
    tokens = {c.tokens for _, c in session.sweep_configs(base)}
    assert {8192, 16384, 32768} <= tokens | {base.tokens}


def test_the_sweep_keeps_each_step_program_as_it_ran(gpu_modules, tmp_path):
    import gzip

    _, _, session = gpu_modules
    assert "--xla_dump_to=" in session.dump_flags(tmp_path)
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_run.cpu_after_optimizations.txt").write_text("HloModule jit_run" * 99)
    (dump / "module_0002.jit_whole.cpu_after_optimizations.txt").write_text("HloModule jit_whole")
    assert session.keep_program(tmp_path, "16k tokens per device") == "16k-tokens-per-device.hlo.gz"
    with gzip.open(tmp_path / "hlo" / "16k-tokens-per-device.hlo.gz", "rt") as f:
        assert f.read() == "HloModule jit_whole"  # the step, not the larger other program
    assert not dump.exists() and session.keep_program(tmp_path, "none") is None


def test_issue_55_rows_are_predicted_before_they_are_measured(gpu_modules):
    """Each row of issue 55 changes what it names, and has its prediction written down
    (predict.py, sx.estimate on a compile-only card) for both cards before a session."""
    _, _, session = gpu_modules
    base = session.base_config("1b", 1)
    rows = dict(session.predicted_configs(base))
    assert rows["fp8"] == dataclasses.replace(base, precision="fp8")
    wide = rows["d 4096 x 8 layers, bf16"]
    assert (wide.layers, wide.d_model, wide.heads, wide.precision) == (8, 4096, 32, "bf16")
    assert rows["d 4096 x 8 layers, fp8"] == dataclasses.replace(wide, precision="fp8")
    zero = rows["ZeRO-1, compute-dtype gather (gather forward)"]
    assert (zero.plan, zero.zero_gather) == ("zero1", "forward")
    assert rows["bf16 residual stream"].residual == "bf16"
    assert rows["fused norm and GELU (elementwise recompute)"].elementwise == "recompute"
    for card in ("H200", "H100"):
        for name in ["default (shardax)", *rows]:
            said = session.prediction(card, name, "1b")
            assert said is not None and said["step_ms"] > 0, (card, name)
            assert said["low_ms"] <= said["step_ms"] <= said["high_ms"] and said["made"]
            assert said["config"] == dataclasses.asdict(rows.get(name, base)), (card, name)
            assert said["classes_ms"]["gemm"] > 0
            assert (said["fp8"] == "datasheet") == (rows.get(name, base).precision == "fp8")
    assert session.prediction("H200", "fp8", "tiny") is None  # another size's: none


def test_every_new_option_runs_and_is_profiled_into_op_classes(gpu_modules, tmp_path):
    """The tiny GPT under fp8, the bf16 residual, the recomputing norm and GELU and ZeRO-1
    gathering in bf16, all at once: one step, then the sweep's profile of three more."""
    _, jax_gpt, session = gpu_modules
    config = dataclasses.replace(session.base_config("tiny", 8), precision="fp8",
                                 residual="bf16", elementwise="recompute", plan="zero1",
                                 zero_gather="forward")  # fmt: skip
    assert "precision fp8" in config.label() and "plan zero1" in config.label()
    out = jax_gpt.run(config, steps=1, warmup=0, hlo=True)
    assert out["plan"] == "zero1 (gather forward)" and out["last_loss"] > 0
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_whole.cpu_after_optimizations.txt").write_text(out["hlo_text"])
    table = session.profile_row(tmp_path, out["_run"], {"name": "all", **out}, config, {})
    assert "error" not in table, table
    assert table["classes"]["gemm"]["ms_per_step"] > 0
    with pytest.raises(ValueError, match="the hand-written step is bf16"):
        jax_gpt.build_jit(config)
