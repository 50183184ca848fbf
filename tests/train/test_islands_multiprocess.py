"""DiLoCo with one island per process: 2 real processes x 4 CPU devices over gloo (under
``shardax launch``, with a wall-clock timeout) train as 1 process with 2 islands does."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_multihost import CLEAN_ENV, LAUNCH, results

SCRIPT = str(Path(__file__).parents[1] / "scripts" / "islands_worker.py")
_spec = importlib.util.spec_from_file_location("islands_worker", SCRIPT)
islands_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(islands_worker)


@pytest.mark.timeout(300)
def test_one_island_per_process_agrees_with_two_islands_in_one_process():
    options = ["-n", "2", "--cpu-devices", "4", "--heartbeat-timeout", "10"]
    proc = subprocess.run(
        [*LAUNCH, "launch", *options, "--", sys.executable, SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env=CLEAN_ENV,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = results(proc.stdout)
    assert sorted(got) == [0, 1], proc.stdout[-4000:]
    for compress, *ranks in zip(islands_worker.CONFIGS, got[0], got[1], strict=True):
        reference = islands_worker.train(compress)  # 1 process x 8 devices: 2 islands here
        assert reference["processes"] == 1 and sorted(reference["losses"]) == ["0", "1"]
        for rank, r in enumerate(ranks):
            assert r["compress"] == compress and r["processes"] == 2 and r["process"] == rank
            assert r["island_processes"] == [[0], [1]]  # island i is process i
            assert r["rows"] == [16 * rank, 16 * rank + 16]  # its island's rows only
            assert list(r["losses"]) == [str(rank)]  # it holds its own island's loss only
            np.testing.assert_allclose(
                r["losses"][str(rank)], reference["losses"][str(rank)], rtol=1e-6
            )
            assert r["syncs"] == reference["syncs"] == islands_worker.STEPS // islands_worker.H
            for name, value in reference["anchor"].items():
                np.testing.assert_allclose(r["anchor"][name], value, rtol=1e-6, atol=1e-7)
