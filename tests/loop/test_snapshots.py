"""Snapshots every step: each step starts once the snapshot of the step before is
committed, so a failure at any moment loses at most the step in flight."""

import os

import jax

import shardax as sx


def committed(directory):
    """The newest committed step in ``directory`` (orbax renames a step's temporary
    directory to its number when the save commits), read without waiting for a save."""
    steps = (
        [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
    )
    return max(steps, default=None)


def test_every_step_the_next_step_starts_once_the_last_snapshot_is_committed(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDAX_SNAPSHOT_DIR", str(tmp_path / "shm"))
    state = {"w": jax.random.normal(jax.random.key(0), (1024, 1024))}  # 4 MiB a snapshot
    behind = []
    with sx.loop.run(state, snapshots=1, goodput=False) as run:
        directory = str(run.snapshots.directory)
        for _ in run.batches(range(6)):
            newest = committed(directory)
            behind.append(run.step - (0 if newest is None else newest))
            run.after_step({"w": run.state["w"] * 1.0001})
    # step 1 follows no snapshot; every later one starts right after its predecessor's
    assert behind == [1, 1, 1, 1, 1, 1], behind
    assert committed(directory) == 6
