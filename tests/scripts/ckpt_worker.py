"""Subprocess worker for checkpoint/test_checkpoint.py: train and save, resume, restore, save.

Training uses the real stack: an NNX model with dropout, ``TrainState``, ``make_train_step``
(fsdp plan), ``sx.batches`` and ``sx.prefetch_to_device``; the checkpoint holds the state and
the loader's position.
"""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import shardax as sx  # noqa: E402

rng = np.random.default_rng(0)
X = rng.normal(size=(96, 8)).astype(np.float32)
DATA = {"x": X, "y": np.sin(X.sum(1, keepdims=True))}


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 64, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jnp.tanh(self.l1(x))))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def new_state():
    return sx.TrainState.create(Net(nnx.Rngs(0)), optax.adam(1e-2), rng=1)


def main():
    mode, directory = sys.argv[1], sys.argv[3]
    mesh = sx.make_mesh({"data": -1})
    if mode == "train":  # argv: stop_step [resume]; 16 examples a batch, 6 batches an epoch
        # (only this mode builds the step: the save loops' first commit comes sooner)
        step = sx.make_train_step(loss_fn, mesh=mesh, plan=sx.fsdp(mesh, min_size=1))
        state = step.shard(new_state())
        stop, resume = int(sys.argv[4]), len(sys.argv) > 5
        loader = sx.batches(DATA, 16, shuffle=True, seed=3, num_epochs=None)
        if resume:
            restored = sx.restore_checkpoint(directory, like=state)
            state = restored.state
            loader.set_state(restored.data_state)
        losses = []
        with sx.prefetch_to_device(loader, mesh) as batches:
            while int(state.step) < stop:
                state, metrics = step(state, next(batches))
                losses.append(float(sx.train.check_finite(metrics["loss"], int(state.step))))
            position = batches.get_state()
        sx.save_checkpoint(directory, state, step=int(state.step), data_state=position)
        params = [np.asarray(x).tolist() for x in jax.tree.leaves(state.params)]
        print(json.dumps({"losses": losses, "params": params, "position": position}))
    elif mode == "restore":  # the latest step onto this process's devices, replicated
        like = sx.shard(new_state(), sx.replicate(mesh))
        restored = sx.restore_checkpoint(directory, like=like)
        leaves = jax.tree.leaves(restored.state.params)
        print(
            json.dumps(
                {
                    "step": restored.step,
                    "params": [np.asarray(x).tolist() for x in leaves],
                    "replicated": all(x.sharding.is_fully_replicated for x in leaves),
                    "devices": len(leaves[0].sharding.device_set),
                }
            )
        )
    elif mode == "save_loop":  # saves step k filled with k, forever, announcing each commit
        plan = sx.fsdp(mesh, min_size=1)
        big = sx.shard({"a": jnp.zeros((1024, 1024)), "b": jnp.zeros((512, 512))}, plan)
        with sx.CheckpointManager(directory, max_to_keep=2) as manager:
            for k in range(1, 10_000):
                manager.save(k, jax.tree.map(lambda x, k=k: x + k, big))
                print(f"saved {k}", flush=True)
    elif mode == "async_save_loop":  # save_loop with async saves: k-1 is committed when
        # save(k) returns (orbax's save waits for the save in flight first)
        plan = sx.fsdp(mesh, min_size=1)
        big = sx.shard({"a": jnp.zeros((1024, 1024)), "b": jnp.zeros((512, 512))}, plan)
        with sx.CheckpointManager(directory, max_to_keep=2, async_save=True) as manager:
            for k in range(1, 10_000):
                manager.save(k, jax.tree.map(lambda x, k=k: x + k, big))
                if k > 1:
                    print(f"saved {k - 1}", flush=True)
    elif mode == "overwrite_loop":  # overwrites step 1 with k, forever, announcing each commit
        plan = sx.fsdp(mesh, min_size=1)
        big = sx.shard({"a": jnp.zeros((1024, 1024)), "b": jnp.zeros((512, 512))}, plan)
        with sx.CheckpointManager(directory, max_to_keep=2) as manager:
            for k in range(1, 10_000):
                manager.save(1, jax.tree.map(lambda x, k=k: x + k, big), overwrite=k > 1)
                print(f"saved {k}", flush=True)


if __name__ == "__main__":
    main()
