"""The goodput ledger: buckets that sum to the wall time, across sessions, and its command."""

import json
import time

import pytest

from shardax.cli import main as cli_main
from shardax.track import goodput


def test_buckets_sum_to_wall_and_counters_move_time(tmp_path):
    path = tmp_path / goodput.FILE
    start = time.time() - 0.05  # imports before the ledger count as start-up
    ledger = goodput.Ledger(path, since=start)
    compiled = [0.01]  # 10 ms compiled since the start, before the ledger counted
    ledger.count("compile", lambda: compiled[0], since=0.0)
    ledger.switch("step")
    time.sleep(0.03)
    compiled[0] += 0.02  # 20 ms of the step's 30 were compiling
    for step in (1, 2):
        ledger.completed(step)
    with ledger.phase("checkpoint"):
        time.sleep(0.01)
    assert ledger.bucket == "step"
    ledger.close()
    end = time.time()
    t = goodput.load(path)["sessions"][0]["buckets"]
    assert t["startup"] >= 0.04 and t["compile"] == pytest.approx(0.03)
    assert t["step"] >= 0.009 and t["checkpoint"] >= 0.01
    assert sum(t.values()) == pytest.approx(end - start, rel=0.02)
    with pytest.raises(ValueError, match="goodput bucket must be one of"):
        ledger.switch("lunch")


def test_resume_from_older_checkpoint_moves_recomputed_steps_to_lost(tmp_path):
    first = goodput.Ledger(tmp_path / goodput.FILE)
    first.switch("step")
    time.sleep(0.02)
    first.completed(10, steps=10)  # 10 steps reached, the last checkpoint has step 6
    first.close()
    step_s = goodput.load(tmp_path)["sessions"][0]["buckets"]["step"]
    second = goodput.Ledger(tmp_path / goodput.FILE)
    assert second.resumed(6) == 4
    second.switch("step")
    second.completed(12, steps=6)
    second.close()
    sessions = goodput.load(tmp_path)["sessions"]
    assert len(sessions) == 2
    assert sessions[0]["buckets"]["lost"] == pytest.approx(step_s * 4 / 10)
    assert sessions[0]["buckets"]["step"] == pytest.approx(step_s * 6 / 10)
    t = goodput.totals(sessions)
    wall = sum(s["end"] - s["start"] for s in sessions)
    assert sum(t.values()) == pytest.approx(wall, rel=0.02)
    assert 0 < goodput.fraction(t) < 1
    assert set(second.scalars()) >= {"goodput/fraction", "goodput/lost_s"}


def test_goodput_command_table_json_png(tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints"
    ledger = goodput.Ledger(ckpt / goodput.FILE)
    ledger.switch("step")
    time.sleep(0.01)
    ledger.completed(1)
    ledger.close(running_as="hang")
    assert cli_main(["goodput", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "hang" in out and "goodput " in out and "over 1 session" in out
    png = tmp_path / "g.png"
    assert cli_main(["goodput", str(ckpt), "--json", "--png", str(png)]) == 0
    got = json.loads(capsys.readouterr().out)
    # The completed step stays "step"; only the time after it is relabelled "hang".
    assert got["sessions"] == 1 and got["buckets_s"]["hang"] > 0 and got["goodput"] > 0.5
    assert png.stat().st_size > 1000
    assert cli_main(["goodput", str(tmp_path)]) == 2
    assert "no goodput ledger" in capsys.readouterr().err
