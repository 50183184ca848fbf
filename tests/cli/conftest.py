"""Fixtures shared by the CLI tests."""

import contextlib
import io
import json

import pytest

TINY_GPT = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len",
            "16", "--batch-size", "8"]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_gpt_run(tmp_path_factory):
    """One in-process ``shardax train --verify`` of a tiny GPT (6 steps, validation every
    3, scalars every step into a TensorBoard --log-dir), shared by the tests that check
    different things about it (test_cli: --verify's report; test_cli_track: the logged
    scalars): compiling the GPT's programs costs more than its steps. Returns what it
    printed, its summary.json and its run and log directories."""
    from shardax.cli.main import main as cli

    run = tmp_path_factory.mktemp("tiny_gpt")
    argv = [*TINY_GPT, "--steps", "6", "--eval-every", "3", "--verify", "--log-every", "1"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli(["train", *argv, "--run-dir", str(run), "--log-dir", str(run / "tb")])
    assert code == 0, printed.getvalue()[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    return printed.getvalue(), summary, run, run / "tb"
