"""``shardax plan --measure``: candidates compiled for the built-in MLP, in process."""

import json

from shardax.cli.main import main as cli
from shardax.cli.plan_measure import gpt_config

PNG = b"\x89PNG\r\n\x1a\n"


def test_plan_measure_with_a_model_axis(tmp_path, capsys):
    argv = ["plan", "--measure", "--hidden", "128", "--layers", "2", "--batch", "64"]
    argv += ["--mesh", "data=4,model=2", "--device-memory", "0.0006", "--json"]
    assert cli([*argv, "--run-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in out["candidates"]}
    assert list(rows) == ["replicate", "zero1", "zero2", "fsdp", "fsdp+tp"]
    assert out["mesh"] == {"data": 4, "model": 2}
    batch_slice = 64 // 4 * (64 * 4 + 4)  # x float32 (64 features) and y int32 rows
    for name, r in rows.items():
        f = r["formula"]["params_and_optimizer_bytes"]
        # Arguments hold the state and this device's slice of the batch; leaves below
        # fsdp's min_size (biases) stay whole, so sharded plans of
        # this tiny model hold more than the ideal split.
        assert 0.99 * f <= r["argument_bytes"] - batch_slice <= 1.3 * f, name
    replicated = rows["replicate"]
    assert (
        replicated["argument_bytes"] - batch_slice
        <= 1.01 * replicated["formula"]["params_and_optimizer_bytes"]
    )
    assert rows["fsdp+tp"]["formula"]["strategy"] == "FSDP×TP"
    assert rows["zero1"]["formula"]["strategy"] == "ZeRO-1"
    budget = 0.0006 * 1024**3
    assert out["device_memory_bytes"] == budget
    assert rows["replicate"]["fits"] is (rows["replicate"]["total_bytes"] <= budget)
    picked = rows[out["pick"]]
    assert picked["fits"] and out["reason"].startswith("least communication")
    fitting = [r for r in rows.values() if r["fits"]]
    assert picked["collective_bytes"] == min(r["collective_bytes"] for r in fitting)
    assert (tmp_path / "plan.png").read_bytes().startswith(PNG)
    assert json.loads((tmp_path / "plan.json").read_text())["pick"] == out["pick"]


def test_gpt_of_a_given_size():
    for n in (1e6, 1e8, 7e9):
        cfg = gpt_config(n, 128)
        blocks = 12 * cfg.layers * cfg.d_model**2
        assert cfg.d_model % 64 == 0 and cfg.heads * 64 == cfg.d_model
        assert 0.5 * n <= blocks <= 1.5 * n, (n, cfg)


def test_plan_measure_gpt(tmp_path, capsys):
    argv = ["plan", "--measure", "--model", "gpt", "--layers", "1", "--d-model", "64"]
    argv += ["--heads", "2", "--seq-len", "16", "--batch", "8", "--plans", "replicate,zero1"]
    argv += ["--json"]
    assert cli([*argv, "--run-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].startswith("gpt 1 x 64")
    rows = {r["name"]: r for r in out["candidates"]}
    assert list(rows) == ["replicate", "zero1"]
    replicated = rows["replicate"]
    formula = replicated["formula"]["params_and_optimizer_bytes"]
    assert formula == 3 * 4 * out["params"]  # params + Adam's two moments, fp32
    assert formula <= replicated["argument_bytes"] <= formula + 8 * 16 * 4  # + the batch
    assert rows["zero1"]["argument_bytes"] < 0.5 * replicated["argument_bytes"]


def test_plan_measure_gpt_with_a_stage_axis(tmp_path, capsys):
    """data=2 × stage=4: the GPT runs sx.pipeline under every candidate; the pipeline
    candidate splits its blocks over "stage", so it holds the least."""
    argv = ["plan", "--measure", "--model", "gpt", "--layers", "4", "--d-model", "32"]
    argv += ["--heads", "2", "--seq-len", "8", "--batch", "8", "--mesh", "data=2,stage=4"]
    argv += ["--plans", "replicate,pipeline", "--json"]
    assert cli([*argv, "--run-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].endswith("sx.pipeline in 4 microbatches")
    rows = {r["name"]: r for r in out["candidates"]}
    assert list(rows) == ["replicate", "pipeline"]
    pipe, rep = rows["pipeline"], rows["replicate"]
    assert pipe["formula"]["strategy"] == "DP×PP" and rep["formula"]["strategy"] == "DP"
    assert (
        pipe["formula"]["params_and_optimizer_bytes"]
        == rep["formula"]["params_and_optimizer_bytes"] / 4
    )
    # The blocks split 4 ways; the embedding, head and final norm stay whole (the formula
    # splits everything), so the compiled figure sits between a quarter and the whole.
    assert pipe["formula"]["params_and_optimizer_bytes"] < pipe["argument_bytes"]
    assert pipe["argument_bytes"] < 0.6 * rep["argument_bytes"]
    # Both run the same schedule: 2 × (M + S - 1) collective-permutes of activations.
    assert pipe["collectives"]["collective-permute"] == rep["collectives"]["collective-permute"]
    assert pipe["collectives"]["collective-permute"] == 2 * (4 + 4 - 1)
    assert pipe["collective_bytes"] < rep["collective_bytes"]
    assert "'stage' (4) splits the state in pipeline only" in out["reason"]
    assert (tmp_path / "plan.png").read_bytes().startswith(PNG)
    usage = ["plan", "--measure", "--model", "gpt", "--mesh", "data=8", "--microbatches", "4"]
    assert cli(usage) == 2
    assert "--microbatches 4 pipelines the GPT's blocks over a 'stage' axis" in (
        capsys.readouterr().err
    )
