"""Every test sees 8 simulated CPU devices, set before any JAX backend starts.

Most of the suite's time is XLA compiling small programs, in this process and in each
subprocess, so:

- the session shares one persistent compilation cache (JAX's own, in a fresh temporary
  directory deleted at the end) with the CLI and multi-process tests it starts, which
  inherit it through the environment;
- XLA:CPU compiles with the flags of ``tests/xla_flags.py`` (``XLA_FLAGS``, inherited
  likewise): the backend at optimization level 0 and, on JAX 0.10, the older elemental
  emitters; the same HLO, shardings and collectives, compiled in a fraction of the time.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from xla_flags import TEST_XLA_FLAGS

for _flag in TEST_XLA_FLAGS:  # tests/xla_flags.py: why each
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# The tests run on the CPU; naming it also lets JAX's CUDA plugin (the gpu-compile extra of
# the compile leg) register its compiler without a GPU driver
# (shardax/cost/plugins.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Python's bytecode: where the environment turns its writing off (PYTHONDONTWRITEBYTECODE),
# every subprocess compiled JAX, Flax, orbax and shardax from source again, about 2 s of a
# core each, over a hundred processes a run. The session keeps the bytecode in a temporary
# directory of its own instead (PYTHONPYCACHEPREFIX, inherited like the JAX cache below):
# nothing is written beside the sources, and it is deleted at the end.
_OWN_PYCACHE = bool(os.environ.get("PYTHONDONTWRITEBYTECODE")) and not os.environ.get(
    "PYTHONPYCACHEPREFIX"
)
if _OWN_PYCACHE:
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="shardax-tests-pycache-")
    sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False

# pytest-xdist gives each worker COLUMNS=80 (its terminal's width, or 80 without one), and
# the CLI's piped output honours $COLUMNS: the tests read the CLI as a pipe does, 120 wide
# (cli/common.py PIPED_WIDTH); a test of COLUMNS sets it itself (monkeypatch).
os.environ.pop("COLUMNS", None)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Under pytest-xdist (pyproject's addopts) the workers share the controller's cache: each
# inherits its environment, and only the process that made the directory deletes it.
_OWN_CACHE = "SHARDAX_TESTS_JAX_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["SHARDAX_TESTS_JAX_CACHE"] = tempfile.mkdtemp(prefix="shardax-tests-jax-cache-")
CACHE_DIR = os.environ["SHARDAX_TESTS_JAX_CACHE"]
CACHE_ENV = {
    "JAX_COMPILATION_CACHE_DIR": CACHE_DIR,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
os.environ.update(CACHE_ENV)
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# --- compile-only targets (sx.target): GPU and TPU compilers without the devices -----------

COMPILE_EXTRAS = {
    "gpu": ("jax_plugins.xla_cuda12", "gpu-compile"),
    "tpu": ("libtpu", "tpu-compile"),
}


def missing_compile_extras(kinds=("gpu", "tpu")) -> list[str]:
    """What the compile-only tests of ``kinds`` lack: JAX >= 0.12, then each extra."""
    from shardax.cost.plugins import installed

    if tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 12):
        extras = " and ".join(f"shardax[{COMPILE_EXTRAS[k][1]}]" for k in kinds)
        return [f"JAX >= 0.12 (Python 3.12+; this is JAX {jax.__version__}) with {extras}"]
    return [
        f"shardax[{extra}] ({module.split('.')[-1]})"
        for kind, (module, extra) in COMPILE_EXTRAS.items()
        if kind in kinds and not installed(module)
    ]


# pytest-xdist (``--dist loadgroup`` in pyproject) sends each test to any worker, except
# tests that share work, which go to one worker together so that the work happens once:
# the users of a session fixture's run (SHARED_RUNS), of a module or class fixture (by
# file), and the tests of a file whose module-level caches (functools.cache) they share.
SHARED_RUNS = ("launched_train", "tiny_gpt_run")
CACHED_FILES = (
    "tests/models/test_gpt_context.py",
    "tests/parallel/test_moe.py",
    "tests/train/test_train_step.py",
)


def xdist_group(item, root: Path) -> str | None:
    """The group ``item`` runs in (None: any worker, on its own)."""
    file = Path(str(item.path)).relative_to(root).as_posix()
    if any(name in SHARED_RUNS for name in item.fixturenames):
        return "shared-runs"
    defs = getattr(item, "_fixtureinfo", None)
    for fixtures in defs.name2fixturedefs.values() if defs else ():
        if fixtures and fixtures[-1].scope in ("module", "class", "package"):
            return file
    return file if file in CACHED_FILES else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Groups the tests for pytest-xdist (:func:`xdist_group`), and
    ``@pytest.mark.compile_only`` (or ``compile_only("gpu")``) tests skip, naming what is
    missing, where the compile extras are not installed (CI legs 1 and 2); leg 3 installs
    them and sets SHARDAX_COMPILE_TESTS=required, so there a missing extra fails instead."""
    root = Path(str(config.rootpath))
    for item in items:
        group = xdist_group(item, root)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("SHARDAX_COMPILE_TESTS") == "required":
        return
    for item in items:
        marker = item.get_closest_marker("compile_only")
        if marker is None:
            continue
        missing = missing_compile_extras(marker.args or ("gpu", "tpu"))
        if missing:
            reason = f"compile-only target test: needs {', '.join(missing)} (CI leg 3)"
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(CACHE_DIR, ignore_errors=True)
    if _OWN_PYCACHE:
        shutil.rmtree(sys.pycache_prefix, ignore_errors=True)


@pytest.fixture(scope="session")
def launched_train(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """One ``shardax launch -n 2 --cpu-devices 2 -- shardax train`` run (MLP, 2 epochs of
    6 steps, a profile of steps 2:3, scalars every step, its last step saved in
    ``<run>/ckpt``), shared by the tests that check different things about it (test_cli:
    JSON and output of the processes, the curve of one process; test_cli_track: one trace
    per process, process 0's scalars; test_preemption: the uninterrupted run a preempted
    one resumes to, bitwise): three Python processes cost more than the training. Returns
    the finished process, its run directory and the train options it used."""
    run = tmp_path_factory.mktemp("launched") / "run"
    train = ["--epochs", "2", "--hidden", "32", "--batch-size", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "shardax", "launch", "-n", "2", "--cpu-devices", "2", "--",
         sys.executable, "-m", "shardax", "train", *train, "--run-dir", str(run),
         "--checkpoint-dir", str(run / "ckpt"), "--save-every", "1000",
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
