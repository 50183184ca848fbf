"""global_batch in one process, and on two real processes over gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx
from shardax.cli.launch import free_port
from shardax.data.assembly import process_grid

WORKER = Path(__file__).parents[1] / "scripts" / "data_process.py"


def test_one_process_is_a_device_put(mesh):
    local = {"x": np.arange(32.0).reshape(16, 2), "lr": np.float32(0.1), "name": "b"}
    out = sx.global_batch(local, mesh, global_size=16)
    assert out["x"].sharding.spec == P("data") and out["lr"].sharding.is_fully_replicated
    assert [s.data.shape for s in out["x"].addressable_shards] == [(2, 2)] * 8
    np.testing.assert_array_equal(np.asarray(out["x"]), local["x"])
    assert out["name"] == "b"
    two_d = NamedSharding(sx.make_mesh({"data": 4, "model": 2}), P("data", "model"))
    assert {s.data.shape for s in sx.global_batch(local, two_d)["x"].addressable_shards} == {(4, 1)}
    assert process_grid(two_d, 2) == (1, 1)
    assert sx.global_batch(np.ones(3), jax.devices()[4]).devices() == {jax.devices()[4]}


def test_shapes_are_checked_and_named(mesh):
    with pytest.raises(ValueError, match=r"batch size.*'x': \(16, 2\), 'y': \(15,\)"):
        sx.global_batch({"x": np.zeros((16, 2)), "y": np.zeros(15)}, mesh)
    with pytest.raises(ValueError, match=r"local shape \(16, 2\), expected \(32, 2\)"):
        sx.global_batch({"x": np.zeros((16, 2))}, mesh, global_size=32)
    with pytest.raises(ValueError, match=r"\(12, 2\).*size 12 is not divisible by the size 8"):
        sx.global_batch({"x": np.zeros((12, 2))}, mesh)


def test_two_processes_build_the_one_process_batches():
    port, env = free_port(), {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)  # a hang is a failure
            assert p.returncode == 0, stderr[-3000:]
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    # What one process alone builds from the same loader settings.
    N = 37
    data = {"x": np.arange(N * 3, dtype=np.float32).reshape(N, 3), "y": np.arange(N)}
    expected = list(
        sx.batches(data, 16, shuffle=True, seed=5, policy="pad", process_index=0, process_count=1)
    )
    for r in results:
        assert r["process_count"] == 2
        assert r["local_rows"] == [8, 8, 8]  # each process holds only its half
        assert r["y"] == [b["y"].tolist() for b in expected]
        assert r["mask"] == [b["mask"].tolist() for b in expected]
        want = [float((b["x"] * b["mask"][:, None]).sum()) for b in expected]
        np.testing.assert_allclose(r["sums"], want, rtol=1e-6)
        assert (r["state"]["epoch"], r["state"]["index"]) == (1, 0)
        assert r["grid"] == [2, 1] and r["mesh2_shape"] == [16, 3] and r["lr"] == 1.0
        halves = [np.arange(24.0).reshape(8, 3) + 100 * p for p in (0, 1)]
        np.testing.assert_array_equal(r["mesh2_x"], np.concatenate(halves))
        assert "local shape (5, 3), expected (8, 3)" in r["error"]
        assert "global batch 16 split over 2 process(es)" in r["error"]
