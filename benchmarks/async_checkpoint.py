"""Do checkpoints stop training? Steps during an asynchronous save against steps without
one, and the synchronous save's stall, side by side.

An MLP train state (``--width``, ``--depth``: about 4·width²·depth float32 with Adam's
moments) is trained with ``sx.make_train_step`` on the devices present (8 simulated CPU
devices by default). In turns, for ``--rounds`` rounds:

- ``plain``: ``--steps`` steps, no save;
- ``async``: ``CheckpointManager(async_save=True).save`` (its blocking part timed as
  ``async_block``), then the steps that start while orbax still writes in the
  background (at most ``--steps``), then the commit is waited for (untimed);
- ``sync``: ``CheckpointManager(async_save=False).save`` (timed: ``sync_stall``), then
  ``--steps`` steps.

Goal: median step during an async save ÷ median step without one <= 1.10, and the async
save's blocking part much below the synchronous save's stall. Each step is timed to
``block_until_ready``; ``during_save`` counts the async steps that ran before the commit.

    python benchmarks/async_checkpoint.py              # table
    python benchmarks/async_checkpoint.py --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

from _common import mlp, mse, regression_batch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps after each save")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import jax
    import optax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    tx = optax.adam(1e-3)
    model = mlp([args.width] * (args.depth + 1) + [10])
    step = sx.make_train_step(mse, mesh=mesh)
    state = step.shard(model.new_state(tx))
    batch = regression_batch(mesh, args.batch_size, args.width)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
    for _ in range(3):  # compile and warm up
        state, _ = step(state, batch)
    jax.block_until_ready(state)

    def steps(state, until=None):
        """``--steps`` timed steps, or while ``until()`` holds (at most ``--steps``)."""
        times = []
        for _ in range(args.steps):
            if until is not None and not until():
                break
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - start)
        return state, times

    root = tempfile.mkdtemp(prefix="shardax-async-ckpt-")
    times = {"plain": [], "async": [], "sync": []}
    async_block, sync_stall, during = [], [], []
    managers = {
        "async": sx.CheckpointManager(f"{root}/async", max_to_keep=1, async_save=True),
        "sync": sx.CheckpointManager(f"{root}/sync", max_to_keep=1),
    }
    try:
        for r in range(args.rounds):
            order = ("plain", "async", "sync") if r % 2 == 0 else ("sync", "async", "plain")
            for name in order:
                if name != "plain":
                    start = time.perf_counter()
                    managers[name].save(r + 1, state)
                    (async_block if name == "async" else sync_stall).append(
                        time.perf_counter() - start
                    )
                writing = managers["async"]._manager.is_saving_in_progress
                state, t = steps(state, writing if name == "async" else None)
                times[name] += t
                if name == "async":
                    during.append(len(t))
                    managers["async"].wait()
    finally:
        for m in managers.values():
            m.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "state_mib": state_bytes / 2**20,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "step_ms": {k: 1e3 * v for k, v in med.items()},
        "async_over_plain": med["async"] / med["plain"],
        "sync_over_plain": med["sync"] / med["plain"],
        "async_block_ms": 1e3 * statistics.median(async_block),
        "sync_stall_ms": 1e3 * statistics.median(sync_stall),
        "steps_during_save": during,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return result
    print(
        f"MLP state {result['state_mib']:.0f} MiB on {result['devices']} "
        f"{result['platform']} devices, {args.rounds} rounds of {args.steps} steps"
    )
    ms = result["step_ms"]
    print(f"{'':<28}{'median step ms':>15}{'ratio':>8}")
    print(f"{'no save':<28}{ms['plain']:>15.2f}{1:>8.3f}")
    print(f"{'during an async save':<28}{ms['async']:>15.2f}{result['async_over_plain']:>8.3f}")
    print(f"{'after a sync save':<28}{ms['sync']:>15.2f}{result['sync_over_plain']:>8.3f}")
    print(
        f"save blocks the loop: async {result['async_block_ms']:.0f} ms, sync "
        f"{result['sync_stall_ms']:.0f} ms; steps timed while writing: "
        f"{result['steps_during_save']}"
    )
    return result


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", parse_args(sys.argv[1:]).cpu_devices)
    main(sys.argv[1:])
