"""``shardax plan --explain`` on the 8 CPU devices at hand (in process, as tests/cli's
in-process runs): the built-in GPT's step under zero1 explained with no unasked collective
(test_explain.py has fsdp+tp, the compile-only test fsdp), its JSON and its tables, and the
options it would ignore refused by name. The compile-only target's run is in
tests/compile/test_explain_targets.py."""

import json

import pytest

from shardax.cli import plan_explain
from shardax.cli.main import build_parser
from shardax.cli.main import main as cli

SMALL = ["--layers", "1", "--d-model", "64", "--heads", "2", "--seq-len", "32", "--vocab", "256"]


def test_plan_explain_on_the_devices_at_hand():
    argv = ["plan", "--explain", "--mesh", "data=8", "--plan", "zero1", "--batch", "16", *SMALL]
    result, report = plan_explain.explained(build_parser().parse_args(argv))
    out = json.loads(json.dumps(result))  # what --json prints
    assert out["target"] is None and out["devices"] == 8 and out["plan"] == "zero1"
    explained = out["explain"]
    assert explained["unasked"] == [] and explained["implied"]  # no false alarm
    assert explained["placement"]["meant"] == {"parameter": 1, "optimizer state": 8}
    kinds = {b["kind"] for b in explained["memory"]["buffers"]}
    assert kinds & {"parameter", "activation", "gradient", "temporary"}
    text = str(report)  # the tables the command prints
    for title in ("memory at the peak", "collectives the plan did not ask for: 0",
                  "placement against intent: plan zero1"):  # fmt: skip
        assert title in text, text


@pytest.mark.parametrize(("argv", "message"), [
    (["--plan", "auto"], "--plan auto: only with --target"),
    (["--png", "x.png"], "--png x.png: not with --explain"),
    (["--params", "1e9"], "--params 1e+09: not with --explain"),
    (["--memory-fraction", "0.9"], "--memory-fraction 0.9: only with --target"),
    (["--batch", "12"], "--batch 12 is not divisible by the data axes data = 8"),
])  # fmt: skip
def test_plan_explain_refuses_what_it_would_ignore(argv, message, capsys):
    assert cli(["plan", "--explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
