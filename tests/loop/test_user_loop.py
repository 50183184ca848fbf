"""``sx.loop.run`` on a user's own loop (tests/scripts/user_loop.py): an ``nnx.Optimizer``
loop kept with ``sx.prepare``, and a ``sx.make_train_step`` loop.

As with ``shardax train``: a SIGTERM saves and the process exits 75 (a real signal, in a
subprocess); resuming gives bitwise the losses and params of the uninterrupted run;
``shardax goodput`` reads the ledger the run kept; a stuck rank is named (two real
processes on 127.0.0.1). Every subprocess runs under a wall-clock timeout.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from test_multihost import CLEAN_ENV, Ranks

import shardax as sx
from shardax.cli.main import main as cli
from shardax.loop.hooks import ORDER
from shardax.runtime import status

WORKER = str(Path(__file__).parents[1] / "scripts" / "user_loop.py")
_spec = importlib.util.spec_from_file_location("user_loop", WORKER)
user_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(user_loop)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavour", ["nnx", "step"])
def test_sigterm_saves_exits_75_resume_is_bitwise_and_goodput_reads_the_ledger(
    flavour, tmp_path, capsys
):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, WORKER, flavour, str(ckpt), "--sigterm-at", "6", "--cpu-devices", "8"],
        capture_output=True, text=True, env=CLEAN_ENV, timeout=180,
    )  # fmt: skip
    assert proc.returncode == sx.checkpoint.PREEMPTED_EXIT_CODE == 75, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"preempted (SIGTERM): saved step 6 to {ckpt}; exiting with code 75 so the scheduler "
        "requeues the job; run the script again to continue from it (sx.loop.run resumes "
        "from the latest checkpoint)"
    )
    with sx.CheckpointManager(ckpt) as manager:
        assert manager.all_steps() == [4, 6]  # every 4 steps, and at the SIGTERM's step
        assert manager.data_state()["step"] == 6
    resumed = user_loop.train(flavour, str(ckpt), 12)  # this process, 8 devices as there
    straight = user_loop.train(flavour, str(tmp_path / "straight"), 12)
    assert list(resumed["losses"]) == [str(s) for s in range(7, 13)]
    want = straight["losses"]
    assert resumed["losses"] == {k: want[k] for k in resumed["losses"]}  # bitwise
    assert "RESULT" not in proc.stdout  # it exited at the save
    for got, expected in zip(resumed["params"], straight["params"], strict=True):
        np.testing.assert_array_equal(np.array(got), np.array(expected))
    capsys.readouterr()
    assert cli(["goodput", str(ckpt), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["sessions"] == 2 and table["last_step"] == 12 and 0 < table["goodput"] < 1
    sessions = sx.track.goodput.load(ckpt)["sessions"]
    assert [(s["first_step"], s["last_step"]) for s in sessions] == [(1, 6), (7, 12)]
    assert all(s["buckets"]["compile"] > 0 and s["buckets"]["checkpoint"] > 0 for s in sessions)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("late", [0, 2])
def test_a_stuck_rank_is_named_by_the_watchdog(tmp_path, late):
    # late: process 0's watchdog fires 2 s after process 1's (as on a loaded machine);
    # process 1 still waits for process 0's report before it leaves, so process 0 reports
    # the hang too instead of failing in the collective process 1's exit would break
    timeout, at = 5, 3
    cmd = [sys.executable, WORKER, "step", str(tmp_path / "ckpt"), "--steps", "6",
           "--hang-at", str(at), "--watchdog", str(timeout), "--late", str(late)]  # fmt: skip
    run = Ranks(cmd, 2, cpu_devices=2)
    try:
        codes = [run.wait(r, timeout=150) for r in (0, 1)]
    finally:
        run.kill()
    for rank in (0, 1):
        text = run.text(rank)
        assert codes[rank] == sx.runtime.WATCHDOG_EXIT_CODE, text[-3000:]
        # process 0 is in step 4, waiting one step behind for step 3: it names step 3
        assert f"process {rank} of 2: step {at} did not complete within {timeout} s" in text
        behind = [line for line in text.splitlines() if "hang watchdog: behind:" in line]
        assert behind and behind[0].startswith(
            f"shardax: hang watchdog: behind: process 1 (step {at}, last completed {at - 1}): "
            "dispatching for "
        ), text[-3000:]
        # process 0 dispatched step 3 but never got its result: it does not claim it
        other = re.search(r"\| the others: process 0 \(step (\d+), last completed (\d+)\): ",
                          behind[0])  # fmt: skip
        assert other and int(other[1]) in (at, at + 1) and int(other[2]) == at - 1, behind[0]
    # the hung step's time is the ledger's "hang" (process 0 keeps it, beside the checkpoints)
    sessions = sx.track.goodput.load(tmp_path / "ckpt")["sessions"]
    assert sessions[0]["last_step"] == at - 1 and sessions[0]["buckets"]["hang"] > 0


@pytest.mark.timeout(120)
def test_a_stuck_loader_is_caught_by_the_watchdog(tmp_path):
    """The clock runs from the wait for the step's batch: one process whose loader stops
    yielding is ended, naming the step and that it waits for data."""
    cmd = [sys.executable, WORKER, "step", str(tmp_path / "ckpt"), "--steps", "6",
           "--stall-data-at", "3", "--watchdog", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=CLEAN_ENV)
    text = proc.stdout + proc.stderr
    assert proc.returncode == sx.runtime.WATCHDOG_EXIT_CODE, text[-3000:]
    assert "step 3 did not complete within 3 s (waiting for data for step 3;" in text, text[-3000:]


# --- the driver and its hooks, in this process --------------------------------------------


def test_itstime_is_the_one_schedule():
    assert [s for s in range(1, 11) if sx.loop.itstime(s, 4, total=10)] == [4, 8, 10]
    assert [s for s in range(1, 6) if sx.loop.itstime(s, None)] == []
    assert sx.loop.itstime(5, None, total=5)
    with pytest.raises(ValueError, match="every must be an integer >= 1, got -2"):
        sx.loop.itstime(4, -2)


def test_metrics_reach_the_host_once_per_window_and_the_nan_guard_names_the_step(tmp_path):
    seen = []

    class Seen(sx.loop.Hook):  # records what each step had on the host
        def after_step(self, run):
            seen.append((run.step, [s for s, _ in run.flushed], len(run.pending)))

    losses = [1.0, 0.5, np.nan, 0.25, 0.2]
    hooks = [sx.loop.MetricsWindow(), sx.loop.Logging(every=2), Seen()]
    writer = sx.MetricWriter(tmp_path)
    with (
        pytest.raises(sx.NonFiniteLossError, match="step 3"),
        writer,
        sx.loop.Run({"w": jnp.ones(2)}, hooks, writer=writer) as run,
    ):
        for batch in run.batches(iter(losses)):
            run.after_step({"w": jnp.ones(2)}, {"loss": jnp.float32(batch)})
    # step 2 fetched steps 1 and 2 in one transfer; step 3 waited for step 4's window
    assert seen == [(1, [], 1), (2, [1, 2], 0), (3, [], 1)]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in rows] == [(2, 0.5)]


def test_evaluation_and_a_save_at_the_end_of_a_loader_with_no_total(tmp_path):
    calls = []

    def evaluate(state):
        calls.append(float(state["w"][0]))
        return {"val/w": state["w"][0]}

    with sx.loop.run({"w": jnp.zeros(2)}, checkpoints=tmp_path / "c", evaluate=evaluate,
                     every={"eval": 2}, writer=tmp_path) as run:  # fmt: skip
        state = run.state
        for batch in run.batches(iter(range(5))):
            state = {"w": state["w"] + batch}
            run.after_step(state, jnp.float32(batch))
    assert calls == [1.0, 6.0, 10.0]  # steps 2 and 4, and at the loader's end
    assert sx.CheckpointManager(tmp_path / "c").all_steps() == [5]
    with pytest.raises(ValueError, match=r"every takes the keys \['save', 'eval', 'log'\], got"):
        sx.loop.run({}, every={"safe": 3})


def test_your_hooks_run_on_their_schedule_after_the_usual_ones_in_order(tmp_path):
    calls = []

    def evaluate(state):
        calls.append(("eval", int(state["w"][0])))
        return {"val/w": state["w"][0]}

    class Mine(sx.loop.Hook):  # a hook of one's own, as a class
        def after_step(self, run):
            calls.append(("mine", run.step))

    def every_third(run):  # a function with a schedule; its steps' metrics on the host
        calls.append(("every 3", run.step, run.flushed[-1][0]))

    ckpt = tmp_path / "c"
    yours = [sx.loop.Every(every_third, every=3), Mine()]
    every = {"eval": 2, "save": 2}
    with sx.loop.run(
        {"w": jnp.zeros(2)}, checkpoints=ckpt, evaluate=evaluate, every=every, hooks=yours
    ) as run:
        state = run.state
        for _ in run.batches(iter(range(6)), steps=4):
            state = {"w": state["w"] + 1}
            run.after_step(state, jnp.float32(0))
        names = [type(hook).__name__ for hook in run.hooks]
    # ORDER, written once: the usual hooks (saves before the evaluation), then yours
    usual = ["Goodput", "Preemption", "MetricsWindow", "Checkpoints", "Evaluation"]
    assert names == [*usual, "Every", "Mine"]
    assert ORDER[-3:] == ("snapshots", "evaluation", "yours")
    # every 3: at step 3 and at the last (4); each after the evaluation of its step
    mine = [("mine", 1), ("eval", 2), ("mine", 2), ("every 3", 3, 3), ("mine", 3)]
    assert calls == [*mine, ("eval", 4), ("every 3", 4, 4), ("mine", 4)]
    assert sx.CheckpointManager(ckpt).all_steps() == [2, 4]
    with pytest.raises(TypeError, match=r"hooks\[0\] must be a sx.loop.Hook, got .*Every\(fn"):
        sx.loop.run({}, hooks=[print])


class _Result:
    """A step's output that records when the host waits for it (a pytree leaf with
    ``block_until_ready``, as ``jax.block_until_ready`` calls on every leaf)."""

    def __init__(self, step, run, waited):
        self.step, self.run, self.waited = step, run, waited

    def block_until_ready(self):
        self.waited.append((self.run.step, self.step))
        return self


def test_the_watchdog_waits_one_step_behind_so_dispatch_runs_ahead():
    waited = []

    class Due(sx.loop.Hook):  # fetches after step 4: the watchdog then waits for it too
        def due(self, run):
            return run.step == 4

    hooks = [sx.loop.Watchdog(60), sx.loop.Goodput(), Due()]
    with sx.loop.Run({"w": jnp.ones(2)}, hooks) as run:
        for _ in run.batches(iter(range(6))):
            run.after_step({"w": jnp.ones(2)}, {"loss": _Result(run.step, run, waited)})
            assert run.completed == {1: 0, 2: 1, 3: 2, 4: 4, 5: 4, 6: 5}[run.step]
            # the hang report's last completed step is the one waited for, not the armed one
            assert status.STATUS.last_completed == run.completed
        ledger = run.ledger
    # (step being dispatched, step waited for): step 1 compiles unwatched; each later
    # step waits for the one before; step 4, due, for itself; the end for the last
    assert waited == [(2, 1), (3, 2), (4, 3), (4, 4), (6, 5), (6, 6)]
    assert run.completed == 6 and ledger.session["steps"] == 6
    assert (ledger.session["first_step"], ledger.session["last_step"]) == (1, 6)


def test_pending_metrics_are_bounded_by_the_window_when_no_hook_is_due():
    seen = []

    class Seen(sx.loop.Hook):  # never due: nothing else fetches
        def after_step(self, run):
            seen.append((run.step, [s for s, _ in run.flushed], len(run.pending)))

    losses = [1.0, 0.5, 0.4, 0.3, np.inf, 0.1, 0.1]
    with (
        pytest.raises(sx.NonFiniteLossError, match="step 5"),
        sx.loop.Run({"w": jnp.ones(2)}, [Seen()], window=3) as run,
    ):
        for batch in run.batches(iter(losses)):
            run.after_step({"w": jnp.ones(2)}, {"loss": jnp.float32(batch)})
    # three steps at most wait on the device; each full window is fetched once and checked
    assert seen == [(1, [], 1), (2, [], 2), (3, [1, 2, 3], 0), (4, [], 1), (5, [], 2)]
    with pytest.raises(ValueError, match="window must be an integer >= 1, got 0"):
        sx.loop.Run({}, [], window=0)


def test_a_loop_without_metrics_under_the_watchdog_survives_the_next_steps_donation(mesh):
    """With no metrics the watchdog waits on a token of the state: the state itself is
    donated to the next step before it is waited for, and a donated array cannot be."""
    import optax

    apply = lambda params, x: x @ params["w"]  # noqa: E731
    loss_fn = lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)  # noqa: E731
    step = sx.make_train_step(loss_fn, mesh=mesh)  # donate=True
    state = sx.TrainState.from_params({"w": jnp.zeros((16, 4))}, apply, optax.sgd(0.1))
    batch = {"x": np.ones((16, 16), np.float32), "y": np.ones((16, 4), np.float32)}
    with sx.loop.run(step.shard(state), watchdog=60, goodput=False) as run:
        for placed in run.batches([batch] * 5, mesh):
            old = run.state
            new, _ = step(run.state, placed)
            assert old.params["w"].is_deleted()  # donated
            run.after_step(new)  # no metrics
            assert run.completed == run.step - 1 or run.step == 1
    assert run.completed == 5 and not run.state.params["w"].is_deleted()
