"""``shardax train`` tracking: --log-dir, --log-every, --log, --profile-steps, data wait."""

import json

import pytest
from test_track import read_tensorboard

from shardax.cli.main import main as cli
from shardax.cli.train_gpt import WARMUP_STEPS

SMALL = ["--epochs", "2", "--hidden", "32", "--batch-size", "256"]  # 6 steps an epoch


def test_gpt_logs_tokens_per_s_the_schedules_learning_rate_and_val_loss(tiny_gpt_run):
    # a tiny GPT, 6 steps, --eval-every 3 --log-every 1 --log-dir (conftest.py; with --verify)
    _, summary, _, tb = tiny_gpt_run
    scalars = read_tensorboard(tb)
    assert [s for s, _ in scalars["train/loss"]] == [2, 3, 4, 5, 6]
    assert [s for s, _ in scalars["perf/tokens_per_s"]] == [2, 3, 4, 5, 6]
    assert [s for s, _ in scalars["val/loss"]] == [3, 6]
    assert [v for _, v in scalars["val/loss"]] == pytest.approx(
        [h["val_loss"] for h in summary["history"] if "val_loss" in h]
    )
    # linear warm-up over WARMUP_STEPS, then constant: the rate each update used, read
    # from the optax state (logged step k is the update that started at step k - 1)
    rates = [v for _, v in scalars["train/learning_rate"]]
    assert rates == pytest.approx([3e-3 * min(k, WARMUP_STEPS) / WARMUP_STEPS for k in range(1, 6)])
    assert all(v > 0 for _, v in scalars["train/grad_norm"])


def test_train_log_dir_writes_scalars_tensorboard_reads_and_a_trace(tmp_path, capsys):
    run, tb = tmp_path / "run", tmp_path / "tb"
    argv = [*SMALL, "--run-dir", str(run), "--log-dir", str(tb), "--log-every", "2"]
    assert cli(["train", *argv, "--profile-steps", "3:4"]) == 0
    out = capsys.readouterr().out
    scalars = read_tensorboard(tb)
    # every --log-every steps from step 2 (the first, compiling step starts the clock)
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6, 8, 10, 12]
    for tag in ("train/grad_norm", "train/param_norm", "train/learning_rate",
                "perf/examples_per_s", "perf/step_time_s", "perf/data_wait_fraction"):  # fmt: skip
        assert len(scalars[tag]) == 6, tag
    assert [v for _, v in scalars["train/learning_rate"]] == [pytest.approx(3e-3)] * 6
    assert all(0 <= v <= 1 for _, v in scalars["perf/data_wait_fraction"])
    assert [s for s, _ in scalars["test/loss"]] == [6, 12]  # after each epoch
    assert [s for s, _ in scalars["test/accuracy"]] == [6, 12]
    # the goodput ledger's figures with each evaluation's (compile seconds included)
    assert [s for s, _ in scalars["goodput/fraction"]] == [6, 12]
    assert all(0 < v < 1 for _, v in scalars["goodput/fraction"])
    assert all(v > 0 for _, v in scalars["goodput/compile_s"])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "train/loss" in x] == [2, 4, 6, 8, 10, 12]
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["data_wait_fraction"] <= 1
    assert summary["log_dir"] == str(tb)
    trace = summary["profile_trace"]
    assert trace.startswith(str(tb / "profile" / "process_0" / "plugins" / "profile"))
    # on one line whatever its length: a path the terminal's width broke could not be copied
    assert any(line.startswith(f"profiler trace: {trace} (") for line in out.splitlines())
    assert "waiting for input" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile-steps", "5:3"], "argument --profile-steps: expected A:B with 1 <= A <= B"),
        (["--profile-steps", "0:3"], "argument --profile-steps: expected A:B"),
        (["--profile-steps", "5:13"], "--profile-steps 5:13: this run has 12 steps"),
        (["--log-dir", "{file}/tb"], "--log-dir: log_dir '"),
        (["--log", "tensorboard"], "--log tensorboard needs --log-dir"),
        (["--log-every", "0"], "argument --log-every: expected an integer >= 1, got 0"),
    ],
)
def test_bad_tracking_options_are_one_line_usage_errors(argv, message, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.replace("{file}", str(blocker)) for a in argv]
    try:
        code = cli(["train", *SMALL, "--run-dir", str(tmp_path / "run"), *argv])
    except SystemExit as e:  # argparse errors
        code = e.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and captured.err.startswith("shardax")
    assert message in captured.err, captured.err
    assert "training an MLP" not in captured.out  # before training starts


def test_a_missing_backend_extra_is_named_in_one_line(tmp_path, capsys):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed")
    except ImportError:
        pass
    assert cli(["train", *SMALL, "--run-dir", str(tmp_path), "--log", "wandb"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "install it with: pip install 'shardax[wandb]'" in err


def test_each_process_writes_its_own_trace_into_one_directory(launched_train):
    # launch -n 2 --cpu-devices 2 -- shardax train (2 epochs of 6 steps) --profile-steps 2:3
    # --log-every 1, no --log-dir
    proc, run, _ = launched_train
    assert proc.returncode == 0, proc.stderr[-3000:]
    # without --log-dir the trace goes to the run directory, one per process
    for rank in (0, 1):
        assert list((run / "profile" / f"process_{rank}").glob("plugins/profile/*/*.xplane.pb"))
    # process 0 alone writes the scalars: one line per step after the first, then val
    lines = (run / "metrics.jsonl").read_text().splitlines()
    steps = [2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11, 12, 12]
    assert [json.loads(x)["step"] for x in lines] == steps
    assert not list(run.parent.glob("**/events.out.tfevents*"))  # no --log-dir, no TensorBoard
