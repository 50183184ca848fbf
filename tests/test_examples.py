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


def test_examples_reject_bad_flags():
    with pytest.raises(SystemExit):
        load("seed_notebook_modes").parse_args(["--modes", "pjit"])


def test_cli_train_uses_the_train_step(capsys):
    import argparse

    from shardax.cli import train

    train.run(argparse.Namespace(epochs=2, batch_size=128, seed=0))
    out = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("epoch")]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "test accuracy" in out
