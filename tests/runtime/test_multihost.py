"""Multi-process runs with real processes on 127.0.0.1 and gloo CPU collectives.

Each multi-process test runs under a wall-clock timeout: a hang is a failure. The
single-process references run in this pytest process on its 8 CPU devices.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import shardax as sx
from shardax.cli import main as cli_main
from shardax.cli.launch import exit_code, free_port, process_env, start_processes, supervise
from shardax.runtime.agreement import fingerprint
from shardax.runtime.distributed import (
    ENV_COORDINATOR,
    ENV_CPU_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    resolve_coordinates,
)

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "multihost_train.py")
_spec = importlib.util.spec_from_file_location("multihost_train", SCRIPT)
multihost_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multihost_train)
LAUNCH = [sys.executable, "-c", "import sys; from shardax.cli import main; sys.exit(main())"]
WHO = r"\(pid \d+, host [^)]+\) "  # how launch names a process, after its rank
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDAX_", "SLURM_"))}


def results(output: str) -> dict[int, dict]:
    """The ``RESULT`` json of each rank, by rank, from launch's prefixed output."""
    found: dict[int, list[dict]] = {}
    decoder = json.JSONDecoder()
    for line in output.splitlines():
        # a runtime's unterminated chatter on the same pipe may stand before the RESULT,
        # or run on after it: the JSON object is read from where it starts to where it ends
        match = re.match(r"\[(\d+)\] .*?RESULT (\{.*)$", line)
        if match:
            try:
                value, _ = decoder.raw_decode(match[2])
            except json.JSONDecodeError:
                continue
            found.setdefault(int(match[1]), []).append(value)
    return found


class Ranks:
    """N processes of ``cmd`` started with the launch environment, output collected."""

    def __init__(self, cmd: list[str], n: int, **env_kw: int) -> None:
        port = free_port()
        envs = [process_env(r, n, port, base=CLEAN_ENV, **env_kw) for r in range(n)]
        # stdout and stderr in two pipes, read line by line into one list: in one merged
        # pipe gloo's C++ writes land inside the program's lines
        self.procs = start_processes(cmd, envs, merge_stderr=False)
        self.lines: list[list[str]] = [[] for _ in range(n)]
        self.threads = [
            threading.Thread(target=self._read, args=(r, pipe), daemon=True)
            for r in range(n)
            for pipe in (self.procs[r].stdout, self.procs[r].stderr)
        ]
        for t in self.threads:
            t.start()

    def _read(self, rank: int, pipe) -> None:
        for raw in iter(pipe.readline, b""):
            self.lines[rank].append(raw.decode(errors="replace"))

    def text(self, rank: int) -> str:
        return "".join(self.lines[rank])

    def wait_for(self, rank: int, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text(rank):
            assert self.procs[rank].poll() is None, f"rank {rank} ended:\n{self.text(rank)}"
            assert time.monotonic() < deadline, f"no {needle!r} from rank {rank}"
            time.sleep(0.1)

    def wait(self, rank: int, timeout: float) -> int:
        try:
            code = self.procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"rank {rank} still running after {timeout} s (hang):\n{self.text(rank)}")
        # Its last lines may still be in the pipes: the readers end at end of file.
        for t in self.threads[2 * rank : 2 * rank + 2]:
            t.join(timeout=30)
        return code

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def ranks():
    started: list[Ranks] = []

    def start(*args, **kw) -> Ranks:
        started.append(Ranks(*args, **kw))
        return started[-1]

    yield start
    for r in started:
        r.kill()


# --- real processes ------------------------------------------------------------------------


PLANS = ("dp", "fsdp", "dp-shard_map", "hsdp", "zero2")


@pytest.fixture(scope="module")
def launched_plans():
    """One ``shardax launch -n 2 --cpu-devices 4`` of the script training every plan in
    PLANS for 5 steps, one after the other in the same 2 processes (starting them costs
    more than the training), shared by the tests that check each group of plans."""
    options = ["-n", "2", "--cpu-devices", "4", "--heartbeat-timeout", "10"]
    script = [sys.executable, SCRIPT, "--mode", ",".join(PLANS), "--steps", "5"]
    proc = subprocess.run(
        [*LAUNCH, "launch", *options, "--", *script],
        capture_output=True,
        text=True,
        timeout=360,
        env=CLEAN_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = results(proc.stdout)
    assert sorted(got) == [0, 1]
    for rank in (0, 1):
        assert [r["plan"] for r in got[rank]] == list(PLANS)
    return proc, {rank: dict(zip(PLANS, got[rank], strict=True)) for rank in (0, 1)}


@pytest.mark.timeout(420)
def test_two_processes_match_one_process_dp_fsdp_and_shard_map(launched_plans):
    proc, got = launched_plans
    # Printing comes from process 0 only.
    assert "[0] step 4 loss" in proc.stdout and "[1] step" not in proc.stdout
    for plan in ("dp", "fsdp", "dp-shard_map"):
        reference = multihost_train.train(plan, 5)  # 1 process x 8 devices, here
        assert reference["processes"] == 1
        for rank in (0, 1):
            r = got[rank][plan]
            assert r["plan"] == plan and r["processes"] == 2 and r["process"] == rank
            np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-6)
            # Each process read only its half of every global batch of 32 ...
            assert r["rows"] == [16 * rank, 16 * rank + 16]
            assert r["batch_local_shards"] == 4
            assert r["examples_seen_all_hosts"] == 5 * 32
            # ... the data axis crosses processes, a model axis stays inside one.
            assert r["mesh_process_of_data_index"] == [0, 0, 0, 0, 1, 1, 1, 1]
            assert r["mesh_2d_processes"] == [[0, 0], [0, 0], [1, 1], [1, 1]]
            assert r["w1_spec"] == reference["w1_spec"]
            if plan == "fsdp":
                assert r["w1_spec"] == "P(None, 'data')"
                assert r["w1_local_shards"] == [[16, 8]] * 4
            else:
                assert r["w1_local_shards"] == [[16, 64]] * 4


@pytest.mark.timeout(420)
def test_two_processes_hsdp_and_zero2_match_one_process(launched_plans):
    """HSDP: the replica axis crosses the 2 processes (DCN), fsdp stays inside each."""
    _, got = launched_plans
    for plan in ("hsdp", "zero2"):
        reference = multihost_train.train(plan, 5)  # 1 process x 8 devices, here
        for rank in (0, 1):
            r = got[rank][plan]
            assert r["plan"] == plan and r["processes"] == 2
            np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
            assert r["rows"] == [16 * rank, 16 * rank + 16]
            assert r["w1_spec"] == reference["w1_spec"]
            if plan == "hsdp":
                assert r["mesh_processes"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
                assert r["w1_spec"] == "P(None, 'fsdp')"
                assert r["w1_local_shards"] == r["nu_w1_local_shards"] == [[16, 16]] * 4
            else:
                assert r["w1_spec"] == "P()" and r["w1_local_shards"] == [[16, 64]] * 4
                assert r["nu_w1_local_shards"] == [[16, 8]] * 4


@pytest.mark.timeout(120)
def test_a_process_raises_every_process_exits_nonzero_promptly():
    port = free_port()
    envs = [process_env(r, 2, port, cpu_devices=4, base=CLEAN_ENV) for r in range(2)]
    procs = start_processes([sys.executable, SCRIPT, "--mode", "raise"], envs, merge_stderr=False)
    out = io.StringIO()
    start = time.monotonic()
    code = supervise(procs, grace=3.0, out=out, err=out)
    elapsed = time.monotonic() - start
    text = out.getvalue()
    assert code == 1, text
    assert all(p.returncode != 0 for p in procs), [p.returncode for p in procs]
    assert "[1] RuntimeError: deliberate failure on process 1 at step 2" in text
    # Rank 1 is named: seen to exit first, or (when rank 0's collective fails first and
    # rank 1 waits in the runtime's shutdown) as the process that raised first.
    assert re.search(
        r"process (1 "
        + WHO
        + r"exited with code 1: RuntimeError: deliberate failure on process 1 at "
        r"step 2|0 " + WHO + r"exited with code \d+.* after process 1 raised)",
        text,
    ), text
    assert elapsed < 60, elapsed


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "door", "expected"),
    [
        (
            "config",
            "sx.runtime.check_agreement",
            ["'config' (processes [1] differ from process 0; 1 leaf differs", "lr: {lr}"],
        ),
        (
            "plan",  # no explicit check: the train step's own, in step.shard
            "sx.train.TrainStep.shard",
            [
                "'state_shardings' (processes [1] differ from process 0; 4 leaves differ",
                "params/w1: {w1}",
                "'train_step' (processes [1] differ",
            ],
        ),
    ],
    ids=["config-by-check_agreement", "plan-by-train-step"],
)
def test_mismatch_raises_on_every_process(ranks, fault, door, expected):
    run = ranks([sys.executable, SCRIPT, "--mode", fault], 2, cpu_devices=4)
    local = [{"lr": 0.1, "w1": "P()"}, {"lr": 0.11, "w1": "P(None, 'data')"}]
    for rank in (0, 1):
        assert run.wait(rank, timeout=90) == 1, run.text(rank)
        text = run.text(rank)
        assert f"AgreementError: {door}: the processes disagree on " in text, text
        assert f"differ, on process {rank}: " in text or f"differs, on process {rank}: " in text
        for needle in expected:
            assert needle.format(**local[rank]) in text, (needle, text[-2000:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "coordinator"])
def test_kill_9_of_one_process_stops_the_other_within_heartbeat(ranks, victim):
    heartbeat, other = 5, 1 - victim
    cmd = [sys.executable, SCRIPT, "--mode", "spin"]
    run = ranks(cmd, 2, cpu_devices=2, heartbeat_timeout=heartbeat)
    run.wait_for(victim, "spin 2 ", timeout=60)
    run.wait_for(other, "spin 2 ", timeout=10)
    killed = time.monotonic()
    run.procs[victim].send_signal(signal.SIGKILL)
    code = run.wait(other, timeout=heartbeat + 30)
    assert code != 0, run.text(other)
    assert time.monotonic() - killed < heartbeat + 30
    assert exit_code(run.procs[victim].wait()) == 128 + signal.SIGKILL


@pytest.mark.timeout(60)
def test_alone_initialize_is_a_noop_that_sets_cpu_devices():
    code = (
        "import shardax as sx, jax\n"
        "assert sx.initialize() is False\n"
        "assert sx.initialize() is False\n"  # twice is harmless
        "assert jax.process_count() == 1 and jax.device_count() == 3, jax.devices()\n"
        "assert sx.initialize() is False\n"  # even once the backend runs
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=50,
        env={**CLEAN_ENV, ENV_CPU_DEVICES: "3"},
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


# --- shardax launch without JAX in the children -----------------------------------------------

PY = [sys.executable, "-c"]


def test_launch_prefixes_ranks_and_passes_environment():
    show = f"import os; print(os.environ['{ENV_PROCESS_ID}'], os.environ['{ENV_NUM_PROCESSES}'],"
    show += f" os.environ['{ENV_COORDINATOR}'], os.environ['{ENV_CPU_DEVICES}'])"
    proc = subprocess.run(
        [*LAUNCH, "launch", "-n", "3", "--cpu-devices", "2", "--port", "4567", "--", *PY, show],
        capture_output=True,
        text=True,
        timeout=30,
        env=CLEAN_ENV,
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == [f"[{r}] {r} 3 127.0.0.1:4567 2" for r in range(3)]


def test_launch_json_keeps_stdout_pure_and_runtime_chatter_on_stderr():
    child = "import json, os, sys\nrank = os.environ['SHARDAX_PROCESS_ID']\n"
    child += "print('[Gloo] Rank', rank, 'is connected', flush=True)\n"
    # two of gloo's threads at once: one message inside another's line, its end ("3") after;
    # then one cut before its "Expected ...", the tail on a line of its own
    expected = "Expected number of connected peer ranks is : "
    child += f"print('[Gloo] Rank 2 is connected to 3 peer ranks. {expected}"
    child += f"[Gloo] Rank 3 is connected to 3 peer ranks. {expected}3'); print(3, flush=True)\n"
    child += "print('[Gloo] Rank 1 is connected to 1 peer ranks. [Gloo] Rank 1 is connected "
    child += f"to 1 peer ranks. {expected}1'); print('{expected}1', flush=True)\n"
    child += "print('log', rank, file=sys.stderr, flush=True)\n"
    child += "if rank == '0': print(json.dumps({'ok': sys.argv[1:]}))"
    for flag in ("--json", "--text"):
        proc = subprocess.run(
            [*LAUNCH, "launch", "-n", "2", "--", *PY, child, flag],
            capture_output=True,
            text=True,
            timeout=120,  # launch imports shardax: slow on a loaded 2-core machine
            env=CLEAN_ENV,
        )
        assert proc.returncode == 0, proc.stderr
        for rank in (0, 1):
            assert f"[{rank}] [Gloo] Rank {rank} is connected" in proc.stderr
            assert f"[{rank}] log {rank}" in proc.stderr
            assert f"[{rank}] 3\n" in proc.stderr
            assert f"[{rank}] Expected number of connected peer ranks is : 1\n" in proc.stderr
        if flag == "--json":  # unprefixed: pure JSON
            assert json.loads(proc.stdout) == {"ok": ["--json"]}
        else:
            assert proc.stdout == '[0] {"ok": ["--text"]}\n'


def test_launch_exits_with_first_failure_and_stops_the_others():
    failing = "import os, sys, time\nif os.environ['SHARDAX_PROCESS_ID'] == '1': sys.exit(7)\n"
    failing += "print('waiting', flush=True); time.sleep(60)"
    start = time.monotonic()
    proc = subprocess.run(
        [*LAUNCH, "launch", "-n", "3", "--grace", "1", "--", *PY, failing],
        capture_output=True,
        text=True,
        timeout=120,
        env=CLEAN_ENV,
    )
    assert proc.returncode == 7, proc.stdout + proc.stderr
    assert re.search(r"process 1 " + WHO + r"exited with code 7; stopping the others", proc.stderr)
    # Far below JAX's 300 s shutdown barrier, which the others would wait out if the
    # launcher did not stop them; loose enough for a loaded 2-core machine.
    assert time.monotonic() - start < 90


# As a non-interactive shell starts a background job (`cmd &`): SIGINT ignored, which
# the launcher would inherit; it must stop on SIGINT all the same.
IGNORING_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "


@pytest.mark.parametrize("inherited", ["", IGNORING_SIGINT], ids=["default", "ignored"])
def test_launch_ctrl_c_stops_every_process(inherited):
    child = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    launcher = [sys.executable, "-c", inherited + LAUNCH[2]]
    launch = subprocess.Popen(
        [*launcher, "launch", "-n", "2", "--grace", "1", "--", *PY, child],
        stdout=subprocess.PIPE,
        text=True,
        env=CLEAN_ENV,
    )
    pids = []
    while len(pids) < 2:
        line = launch.stdout.readline()
        assert line, "launch ended early"
        pids.append(int(line.split()[-1]))
    launch.send_signal(signal.SIGINT)
    assert launch.wait(timeout=20) == 130
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_usage_errors(capsys):
    for args, message in [
        (["-n", "2"], "give the command after --"),
        (["-n", "0", "--", "true"], "-n/--num-processes: expected an integer >= 1, got 0"),
        (["-n", "1", "--cpu-devices", "0", "--", "true"], "expected an integer >= 1, got 0"),
        (["-n", "1", "--heartbeat-timeout", "0", "--", "true"], "expected an integer >= 1"),
        (["-n", "1", "--port", "99999", "--", "true"], "expected a port in 1..65535"),
        (["-n", "1", "--", "/no/such/program"], "cannot run '/no/such/program'"),
    ]:
        try:
            code = cli_main(["launch", *args])
        except SystemExit as e:
            code = e.code
        assert code == 2, args
        assert message in capsys.readouterr().err


# --- in this process ---------------------------------------------------------------------


def test_resolve_coordinates_order(monkeypatch):
    for var in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)
    assert resolve_coordinates(env={}) is None
    launch_env = {ENV_COORDINATOR: "127.0.0.1:99", ENV_NUM_PROCESSES: "2", ENV_PROCESS_ID: "1"}
    assert tuple(resolve_coordinates(env=launch_env)) == ("shardax launch", "127.0.0.1:99", 2, 1)
    # Explicit arguments win over the environment.
    got = resolve_coordinates("10.0.0.1:5", 4, 3, env=launch_env)
    assert tuple(got) == ("arguments", "10.0.0.1:5", 4, 3)
    with pytest.raises(ValueError, match=r"incomplete; missing \['process_id"):
        resolve_coordinates(env={ENV_COORDINATOR: "h:1", ENV_NUM_PROCESSES: "2"})
    with pytest.raises(ValueError, match="SHARDAX_PROCESS_ID must be an integer, got 'x'"):
        resolve_coordinates(env={**launch_env, ENV_PROCESS_ID: "x"})
    with pytest.raises(ValueError, match=r"supplies the missing \['num_processes', 'process_id'\]"):
        resolve_coordinates("h:1", env={})


def test_resolve_coordinates_detects_slurm(monkeypatch):
    slurm = {
        "SLURM_JOB_ID": "12",
        "SLURM_STEP_NODELIST": "node[001-004]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
    }
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    assert resolve_coordinates(env={}).source == "slurm"
    # JAX's own SLURM detection fills in what is left, as sx.initialize relies on.
    from shardax.runtime.compat import private

    addr, n, pid, local = private("ClusterEnv").auto_detect_unset_distributed_params(
        None, None, None, None, None, 10
    )
    assert (addr.split(":")[0], n, pid, local) == ("node001", 4, 2, [0])


def test_initialize_after_backend_started_says_call_it_first():
    jax.devices()
    with pytest.raises(RuntimeError, match=r"must be called before any JAX computation"):
        sx.initialize()


def test_check_agreement_alone_and_fingerprints():
    mesh = sx.make_mesh({"data": -1})
    params = {"w": np.zeros((64, 8), np.float32)}
    digest = sx.runtime.check_agreement(config={"lr": 0.1}, mesh=mesh, plan=sx.fsdp(mesh)(params))
    assert digest == sx.runtime.check_agreement(
        config={"lr": 0.1}, mesh=mesh, plan=sx.fsdp(mesh)(params)
    )
    fp = fingerprint
    # What tells setups apart: config values, mesh shapes, plan rules and their settings.
    assert fp({"lr": 0.1}) != fp({"lr": 0.2})
    assert fp(mesh) != fp(sx.make_mesh({"data": 4, "model": 2}))
    assert fp(sx.fsdp(mesh, min_size=1)) != fp(sx.fsdp(mesh, min_size=2))
    assert fp(sx.fsdp(mesh)) != fp(sx.replicate(mesh))
    assert fp(sx.fsdp(mesh, min_size=1)(params)) != fp(sx.replicate(mesh)(params))
    assert fp(sx.fsdp(mesh)) == fp(sx.fsdp(sx.make_mesh({"data": -1})))

    class Opaque:
        __slots__ = ()

    with pytest.raises(TypeError, match=r"cannot fingerprint a .*Opaque"):
        fp({"thing": Opaque()})
    with pytest.raises(ValueError, match="pass at least one part"):
        sx.runtime.check_agreement()


def test_host_helpers_alone(capsys):
    assert sx.is_main_process()
    sx.print0("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
    out = sx.runtime.host_reduce({"n": np.int64(3), "x": np.ones(2)}, "sum")
    assert out["n"] == 3 and out["x"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="op must be one of"):
        sx.runtime.host_reduce(1.0, "median")
    mesh = sx.make_mesh({"data": -1})
    x = sx.distribute_batch(np.arange(16.0), sx.batch_sharding(mesh))
    got = sx.runtime.host_value({"x": x, "name": "loss"})
    assert isinstance(got["x"], np.ndarray) and got["x"].tolist() == list(range(16))
    assert got["name"] == "loss"


def test_launch_sends_gloo_lines_to_stderr_even_when_two_interleave():
    # gloo writes from several threads: one message can start inside another's line.
    script = (
        "print('[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
        "connected peer ranks is : 1'); print('0 is connected to 1 peer ranks. Expected "
        "number of connected peer ranks is : 1'); print('3 peer ranks. Expected number of "
        "connected peer ranks is : 3'); print('{\"ok\": 1}')"
    )
    procs = start_processes([sys.executable, "-c", script], [dict(CLEAN_ENV)])
    out, err = io.StringIO(), io.StringIO()
    assert supervise(procs, out=out, err=err, prefix_stdout=False) == 0
    assert json.loads(out.getvalue()) == {"ok": 1}
    assert err.getvalue().count("[0] ") == 3 and "0 is connected" in err.getvalue()


def test_launch_reports_an_exception_before_a_peer_killed_by_a_signal():
    # Both seen in one poll: the abort of rank 0 is the consequence of rank 1's exception.
    scripts = ["import os, time; time.sleep(1); os.abort()", "import time; time.sleep(1); exit(3)"]
    procs = [start_processes([sys.executable, "-c", s], [dict(CLEAN_ENV)])[0] for s in scripts]
    for p in procs:
        p.wait()  # both have ended before supervise polls them
    err = io.StringIO()
    assert supervise(procs, out=io.StringIO(), err=err) == 3  # not rank 0's 134
    # every process ended before a poll saw one fail: the failure is still named
    assert re.search(r"process 1 " + WHO + r"exited with code 3; all have ended", err.getvalue())


def test_launch_names_the_process_that_raised_first():
    """Rank 1 raises first, then waits (as in the runtime's shutdown barrier); rank 0's
    collective fails after it, and rank 0 is seen to exit first: launch names both."""
    scripts = [
        "import time; time.sleep(1.0); raise RuntimeError('a collective mismatch')",
        "import atexit, time; atexit.register(time.sleep, 3); time.sleep(0.2); "
        "raise RuntimeError('the cause')",
    ]
    procs = [start_processes([sys.executable, "-c", s], [dict(CLEAN_ENV)])[0] for s in scripts]
    err = io.StringIO()
    assert supervise(procs, out=err, err=err) == 1
    text = err.getvalue()
    assert re.search(
        r"process 0 " + WHO + r"exited with code 1: RuntimeError: a collective mismatch after "
        r"process 1 raised \(its traceback is above\)",
        text,
    ), text
    assert text.index("the cause") < text.index("a collective mismatch")


def test_launch_blames_a_process_killed_from_outside_over_the_peer_that_raised_after_it():
    # Both seen ended in one poll: rank 1 was killed (-9, as by the out-of-memory killer),
    # and rank 0's collective failed because of it, so it raised and exited.
    scripts = [
        "import time; time.sleep(1); raise RuntimeError('Gloo AllGather failed')",
        "import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)",
    ]
    procs = [start_processes([sys.executable, "-c", s], [dict(CLEAN_ENV)])[0] for s in scripts]
    for p in procs:
        p.wait()
    err = io.StringIO()
    assert supervise(procs, out=err, err=err) == 128 + signal.SIGKILL
    assert re.search(r"process 1 " + WHO + r"killed by SIGKILL; all have ended", err.getvalue())
