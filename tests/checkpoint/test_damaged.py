"""A committed step damaged on disk (a file truncated after the commit) is named as
damaged, in one line, and the newest intact step is used in its place, with a warning:
by ``restore``, and so by ``sx.loop.run``'s resume, which then trains on equal to a run
that was never damaged."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx


def _state(step):
    return {"w": jnp.arange(4096.0) * step, "b": jnp.full(3, float(step))}


def _like():
    return {"w": jnp.zeros(4096), "b": jnp.zeros(3)}


def _truncate_largest_file(step_dir):
    """Cuts the largest file of the step's arrays to half (a copy cut short)."""
    path = max(
        (
            os.path.join(root, name)
            for root, _, names in os.walk(step_dir / "state")
            for name in names
        ),
        key=os.path.getsize,
    )
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_a_truncated_latest_step_is_named_and_the_newest_intact_step_used(tmp_path):
    with sx.CheckpointManager(tmp_path) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
    _truncate_largest_file(tmp_path / "3")
    with sx.CheckpointManager(tmp_path) as manager:
        with pytest.raises(OSError) as caught:
            manager.restore(_like(), step=3)
        message = str(caught.value)
        assert message.startswith(
            f"sx.CheckpointManager.restore: checkpoint step 3 in {tmp_path} is damaged (it "
            "cannot be read: OUT_OF_RANGE: Error reading "
        ), message
        assert message.endswith("); restore another step (step=, committed: [1, 2])")
        assert len(message) < 500  # one line, not tensorstore's spec
        with pytest.warns(UserWarning) as seen:
            got = manager.restore(_like())
        words = [str(w.message) for w in seen if "damaged" in str(w.message)]
        assert len(words) == 1 and words[0].startswith(
            f"checkpoint step 3 in {tmp_path} is damaged (it cannot be read: OUT_OF_RANGE: "
        ), words
        assert words[0].endswith(
            f"restored step 2, the newest intact step, instead: it is moved aside to "
            f"{tmp_path}/.damaged-3 (kept for inspection: delete it when done)"
        ), words[0]
        assert got.step == 2
        np.testing.assert_array_equal(got.state["w"], _state(2)["w"])
        assert manager.all_steps() == [1, 2]
        manager.save(3, _state(3))  # the run goes on and saves step 3 again
        np.testing.assert_array_equal(manager.restore(_like()).state["w"], _state(3)["w"])
    assert sorted(os.listdir(tmp_path)) == [".damaged-3", "1", "2", "3"]


def test_a_truncated_metadata_file_is_damage_not_a_model_mismatch(tmp_path):
    with sx.CheckpointManager(tmp_path) as manager:
        manager.save(1, _state(1))
    with open(tmp_path / "1" / "state" / "_METADATA", "r+b") as f:
        f.truncate(10)
    with sx.CheckpointManager(tmp_path) as manager, pytest.raises(OSError) as caught:
        manager.restore(_like())
    assert str(caught.value).startswith(
        f"sx.CheckpointManager.restore: no committed step of {tmp_path} can be read (damaged "
        "on disk?): step 1: JSONDecodeError: "
    ), str(caught.value)
    assert not isinstance(caught.value, ValueError)  # not "does not fit this model"


@jax.jit
def _train_step(state, batch):
    return {"w": state["w"] - 0.1 * (state["w"] - batch["x"].mean(0))}, jnp.mean(state["w"])


def _train(directory, steps, mesh):
    data = {"x": np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)}
    with sx.loop.run({"w": jnp.zeros(4)}, checkpoints=directory, every={"save": 2},
                     goodput=False) as run:  # fmt: skip
        state = run.state
        for batch in run.batches(sx.batches(data, 8), mesh, steps=steps):
            state, loss = _train_step(state, batch)
            run.after_step(state, loss)
    return run, state


def test_a_run_resumes_past_a_damaged_latest_step_equal_to_the_straight_run(tmp_path, mesh):
    _train(tmp_path / "run", 4, mesh)
    _truncate_largest_file(tmp_path / "run" / "4")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run, resumed = _train(tmp_path / "run", 6, mesh)
    assert run.first == 2  # step 4 was damaged: from step 2, with the line saying so
    assert any("checkpoint step 4 in" in str(w.message) and "restored step 2" in str(w.message)
               for w in seen)  # fmt: skip
    _, straight = _train(tmp_path / "straight", 6, mesh)
    np.testing.assert_array_equal(resumed["w"], straight["w"])
    assert sx.CheckpointManager(tmp_path / "run").all_steps() == [2, 4, 6]
