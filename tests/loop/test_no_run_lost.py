"""No run is lost through ``sx.loop.run``: a tiny plain-pytree model (a weight and a PRNG
key, never placed by ``sx.prepare``) trained by the user's own ``jax.jit`` step over a tmp
directory, in this process.

A run that would mix its steps with an earlier run's, save a state it never got, or save
the metrics as the state is refused, naming the way out; a resumed state is placed where
the live one was, so the next jitted step runs; a loop that gets no batch says so; the
preemption line says how this loop continues.
"""

from __future__ import annotations

import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardax as sx

ROWS = np.random.default_rng(0).normal(size=(48, 6)).astype(np.float32)
DATA = {"x": ROWS[:, :4], "y": ROWS[:, 4:]}
BATCHES = [{"x": DATA["x"][i : i + 8], "y": DATA["y"][i : i + 8]} for i in range(0, 48, 8)]


@jax.jit
def train_step(state, batch):  # the user's own step, not donating (donate=False)
    def loss_fn(w):
        return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

    loss, grad = jax.value_and_grad(loss_fn)(state["w"])
    key, _ = jax.random.split(state["key"])
    return {**state, "w": state["w"] - 0.01 * grad, "key": key}, loss


def fresh():
    """The live state as a user builds it: uncommitted arrays on the default device."""
    return {"w": jnp.zeros((4, 2)), "key": jax.random.key(0)}


def train(directory, steps, mesh, state=None, **kwargs):
    with sx.loop.run(fresh() if state is None else state, checkpoints=directory,
                     goodput=False, **kwargs) as run:  # fmt: skip
        state = run.state
        for batch in run.batches(sx.batches(DATA, 8), mesh, steps=steps):  # resumable
            state, loss = train_step(state, batch)
            run.after_step(state, loss)
    return run, state


def test_a_fresh_run_over_an_earlier_runs_checkpoints_is_refused(tmp_path, mesh):
    train(tmp_path, 4, mesh, every={"save": 2})
    with (
        pytest.raises(ValueError) as caught,
        sx.loop.run(fresh(), checkpoints=tmp_path, resume=False),
    ):
        pytest.fail("entered")  # pragma: no cover
    assert str(caught.value) == (
        f"sx.loop.Run: the checkpoint directory {tmp_path} already holds checkpoints (steps "
        "2, 4) of an earlier run: a run started afresh would save its steps among them and a "
        "resume would take the newest, whichever run it is from. Pass resume=True to continue "
        "from them, or choose an empty directory"
    )
    assert sx.CheckpointManager(tmp_path).all_steps() == [2, 4]  # untouched
    train(tmp_path / "empty", 1, mesh, resume=False)  # an empty directory is fine


def test_a_state_never_handed_to_after_step_saves_nothing_and_says_why(tmp_path, mesh):
    with pytest.raises(RuntimeError) as caught, sx.loop.run(fresh(), checkpoints=tmp_path) as run:
        state = run.state
        for batch in run.batches(BATCHES, mesh, steps=4):
            state, _ = train_step(state, batch)  # no run.after_step
    assert str(caught.value).startswith(
        "sx.loop.Run: the loop took 4 batches (steps 1..4) but never called "
        "run.after_step(state, metrics), so the run never had a state of theirs: nothing was "
        "saved at the end (it would have saved the state the run started with as step 4)"
    )
    assert sx.CheckpointManager(tmp_path).all_steps() == []


def test_a_loop_that_leaves_before_handing_its_last_step_saves_no_older_state(tmp_path, mesh):
    with pytest.warns(UserWarning, match=re.escape(
        "sx.loop.Run: step 3's batch was taken but run.after_step was not called for it (the "
        "last state handed is step 2's): nothing was saved at the end"
    )), sx.loop.run(fresh(), checkpoints=tmp_path, goodput=False) as run:  # fmt: skip
        state = run.state
        for batch in run.batches(BATCHES, mesh):
            if run.step == 3:
                break
            state, loss = train_step(state, batch)
            run.after_step(state, loss)
    assert sx.CheckpointManager(tmp_path).all_steps() == []


def test_after_step_takes_the_runs_state_and_scalar_metrics_inside_the_run(tmp_path, mesh):
    with sx.loop.run(fresh(), checkpoints=tmp_path, every={"save": 1}) as run:
        batches = run.batches(BATCHES, mesh)
        state, loss = train_step(run.state, next(batches))
        with pytest.raises(TypeError, match=re.escape(
            "sx.loop.Run.after_step: state must be the run's state, a dict with keys ['w', "
            "'key'] as the run started, got a dict with keys ['loss'] (it lacks the run's leaf "
            "'key' and 1 more); call run.after_step(state, metrics)"
        )):  # fmt: skip
            run.after_step({"loss": loss})  # the state left out
        with pytest.raises(ValueError, match=re.escape(
            "sx.loop.Run.after_step: metrics['loss'] must be a scalar (one number per step, "
            "which the run logs and, for the loss, checks finite), got shape (2,)"
        )):  # fmt: skip
            run.after_step(state, {"loss": [np.nan, 1.0]})
        with pytest.raises(TypeError, match=re.escape(
            "sx.loop.Run.after_step: metrics (loss, aux) must have a dict of scalar metrics as "
            "aux, got aux Array("
        )):  # fmt: skip
            run.after_step(state, (loss, jnp.ones(3)))
        assert sx.CheckpointManager(tmp_path).all_steps() == []  # nothing saved by those
        run.after_step(state, (loss, {"accuracy": jnp.float32(0.5)}))  # the loss contract's
        assert [sorted(m) for _, m in run.flushed] == [["accuracy", "loss"]]
        assert sx.CheckpointManager(tmp_path).all_steps() == [1]
    with pytest.raises(RuntimeError, match=re.escape(
        "sx.loop.Run.after_step: the run has ended (its with block was left at step 1): "
        "run.after_step() after it would count, save or log nothing"
    )):  # fmt: skip
        run.after_step(state, loss)
    assert sx.CheckpointManager(tmp_path).all_steps() == [1]


def test_a_resumed_plain_pytree_and_key_are_placed_as_the_live_ones(tmp_path, mesh):
    """The state is never placed (no sx.prepare): a weight and a key, uncommitted on the
    default device, beside a leaf the user placed on the mesh. Restored committed to
    device 0, the next jitted step beside the mesh's batch would fail ("incompatible
    devices"); each leaf comes back as the live one is."""
    placed = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    _, straight = train(tmp_path / "straight", 4, mesh, state={**fresh(), "placed": placed})
    train(tmp_path / "c", 2, mesh, state={**fresh(), "placed": placed}, every={"save": 2})
    live = {**fresh(), "placed": placed}
    with sx.loop.run(live, checkpoints=tmp_path / "c", goodput=False) as run:
        restored = run.state
        assert run.first == 2
        for name in live:
            got, want = restored[name], live[name]
            assert got.committed == want.committed and got.sharding == want.sharding, name
            assert [s.device for s in got.addressable_shards] == [
                s.device for s in want.addressable_shards
            ]
        state = restored
        for batch in run.batches(sx.batches(DATA, 8), mesh, steps=4):  # the next step runs
            state, loss = train_step(state, batch)
            run.after_step(state, loss)
    np.testing.assert_array_equal(state["w"], straight["w"])
    np.testing.assert_array_equal(jax.random.key_data(state["key"]),
                                  jax.random.key_data(straight["key"]))  # fmt: skip


def test_a_loop_that_gets_no_batch_says_so(tmp_path, mesh):
    used = iter(BATCHES[:2])
    list(used)
    with pytest.warns(UserWarning, match=re.escape(
        "sx.loop.Run.batches: the loader gave no batch, so this loop ran 0 steps (the run is "
        "at step 0): it is empty or exhausted"
    )), sx.loop.run(fresh(), goodput=False) as run:  # fmt: skip
        for _ in run.batches(used):
            pytest.fail("a batch")  # pragma: no cover
    with sx.loop.run(fresh(), goodput=False) as run:
        for batch in run.batches(BATCHES, steps=2):
            run.after_step(*train_step(run.state, batch))
        with pytest.warns(UserWarning, match=re.escape(
            "sx.loop.Run.batches: the run is at step 2 of steps=2, so this loop gets no "
            "batch; pass a larger steps= to train further"
        )):  # fmt: skip
            for _ in run.batches(BATCHES):
                pytest.fail("a batch")  # pragma: no cover


def test_the_preemption_line_says_how_this_loop_continues(tmp_path, mesh):
    def preempted(**kwargs):
        with (
            pytest.raises(sx.Preempted) as caught,
            sx.loop.run(
                fresh(),
                checkpoints=tmp_path / str(len(kwargs)),
                goodput=False,
                exit_on_preemption=False,
                **kwargs,
            ) as run,  # fmt: skip
        ):
            for batch in run.batches(BATCHES, mesh):
                if run.step == 2:
                    os.kill(os.getpid(), signal.SIGTERM)  # the run's handler notes it
                run.after_step(*train_step(run.state, batch))
        return str(caught.value)

    assert preempted() == (
        f"preempted (SIGTERM): saved step 2 to {tmp_path / '0'}; exiting with code 75 so the "
        "scheduler requeues the job; run the script again to continue from it (sx.loop.run "
        "resumes from the latest checkpoint)"
    )
    assert preempted(resume=False).endswith(
        "requeues the job; run it again with sx.loop.run(..., resume=True) to continue from it"
    )
    assert str(sx.Preempted(3, "d")).endswith("restore it to continue (sx.restore_checkpoint)")


def test_the_checkpoints_loader_position_moves_the_first_loop_only(tmp_path, mesh):
    train(tmp_path, 2, mesh, every={"save": 2})  # saved after batches 0 and 1
    firsts = []
    with sx.loop.run(fresh(), checkpoints=tmp_path, goodput=False) as run:
        loader = sx.batches(DATA, 8)
        for steps in (3, 4):  # two loops over one loader: the second goes on from the first
            for batch in run.batches(loader, steps=steps):
                firsts.append(float(batch["x"][0, 0]))
                run.after_step(*train_step(run.state, batch))
    assert firsts == [DATA["x"][16, 0], DATA["x"][24, 0]]


def test_an_evaluate_that_raises_never_costs_the_save_of_its_step(tmp_path, mesh):
    """every={"save": 2, "eval": 2} with an evaluate that fails at step 2: the step is
    saved before it is evaluated, so the run resumes from step 2, equal to the straight run."""

    def evaluate(state):
        raise FloatingPointError("the evaluation set is gone")

    with pytest.raises(FloatingPointError, match="the evaluation set is gone"):
        train(tmp_path, 4, mesh, every={"save": 2, "eval": 2}, evaluate=evaluate)
    with sx.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [2]
    _, straight = train(tmp_path / "straight", 4, mesh)
    run, resumed = train(tmp_path, 4, mesh)  # resumed at step 2: steps 3 and 4
    assert run.first == 2
    np.testing.assert_array_equal(resumed["w"], straight["w"])
