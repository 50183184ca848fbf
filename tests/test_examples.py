"""The examples run at small size (imported, so they share this process's 8 devices)."""

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"example_{name}"] = module  # dataclasses (Linen modules) look it up
    spec.loader.exec_module(module)
    return module


def test_seed_notebook_modes_agree(capsys):
    losses = load("seed_notebook_modes").main(
        ["--batch-size", "64", "--hidden-dim", "32", "--n-layers", "2", "--steps", "3"]
    )
    assert set(losses) == {"single", "jit", "pmap", "shard_map"}
    assert losses["jit"][-1] < losses["jit"][0]
    out = capsys.readouterr().out
    assert "ms/step" in out and "shard_map: losses agree with single" in out


def test_equinox_autoparallel_matches_one_device(capsys):
    losses = load("equinox_autoparallel").main([])
    assert len(losses) == 10 and losses[-1] < losses[0]
    assert "matches one device" in capsys.readouterr().out


def test_nnx_data_parallel_learns(capsys):
    result = load("nnx_data_parallel").main(["--steps", "40"])
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert result["accuracy"] > 0.8
    assert "batch spec P('data',)" in capsys.readouterr().out


def test_multihost_train_in_one_process(capsys):
    """The many-hosts guide's script, in this process on its 8 devices (under ``shardax
    launch -n 2`` it is run by tests/test_docs.py, from the guide's own command)."""
    result = load("multihost_train").main(["--epochs", "2", "--rows", "1024"])
    assert (result["processes"], result["devices"], result["steps"]) == (1, 8, 8)
    assert result["last_loss"] < result["first_loss"]
    assert tuple(result["spec"]) == (None, "data")
    out = capsys.readouterr().out
    assert "1 process(es), 8 devices" in out and "up kernel spec P(None, 'data')" in out
    with pytest.raises(SystemExit):
        load("multihost_train").parse_args(["--batch-size", "0"])


def test_examples_reject_bad_flags():
    with pytest.raises(SystemExit):
        load("seed_notebook_modes").parse_args(["--modes", "pjit"])


def test_cli_train_uses_the_train_step(capsys, tmp_path):
    import json

    from shardax.cli import main

    assert main(["train", "--epochs", "2", "--json", "--run-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    losses = [h["train_loss"] for h in out["history"]]
    assert len(losses) == 2 and losses[1] < losses[0]
    # The state is a TrainState: parameters live under "params".
    assert set(out["param_specs"]) >= {"params/layers/0/kernel/value", "params/out/kernel/value"}
