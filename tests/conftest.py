"""Every test sees 8 simulated CPU devices, set before any JAX backend starts.

Most of the suite's time is XLA compiling small programs, in this process and in each
subprocess, so:

- the session shares one persistent compilation cache (JAX's own, in a fresh temporary
  directory deleted at the end) with the CLI and multi-process tests it starts, which
  inherit it through the environment;
- XLA:CPU's backend (LLVM) optimizes at level 0 (``XLA_FLAGS``, inherited likewise):
  the same HLO programs, shardings, collectives and buffer assignments, compiled in
  about half the time and run more slowly. The tests check what is computed and where
  it is placed, never how fast; ``benchmarks/`` keep the default level.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

CACHE_DIR = tempfile.mkdtemp(prefix="shardax-tests-jax-cache-")
CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": CACHE_DIR,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(CACHE_ENV)
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def launched_train(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """One ``shardax launch -n 2 --cpu-devices 2 -- shardax train`` run (MLP, 2 epochs of
    6 steps, a profile of steps 2:3, scalars every step), shared by the tests that check
    different things about it (test_cli: JSON and output of the processes, the curve of one
    process; test_cli_track: one trace per process, process 0's scalars): three Python
    processes cost more than the training. Returns the finished process, its run directory
    and the train options it used."""
    run = tmp_path_factory.mktemp("launched") / "run"
    train = ["--epochs", "2", "--hidden", "32", "--batch-size", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "shardax", "launch", "-n", "2", "--cpu-devices", "2", "--",
         sys.executable, "-m", "shardax", "train", *train, "--run-dir", str(run),
         "--profile-steps", "2:3", "--log-every", "1", "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    return proc, run, train


# --- shared meshes ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def mesh():
    """All 8 simulated devices on one ``data`` axis."""
    import shardax as sx

    return sx.make_mesh({"data": -1})


@pytest.fixture(scope="session")
def mesh_2d():
    """``data=4, model=2``: data parallelism with 2-way tensor parallelism."""
    import shardax as sx

    return sx.make_mesh({"data": 4, "model": 2})


@pytest.fixture(scope="session")
def stage_mesh():
    """``data=2, stage=4``: the pipeline tests' mesh."""
    import shardax as sx

    return sx.make_mesh({"data": 2, "stage": 4})
