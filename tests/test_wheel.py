"""The built wheel in a fresh venv: `shardax train` with the documented extras trains
and writes its summary, as a user installing from a wheel (not a clone) gets it.

The wheel is built by `uv build`; the venv gets it and the locked versions of its
dependencies (`uv export` of `uv.lock`), from uv's cache or the package index (offline,
it would need the index's pages cached, which `uv sync` does not leave), without resolving
(`--no-deps`; `uv pip check` then checks the wheel's own requirements are met). First
without the `demo` extra: `shardax train` (the digits MLP) refuses at once, naming the
extra; then with `demo` and without `plot`: it trains one epoch and writes summary.json,
with a warning that no curves.png is written.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UV = shutil.which("uv")


def uv(*args, cwd=ROOT, timeout=300):
    proc = subprocess.run([UV, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"uv {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def locked(path, *extras):
    """The locked versions of shardax's dependencies (and ``extras``'), pinned, to ``path``."""
    flags = [f"--extra={e}" for e in extras]
    uv("export", "--frozen", "--no-hashes", "--no-default-groups", "--no-emit-project",
       "--format", "requirements-txt", "--quiet", "--output-file", str(path), *flags)  # fmt: skip
    return str(path)


def shardax(venv, *argv, cwd):
    """``venv``'s ``shardax *argv``, started (the caller waits), run as a user would: from
    ``cwd``, with no path to this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.Popen(
        [str(venv / "bin" / "shardax"), *argv],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def finished(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


@pytest.mark.skipif(UV is None, reason="needs uv (it builds the wheel and the venv); not on PATH")
@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="the wheel is pure Python and the same on every leg: CI checks it once, on Python "
    "3.11 (leg 1), where a two-venv install costs a minute (two on leg 2)",
)
def test_wheel_in_a_fresh_venv_trains_with_the_documented_extras(tmp_path):
    uv("build", "--wheel", "--out-dir", str(tmp_path / "dist"), "--quiet")
    (wheel,) = (tmp_path / "dist").glob("shardax-*.whl")

    def venv(name, *extras):
        """A fresh venv with the wheel and the locked packages of ``extras``."""
        path = tmp_path / name
        uv("venv", "--quiet", "--python", sys.executable, str(path))
        python = str(path / "bin" / "python")
        requirements = locked(tmp_path / f"{name}.txt", *extras)
        uv("pip", "install", "--quiet", "--no-deps", "--python", python,
           "-r", requirements, str(wheel))  # fmt: skip
        uv("pip", "check", "--python", python)  # the wheel's requirements are installed
        return path

    bare, demo = venv("bare"), venv("demo", "demo")
    run = tmp_path / "run"
    # both at once: each imports JAX, flax and optax from scratch (no bytecode yet)
    refused = shardax(bare, "train", "--epochs", "1", cwd=tmp_path)
    trained = shardax(demo, "train", "--epochs", "1", "--cpu-devices", "2", "--run-dir", str(run),
                      "--json", cwd=tmp_path)  # fmt: skip
    code, _, err = finished(refused)
    assert code == 2, err
    assert (
        "shardax train: error: --model mlp needs sklearn; install it with: pip install "
        "'shardax[demo]' (or the package alone: pip install 'scikit-learn>=" in err
    )
    code, out, err = finished(trained)
    assert code == 0, err[-3000:]
    assert (
        "warning: curves.png will not be written: plotting needs matplotlib; install it "
        "with: pip install 'shardax[plot]'" in err
    )
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads(out) == summary
    assert summary["plot"] is None and not (run / "curves.png").exists()
    assert summary["devices"] == 2 and summary["epochs"] == 1 and summary["test_accuracy"] > 0.5
    assert len(list(demo.glob("lib/python*/site-packages/shardax/cli/train.py"))) == 1
    assert not list(demo.glob("lib/python*/site-packages/*shardax*.pth"))  # not an editable
