"""Preemption (SIGTERM -> save at an agreed step, exit 75), exact and elastic resume, the
hang watchdog, and joining from SLURM / Kubernetes JobSet environments.

Every signal here is a real one; multi-process runs are real processes on 127.0.0.1 with
gloo, under wall-clock timeouts. Runs that can share this pytest process (8 CPU devices)
do, to keep the suite quick.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_multihost import CLEAN_ENV, LAUNCH, SCRIPT, Ranks, results

import shardax as sx
from shardax.cli.launch import forward_signals, free_port, start_processes, supervise
from shardax.cli.main import main as cli
from shardax.models.mlp import make_mlp
from shardax.runtime.distributed import resolve_coordinates

SMALL = ["--hidden", "32", "--epochs", "2", "--batch-size", "128"]  # 12 steps an epoch


def train_summary(
    tmp_path: Path, name: str, *argv: str, options: list[str] = SMALL
) -> tuple[int, dict]:
    """Runs ``shardax train`` (``options``, then ``argv``) in this process; its exit code
    and summary (if any)."""
    run = tmp_path / f"run-{name}"
    code = cli(["train", *options, "--run-dir", str(run), *argv])
    summary = run / "summary.json"
    return code, json.loads(summary.read_text()) if summary.exists() else {}


def final_params(directory: Path, hidden: int = 32) -> dict[str, np.ndarray]:
    """The params of the newest checkpoint in ``directory``, as NumPy arrays by path."""
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=3e-3)  # as the MLP job
    like = sx.TrainState.create(make_mlp(64, hidden, 1, 10, 0), tx, rng=0)
    with sx.CheckpointManager(directory) as manager:
        state = manager.restore(like).state
    leaves = jax.tree_util.tree_leaves_with_path(state.params)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def sigterm_when(path: Path, pid: int | None = None, timeout: float = 240) -> threading.Thread:
    """A thread that sends SIGTERM to ``pid`` (default: this process) once ``path``
    exists: a checkpoint of ``--save-every`` was committed, so the run is under way."""

    def wait_and_signal() -> None:
        deadline = time.monotonic() + timeout
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(os.getpid() if pid is None else pid, signal.SIGTERM)

    thread = threading.Thread(target=wait_and_signal, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, dict[str, np.ndarray]]:
    """The uninterrupted run (1 process x 8 devices): its summary and final params."""
    tmp = tmp_path_factory.mktemp("straight")
    code, summary = train_summary(tmp, "straight", "--checkpoint-dir", str(tmp / "ckpt"))
    assert code == 0
    return summary, final_params(tmp / "ckpt")


def assert_same_history(got: list[dict], want: list[dict], rtol: float = 0.0) -> None:
    keys = ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy")
    for a, b in zip(got, want, strict=True):
        for k in keys:
            if rtol:
                assert a[k] == pytest.approx(b[k], rel=rtol), (k, a, b)
            else:
                assert a[k] == b[k], (k, a, b)


# --- the library pieces ---------------------------------------------------------------------


def test_sigterm_is_reported_at_the_next_step_and_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with sx.watch_preemption():
        assert not sx.checkpoint.reached_preemption(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it: we live on
        assert sx.checkpoint.reached_preemption(2)
        assert sx.checkpoint.reached_preemption(3)  # until handled
    assert signal.getsignal(signal.SIGTERM) is before
    with sx.watch_preemption():
        assert not sx.checkpoint.reached_preemption(4)  # a handled notice is forgotten
    with pytest.raises(RuntimeError, match="main thread"):
        failed = []
        t = threading.Thread(target=lambda: failed.append(_capture(sx.watch_preemption)))
        t.start()
        t.join()
        raise failed[0]


def _capture(fn):
    try:
        fn()
    except Exception as e:
        return e
    return AssertionError("no error")


def test_sigterm_during_a_save_lets_it_complete(tmp_path):
    mesh = sx.make_mesh({"data": -1})
    state = sx.shard({"w": jnp.ones((512, 512)), "b": jnp.zeros(8)}, sx.fsdp(mesh, min_size=1))
    with sx.watch_preemption(), sx.CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
        # The signal arrives as soon as step 2's temporary directory shows up.
        stop = threading.Event()

        def signal_during_save() -> None:
            while not stop.is_set():
                if any("tmp" in p for p in os.listdir(tmp_path)):
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                time.sleep(0.0005)

        t = threading.Thread(target=signal_during_save, daemon=True)
        t.start()
        manager.save(2, jax.tree.map(lambda x: x + 1, state))
        stop.set()
        t.join()
        assert manager.all_steps() == [1, 2]
        assert sx.checkpoint.reached_preemption(2)  # noted, and reported after the save
        assert not hasattr(manager, "reached_preemption")  # retired in 0.2.0 (CHANGELOG.md)
        got = manager.restore(state)
        assert got.step == 2 and float(got.state["w"][0, 0]) == 2.0


def test_step_watchdog_arguments():
    for bad in (0, -1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(ValueError, match=r"timeout \(seconds\) must be a finite number > 0"):
            sx.StepWatchdog(bad)
    with sx.StepWatchdog(30) as watchdog:  # steps that complete in time: nothing happens
        for step in range(3):
            with watchdog.step(step):
                pass
    with pytest.raises(RuntimeError, match=r"arm\(\) after close"):
        watchdog.arm(4)


# --- shardax launch forwards SIGTERM --------------------------------------------------------


def test_launch_forwards_sigterm_and_exits_75_once_all_saved():
    child = (
        "import os, signal, sys, time\n"
        "def preempted(*_):\n"
        "    time.sleep(0.3 * int(os.environ['SHARDAX_PROCESS_ID']))\n"  # a save takes a while
        "    print('saved', flush=True); sys.exit(75)\n"
        "signal.signal(signal.SIGTERM, preempted)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    envs = [{**CLEAN_ENV, "SHARDAX_PROCESS_ID": str(r)} for r in range(3)]
    procs = start_processes([sys.executable, "-c", child], envs)
    out = _Lines()
    ready = threading.Event()
    out.on("ready", 3, ready)
    with forward_signals(procs):
        t = threading.Thread(target=lambda: (ready.wait(30), os.kill(os.getpid(), 15)))
        t.start()
        code = supervise(procs, grace=1.0, out=out)
        t.join()
    text = out.text()
    assert code == sx.checkpoint.PREEMPTED_EXIT_CODE == 75, text
    assert sorted(line for line in text.splitlines() if "saved" in line) == [
        f"[{r}] saved" for r in range(3)
    ]
    assert "stopping the others" not in text  # 75 is not a failure: everyone saves
    assert signal.getsignal(signal.SIGTERM) is not None


class _Lines:
    """A text sink for supervise that sets ``event`` once ``needle`` was written ``n`` times."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._wait: tuple[str, int, threading.Event] | None = None

    def on(self, needle: str, n: int, event: threading.Event) -> None:
        self._wait = (needle, n, event)

    def write(self, text: str) -> None:
        self._parts.append(text)
        if self._wait and self.text().count(self._wait[0]) >= self._wait[1]:
            self._wait[2].set()

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return "".join(self._parts)


# --- shardax train: preemption and exact resume ---------------------------------------------


def test_train_sigterm_saves_exits_75_and_resume_is_bitwise(tmp_path, capsys, straight):
    ckpt = tmp_path / "preempted"
    straight, want = straight
    sigterm_when(ckpt / "5")
    code, _ = train_summary(tmp_path, "first", "--checkpoint-dir", str(ckpt), "--save-every", "5")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == sx.checkpoint.PREEMPTED_EXIT_CODE, err
    with sx.CheckpointManager(ckpt) as manager:
        stopped = manager.latest_step()
    assert 5 < stopped < 24, stopped  # saved at the next step boundary, mid-run
    assert err == (
        f"shardax train: preempted (SIGTERM): saved step {stopped} to {ckpt}; exiting with "
        "code 75 so the scheduler requeues the job; continue it with --resume"
    )
    code, resumed = train_summary(
        tmp_path, "resumed", "--checkpoint-dir", str(ckpt), "--save-every", "5", "--resume"
    )
    assert code == 0
    assert resumed["resumed_from_epoch"] == stopped // 12
    assert_same_history(resumed["history"], straight["history"])  # bitwise
    got = final_params(ckpt)
    assert sorted(want) == sorted(got)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)

    # Bad input, one line each.
    for argv, message in [
        (["--resume", "--checkpoint-dir", str(tmp_path / "empty")], "--resume: no checkpoint in"),
        (["--save-every", "3"], "--save-every 3 needs --checkpoint-dir"),
        (
            ["--resume", "--checkpoint-dir", str(ckpt), "--hidden", "16"],
            "'params/layers/0/bias/value' has shape (32,) in the checkpoint but (16,) in `like`",
        ),
    ]:
        assert cli(["train", *SMALL, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


GPT = ["--model", "gpt", "--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16",
       "--batch-size", "8", "--steps", "12", "--eval-every", "4"]  # fmt: skip


def saved_arrays(directory: Path) -> dict[str, np.ndarray]:
    """Every array of the newest checkpoint in ``directory``, by path (saved by this
    process's devices, so read back without a target)."""
    import orbax.checkpoint as ocp

    with sx.CheckpointManager(directory) as manager:
        step = manager.latest_step()
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(directory / str(step) / "state")
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in leaves}


def untimed(history: list[dict]) -> list[dict]:
    """History entries without their timings."""
    return [
        {k: v for k, v in h.items() if "seconds" not in k and "_per_s" not in k} for h in history
    ]


@pytest.mark.timeout(900)
def test_gpt_sigterm_then_resume_is_bitwise(tmp_path, capsys):
    def run(name: str, *argv: str) -> tuple[int, dict]:
        code = cli(["train", *GPT, "--json", "--run-dir", str(tmp_path / name), *argv])
        out = capsys.readouterr().out
        return code, json.loads(out) if code == 0 else {}

    code, straight = run("straight", "--checkpoint-dir", str(tmp_path / "a"))
    assert code == 0
    ckpt = tmp_path / "preempted"
    sigterm_when(ckpt / "2")
    code, _ = run("first", "--checkpoint-dir", str(ckpt), "--save-every", "2")
    assert code == sx.checkpoint.PREEMPTED_EXIT_CODE
    with sx.CheckpointManager(ckpt) as manager:
        stopped = manager.latest_step()
    assert 2 < stopped < 12, stopped
    code, resumed = run("resumed", "--checkpoint-dir", str(ckpt), "--save-every", "2", "--resume")
    assert code == 0 and resumed["resumed_from_step"] == stopped
    # The goodput ledger spans both sessions; its buckets add up to their wall time.
    sessions = sx.track.goodput.load(ckpt)["sessions"]
    assert [s["last_step"] for s in sessions] == [stopped, 12], sessions
    for s in sessions:
        assert sum(s["buckets"].values()) == pytest.approx(s["end"] - s["start"], rel=0.02)
        assert s["buckets"]["compile"] > 0 and s["buckets"]["step"] > 0
    assert cli(["goodput", str(ckpt), "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["sessions"] == 2 and 0 < table["goodput"] < 1
    assert table["wall_s"] == pytest.approx(sum(s["end"] - s["start"] for s in sessions))
    assert resumed["goodput"]["ledger"] == str(ckpt / "goodput.json")
    # Every step's loss and every evaluation, bitwise; then the whole state.
    assert untimed(resumed["history"]) == untimed(straight["history"])
    want, got = saved_arrays(tmp_path / "a"), saved_arrays(ckpt)
    assert sorted(want) == sorted(got)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--save-every", "0"], "argument --save-every: expected an integer >= 1, got 0"),
        (["--step-timeout", "0"], "argument --step-timeout: expected a finite number > 0, got '0'"),
    ],
)
def test_train_option_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli(["train", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_resume_on_a_data_axis_the_batch_does_not_divide_names_sizes_and_options(capsys):
    argv = ["--batch-size", "12", "--mesh", "data=8", "--resume", "--checkpoint-dir", "x"]
    assert cli(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "shardax train: error: --batch-size 12 is not divisible by the data axis size 8 of "
        "mesh {'data': 8}; a resumed run keeps the checkpoint's global batch (its data "
        "position counts batches of 12), so pass a --mesh whose data axis divides 12 on these "
        "8 devices (data=4,model=2, data=2,model=4, data=1,model=8), or run on a device count "
        "it divides"
    )


# --- two processes under shardax launch: agreed save step, exact and elastic resume -------


@pytest.mark.timeout(900)
def test_two_processes_preempted_under_launch_resume_exactly_and_elastically(
    tmp_path, launched_train
):
    # The uninterrupted 2-process run is the session's launched_train (conftest: launch -n 2
    # --cpu-devices 2, 2 epochs of 6 steps of 256, its last step saved in <run>/ckpt); this
    # run is the same one, preempted, then resumed.
    reference, run, options = launched_train
    assert reference.returncode == 0, reference.stderr[-6000:]
    ckpt = tmp_path / "mp"
    launch = [*LAUNCH, "launch", "-n", "2", "--cpu-devices", "2", "--"]
    train = [sys.executable, "-m", "shardax", "train", *options, "--log-every", "1"]

    def start(name: str, *argv: str, log=subprocess.PIPE) -> subprocess.Popen:
        return subprocess.Popen(
            [*launch, *train, *argv, "--run-dir", str(tmp_path / f"run-{name}")],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=CLEAN_ENV,
        )

    # (Saving changes nothing it computes. The whole run takes a second or two here, so it
    # saves every step: each save of 2 processes costs about a quarter of a second, which
    # leaves the 11 steps after the first save time for SIGTERM to reach both processes and
    # for them to agree on a step; with a save every 3 steps the run once ended first.)
    watchdog = ("--step-timeout", "300")  # never fires
    proc = start("mp", "--checkpoint-dir", str(ckpt), "--save-every", "1", *watchdog)
    try:
        sigterm_when(ckpt / "1", pid=proc.pid)  # to launch, which forwards it to both
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == sx.checkpoint.PREEMPTED_EXIT_CODE, out[-3000:]
    saved = {
        line[:3]: line.split("saved step ")[1].split()[0]
        for line in out.splitlines()
        if "preempted (SIGTERM): saved step" in line
    }
    assert sorted(saved) == ["[0]", "[1]"] and len(set(saved.values())) == 1, out[-3000:]
    stopped = int(saved["[0]"])
    assert 1 < stopped < 12, out[-3000:]
    # Both processes wrote their shards of that step, and nothing after it.
    with sx.CheckpointManager(ckpt) as manager:
        assert manager.latest_step() == stopped
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(ckpt / str(stopped) / "state"))

    # The saved position is global: the same whatever wrote it.
    with sx.CheckpointManager(ckpt) as manager:
        loader = manager.data_state(stopped)["loader"]
    assert loader == {
        **loader,
        "epoch": stopped // 6,
        "index": stopped % 6,
        "batch_size": 256,
    }
    for data in (8, 4, 2):
        shutil.copytree(ckpt, tmp_path / f"elastic{data}")

    # Exact: resumed by 2 processes again, equal to 2 processes uninterrupted, bitwise. It
    # runs before the elastic resumes below (in this process, on copies of the checkpoint):
    # side by side on 2 cores, gloo's peers once lost each other under the load.
    # (Its output goes to a file: nothing reads a pipe meanwhile.)
    uninterrupted = json.loads((run / "summary.json").read_text())
    want = final_params(run / "ckpt")
    log = tmp_path / "mp-resumed.log"
    with log.open("w") as log_file:
        resumed = start("mp-resumed", "--checkpoint-dir", str(ckpt), "--resume",
                        "--save-every", "1000", log=log_file)  # fmt: skip
    try:
        resumed.wait(timeout=300)
        # Elastic: the 2 x 2 checkpoint resumes on 1 x 8, 1 x 4 and 1 x 2 devices.
        for data in (8, 4, 2):
            copy = tmp_path / f"elastic{data}"
            code, summary = train_summary(
                tmp_path, f"on{data}", "--checkpoint-dir", str(copy), "--resume",
                "--mesh", f"data={data}", options=options,
            )  # fmt: skip
            assert code == 0 and summary["devices"] == data and summary["processes"] == 1
            assert_same_history(summary["history"], uninterrupted["history"], rtol=1e-5)
            got = final_params(copy)
            for path in want:
                np.testing.assert_allclose(
                    got[path], want[path], rtol=1e-5, atol=1e-6, err_msg=path
                )
    finally:
        resumed.kill()
    out = log.read_text()
    assert resumed.returncode == 0, out[-3000:]
    summary = json.loads((tmp_path / "run-mp-resumed" / "summary.json").read_text())
    assert (summary["processes"], summary["devices"]) == (2, 4)
    assert summary["resumed_from_epoch"] == stopped // 6
    assert_same_history(summary["history"], uninterrupted["history"])
    got = final_params(ckpt)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)


# --- the hang watchdog across processes -------------------------------------------------


@pytest.mark.timeout(180)
def test_one_rank_hangs_both_exit_nonzero_naming_the_step():
    timeout, step = 5, 3
    run = Ranks([sys.executable, SCRIPT, "--mode", "hang", "--steps", str(step),
                 "--step-timeout", str(timeout)], 2, cpu_devices=2)  # fmt: skip
    try:
        run.wait_for(0, f"step {step - 1} ", timeout=120)
        entered = time.monotonic()
        codes = [run.wait(r, timeout=timeout + 30) for r in (0, 1)]
        assert time.monotonic() - entered < timeout + 30
    finally:
        run.kill()
    for rank in (0, 1):
        text = run.text(rank)
        assert codes[rank] == sx.runtime.WATCHDOG_EXIT_CODE, text[-2000:]
        assert f"process {rank} of 2: step {step} did not complete within {timeout} s" in text
        assert f"step {step} " not in text.replace(f"step {step} did not", "")
        # one line, before the stacks, names the rank behind, its step and its phase
        behind = [line for line in text.splitlines() if "hang watchdog: behind:" in line]
        assert behind, text[-2000:]
        assert behind[0].startswith(
            f"shardax: hang watchdog: behind: process 1 (step {step}, last completed "
            f"{step - 1}): waiting for data for "
        ), behind
        assert (
            f"process 0 (step {step}, last completed {step - 1}): waiting on device" in (behind[0])
        )
        assert text.index(behind[0]) < text.index("most recent call first"), text[-3000:]
    assert "in hang" in run.text(1)  # the stack dump shows where rank 1 sleeps


# --- schedulers, simulated ----------------------------------------------------------------


def _free_port_in(low: int, high: int) -> int:
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def slurm_env(rank: int, n: int, port: int) -> dict[str, str]:
    """What ``srun --ntasks=n`` sets for task ``rank`` (JAX takes the coordinator port
    from the job id: 61440 + id % 4096)."""
    return {
        "SLURM_JOB_ID": str(port - 61440 + 4096 * 7),
        "SLURM_NTASKS": str(n),
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NODEID": "0",
    }


def jobset_env(rank: int, n: int, port: int) -> dict[str, str]:
    """What the JobSet manifest of docs/guides/checkpoints.md gives pod ``rank``."""
    return {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(n),
        "JOB_COMPLETION_INDEX": str(rank),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheduler", ["slurm", "jobset"])
def test_processes_join_from_scheduler_environment(scheduler):
    make_env, port = (
        (slurm_env, _free_port_in(61440, 65535))
        if scheduler == "slurm"
        else (jobset_env, free_port())
    )
    envs = [{**CLEAN_ENV, "SHARDAX_CPU_DEVICES": "2", **make_env(r, 2, port)} for r in range(2)]
    if scheduler == "jobset":  # (SLURM's detection is JAX's, which reads os.environ)
        assert resolve_coordinates(env=envs[1]).source == "jax environment"
    # stderr apart, as `shardax launch` keeps it: gloo's C++ writes land mid-line in a
    # merged pipe and would take a RESULT line with them into the chatter
    procs = start_processes([sys.executable, SCRIPT, "--mode", "join"], envs, merge_stderr=False)
    out, err = _Lines(), _Lines()
    try:
        code = supervise(procs, grace=1.0, out=out, err=err)
    finally:
        for p in procs:
            p.kill()
    assert code == 0, out.text()[-3000:] + err.text()[-3000:]
    got = results(out.text())
    assert set(got) == {0, 1}, out.text()[-3000:] + err.text()[-3000:]
    for rank in (0, 1):
        assert got[rank] == [
            {"process": rank, "processes": 2, "devices": 4, "sum_of_ranks_plus_one": 3}
        ]


def test_jax_environment_coordinates_and_errors():
    env = jobset_env(1, 4, 1234)
    assert tuple(resolve_coordinates(env=env)) == ("jax environment", "127.0.0.1:1234", 4, 1)
    assert resolve_coordinates(env={**env, "JAX_PROCESS_ID": "3"}).process_id == 3
    assert resolve_coordinates(process_id=2, env=env).process_id == 2  # arguments win
    with pytest.raises(ValueError, match=r"lacks \['process_id \(or \$JAX_PROCESS_ID"):
        resolve_coordinates(env={k: v for k, v in env.items() if k != "JOB_COMPLETION_INDEX"})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer, got 'x'"):
        resolve_coordinates(env={**env, "JAX_NUM_PROCESSES": "x"})
