"""DiLoCo over processes, for tests/train/test_islands_multiprocess.py.

Under ``shardax launch -n 2 --cpu-devices 4`` each process is one island of the mesh
``{"island": 2, "data": 4}``: it reads only its island's rows of every global batch
(``sx.global_batch``), trains them with fsdp inside the island and meets the other
process only at the outer steps (gloo). Run alone (8 devices) it is the reference: one
process, two islands. Prints one ``RESULT {json}`` line per configuration: each island's
losses this process holds, the anchor after the last outer step, and where the islands lie.

    shardax launch -n 2 --cpu-devices 4 -- python tests/scripts/islands_worker.py
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

GLOBAL_BATCH, FEATURES, STEPS, H = 32, 8, 4, 2
CONFIGS = (None,)


def train(compress: str | None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    import shardax as sx

    mesh = sx.make_mesh({"island": 2, "data": 4})
    rng = np.random.default_rng(0)
    params = {
        "w": (rng.normal(size=(FEATURES, 16)) * 0.3).astype(np.float32),
        "v": (rng.normal(size=(16,)) * 0.3).astype(np.float32),
    }

    def apply_fn(p, x):
        return jnp.tanh(x @ p["w"]) @ p["v"]

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    step = sx.make_train_step(
        loss_fn,
        mesh=mesh,
        plan=sx.fsdp(mesh, axis="data", min_size=0),
        diloco=sx.DiLoCo(inner_steps=H, compress=compress, block=32),
    )
    state = step.shard(sx.TrainState.from_params(params, apply_fn, optax.adamw(1e-2)))
    data = np.random.default_rng(1)
    sharding = step.batch_sharding
    rows = sorted(
        {idx[0].indices(GLOBAL_BATCH)[:2] for idx in sharding.addressable_devices_indices_map(
            (GLOBAL_BATCH,)).values()}
    )  # fmt: skip
    start, stop = rows[0][0], rows[-1][1]
    losses: dict[int, list[float]] = {}
    for i in range(STEPS):
        x = data.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
        y = data.normal(size=GLOBAL_BATCH).astype(np.float32)
        local = {"x": x[start:stop], "y": y[start:stop]}  # this process's rows only
        batch = sx.global_batch(local, sharding, global_size=GLOBAL_BATCH)
        state, metrics = step(state, batch)
        state = step.sync(state, i + 1)
        for shard in metrics["loss"].addressable_shards:  # the islands this process holds
            island = shard.index[0].indices(2)[0]
            losses.setdefault(island, []).append(float(np.asarray(shard.data)[0]))
    anchor = {
        k: np.asarray(sx.runtime.host_value(v)).tolist() for k, v in state.outer.anchor.items()
    }
    return {
        "compress": compress,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "rows": [start, stop],
        "losses": {str(k): v for k, v in sorted(losses.items())},
        "anchor": anchor,
        "syncs": int(sx.runtime.host_value(state.outer.syncs)),
        "island_processes": [
            sorted({d.process_index for d in mesh.devices[i].flat}) for i in range(2)
        ],
    }


def main() -> int:
    import shardax as sx

    sx.initialize()
    for compress in CONFIGS:
        print("RESULT " + json.dumps(train(compress)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
