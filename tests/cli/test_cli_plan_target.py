"""``shardax plan --target``: the built-in GPT compiled for a compile-only cluster, in
process; its bad input as one-line usage errors."""

import contextlib
import io
import json
import re

import jax.numpy as jnp
import pytest

import shardax as sx
from shardax.cli.main import main as cli
from shardax.cost.memory import estimate as formula

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--vocab", "256",
        "--batch", "8"]  # fmt: skip


def run(argv, capsys=None):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli(["plan", *argv])
    return code, printed.getvalue()


@pytest.fixture(scope="module")
def auto_2x4():
    """``--plan auto`` on 2 hosts × 4 H100s (JSON) among HSDP and pipeline over the two
    hosts, remat full, at 1 and 2 microbatches: two GPU compiles (hsdp at 1 microbatch
    fits with headroom, so 2 is not compiled; the others are left out for time)."""
    argv = ["--target", "2x4xH100", *TINY, "--layers", "2", "--batch", "16"]
    code, out = run([*argv, "--plans", "hsdp,pipeline", "--remat", "full", "--json"])
    assert code == 0, out[-3000:]
    return json.loads(out)


@pytest.mark.compile_only("gpu")
def test_auto_for_a_target_ranks_with_reasons_and_picks_a_plan_that_fits(auto_2x4):
    r = auto_2x4
    assert r["device_kind"] == "NVIDIA H100 80GB HBM3" and r["hosts"] == 2
    names = [c["name"] for c in r["auto"]["candidates"]]
    assert names == ["hsdp·full·mb1", "hsdp·full·mb2", "pipeline·full"]
    reasons = r["auto"]["reasons"]
    assert set(reasons) == set(names) and reasons[r["plan"]] == "picked"
    assert reasons["hsdp·full·mb2"] == (
        "not compiled: hsdp·full·mb1 fits; more microbatches only add work"
    )
    assert r["auto"]["compiles"] == 2
    compiled = [c for c in r["auto"]["candidates"] if not c["skipped"]]
    assert all(
        reasons[c["name"]].startswith(("predicted", "does not fit", "picked")) for c in compiled
    )
    assert "fastest predicted step" in r["auto"]["reason"]
    assert "pipeline: mesh stage=2,data=4, sx.pipeline in 4 microbatches" in r["auto"]["reason"]
    picked = next(c for c in compiled if c["name"] == r["plan"])
    assert picked["predicted_s"] == min(c["predicted_s"] for c in compiled)
    e = r["estimate"]
    assert e["fits_with_headroom"] and e["prediction"]["mfu"] > 0
    flags = {"hsdp·full·mb1": "--mesh replica=2,data=4 --plan fsdp --remat full",
             "pipeline·full": "--mesh stage=2,data=4 --plan pipeline --microbatches 4 "
                              "--remat full"}  # fmt: skip
    assert r["mesh_flags"] == flags[r["plan"]] and r["remat"] == "full"
    assert r["launch"].startswith("srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 ")
    assert r["launch"].endswith(r["mesh_flags"])


@pytest.mark.compile_only("gpu")
def test_auto_ranks_remat_and_microbatches_and_picks_one_that_fits():
    """8 H100s, a budget of 1.0 MB per device: no remat at 1 microbatch does not fit, at
    2 it does; dots_no_batch at 1 fits with headroom, so full is not compiled. Three
    compiles; the pick is the fastest predicted of those with headroom, and its flags
    carry its remat and microbatches. (The peaks depend on the step's compiler options,
    "auto": 1.03 MB, 0.43 MB and 0.79 MB with the combine thresholds sized per state.)"""
    budget = 1.0e6
    argv = ["--target", "8xH100", *TINY, "--batch", "32", "--plans", "fsdp"]
    code, out = run([*argv, "--device-memory", str(budget / 2**30), "--json"])
    assert code == 0, out[-3000:]
    r = json.loads(out)
    by = {c["name"]: c for c in r["auto"]["candidates"]}
    assert list(by) == [f"fsdp·{m}·mb{k}" for m in ("none", "dots_no_batch", "full")
                        for k in (1, 2, 4)]  # fmt: skip
    compiled = [n for n, c in by.items() if not c["skipped"]]
    assert compiled == ["fsdp·none·mb1", "fsdp·none·mb2", "fsdp·dots_no_batch·mb1"]
    assert r["auto"]["compiles"] == 3
    # The pick's own fit is judged in the same budget as the ranking's.
    e = r["estimate"]
    assert e["memory_budget"] == pytest.approx(budget)
    assert e["budget_note"] == f"--device-memory {budget / 2**30:g}"
    assert by["fsdp·none·mb1"]["fits"] is False and by["fsdp·none·mb1"]["total_bytes"] > budget
    assert by["fsdp·none·mb2"]["temp_bytes"] < by["fsdp·none·mb1"]["temp_bytes"]
    assert by["fsdp·none·mb2"]["accumulate"] == 2
    reasons = r["auto"]["reasons"]
    assert reasons["fsdp·full·mb1"].startswith("not compiled: fsdp·dots_no_batch·mb1 fits")
    roomy = [n for n in compiled if by[n]["total_bytes"] <= 0.9 * budget]
    pick = min(roomy, key=lambda n: by[n]["predicted_s"])
    assert r["plan"] == pick and reasons[pick] == "picked"
    c = by[pick]
    flags = "--mesh data=8 --plan fsdp" + (f" --accumulate {c['accumulate']}"
                                            if c["accumulate"] > 1 else "")  # fmt: skip
    assert r["mesh_flags"] == f"{flags} --remat {c['variant']}"
    assert r["accumulate"] == c["accumulate"] and r["remat"] == c["variant"]
    assert r["launch"].endswith(r["mesh_flags"])


@pytest.mark.compile_only("gpu")
def test_hsdp_on_a_target_matches_the_formula_and_crosses_hosts_once(tmp_path):
    """bf16 params and Adam moments (6 bytes per parameter), FSDP within a host: params +
    optimizer state per device within 10% of sx.cost's formula, the shards gathered
    within the host and the gradients reduced across the hosts; a PNG of the memory."""
    png = tmp_path / "memory.png"
    argv = ["--target", "2x4xH100", *TINY, "--plan", "hsdp", "--param-dtype", "bf16"]
    code, out = run([*argv, "--json", "--png", str(png)])
    assert code == 0, out[-3000:]
    r = json.loads(out)
    assert r["plan"] == "hsdp"
    assert r["mesh_flags"] == "--mesh replica=2,data=4 --plan fsdp --remat full"
    e = r["estimate"]
    got = e["memory"]["params"] + e["memory"]["optimizer"]
    pure_bf16 = sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    f = formula(r["params"], pure_bf16, data=4, zero=3)
    assert got == pytest.approx(f.params_bytes + f.optimizer_bytes, rel=0.1)
    ops = {(c["op"], c["link"]) for c in e["collectives"]}
    assert ("all-gather", "intra-host") in ops and ("all-reduce", "inter-host") in ops
    assert not any(op == "all-gather" and link == "inter-host" for op, link in ops)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.compile_only("gpu")
def test_plan_target_prints_the_table_flags_and_launch():
    argv = ["--target", "8xH100", *TINY, "--plan", "fsdp", "--memory-fraction", "0.9"]
    code, out = run(argv)
    assert code == 0, out[-3000:]
    # the headline only: the step in ms with its interval, MFU, the peak against the budget
    (line,) = [ln for ln in out.splitlines() if ln.startswith("PREDICTED (not measured) step")]
    assert re.search(r": [\d.]+ \([\d.]+-[\d.]+\) ms, [\d,]+ tokens/s, MFU [\d.]+%; peak ", line)
    assert "of the memory budget free" in line and "0.000" not in out
    assert "HBM 79.65 GiB" not in " ".join(out.split())  # the whole estimate: --roofline
    assert "mesh flags: --mesh data=8 --plan fsdp" in out
    assert "launch: shardax train --model gpt --layers 1" in out  # one host: no srun
    code, out = run([*argv, "--roofline"])
    text = " ".join(out.split())  # the table's title wraps
    assert code == 0 and "PREDICTED (not measured)" in out, out[-3000:]
    assert "HBM 79.65 GiB, budget 71.68 GiB (memory_fraction 0.9 of 81,559 MiB)" in text


@pytest.mark.compile_only("gpu")
def test_plan_target_defaults_the_batch_and_folds_the_pruned_candidates():
    """No --batch: 2 sequences per data shard, said; --plan auto's candidates not compiled
    are one line per reason, not a row each."""
    argv = ["--target", "8xH100", *TINY[:-2], "--plans", "fsdp,zero1", "--remat", "full"]
    code, out = run(argv)
    assert code == 0, out[-3000:]
    assert "--batch 16: the default, 2 sequences per data shard" in out
    folded = [ln for ln in out.splitlines() if ln.startswith("not compiled (")]
    assert folded and "candidates of fsdp, zero1 beside the one of each that fits" in out, out
    assert not [ln for ln in out.splitlines() if "│" in ln and "not compiled" in ln]


@pytest.mark.compile_only("gpu")
def test_a_mesh_larger_than_the_target_is_one_usage_line(capsys):
    code, _ = run(["--target", "8xH100", *TINY, "--mesh", "data=16"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "shardax plan: error: --mesh {'data': 16}:" in err and "8xH100" in err


def test_memory_fraction_is_a_share_for_a_gpu_target(capsys):
    """--memory-fraction out of (0, 1], or without --target: one usage line each."""
    for argv, says in (
        (["--target", "8xH100", "--memory-fraction", "1.5"],
         "argument --memory-fraction: expected a share in (0, 1] such as 0.9, got '1.5'"),
        (["--memory-fraction", "0.9", "--params", "1e9"],
         "--memory-fraction 0.9: only with --target"),
    ):  # fmt: skip
        try:
            code, _ = run(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.compile_only("tpu")
def test_memory_fraction_on_a_tpu_target_is_one_usage_line(capsys):
    code, _ = run(["--target", "v5e-8", *TINY, "--memory-fraction", "0.9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("shardax plan: error: --target v5e-8 --memory-fraction 0.9: sx.target: ")
    assert "for GPU targets" in err


def test_bad_targets_are_one_usage_line(capsys):
    """An unknown name (on leg 3), or JAX 0.10 / a missing extra (legs 1 and 2): one line
    naming the option, never a traceback."""
    code, _ = run(["--target", "8xH999", *TINY])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("shardax plan: error: --target 8xH999: ")


def _calibration_file(tmp_path, scale_stream=1.0, **changes):
    """The shipped H100 tables as a user's ``shardax calibrate`` file, changed."""
    from shardax.cost.calibration import TABLES

    data = json.loads((TABLES / "h100-2026-11-27.json").read_text())
    for table in ("stream", "reduce"):  # the memory-bound kernels' bandwidths
        data[table] = [{**r, "gbs": r["gbs"] * scale_stream} for r in data[table]]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**data, **changes}))
    return path


@pytest.mark.compile_only("gpu")
def test_a_calibration_file_prices_the_targets_step(tmp_path):
    """--calibration: the step is priced with the file's tables (stream and reduction
    bandwidths halved: the elementwise kernels take twice as long), named in the report;
    the shipped tables are back afterwards."""
    from shardax.cost.calibration import H100, calibration_for

    argv = ["--target", "8xH100", *TINY, "--plan", "fsdp", "--json"]
    slow = _calibration_file(tmp_path, scale_stream=0.5, date="2026-12-01")
    (c0, shipped), (c1, mine) = run(argv), run([*argv, "--calibration", str(slow)])
    assert c0 == c1 == 0, (shipped[-2000:], mine[-2000:])
    base, ours = (json.loads(out)["estimate"]["per_op"] for out in (shipped, mine))
    assert base["calibration"] == "calibrated: H100, JAX 0.11.2, 2026-11-27"
    assert ours["calibration"] == "calibrated: H100, JAX 0.11.2, 2026-12-01"
    seconds = [c["classes"]["elementwise"]["seconds"] for c in (base, ours)]
    assert seconds[0] > 0 and seconds[1] == pytest.approx(2 * seconds[0], rel=1e-9)
    assert ours["step_s"] > base["step_s"]
    assert calibration_for("NVIDIA H100 80GB HBM3") is H100


@pytest.mark.compile_only("gpu")
def test_a_calibration_of_another_kind_or_unreadable_is_one_usage_line(tmp_path, capsys):
    from shardax.cost.calibration import TABLES

    h200, none = TABLES / "h200-2026-11-27.json", tmp_path / "none.json"
    for path, says in (
        (h200, f"--calibration {h200}: measured on NVIDIA H200 (H200), and 8xH100's GPUs are "
               "NVIDIA H100 80GB HBM3: tables price their own kind's kernels only"),
        (none, f"--calibration {none}: no such file"),
    ):  # fmt: skip
        code, _ = run(["--target", "8xH100", *TINY, "--calibration", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and says in err, err


def test_a_calibration_without_a_target_is_one_usage_line(tmp_path, capsys):
    mine = _calibration_file(tmp_path)
    code, _ = run(["--params", "1e9", "--calibration", str(mine)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--calibration {mine}: only with --target" in err
