"""`shardax train --model gpt` refuses option combinations that would otherwise run
something other than what was asked (refused before anything compiles)."""

from shardax.cli.main import main as cli

TINY = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "4",
        "--seq-len", "32", "--batch-size", "8", "--steps", "1"]  # fmt: skip


def test_attention_scheme_without_a_context_axis(capsys):
    assert cli(["train", *TINY, "--attention", "ring"]) == 2
    err = capsys.readouterr().err
    assert "--attention ring" in err and "--mesh data=8 has none" in err


def test_context_axis_needs_mode_jit(capsys):
    for mode in ("shard_map", "pmap"):
        assert cli(["train", *TINY, "--mesh", "data=2,context=4", "--mode", mode]) == 2
        err = capsys.readouterr().err
        assert "under --mode jit only" in err and f"got --mode {mode}" in err, err


def test_expert_axis_needs_experts(capsys):
    assert cli(["train", *TINY, "--mesh", "data=2,expert=4"]) == 2
    err = capsys.readouterr().err
    assert "'expert' axis of size 4" in err and "--experts is not given" in err


def test_experts_must_divide_over_the_expert_axis(capsys):
    assert cli(["train", *TINY, "--mesh", "data=4,expert=2", "--experts", "3"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "shardax train: error: --experts 3 is not divisible by the size 2 of the 'expert' "
        "axis of --mesh data=4,expert=2, which splits the experts evenly over its devices; "
        "use a multiple of 2 (e.g. 4), or change expert= in --mesh\n"
    ), err
