"""The CLI: every command at a small size, usage errors, and the train job.

Subprocess tests run ``python -m shardax`` as a user would, where the process is what is
tested: ``--cpu-devices`` in a fresh process, a usage error's exit code and one line of
stderr, and (test_train_under_launch...) ``train --json``'s pure stdout. The rest call
``main`` in this process (8 CPU devices, as conftest sets) to keep the suite quick: each
subprocess imports JAX, flax and the command's libraries again. The in-process ``--json``
runs read stdout at the file-descriptor level (``capfd``), so output that native code
writes still breaks their JSON.
"""

import contextlib
import io
import json
import subprocess
import sys

import numpy as np
import pytest

import shardax as sx
from shardax.cli.main import COMMANDS, build_parser
from shardax.cli.main import main as cli

PNG = b"\x89PNG\r\n\x1a\n"


def run_cli(*args, timeout=180):
    proc = subprocess.run(
        [sys.executable, "-m", "shardax", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc


def json_of(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# --- every command in a subprocess -------------------------------------------------------


def test_info_subprocess_json():
    out = json_of(run_cli("info", "--cpu-devices", "4", "--mesh", "data=2,model=2", "--json"))
    assert out["num_devices"] == 4 and out["hardware_type"] == "cpu"
    assert [d["id"] for d in out["devices"]] == [0, 1, 2, 3]
    assert out["recommendation"]["critical_batch_size"] == 16
    h100 = next(r for r in out["batch_size_table"] if r["hardware"] == "h100")
    assert h100["critical_batch_size"] == 298
    assert h100["roofline_critical_batch"] == pytest.approx(989e12 / 3350e9)
    assert out["mesh"]["axes"] == {"data": 2, "model": 2}
    assert np.array(out["mesh"]["device_ids"]).shape == (2, 2)


def cli_json(capfd, *argv):
    """``main(argv)`` in this process: exit code 0 and stdout (fd 1) one JSON document."""
    assert cli(list(argv)) == 0
    return json.loads(capfd.readouterr().out)


def test_plan_json_seven_billion_on_eight_h100(capfd):
    out = cli_json(capfd, "plan", "--params", "7e9", "--devices", "8", "--hardware", "h100",
                   "--json")  # fmt: skip
    rows = {(r["strategy"], r["data"], r["model"]): r for r in out["strategies"]}
    assert rows["DP", 8, 1]["total_bytes"] == 16 * 7e9 and rows["DP", 8, 1]["fits"] is False
    assert rows["FSDP", 8, 1]["total_bytes"] == 2 * 7e9 and rows["FSDP", 8, 1]["fits"] is True
    assert rows["DP×TP", 4, 2]["global_critical_batch"] == pytest.approx(4 * 989e12 / 3350e9)
    pp = {(r["data"], r["stage"]): r for r in out["strategies"] if r["strategy"] == "DP×PP"}
    assert pp[2, 4]["total_bytes"] == 16 * 7e9 / 4 and pp[2, 4]["model"] == 1
    assert any("does not fit" in w for w in out["warnings"])


def test_train_default_reaches_95_percent(tmp_path, capfd):
    out = cli_json(capfd, "train", "--run-dir", str(tmp_path), "--json")
    assert out["devices"] == 8 and out["mesh"] == {"data": 8}
    assert out["test_accuracy"] >= 0.95
    assert len(out["history"]) == out["epochs"]
    assert json.loads((tmp_path / "summary.json").read_text()) == {k: v for k, v in out.items()}
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG


def test_bench_small(tmp_path, capfd):
    out = cli_json(
        capfd, "bench", "--layers", "2", "--hidden", "64", "--input-dim", "32",
        "--batch-size", "128", "--warmup", "1", "--repeats", "2", "--run-dir", str(tmp_path),
        "--json",
    )  # fmt: skip
    rows = {r["mode"]: r for r in out["results"]}
    assert list(rows) == ["single", "jit", "shard_map", "pmap"]
    assert rows["single"]["devices"] == 1 and rows["pmap"]["devices"] == 8  # all of them
    assert rows["single"]["speedup_vs_single"] == 1.0
    for r in rows.values():
        assert len(r["times_s"]) == 2 and r["median_s"] > 0
        # The same step from the same state: every mode computes the same loss.
        assert r["loss"] == pytest.approx(rows["single"]["loss"], rel=1e-5)
        # FLOPs of each mode's compiled step: the same work, MFU unknown on CPU.
        assert r["flops_per_step"] == pytest.approx(rows["single"]["flops_per_step"], rel=0.25)
        assert r["tflops_per_s_per_device"] > 0 and r["mfu"] == "n/a"
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG


def test_tune_batch_small(tmp_path, capfd):
    out = cli_json(
        capfd, "tune-batch", "--devices", "2", "--layers", "1", "--hidden", "32",
        "--input-dim", "16", "--batch-sizes", "8,2,32", "--warmup", "1", "--repeats", "2",
        "--run-dir", str(tmp_path), "--json",
    )  # fmt: skip
    assert [r["batch_size"] for r in out["results"]] == [2, 8, 32]
    assert [r["per_device"] for r in out["results"]] == [1, 4, 16]
    peak = max(r["examples_per_s"] for r in out["results"])
    knee = next(r for r in out["results"] if r["batch_size"] == out["knee_batch_size"])
    assert knee["examples_per_s"] >= 0.9 * peak
    assert all(
        r["examples_per_s"] < 0.9 * peak
        for r in out["results"]
        if r["batch_size"] < out["knee_batch_size"]
    )
    assert out["table_critical_batch_size"] == 16 and out["roofline_critical_batch"] is None
    assert (tmp_path / "tune.png").read_bytes()[:8] == PNG


def test_usage_error_subprocess_is_one_line_without_traceback():
    proc = run_cli("train", "--batch-size", "100")
    assert proc.returncode == 2
    assert proc.stderr == (
        "shardax train: error: --batch-size 100 is not divisible by the data axis size 8 of "
        "mesh {'data': 8}; pass a --batch-size that is a multiple of 8, or a --mesh whose data "
        "axis divides 100 (data=4,model=2, data=2,model=4, data=1,model=8)\n"
    )


# --- tables, help and usage errors, in process ------------------------------------------


def test_info_tables(capsys):
    assert cli(["info"]) == 0
    text = capsys.readouterr().out
    for phrase in ("8 devices", "hardware type: cpu", "B* = peak ÷ HBM", "295", "mesh data=8"):
        assert phrase in text


def test_plan_table_and_warnings(capsys):
    argv = ["plan", "--params", "7e9", "--devices", "8", "--hardware", "h100", "--batch", "1024"]
    assert cli(argv) == 0
    text = capsys.readouterr().out
    assert "DP (data=8, model=1) does not fit: 104.3 GiB" in text
    assert "FSDP×TP" in text and "= 16 bytes/param" in text
    assert "128 < B*" in text  # DP: 1024 / 8 per replica, below the H100's 295


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_is_clear(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert COMMANDS[command][1] in " ".join(text.split())
    assert ("--cpu-devices" in text) == (command != "goodput")  # goodput reads a file


def test_only_the_named_command_is_imported():
    """``shardax --help`` lists every command and imports none; ``shardax goodput`` imports
    goodput's module, not train's (cli/main.py's docstring)."""
    code = (
        "import sys\n"
        "from shardax.cli.main import COMMANDS, main\n"
        "for argv in (['--help'], ['goodput', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    print('LOADED', sorted(n for n, (m, _) in COMMANDS.items() if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    listing, rest = out.split("LOADED", 1)
    assert all(f"    {name} " in listing for name in COMMANDS), listing
    loaded = [line for line in out.splitlines() if line.startswith("LOADED")]
    assert loaded == ["LOADED []", "LOADED ['goodput']"], out
    assert "--png PATH" in rest  # goodput's own options were added


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--plan", "zero"], "argument --plan: invalid choice: 'zero'"),
        (["train", "--mesh", "data4"], "argument --mesh: expected AXIS=SIZE pairs"),
        (["train", "--epochs", "0"], "argument --epochs: expected an integer >= 1, got 0"),
        (["train", "--lr", "-1"], "argument --lr: expected a finite number > 0, got '-1'"),
        (
            ["train", "--mesh", "data=3,model=3"],
            "--mesh: Not enough devices: mesh requires 9 devices but only 8 available (mesh shape",
        ),
        (
            ["train", "--plan", "tp", "--mesh", "data=8"],
            "plan 'tp' needs a mesh with a 'model' axis",
        ),
        (["train", "--mode", "single", "--plan", "fsdp"], "--mode single runs on one device"),
        (
            ["train", "--accumulate", "3"],
            "--batch-size 128 is not divisible by the 8 data devices × --accumulate 3 = 24",
        ),
        (
            ["train", "--model", "gpt", "--accumulate", "3"],
            "--batch-size 16 is not divisible by the 8 data devices",
        ),
        (["train", "--mode", "pmap", "--plan", "fsdp"], "supports only a replicating plan"),
        (["train", "--resume"], "--resume needs --checkpoint-dir"),
        (["plan"], "--params is required (or --measure to compile the built-in model)"),
        (["plan", "--measure", "--params", "1e9", "--model", "mlp"], "--params builds a GPT"),
        (["plan", "--measure", "--batch", "12"], "--batch 12 is not divisible by the data axis"),
        (["plan", "--measure", "--plans", "zero3"], "--plans zero3: zero3 not among the"),
        (["plan", "--params", "seven"], "argument --params: expected a finite parameter count"),
        (["plan", "--params", "1e9", "--hardware", "h10"], "argument --hardware: invalid choice"),
        (["bench", "--modes", "jit,vmap"], "argument --modes: expected a comma-separated subset"),
        (["bench", "--batch-size", "12"], "--batch-size 12 is not divisible by the 8 devices"),
        (["tune-batch", "--batch-sizes", "8,x"], "argument --batch-sizes: expected comma-sep"),
        (["tune-batch", "--devices", "9"], "--devices 9 is more than the 8 devices at hand"),
        (["tune-batch", "--devices", "8", "--batch-sizes", "8,12"], "--batch-sizes [12] are not"),
        (
            ["info", "--mesh", "data=16"],
            "--mesh: Not enough devices: mesh requires 16 devices but only 8 available",
        ),
        (["launch-rockets"], "argument command: invalid choice: 'launch-rockets'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    try:
        code = cli(argv)
    except SystemExit as e:  # argparse errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("shardax")
    assert message in err
    assert "Traceback" not in err


# --- the train job, in process -----------------------------------------------------------


def train_json(capsys, *argv):
    assert cli(["train", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_train_tp_plan_places_megatron_specs(tmp_path, capsys):
    out = train_json(capsys, "--plan", "tp", "--epochs", "12", "--run-dir", str(tmp_path))
    assert out["mesh"] == {"data": 4, "model": 2}
    specs = out["param_specs"]
    assert specs["params/layers/0/kernel/value"] == "P(None, 'model')"
    assert specs["params/layers/0/bias/value"] == "P('model',)"
    assert specs["params/out/kernel/value"] == "P('model', None)"
    assert specs["params/out/bias/value"] == "P()"
    assert out["test_accuracy"] >= 0.95


@pytest.fixture(scope="module")
def one_epoch_runs(tmp_path_factory):
    """Two one-epoch runs of the default MLP, shared by the tests that check different
    things about them: ``--verify`` on the replicating plan (its printed output, and its
    summary.json), and ``--plan fsdp --json`` (its JSON)."""
    root = tmp_path_factory.mktemp("one_epoch")
    verified, fsdp = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(verified):
        code = cli(["train", "--verify", "--epochs", "1", "--run-dir", str(root / "r")])
    assert code == 0
    replicated = json.loads((root / "r" / "summary.json").read_text())
    with contextlib.redirect_stdout(fsdp):
        code = cli(["train", "--json", "--epochs", "1", "--plan", "fsdp",
                    "--run-dir", str(root / "f")])  # fmt: skip
    assert code == 0
    return {"verified": verified.getvalue(), "replicated": replicated,
            "fsdp": json.loads(fsdp.getvalue())}  # fmt: skip


def test_train_fsdp_shards_every_large_leaf(one_epoch_runs):
    specs = one_epoch_runs["fsdp"]["param_specs"]
    assert specs["params/layers/0/kernel/value"] == "P(None, 'data')"  # (64, 256): largest dim
    assert specs["params/out/kernel/value"] == "P('data', None)"  # (256, 10)
    assert specs["params/out/bias/value"] == "P()"  # 10 elements: replicated


def test_resume_continues_exactly_where_it_stopped(tmp_path, capsys):
    # The default MLP, whose programs on both plans one_epoch_runs has compiled.
    straight = train_json(capsys, "--epochs", "2", "--run-dir", str(tmp_path / "a"))
    ckpt = str(tmp_path / "ckpt")
    train_json(capsys, "--epochs", "1", "--checkpoint-dir", ckpt,
               "--run-dir", str(tmp_path / "b"))  # fmt: skip
    # Resume on another plan: the checkpoint is resharded onto FSDP shardings.
    resumed = train_json(capsys, "--epochs", "2", "--checkpoint-dir", ckpt, "--resume",
                         "--plan", "fsdp", "--run-dir", str(tmp_path / "c"))  # fmt: skip
    assert resumed["resumed_from_epoch"] == 1
    assert resumed["param_specs"]["params/layers/0/kernel/value"] == "P(None, 'data')"  # (64, 256)
    for a, b in zip(straight["history"], resumed["history"], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-6)
    assert cli(["train", "--checkpoint-dir", ckpt]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_nan_loss_stops_at_its_step_and_saves_nothing(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    argv = ["train", "--epochs", "2", "--lr", "1e30", "--checkpoint-dir", str(ckpt)]
    assert cli([*argv, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "loss is nan at step 2" in err and "no checkpoint was written" in err
    with sx.CheckpointManager(ckpt) as manager:
        assert manager.all_steps() == []


def test_train_under_launch_in_two_processes_matches_one_process(launched_train, tmp_path, capsys):
    proc, run, argv = launched_train  # launch -n 2 --cpu-devices 2 -- shardax train --json
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["processes"], summary["devices"]) == (2, 4)
    # stdout is pure JSON: process 0's result; gloo's lines and the tables go to stderr.
    assert json.loads(proc.stdout)["history"] == summary["history"]
    assert len(summary["history"]) == 2
    assert "[0] [Gloo]" in proc.stderr
    # Only process 0 shows progress and the result.
    assert "[0] training an MLP" in proc.stderr
    assert "[1] training" not in proc.stdout + proc.stderr
    # The same 4-device run in one process gives the same curve.
    single = train_json(capsys, *argv, "--mesh", "data=4", "--run-dir", str(tmp_path / "sp"))
    for a, b in zip(single["history"], summary["history"], strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-6)


def test_missing_optional_dependency_names_the_extra():
    from shardax.cli.common import require

    with pytest.raises(SystemExit, match=r"pip install 'shardax\[plot\]'"):
        require("matplotlib_that_is_not_installed", "plot", "bench")
    assert require("json", "demo", "train").dumps([1]) == "[1]"


def test_train_reports_state_memory_per_device(one_epoch_runs):
    replicated, sharded = one_epoch_runs["replicated"], one_epoch_runs["fsdp"]
    assert replicated["state_bytes"] == sharded["state_bytes"]
    assert replicated["state_bytes_per_device"] == replicated["state_bytes"]
    # FSDP over 8 devices: the two kernels (and their Adam moments) split 8 ways; the
    # biases (< 1024 elements) stay whole.
    assert sharded["state_bytes_per_device"] < replicated["state_bytes"] / 6


def test_train_verify_checks_the_first_batch_against_one_device_mlp(one_epoch_runs):
    # train --verify --epochs 1 (the default MLP); the run goes on to write its summary
    assert "sx.verify: ok" in one_epoch_runs["verified"]
    assert one_epoch_runs["replicated"]["epochs"] == 1  # summary.json was written


def test_train_verify_checks_the_first_batch_against_one_device_gpt(tiny_gpt_run):
    # train --verify on a tiny GPT (conftest.py), 6 steps: the run goes on to its summary
    printed, summary, run, _ = tiny_gpt_run
    assert "sx.verify: ok" in printed
    assert (run / "summary.json").exists() and summary["steps"] == 6
    # On CPU: fp32 by default, and the step compiled to dense attention, said and recorded.
    assert summary["precision"] == "fp32" and summary["attention_kernel"] == "dense"
    assert "attention kernel: dense (read from the compiled step)" in printed


def test_train_verify_too_tight_for_bf16_names_reduced_precision_and_exits_1(tmp_path, capsys):
    # bf16 against an fp32 tolerance: the report names reduced precision, exit 1.
    argv = ["--epochs", "1", "--hidden", "32", "--precision", "bf16", "--verify-rtol", "1e-7"]
    assert cli(["train", "--verify", *argv, "--run-dir", str(tmp_path / "run")]) == 1
    assert "reduced precision" in capsys.readouterr().out
    assert not (tmp_path / "run" / "summary.json").exists()


def test_train_records_the_compiler_options_and_their_environment(tiny_gpt_run):
    """summary.json says what the step compiled with ("auto": nothing on CPUs), and the
    environment the GPU settings need, as it was; shardax launch sets it for its processes."""
    from shardax.cli.launch import process_env

    printed, summary, _, _ = tiny_gpt_run
    assert "XLA compiler options: 'auto' (cpu: none)" in printed
    record = summary["compiler"]
    assert (record["setting"], record["options"]) == ("auto", {})
    assert record["summary"] == "'auto' (cpu: none)"
    assert set(record["environment"]) == {"CUDA_DEVICE_MAX_CONNECTIONS"}
    assert process_env(0, 1, 1234, base={})["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    kept = process_env(0, 1, 1234, base={"CUDA_DEVICE_MAX_CONNECTIONS": "4"})
    assert kept["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"
