"""A user's own training loop with ``sx.loop.run``, for tests/loop/test_user_loop.py.

Two flavours, each the user's loop plus the lines ``sx.loop.run`` adds:

- ``nnx``: an NNX model with dropout and an ``nnx.Optimizer``, placed with
  ``sx.prepare``, stepped by the user's own ``nnx.jit`` step; the state the run saves
  and restores (in place) is ``(model, optimizer)``;
- ``step``: a ``sx.make_train_step`` loop on a ``sx.TrainState``.

Run as a script it trains and prints one ``RESULT {json}`` line (the losses of this
session's steps and the final params); ``--sigterm-at S`` sends this process SIGTERM
during step S (the run saves S and exits 75); ``--hang-at S`` makes process 1 of a
multi-process run (``sx.initialize()``) sleep in step S under ``--watchdog``, and
``--late T`` makes process 0 sleep T seconds in step S-1, so its watchdog fires T seconds
after process 1's (as on a loaded machine); ``--stall-data-at S`` makes the loader sleep
before it yields step S's batch; ``--kill-at S`` kills process 1 with -9 in step S of the
run's first start, ``--kill-in-snapshot S`` while its snapshot of step S is written
(``--snapshots N``: ``sx.loop.run``'s ``snapshots``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

ROWS = np.random.default_rng(0).normal(size=(160, 9)).astype(np.float32)
DATA = {"x": ROWS[:, :8], "y": np.sin(ROWS[:, 8:])}


def train(flavour: str, ckpt: str, steps: int, *, save_every: int = 4, sigterm_at: int = 0,
          hang_at: int = 0, watchdog: float | None = None,
          late: float = 0.0, stall_data_at: int = 0, kill_at: int = 0,
          kill_in_snapshot: int = 0, snapshots: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Trains to ``steps`` (resuming from ``ckpt`` when it holds a checkpoint); returns
    this session's losses (by step) and the final params as lists."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.l1 = nnx.Linear(8, 32, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.l2 = nnx.Linear(32, 1, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.l2(self.drop(jnp.tanh(self.l1(x))))

    def loss_fn(model: Any, batch: Any) -> Any:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    mesh = sx.make_mesh({"data": -1})
    loader = sx.batches(DATA, 16, shuffle=True, seed=3, num_epochs=None)
    if stall_data_at:
        loader = _stalling(loader, stall_data_at)
    losses: dict[int, float] = {}

    def poke(run: Any) -> None:  # the faults a test asks for, inside step run.step
        if run.step == sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if run.step == hang_at and jax.process_index() == 1:
            time.sleep(600)
        if run.step == hang_at - 1 and jax.process_index() == 0:
            time.sleep(late)
        first_start = not os.environ.get("SHARDAX_RESTART")
        if run.step == kill_at and jax.process_index() == 1 and first_start:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash, in the first start only

    if kill_in_snapshot and jax.process_index() == 1 and not os.environ.get("SHARDAX_RESTART"):
        from shardax.runtime import faults

        where = os.environ.get("SHARDAX_SNAPSHOT_DIR")
        threading.Thread(target=faults.kill_while_saving, args=(where, kill_in_snapshot),
                         daemon=True).start()  # fmt: skip

    every = {"save": save_every, "log": 1}  # each step's loss written and checked finite
    writer = f"{ckpt}-metrics"
    if flavour == "nnx":

        @nnx.jit
        def train_step(model: Any, optimizer: Any, batch: Any) -> Any:
            loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss

        model = Net(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        model, optimizer = sx.prepare(model, optimizer, mesh=mesh, plan=sx.fsdp(mesh, min_size=1))
        with sx.loop.run((model, optimizer), checkpoints=ckpt, every=every, steps=steps,
                         watchdog=watchdog, writer=writer, snapshots=snapshots) as run:  # fmt: skip
            for batch in run.batches(loader, mesh):
                poke(run)
                loss = train_step(model, optimizer, batch)
                run.after_step((model, optimizer), loss)
                losses[run.step] = loss
        params = nnx.state(model, nnx.Param)
    else:
        step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=1))
        state = step.init(lambda: sx.TrainState.create(Net(nnx.Rngs(0)), optax.adam(1e-2), rng=1))
        with sx.loop.run(state, checkpoints=ckpt, every=every, steps=steps,
                         watchdog=watchdog, writer=writer, snapshots=snapshots) as run:  # fmt: skip
            state = run.state
            for batch in run.batches(loader, mesh):
                poke(run)
                state, metrics = step(state, batch)
                run.after_step(state, metrics)
                losses[run.step] = metrics["loss"]
        params = state.params
    return {
        "losses": {str(k): float(v) for k, v in losses.items()},
        "params": [np.asarray(x).tolist() for x in jax.tree.leaves(sx.runtime.host_value(params))],
    }


def _stalling(loader: Any, at: int) -> Any:
    """``loader``'s batches, sleeping before the ``at``-th (a stuck reader)."""
    for i, batch in enumerate(loader, start=1):
        if i == at:
            time.sleep(600)
        yield batch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("flavour", choices=("nnx", "step"))
    parser.add_argument("ckpt")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--sigterm-at", type=int, default=0)
    parser.add_argument("--hang-at", type=int, default=0)
    parser.add_argument("--watchdog", type=float, default=None)
    parser.add_argument("--late", type=float, default=0.0)
    parser.add_argument("--stall-data-at", type=int, default=0)
    parser.add_argument("--cpu-devices", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-in-snapshot", type=int, default=0)
    parser.add_argument("--snapshots", type=int, default=None)
    args = parser.parse_args()
    import jax

    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import shardax as sx

    sx.initialize()  # a no-op alone; joins the run under shardax launch's environment
    out = train(args.flavour, args.ckpt, args.steps, save_every=args.save_every,
                sigterm_at=args.sigterm_at, hang_at=args.hang_at,
                watchdog=args.watchdog, late=args.late,
                stall_data_at=args.stall_data_at, kill_at=args.kill_at,
                kill_in_snapshot=args.kill_in_snapshot,
                snapshots=args.snapshots)  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
