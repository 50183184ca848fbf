"""Subprocess worker for tests/test_checkpoint.py: train, save, restore, or save in a loop."""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardax as sx  # noqa: E402

TX = optax.adam(1e-2)


def init_state():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (8, 32)) * 0.3,
        "w2": jax.random.normal(k2, (32, 1)) * 0.3,
    }
    return {
        "params": params,
        "opt": TX.init(params),
        "key": jax.random.key(1),
        "step": jnp.int32(0),
    }


def batch_at(index):  # the data position is just the batch index: deterministic per index
    rng = np.random.default_rng(index)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    return x, np.sin(x.sum(1, keepdims=True))


def loss_fn(params, x, y, key):
    h = jnp.tanh(x @ params["w1"])
    h = h * jax.random.bernoulli(key, 0.9, h.shape) / 0.9  # dropout: uses the stored RNG key
    return jnp.mean((h @ params["w2"] - y) ** 2)


@jax.jit
def step_fn(state, x, y):
    key = jax.random.fold_in(state["key"], state["step"])
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y, key)
    updates, opt = TX.update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {**state, "params": params, "opt": opt, "step": state["step"] + 1}, loss


def train(state, start, stop, mesh):
    losses = []
    for i in range(start, stop):
        x, y = sx.distribute_batch(batch_at(i), sx.batch_sharding(mesh))
        state, loss = step_fn(state, x, y)
        losses.append(float(loss))
    return state, losses


def main():
    mode, directory = sys.argv[1], sys.argv[3]
    mesh = sx.make_mesh({"data": -1})
    plan = sx.fsdp(mesh, min_size=1)
    state = sx.shard(init_state(), plan)
    if mode == "train":  # argv: start stop [save_at]
        start, stop = int(sys.argv[4]), int(sys.argv[5])
        if start > 0:
            restored = sx.restore_checkpoint(directory, like=state)
            state, start = restored.state, restored.data_state["next_batch"]
        state, losses = train(state, start, stop, mesh)
        sx.save_checkpoint(directory, state, step=stop, data_state={"next_batch": stop})
        params = {k: np.asarray(v).tolist() for k, v in state["params"].items()}
        print(json.dumps({"losses": losses, "params": params}))
    elif mode == "restore":  # restore the latest step onto this process's devices, replicated
        like = sx.shard(init_state(), sx.replicate(mesh))
        restored = sx.restore_checkpoint(directory, like=like)
        w = restored.state["params"]["w1"]
        print(
            json.dumps(
                {
                    "step": restored.step,
                    "w1": np.asarray(w).tolist(),
                    "replicated": w.sharding.is_fully_replicated,
                    "devices": len(w.sharding.device_set),
                }
            )
        )
    elif mode == "save_loop":  # saves step k filled with k, forever, announcing each commit
        big = sx.shard({"a": jnp.zeros((2048, 2048)), "b": jnp.zeros((1024, 1024))}, plan)
        with sx.CheckpointManager(directory, max_to_keep=2) as manager:
            for k in range(1, 10_000):
                manager.save(k, jax.tree.map(lambda x, k=k: x + k, big))
                print(f"saved {k}", flush=True)


if __name__ == "__main__":
    main()
