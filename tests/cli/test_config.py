"""`shardax train --config FILE`, `key=value` overrides and `--print-config`: one schema
(the command's parser) for the file and the flags; the printed config is the same run."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from shardax.cli.main import main as cli

RUN = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16",
       "--batch-size", "8", "--steps", "2", "--eval-every", "2", "--plan", "fsdp",
       "--mesh", "data=4,model=2", "--seed", "3", "--log", "tensorboard"]  # fmt: skip


def printed_config(capfd, *argv):
    assert cli(["train", *argv, "--print-config"]) == 0
    return yaml.safe_load(capfd.readouterr().out)


def test_print_config_then_config_is_the_same_run(tmp_path, capfd):
    """The flags' run, then the file --print-config wrote for them: the same settings in
    both summaries (run_dir and log_dir given as overrides), the same losses bitwise."""
    flags = [*RUN, "--log-dir", str(tmp_path / "tb-a")]
    assert cli(["train", *flags, "--run-dir", str(tmp_path / "a")]) == 0
    capfd.readouterr()
    printed = printed_config(capfd, *RUN)
    assert printed["mesh"] == {"data": 4, "model": 2} and printed["log"] == ["tensorboard"]
    assert printed["steps"] == 2 and printed["plan"] == "fsdp" and "run_dir" not in printed
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(printed))
    argv = ["train", "--config", str(tmp_path / "run.yaml"), f"run_dir={tmp_path / 'b'}",
            f"log-dir={tmp_path / 'tb-b'}"]  # fmt: skip
    assert cli(argv) == 0
    capfd.readouterr()
    a, b = (json.loads(Path(tmp_path, d, "summary.json").read_text()) for d in "ab")
    for summary, d in ((a, "a"), (b, "b")):
        assert summary["config"].pop("run_dir") == str(tmp_path / d)
        assert summary["config"].pop("log_dir") == str(tmp_path / f"tb-{d}")
    assert a["config"] == b["config"] == printed
    assert a["mesh"] == b["mesh"] == {"data": 4, "model": 2} and b["plan"] == "fsdp"
    np.testing.assert_array_equal(
        [h["train_loss"] for h in a["history"]], [h["train_loss"] for h in b["history"]]
    )


def test_flags_override_key_values_which_override_the_file(tmp_path, capfd):
    (tmp_path / "run.json").write_text(json.dumps({"batch_size": 16, "seed": 5, "lr": 0.01}))
    (tmp_path / "run.toml").write_text("batch-size = 16\nverify = true\n")
    config = ["--config", str(tmp_path / "run.json")]
    out = printed_config(capfd, *config, "batch_size=32", "seed=6", "--batch-size", "64")
    assert (out["batch_size"], out["seed"], out["lr"]) == (64, 6, 0.01)
    out = printed_config(capfd, "--config", str(tmp_path / "run.toml"), "verify=off")
    assert out["batch_size"] == 16 and out["verify"] is False
    # a value with '=' (a mesh) stays the option's; the default model's own defaults filled in
    out = printed_config(capfd, "--mesh", "data=2,model=4", "--plan", "tp")
    assert out["mesh"] == {"data": 2, "model": 4} and out["epochs"] == 15


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz: 3\n", "unknown key 'stepz'; did you mean steps?"),
        ("batch_size: [1, 2]\n", "batch_size takes one value, got [1, 2]"),
        ("verify: 3\n", "verify is on or off: expected true or false, got 3"),
        ("- 1\n- 2\n", "expected a mapping of keys to values, got [1, 2]"),
        ("a: [\n", "not valid YAML"),
        ("batch_size: -4\n", "argument --batch-size: expected an integer >= 1, got -4"),
        ("model: gpt\nepochs: 2\n", "--epochs: only for --model mlp, got --model gpt"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    try:
        code = cli(["train", "--config", str(path), "--print-config"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
