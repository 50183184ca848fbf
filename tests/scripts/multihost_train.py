"""A small training script for the multi-process tests.

Run alone it trains on the local devices; under ``shardax launch -n 2 --cpu-devices 4``
every process reads only its rows of each global batch (``sx.batches``), assembled into
global arrays (``sx.global_batch``) for ``sx.make_train_step``: ``dp`` and ``fsdp`` in jit
mode, ``dp-shard_map`` in shard_map mode; with Adam, ``zero2`` and ``hsdp`` (mesh
``{"replica": 2, "fsdp": 4}``: replicas across processes, fsdp inside each). Every
process prints one ``RESULT {json}`` line with its losses and what it observed of the placements.

    shardax launch -n 2 --cpu-devices 4 -- python tests/scripts/multihost_train.py \
        --mode dp,fsdp,dp-shard_map
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

GLOBAL_BATCH = 32
FEATURES, HIDDEN, CLASSES = 16, 64, 8


def init_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {  # w1 stays float64, as NumPy makes it: sx.shard must accept it on every process
        "w1": rng.normal(size=(FEATURES, HIDDEN)) * 0.3,
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, CLASSES)) * 0.3).astype(np.float32),
        "b2": np.zeros(CLASSES, np.float32),
    }


def dataset(steps: int) -> dict[str, np.ndarray]:
    """``steps`` global batches of examples; every process holds the same arrays and
    ``sx.batches`` hands each only its share of every batch."""
    rng = np.random.default_rng(1000)
    n = steps * GLOBAL_BATCH
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return {"x": x, "y": rng.integers(0, CLASSES, size=n).astype(np.int32)}


def process_rows(sharding: Any, n: int) -> tuple[int, int]:
    """The contiguous rows ``[start, stop)`` of an ``n``-row batch that this process holds."""
    indices = sharding.addressable_devices_indices_map((n,)).values()
    spans = [idx[0].indices(n)[:2] for idx in indices]
    start, stop = min(s for s, _ in spans), max(e for _, e in spans)
    assert sum(e - s for s, e in set(spans)) == stop - start, f"rows not contiguous: {spans}"
    return start, stop


def train(plan_name: str, steps: int = 5, *, fault: str | None = None) -> dict[str, Any]:
    """Trains ``steps`` steps; ``fault`` breaks the run on purpose: ``"raise"`` (process 1
    raises at step 2), ``"config"`` (processes pass different configs to check_agreement),
    ``"plan"`` (process 1 shards the state with another plan; the step's own check)."""
    import jax
    import jax.numpy as jnp
    import optax

    import shardax as sx

    hsdp = plan_name == "hsdp"
    mesh = sx.make_mesh({"replica": 2, "fsdp": -1} if hsdp else {"data": -1})
    data_axis = ("replica", "fsdp") if hsdp else "data"
    params = init_params()
    if fault == "plan" and jax.process_index() == 1:
        plan_name = "fsdp"
    plan = {
        "fsdp": lambda: sx.fsdp(mesh, min_size=1),
        "hsdp": lambda: sx.fsdp(mesh, axis="fsdp", min_size=1),
        "zero2": lambda: sx.zero2(mesh, min_size=1),
    }.get(plan_name, lambda: sx.replicate(mesh))()
    lr = 0.1 + (0.01 * jax.process_index() if fault == "config" else 0.0)
    tx = optax.adam(0.01) if plan_name in ("zero2", "hsdp") else optax.sgd(lr)
    if fault != "plan":
        config = {"plan": plan_name, "steps": steps, "lr": lr}
        if plan_name != "zero2":  # a zero plan places a train state, not bare params
            sx.runtime.check_agreement(config=config, mesh=mesh, plan=plan(params))
    data = sx.batch_sharding(mesh, data_axis)
    start, stop = process_rows(data, GLOBAL_BATCH)

    def apply_fn(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    mode = "shard_map" if plan_name == "dp-shard_map" else "jit"
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, mode=mode, data_axis=data_axis)
    state = step.shard(sx.TrainState.from_params(params, apply_fn, tx))

    losses, seen = [], 0
    loader = sx.batches(dataset(steps), GLOBAL_BATCH, shuffle=True, seed=0)
    for i, local in enumerate(loader):  # this process's rows of global batch i
        if fault == "raise" and jax.process_index() == 1 and i == 2:
            raise RuntimeError(f"deliberate failure on process 1 at step {i}")
        assert len(local["x"]) == stop - start, (len(local["x"]), start, stop)
        seen += len(local["x"])
        batch = sx.global_batch(local, data, global_size=GLOBAL_BATCH)
        state, metrics = step(state, batch)
        losses.append(float(sx.runtime.host_value(metrics["loss"])))
        sx.print0(f"step {i} loss {losses[-1]:.6f}")
    w1 = state.params["w1"]
    whole = sx.runtime.host_value(batch["x"])  # sharded across processes: all-gathered
    assert whole.shape == (GLOBAL_BATCH, FEATURES), whole.shape
    assert np.array_equal(whole[start:stop], local["x"]), "host_value of the batch"
    return {
        "plan": plan_name,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "losses": losses,
        "rows": [start, stop],
        "examples_seen_all_hosts": int(sx.runtime.host_reduce(np.int64(seen), "sum")),
        "w1_spec": str(w1.sharding.spec),
        "w1_local_shards": [list(s.data.shape) for s in w1.addressable_shards],
        "nu_w1_local_shards": [
            list(s.data.shape) for s in state.opt_state[0].nu["w1"].addressable_shards
        ]
        if plan_name in ("zero2", "hsdp")
        else None,
        "mesh_processes": np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
        "batch_local_shards": len(batch["x"].addressable_shards),
        "mesh_process_of_data_index": [d.process_index for d in mesh.devices.flat],
        "mesh_2d_processes": np.vectorize(lambda d: d.process_index)(
            sx.make_mesh({"data": -1, "model": 2}).devices
        ).tolist(),
    }


def spin(seconds: float) -> None:
    """Runs collectives until killed (for the kill -9 test), printing a line per step."""
    import jax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    x = sx.shard({"x": np.ones((mesh.size, 4), np.float32)}, sx.fsdp(mesh, min_size=1))["x"]
    total = jax.jit(lambda a: a.sum())
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        print(f"spin {i} {float(sx.runtime.host_value(total(x)))}", flush=True)
        i += 1
        time.sleep(0.2)


def hang(timeout: float, at: int) -> None:
    """Steps of one collective each under ``sx.StepWatchdog(timeout)``; process 1 sleeps
    instead of entering step ``at``, so process 0 waits in that step's collective."""
    import jax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    x = sx.shard({"x": np.ones((mesh.size, 4), np.float32)}, sx.fsdp(mesh, min_size=1))["x"]
    total = jax.jit(lambda a: a.sum())
    float(sx.runtime.host_value(total(x)))  # compiles, before the watchdog starts
    from shardax.runtime import status

    with sx.StepWatchdog(timeout) as watchdog:
        for step in range(1, at + 2):
            with watchdog.step(step):
                watchdog.phase(status.DATA, step)
                if jax.process_index() == 1 and step == at:
                    time.sleep(600)  # stuck in Python before its step
                watchdog.phase(status.DEVICE)
                print(f"step {step} {float(sx.runtime.host_value(total(x)))}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--mode",
        default="dp",
        help="comma-separated: dp, fsdp, dp-shard_map, zero2, hsdp; raise, config, "
        "plan (faults); spin (for kill -9); hang (process 1 sleeps in a watched step); "
        "join (joins and sums the ranks)",
    )
    parser.add_argument("--steps", type=int, default=5, help="steps; with hang: the hung step")
    parser.add_argument("--step-timeout", type=float, default=5.0, help="for hang")
    args = parser.parse_args(argv)

    import shardax as sx

    joined = sx.initialize()
    assert sx.initialize() == joined  # calling twice is harmless
    if joined:
        try:
            sx.initialize(process_id=5)
            raise AssertionError("a conflicting second initialize was accepted")
        except ValueError as e:
            assert "already runs as" in str(e), e
    for mode in args.mode.split(","):
        if mode == "spin":
            spin(120)
            continue
        if mode == "join":  # who joined, and one collective across them
            import jax

            total = sx.runtime.host_reduce(np.int64(jax.process_index() + 1), "sum")
            emit({
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "sum_of_ranks_plus_one": int(total),
            })  # fmt: skip
            continue
        if mode == "hang":
            hang(args.step_timeout, args.steps)
            continue
        fault = mode if mode in ("raise", "config", "plan") else None
        result = train("dp" if fault else mode, args.steps, fault=fault)
        emit(result)
    return 0


def emit(result: dict) -> None:
    """One ``RESULT {json}`` line in one write: the processes run unbuffered (launch sets
    PYTHONUNBUFFERED), where print() writes the text and its newline apart, and the
    runtime's C++ chatter on the same pipe could land between them."""
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
