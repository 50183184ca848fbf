"""One of 2 processes saving and restoring a checkpoint together (checkpoint/test_checkpoint.py)."""

import json
import sys
import time

import jax
import numpy as np

import shardax as sx

rank, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sx.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank, cpu_devices=2)

mesh = sx.make_mesh({"data": -1})
assert mesh.size == 4 and jax.process_count() == 2
plan = sx.fsdp(mesh, min_size=1)
state = sx.shard({"w": np.arange(32.0).reshape(8, 4), "step": np.int32(3)}, plan)
sx.save_checkpoint(directory, state, step=3, data_state={"epoch": 1})
like = sx.shard({"w": np.zeros((8, 4)), "step": np.int32(0)}, sx.replicate(mesh))
restored = sx.restore_checkpoint(directory, like=like)
w = restored.state["w"]
local = [np.asarray(s.data).tolist() for s in w.addressable_shards]

# max_to_keep: a save displaces a step, which process 0 deletes. Process 1 reads each
# listed step's metadata slowly: the step must still be there when it does.
from shardax.checkpoint import manager as ckpt_manager  # noqa: E402

find_step = ckpt_manager._CheckpointSteps.find_step


def slow_find_step(self, base_path, step):
    if rank == 1 and step == 1:  # the step that save(2) displaces
        time.sleep(1.0)
    return find_step(self, base_path, step)


ckpt_manager._CheckpointSteps.find_step = slow_find_step
with sx.CheckpointManager(f"{directory}-kept", max_to_keep=1) as manager:
    manager.save(1, state)
    manager.save(2, state)
    kept = manager.all_steps()

print(
    json.dumps(
        {
            "rank": rank,
            "step": restored.step,
            "data": restored.data_state,
            "local": local,
            "replicated": w.sharding.is_fully_replicated,
            "kept": kept,
        }
    )
)
