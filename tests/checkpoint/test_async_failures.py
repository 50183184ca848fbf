"""Async saves that fail, collide or are never waited for: a clear error, no lost step, and
the process ends (each runs in a subprocess under a wall-clock limit: a hang fails)."""

import os
import socket
import subprocess
import sys

import jax.numpy as jnp
import pytest

import shardax as sx

WORKER = os.path.join(os.path.dirname(__file__), "..", "scripts", "ckpt_failures.py")
LIMIT = 90  # seconds; orbax's stuck threads used to hold the exit for 300 s


def run_worker(*args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, WORKER, *args], capture_output=True, text=True, timeout=LIMIT
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ckpt_failures.py {args[0]} did not exit within {LIMIT} s: {e.stdout!r}")


@pytest.fixture
def readonly_target(tmp_path):
    """(directory, extra args): made read-only by chmod for a user; for root, whom chmod
    does not stop, a tmpfs remounted read-only (skipped where mounting is not allowed)."""
    if os.geteuid() != 0:
        yield str(tmp_path / "ck"), []
        os.chmod(tmp_path / "ck", 0o755)
        return
    mount = tmp_path / "mnt"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("root without the right to mount a tmpfs: no read-only directory")
    try:
        yield str(mount / "ck"), [str(mount)]
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def _failed_save(out: subprocess.CompletedProcess, directory: str, cause: str) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    wait, steps, end = out.stdout.splitlines()[-3:]
    assert f"checkpoint step 2 was not saved in {directory}: " in wait, wait
    assert cause in wait and "the steps saved before it are kept" in wait, wait
    assert steps == "steps: [1]" and end == "end"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]  # orbax's logs are shardax's error


def test_a_save_into_a_read_only_directory_raises_naming_it_and_exits(readonly_target):
    directory, extra = readonly_target
    out = run_worker("readonly", directory, *extra)
    _failed_save(out, directory, "Read-only file system" if extra else "Permission denied")


def test_a_save_that_runs_out_of_space_raises_naming_the_directory_and_exits(tmp_path):
    directory = str(tmp_path / "ck")
    out = run_worker("full", directory)  # files over 64 KiB fail, as on a full disk
    _failed_save(out, directory, "File too large")


def test_a_full_disk_under_sx_loop_run_names_the_file_and_the_argument(tmp_path):
    """A synchronous save that fails raises the manager's one line (the system's error and
    the file, not orbax's traceback), with the argument to change; step 1 is kept."""
    directory = str(tmp_path / "ck")
    out = run_worker("run-full", directory)
    assert out.returncode == 0, out.stderr[-3000:]
    failed, steps, end = out.stdout.splitlines()
    assert failed.startswith(
        f"run: sx.loop.Run.after_step: checkpoint step 2 was not saved in {directory}: File "
        f"too large ({directory}/2.orbax-checkpoint-tmp/"
    ), failed
    assert failed.endswith(
        "Nothing of step 2 was committed; the steps saved before it are kept. Free space in "
        f"{directory}, or pass another directory as checkpoints="
    ), failed
    assert steps == "steps: [1]" and end == "end"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_a_save_never_waited_for_is_finished_at_exit_or_reported(tmp_path):
    directory = str(tmp_path / "ck")
    out = run_worker("unwaited", directory)
    assert out.returncode == 0, out.stderr[-3000:]
    if sys.version_info < (3, 12):
        assert f"finished saving checkpoint step 2 in {directory} at exit" in out.stderr
        assert sorted(os.listdir(directory)) == ["1", "2"]
    else:  # no thread starts once the script has ended, and orbax needs new ones
        assert f"shardax: checkpoint step 2 was not saved in {directory}: " in out.stderr
        assert "The script ended with this asynchronous save in flight" in out.stderr
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        assert "1" in os.listdir(directory) and "2" not in os.listdir(directory)
    assert out.stdout.splitlines()[-1] == "quiet: True"  # to the end (else a rare traceback)


def test_a_second_manager_in_the_directory_is_refused_and_no_step_is_lost(tmp_path):
    directory = str(tmp_path / "ck")
    out = run_worker("second", directory)
    assert out.returncode == 0, out.stderr[-3000:]
    second, steps, end = out.stdout.splitlines()
    assert second.startswith(
        f"second: sx.CheckpointManager.save: checkpoint directory {directory} is being "
        "written by another CheckpointManager of this process"
    ), second
    assert steps == "steps: [1, 2]" and end == "end"
    assert sorted(os.listdir(directory)) == ["1", "2", "3"]  # no file of shardax's added


def test_another_process_writing_the_directory_is_named(tmp_path):
    directory = str(tmp_path / "ck")
    holder = subprocess.Popen(
        [sys.executable, WORKER, "hold", directory],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "holding\n"
        out = run_worker("second", directory)
        assert out.returncode == 1
        assert (
            f"checkpoint directory {directory} is being written by process {holder.pid} on "
            f"{socket.gethostname()} ({sys.executable} {WORKER} hold {directory}); " in out.stderr
        ), out.stderr[-3000:]
    finally:
        holder.communicate("\n", timeout=LIMIT)
    assert holder.returncode == 0


def test_a_second_run_on_the_directory_is_refused_before_it_touches_the_first_runs_save(
    tmp_path,
):
    """Two sx.loop.run in two processes on one directory: the second stops as it starts,
    naming the first (pid, host, command), and deletes none of its files: neither its
    committed steps nor its save in flight (an unfinished orbax directory, which a
    manager opening the directory used to delete); the first run then ends with every
    step restorable."""
    directory = str(tmp_path / "ck")
    holder = subprocess.Popen(
        [sys.executable, WORKER, "run-hold", directory],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "holding\n"
        out = run_worker("run-second", directory)
        assert out.returncode == 0, out.stderr[-3000:]
        second, steps, end = out.stdout.splitlines()
        assert second == (
            f"second: sx.loop.Run: checkpoint directory {directory} is being written by "
            f"process {holder.pid} on {socket.gethostname()} ({sys.executable} {WORKER} "
            f"run-hold {directory}); two writers in one directory lose steps. Close that "
            "manager (or let that run end), or save into another directory"
        ), second
        assert steps == "steps: [1, 2]" and end == "end"
        assert "3.orbax-checkpoint-tmp-1" in os.listdir(directory)  # the save in flight
    finally:
        rest, _ = holder.communicate("\n", timeout=LIMIT)
    assert holder.returncode == 0 and rest == "end\n"
    with sx.CheckpointManager(directory) as manager:
        assert manager.all_steps() == [1, 2, 3]
        for step in (1, 2, 3):
            got = manager.restore({"w": jnp.zeros(4)}, step=step)
            assert got.state["w"].tolist() == [1.0 + step] * 4


# The CLI with files over 64 KiB failing, as on a full disk (set in the child itself: a
# preexec_fn would fork this multithreaded process). It writes no bytecode (-B): a module
# over 64 KiB would leave a cut-short .pyc in the suite's shared PYTHONPYCACHEPREFIX.
SMALL_FILES = """
import resource, runpy, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
runpy.run_module("shardax", run_name="__main__")
"""


def test_the_cli_says_a_full_disk_in_one_line(tmp_path):
    ck = str(tmp_path / "ck")
    argv = ["train", "--epochs", "1", "--save-every", "4", "--hidden", "256"]
    argv += ["--cpu-devices", "2", "--compile-cache", "off", "--checkpoint-dir", ck]
    argv += ["--run-dir", str(tmp_path / "run")]
    out = subprocess.run(
        [sys.executable, "-B", "-c", SMALL_FILES, *argv],
        capture_output=True,
        text=True,
        timeout=LIMIT * 2,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr[-3000:]
    assert out.stderr.startswith(f"shardax train: error: checkpoint step 4 was not saved in {ck}: ")
    assert "File too large" in out.stderr
