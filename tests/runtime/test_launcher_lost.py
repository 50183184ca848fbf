"""A launcher that dies takes its processes with it (``shardax.runtime.launcher``): killed
with -9, hung up on (SIGHUP) or sent SIGTERM alone, ``shardax launch``'s processes save at
an agreed step and end within the documented bound; every committed step restores, and
the next run resumes from the save made as the launcher was lost."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from test_multihost import CLEAN_ENV, LAUNCH
from test_preemption import final_params, train_summary

import shardax as sx
from shardax.cli.launch import LaunchRecord, process_env, start_processes
from shardax.models.mlp import make_mlp
from shardax.runtime import launcher

TRAIN = ["--epochs", "40", "--hidden", "32", "--batch-size", "256"]
BOUND = launcher.LAUNCHER_GRACE + 15  # the documented grace, and a loaded machine's slack


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def restore_every_step(ckpt: Path) -> list[int]:
    """Restores each committed step of the MLP job's checkpoint; returns the steps."""
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)  # as the MLP job
    like = sx.TrainState.create(make_mlp(64, 32, 1, 10, 0), tx, rng=0)
    with sx.CheckpointManager(ckpt) as manager:
        steps = manager.all_steps()
        for step in steps:
            restored = manager.restore(like, step=step)
            assert restored.step == step
            assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.state))
    return steps


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM],
                         ids=["kill-9", "hup", "term"])  # fmt: skip
def test_launcher_killed_hung_up_or_terminated_takes_its_processes_with_it(tmp_path, sig):
    ckpt, launch_dir = tmp_path / "ckpt", tmp_path / "launch"
    argv = [*LAUNCH, "launch", "-n", "2", "--cpu-devices", "2", "--launch-dir", str(launch_dir),
            "--", sys.executable, "-m", "shardax", "train", *TRAIN, "--run-dir",
            str(tmp_path / "run"), "--checkpoint-dir", str(ckpt), "--save-every", "1"]  # fmt: skip
    out = (tmp_path / "launch.out").open("w")
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=CLEAN_ENV)
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "2").exists():
            assert proc.poll() is None, (tmp_path / "launch.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step 2 saved"
            time.sleep(0.01)
        pids = [r["pid"] for r in launcher.read_status(launch_dir)["ranks"].values()]
        signalled = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(timeout=BOUND)
        while any(alive(p) for p in pids):
            assert time.monotonic() - signalled < BOUND, f"still running: {pids}"
            time.sleep(0.1)
        print(f"the processes ended {time.monotonic() - signalled:.1f} s after the signal")
    finally:
        proc.kill()
        out.close()
    status = launcher.read_status(launch_dir)
    logs = [launcher.rank_log(launch_dir, r).read_text() for r in range(2)]
    said = [log.strip().splitlines()[-1] for log in logs]
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        assert status["launcher"]["state"] == "lost", status
        assert status["message"].startswith(f"the launcher (pid {proc.pid}"), status
        for rank in ("0", "1"):
            entry = status["ranks"][rank]
            assert entry["state"] == "exited after the launcher was lost", status
            assert f"the launcher, pid {proc.pid}, was lost): saved step" in entry["last_line"]
        for log in said:
            assert f"preempted (SIGTERM: the launcher, pid {proc.pid}, was lost)" in log, said
    else:  # the launcher lives: it passed a SIGTERM on, and ends with the processes' 75
        assert code == sx.checkpoint.PREEMPTED_EXIT_CODE, (tmp_path / "launch.out").read_text()
        assert status["launcher"] == {**status["launcher"], "state": "finished", "exit_code": 75}
        assert [status["ranks"][r]["exit_code"] for r in ("0", "1")] == [75, 75], status
        for log in said:
            assert "shardax train: preempted (SIGTERM): saved step" in log, said
    saved = {log.split("saved step ")[1].split()[0] for log in said}
    assert len(saved) == 1, said  # an agreed step
    steps = restore_every_step(ckpt)
    assert steps[-1] == int(saved.pop()) >= 2
    if sig != signal.SIGKILL:
        return  # a save on a SIGTERM passed on: test_preemption resumes it elastically
    # The next run resumes from the save made as the launcher was lost: here one process
    # on 4 devices, elastically.
    shutil.copytree(ckpt, tmp_path / "again")
    code, summary = train_summary(
        tmp_path, "again", "--epochs", str(steps[-1] // 6 + 1), *TRAIN[2:], "--checkpoint-dir",
        str(tmp_path / "again"), "--resume", "--mesh", "data=4", options=[],
    )  # fmt: skip
    assert code == 0, summary
    assert summary["resumed_from_step"] == steps[-1], summary


def test_a_process_whose_launcher_is_gone_says_so_and_stops(tmp_path):
    """Without JAX: a child of a launcher that dies is signalled, logs and records it."""
    child = (
        "import os, signal, sys, time\n"
        "from shardax.runtime import launcher\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: got.append(1))\n"
        # The watcher's record of the loss is slowed: the SIGTERM that PR_SET_PDEATHSIG
        # sends as the launcher dies comes first, and the exit must still wait for it.
        "write = launcher.update_status\n"
        "def slow(d, change):\n"
        "    if change.__name__ == 'lost': time.sleep(1.0)\n"
        "    return write(d, change)\n"
        "launcher.update_status = slow\n"
        "launcher.watch_launcher()\n"
        "print('up', flush=True)\n"
        "while launcher.launcher_lost() is None: time.sleep(0.01)\n"
        "while not got: time.sleep(0.01)\n"
        "print('after the loss, printed to the log', flush=True)\n"
        "launcher.note_exit('bye')\n"
    )
    # An intermediate launcher (a python that starts the child and then is killed)
    middle = (
        "import sys, time\n"
        "from shardax.cli.launch import process_env, start_processes\n"
        f"env = process_env(0, 1, 1, launch_dir={str(tmp_path)!r})\n"
        f"env['{launcher.ENV_LAUNCHER_GRACE}'] = '20'\n"
        f"procs = start_processes([sys.executable, '-c', {child!r}], [env], merge_stderr=False)\n"
        "print(procs[0].pid, flush=True)\n"
        "assert procs[0].stdout.readline() == b'up\\n'\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True,
                            env=CLEAN_ENV)  # fmt: skip
    try:
        pid = int(proc.stdout.readline())
        assert proc.stdout.readline() == "ready\n"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while alive(pid):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        proc.kill()
    status = launcher.read_status(tmp_path)
    assert status["launcher"]["state"] == "lost"
    assert status["ranks"]["0"] == {**status["ranks"]["0"], "last_line": "bye"}
    log = launcher.rank_log(tmp_path, 0).read_text()
    assert "the launcher (pid" in log and "after the loss, printed to the log" in log


def test_launch_record_and_status_file_under_concurrent_writers(tmp_path):
    def bump(i: int) -> None:
        for _ in range(20):
            launcher.update_status(tmp_path, lambda s: s.update(n=s.get("n", 0) + 1))

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert launcher.read_status(tmp_path)["n"] == 80
    assert launcher.read_status(tmp_path / "none") == {}
    env = process_env(1, 2, 1234, launch_dir=tmp_path, base={})
    assert env[launcher.ENV_LAUNCHER_PID] == str(os.getpid())
    assert env[launcher.ENV_LAUNCH_DIR] == str(tmp_path)
    procs = start_processes([sys.executable, "-c", "pass"], [env])
    procs[0].wait()
    record = LaunchRecord(tmp_path, sys.stderr)
    record.started(procs)
    record.finished(procs, 0)
    status = json.loads((tmp_path / launcher.STATUS_FILE).read_text())
    assert status["ranks"]["0"]["exit_code"] == 0
    assert status["launcher"]["state"] == "finished" and status["message"] == (
        "every process exited 0"
    )


@pytest.mark.parametrize(
    "env, message",
    [
        ({launcher.ENV_LAUNCHER_PID: "x"}, "$SHARDAX_LAUNCHER_PID must be a process id, got 'x'"),
        (
            {launcher.ENV_LAUNCHER_PID: "1", launcher.ENV_LAUNCHER_GRACE: "soon"},
            "$SHARDAX_LAUNCHER_GRACE must be a number of seconds, got 'soon'",
        ),
    ],
)
def test_watch_launcher_refuses_a_malformed_environment(env, message):
    with pytest.raises(ValueError, match=message.replace("$", r"\$")):
        launcher.watch_launcher(env)
    assert launcher.watch_launcher({}) is None


# --- in-job recovery: shardax launch --max-restarts ---------------------------------------


GUIDE = Path(__file__).parents[2] / "docs" / "guides" / "checkpoints.md"


def page_command() -> tuple[list[str], list[str]]:
    """The options of ``shardax launch`` and of ``shardax train`` in the block of
    checkpoints.md that this file runs (``<!-- run by tests/runtime/test_launcher_lost.py -->``)."""
    text = GUIDE.read_text()
    block = text.split("<!-- run by tests/runtime/test_launcher_lost.py -->", 1)[1]
    command = block.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    words = shlex.split(command)
    cut = words.index("--")
    assert words[:3] == ["uv", "run", "shardax"] and words[3] == "launch", words
    assert words[cut + 1 : cut + 4] == ["uv", "run", "shardax"] and words[cut + 4] == "train"
    return words[4:cut], words[cut + 5 :]


def wait_for_snapshot(proc, launch_dir: Path, step: int, restarts: int, out: Path) -> dict:
    """The launch's status once its processes, restarted ``restarts`` times, have
    committed the snapshot of ``step``."""
    deadline = time.monotonic() + 240
    while True:
        status = launcher.read_status(launch_dir)
        snaps = Path(status.get("snapshots", "/nonexistent")) / "train" / str(step)
        if len(status.get("restarts", [])) == restarts and snaps.exists():
            return status
        assert proc.poll() is None, out.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no snapshot of step {step}"
        time.sleep(0.01)


def assert_as_without_a_fault(tmp_path: Path, run: Path) -> None:
    """The run in ``tmp_path`` (``run``, ``ckpt``) ends bitwise as the run without a fault
    in ``run``: its history and its final params."""
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    want = json.loads((run / "summary.json").read_text())
    keys = ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy")
    assert [{k: h[k] for k in keys} for h in summary["history"]] == [
        {k: h[k] for k in keys} for h in want["history"]
    ]
    got, expected = final_params(tmp_path / "ckpt"), final_params(run / "ckpt")
    for path in expected:
        np.testing.assert_array_equal(got[path], expected[path], err_msg=path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("faults", ["raise,kill", "stop"])
def test_a_process_that_raises_is_killed_or_stopped_costs_one_step_and_the_run_ends_as_without(
    tmp_path, launched_train, faults
):
    """Each fault kind once: process 1 raises after step 3 (an injected fault), then in the
    restarted run process 0, the coordinator, is killed with -9 at step 8, each costing at
    most one step (a snapshot every step); or process 1 is stopped (SIGSTOP) after the first
    snapshot, under the default auto interval (which every process must agree on). The run
    ends bitwise as the same run without a fault (the session's launched_train: 2 processes
    x 2 devices, 12 steps)."""
    reference, run, options = launched_train
    assert reference.returncode == 0, reference.stderr[-6000:]
    launch_dir, out = tmp_path / "launch", tmp_path / "launch.out"
    launch_options, train_options = page_command()  # the checkpoints guide's, as written
    assert train_options[: len(options)] == options  # the same run as launched_train's
    argv = [*LAUNCH, "launch", *launch_options, "--launch-dir", str(launch_dir), "--",
            sys.executable, "-m", "shardax", "train", *train_options, "--run-dir",
            str(tmp_path / "run"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every",
            "1000", "--log-every", "1"]  # fmt: skip
    if "kill" in faults:  # else --snapshot-every's default, auto: tuned across the processes
        argv += ["--snapshot-every", "1"]
    env = {**CLEAN_ENV, "SHARDAX_FAULT": "1:3:raise"} if "raise" in faults else CLEAN_ENV
    with out.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        if "kill" in faults:
            status = wait_for_snapshot(proc, launch_dir, 8, 1, out)
            victims = [(0, status["ranks"]["0"]["pid"])]
            os.kill(victims[0][1], signal.SIGKILL)
        else:
            status = wait_for_snapshot(proc, launch_dir, 1, 0, out)  # auto starts at step 1
            victims = [(1, status["ranks"]["1"]["pid"])]
            os.kill(victims[0][1], signal.SIGSTOP)
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    text = out.read_text()
    assert code == 0, text[-4000:]
    status = launcher.read_status(launch_dir)
    causes = {
        "raise": "exited with code 1: RuntimeError: injected fault (SHARDAX_FAULT): process 1 "
        "after step 3",
        "kill": "killed by SIGKILL",
        "stop": "stopped (SIGSTOP)",
    }
    kinds = faults.split(",")
    assert len(status["restarts"]) == len(kinds), status
    ranks = [1, 0] if "kill" in faults else [1]
    for number, (restart, kind, rank) in enumerate(
        zip(status["restarts"], kinds, ranks, strict=True), 1
    ):
        assert restart["rank"] == rank and causes[kind] in restart["cause"], restart
        assert f"restart {number} of 2: every process starts again" in text
        assert restart["restored_from"].startswith("the host-memory snapshot"), restart
        if "kill" in faults:
            assert restart["steps_lost"] <= 1, restart  # a snapshot every step
        assert restart["seconds_to_next_step"] < 60, restart
    assert status["restarts"][-1]["pid"] == victims[0][1]
    assert not Path(status["snapshots"]).exists()  # the launcher's, gone with it
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert [r["rank"] for r in summary["restarts"]] == ranks
    assert summary["snapshot_every"] == 1 if "kill" in faults else summary["snapshot_every"] >= 1
    assert_as_without_a_fault(tmp_path, run)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan", ["replicate", "fsdp"])
def test_a_replaced_host_fetches_its_snapshot_from_a_peer_and_the_run_ends_as_without(
    tmp_path, launched_train, plan
):
    """``--snapshot-peers``: each process keeps its own snapshot; process 1 is killed after
    step 3 and its host replaced (a ``host`` fault: the restarted process finds its
    snapshots gone). It fetches its shards from process 0's copy (orbax's peer-to-peer
    manager: the other replica's under the default plan; under ``fsdp``, sharded over
    every process, the copy each half of the processes keeps of the other's shards), at
    most one step is lost, and the run ends bitwise as the same run without the fault
    (the session's launched_train; under fsdp, a run of its own)."""
    reference, run, train = launched_train
    assert reference.returncode == 0, reference.stderr[-6000:]
    if plan == "fsdp":
        train, run = [*train, "--plan", "fsdp"], tmp_path / "straight"
        straight = subprocess.run(
            [*LAUNCH, "launch", "-n", "2", "--cpu-devices", "2", "--", sys.executable, "-m",
             "shardax", "train", *train, "--run-dir", str(run), "--checkpoint-dir",
             str(run / "ckpt"), "--save-every", "1000", "--log-every", "1"],
            capture_output=True, text=True, timeout=300, env=CLEAN_ENV,
        )  # fmt: skip
        assert straight.returncode == 0, straight.stderr[-4000:]
    launch_dir = tmp_path / "launch"
    argv = [*LAUNCH, "launch", "-n", "2", "--cpu-devices", "2", "--max-restarts", "1",
            "--snapshot-peers", "--launch-dir", str(launch_dir), "--", sys.executable, "-m",
            "shardax", "train", *train, "--run-dir", str(tmp_path / "run"), "--checkpoint-dir",
            str(tmp_path / "ckpt"), "--save-every", "1000", "--log-every", "1",
            "--snapshot-every", "1"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=400,
                          env={**CLEAN_ENV, "SHARDAX_FAULT": "1:3:host"})  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    (restart,) = launcher.read_status(launch_dir)["restarts"]
    assert restart["rank"] == 1 and "killed by SIGKILL" in restart["cause"], restart
    assert "its snapshots in host memory are gone (" in text and "process1)" in text, text[-3000:]
    assert restart["restored_from"].startswith("the host-memory snapshot"), restart
    assert restart["steps_lost"] <= 1 and restart["restored_step"] >= 2, restart
    assert f"[1] shardax: process 1: step {restart['restored_step']}'s snapshot was not in" in text
    assert "its shards came from a peer's copy" in text
    assert_as_without_a_fault(tmp_path, run)


def test_injected_faults_are_parsed_and_refused_by_name():
    from shardax.runtime import faults

    assert faults.planned("") == [] and faults.planned(None) == []
    with pytest.raises(ValueError, match=r"each fault is RANK:STEP:KIND .*got '1:x:raise'"):
        faults.planned("1:x:raise")
    with pytest.raises(ValueError, match="got '1:2:explode'"):
        faults.planned("0:1:kill,1:2:explode")
    faults.inject(3, 1, restart=0)  # nothing planned: nothing happens
    assert faults.planned("1:4:snapshot-kill") == [faults.Fault(1, 4, "snapshot-kill")]
    assert faults.planned("1:3:host") == [faults.Fault(1, 3, "host")]
    with pytest.raises(ValueError, match=r"snapshot-kill fault needs \$SHARDAX_SNAPSHOT_DIR"):
        faults.kill_while_saving(None, 4)


def test_auto_snapshots_keep_their_cost_within_the_budget_of_a_step(tmp_path):
    from shardax.loop.hooks import Snapshots

    class Run:  # what the hook reads of a run
        total, state, manager = 1000, {"w": np.arange(4096.0)}, None

        def __init__(self):
            self.step = 0

        def phase(self, name):
            return contextlib.nullcontext()

        def data_state(self):
            return {"step": self.step}

    with sx.CheckpointManager(tmp_path / "snaps", max_to_keep=2) as manager:
        hook, run = Snapshots(manager, None, budget=0.05), Run()
        for step in range(1, 40):
            run.step = step
            time.sleep(0.002)  # a 2 ms step: a snapshot's blocking part is well above 5%
            hook.after_step(run)
        hook.close(run)
        saved = manager.all_steps()
    assert hook.snapshot_s is not None and hook.snapshot_s > 0.05 * 0.002
    assert hook.every > 1, hook.every  # tuned down from every step...
    assert saved[-1] < 39 and len(saved) <= 2, saved  # ...so the steps went on unsaved
    assert Snapshots(manager, 4).every == 4 and not Snapshots(manager, 4).auto


USER_LOOP = str(Path(__file__).parents[1] / "scripts" / "user_loop.py")


@pytest.mark.timeout(600)
def test_your_own_nnx_loop_recovers_in_the_job_bitwise(tmp_path):
    """``sx.loop.run(..., snapshots=1)`` on an ``nnx.Optimizer`` loop of 2 processes: process
    1 killed with -9 while the snapshot of step 6 is written, the launcher restarts both,
    they resume from the snapshot before it (step 5: the cut one never committed), and the
    run ends as the same run without the fault."""

    def launch(name: str, *extra: str) -> tuple[int, dict, Path]:
        launch_dir = tmp_path / f"launch-{name}"
        argv = [*LAUNCH, "launch", "-n", "2", "--cpu-devices", "2", "--max-restarts", "1",
                "--launch-dir", str(launch_dir), "--", sys.executable, USER_LOOP, "nnx",
                str(tmp_path / name), "--steps", "12", "--save-every", "100",
                "--snapshots", "1", *extra]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=400, env=CLEAN_ENV)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        found = [ln for ln in proc.stdout.splitlines() if ln.startswith("[0] RESULT ")]
        return proc.returncode, json.loads(found[-1].split("RESULT ", 1)[1]), launch_dir

    _, want, _ = launch("straight")
    _, got, launch_dir = launch("faulted", "--kill-in-snapshot", "6")
    (restart,) = launcher.read_status(launch_dir)["restarts"]
    assert restart["rank"] == 1 and "killed by SIGKILL" in restart["cause"], restart
    assert restart["restored_from"].startswith("the host-memory snapshot"), restart
    assert restart["restored_step"] == 5 and restart["steps_lost"] == 1, restart
    assert got["params"] == want["params"]  # bitwise, leaf by leaf
    steps = sorted(int(s) for s in got["losses"])  # this session's: from the snapshot on
    assert steps[0] >= 5 and steps[-1] == 12, steps
    assert all(got["losses"][str(s)] == want["losses"][str(s)] for s in steps)


@pytest.mark.timeout(600)
def test_a_process_that_cannot_come_back_shrinks_the_run_as_a_planned_elastic_resume(tmp_path):
    """``--min-processes 1``: process 1 is killed after step 3 and its place is lost (every
    later start there fails at once: a ``lost`` fault). The first restart cannot bring it
    back, so the run shrinks from 2 processes x 2 devices to 1 x 2, with twice the
    microbatches, and ends as a planned elastic resume from the step it restored, at that
    size (``--resume --accumulate 2`` on one process), does: bitwise."""
    launch_dir, ckpt, copied = tmp_path / "launch", tmp_path / "ckpt", tmp_path / "at-shrink"
    train = ["--epochs", "2", "--hidden", "32", "--batch-size", "256"]
    argv = [*LAUNCH, "launch", "-n", "2", "--cpu-devices", "2", "--max-restarts", "2",
            "--min-processes", "1", "--launch-dir", str(launch_dir), "--", sys.executable,
            "-m", "shardax", "train", *train, "--run-dir", str(tmp_path / "run"),
            "--checkpoint-dir", str(ckpt), "--save-every", "1", "--snapshot-every", "1",
            "--log-every", "1"]  # fmt: skip
    out = tmp_path / "launch.out"
    with out.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**CLEAN_ENV, "SHARDAX_FAULT": "1:3:lost"})  # fmt: skip
    try:  # the checkpoints as the shrunk run finds them: what a planned resume starts from
        deadline = time.monotonic() + 300
        while len(launcher.read_status(launch_dir).get("restarts", [])) < 2:
            assert proc.poll() is None, out.read_text()[-4000:]
            assert time.monotonic() < deadline, out.read_text()[-4000:]
            time.sleep(0.01)
        shutil.copytree(ckpt, copied / "ckpt")
        code = proc.wait(timeout=300)
    finally:
        proc.kill()
    text = out.read_text()
    assert code == 0, text[-4000:]
    first, second = launcher.read_status(launch_dir)["restarts"]
    assert first["rank"] == 1 and "killed by SIGKILL" in first["cause"], first
    assert first["processes"] == 2 and first.get("first_step") is None, first  # never came back
    assert second["rank"] == 1 and "place 1 was lost" in second["cause"], second
    assert second["shrunk_to"] == 1 and second["processes"] == 1, second
    assert "could not come back" in text and "the run shrinks to 1 of 2 processes" in text
    assert "the run shrank from 2 to 1 processes: --accumulate 1 -> 2" in text, text[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["processes"] == 1 and summary["accumulate"] == 2
    assert summary["resumed_from_step"] == second["restored_step"] >= 2
    # The planned elastic resume, from the same step, at the size the run shrank to.
    argv = [sys.executable, "-m", "shardax", "train", "--cpu-devices", "2", *train,
            "--accumulate", "2", "--resume", "--checkpoint-dir", str(copied / "ckpt"),
            "--run-dir", str(copied / "run"), "--save-every", "1000",
            "--log-every", "1"]  # fmt: skip
    planned = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=CLEAN_ENV)
    assert planned.returncode == 0, planned.stderr[-4000:]
    want = json.loads((copied / "run" / "summary.json").read_text())
    assert want["resumed_from_step"] == summary["resumed_from_step"]
    keys = ("epoch", "step", "train_loss", "train_accuracy", "test_loss", "test_accuracy")
    assert [{k: h[k] for k in keys} for h in summary["history"]] == [
        {k: h[k] for k in keys} for h in want["history"]
    ]
    got, expected = final_params(ckpt), final_params(copied / "ckpt")
    for path in expected:
        np.testing.assert_array_equal(got[path], expected[path], err_msg=path)
