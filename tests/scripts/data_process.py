"""One process of the multi-process data test: run by tests/data/test_global_batch.py.

Usage: python data_process.py PORT PROCESS_ID NUM_PROCESSES
Prints one JSON line: this process's view of every global batch.
"""

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

port, pid, nproc = (int(a) for a in sys.argv[1:4])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import shardax as sx  # noqa: E402
from shardax.data.assembly import process_grid  # noqa: E402

N = 37
data = {"x": np.arange(N * 3, dtype=np.float32).reshape(N, 3), "y": np.arange(N)}
mesh = sx.make_mesh({"data": -1})
loader = sx.batches(data, 16, shuffle=True, seed=5, policy="pad")  # process from jax
masked_sum = jax.jit(lambda b: jnp.sum(b["x"] * b["mask"][:, None]))

out = {"process_count": jax.process_count(), "local_rows": [], "sums": [], "y": [], "mask": []}
with sx.prefetch_to_device(loader, mesh) as it:
    for batch in it:
        assert batch["x"].shape == (16, 3), batch["x"].shape
        assert batch["x"].sharding.spec == jax.P("data")
        out["local_rows"].append(sum(s.data.shape[0] for s in batch["y"].addressable_shards))
        out["sums"].append(float(masked_sum(batch)))  # a computation across both processes
        out["y"].append(multihost_utils.process_allgather(batch["y"], tiled=True).tolist())
        out["mask"].append(multihost_utils.process_allgather(batch["mask"], tiled=True).tolist())
    out["state"] = it.get_state()

# A 2-D mesh: the data axis still spans both processes, each passes its half of the rows;
# a scalar leaf is replicated (every process passes the same value).
mesh2 = sx.make_mesh({"data": 4, "model": 2})
local = {"x": np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + 100 * pid, "lr": np.float32(0.5)}
placed = sx.global_batch(local, mesh2, global_size=16)
out["grid"] = list(process_grid(sx.batch_sharding(mesh2), 2))
out["mesh2_shape"] = list(placed["x"].shape)
out["mesh2_x"] = multihost_utils.process_allgather(placed["x"], tiled=True).tolist()
out["lr"] = float(jax.jit(lambda b: b["lr"] * 2)(placed))

# A process passing the wrong number of rows gets an error naming both shapes, locally.
try:
    sx.global_batch({"x": np.zeros((5, 3))}, mesh, global_size=16)
except ValueError as e:
    out["error"] = str(e)

print(json.dumps(out), flush=True)
