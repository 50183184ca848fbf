"""``shardax train --islands 2``: the job's step as DiLoCo over two islands of the mesh."""

import json

import numpy as np

from shardax.cli.main import main as cli


def test_shardax_train_islands_trains_the_job_over_two_islands(capfd, tmp_path):
    """The MLP job over {"island": 2, "data": 4} with an outer step every 3 inner steps
    learns the digits (islands across processes: tests/train/test_islands_multiprocess.py)."""
    argv = ["train", "--model", "mlp", "--islands", "2", "--inner-steps", "3", "--json",
            "--epochs", "1", "--run-dir", str(tmp_path / "run"),
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    assert cli(argv) == 0
    summary = json.loads(capfd.readouterr().out)
    assert summary["mesh"] == {"island": 2, "data": 4}
    assert summary["history"][-1]["test_accuracy"] > 0.7
    assert np.isfinite(summary["history"][-1]["train_loss"])
