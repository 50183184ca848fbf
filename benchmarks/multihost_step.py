"""Cost of crossing processes: one data-parallel step on 1 process x 8 CPU devices against
2 processes x 4 CPU devices joined by ``sx.initialize`` (gloo collectives).

Both runs train the same MLP on the same global batch with the same mesh shape; only the
number of processes differs, so the ratio is the price of the cross-process all-reduce
(and of two controllers sharing the machine's cores). Each step is timed to
``block_until_ready``; the table gives medians over the timed steps, and the median of
``sx.runtime.check_agreement`` (one all-gather of fingerprints) in each setting.

    python benchmarks/multihost_step.py
    python benchmarks/multihost_step.py --steps 50 --width 1024 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One process of a run: times the step and check_agreement, prints JSON on process 0."""
    import shardax as sx

    sx.initialize()
    import jax
    import jax.numpy as jnp

    mesh = sx.make_mesh({"data": -1})
    rng = np.random.default_rng(0)
    w = args.width
    shapes = {"w1": (w, w), "w2": (w, w), "w3": (w, 1)}
    params = {k: (rng.normal(size=s) / np.sqrt(w)).astype(np.float32) for k, s in shapes.items()}
    params = sx.shard(params, sx.replicate(mesh))
    data = sx.batch_sharding(mesh)
    x = rng.normal(size=(args.batch_size, w)).astype(np.float32)
    rows = args.batch_size // jax.process_count()
    local = x[jax.process_index() * rows : (jax.process_index() + 1) * rows]
    batch = jax.make_array_from_process_local_data(data, local, x.shape)

    def loss_fn(p, x):
        h = jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"]) ** 2)

    @jax.jit
    def step(p, x):
        loss, g = jax.value_and_grad(loss_fn)(p, x)
        return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g), loss

    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        params, loss = step(params, batch)
        loss.block_until_ready()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    agree = []
    for _ in range(5):
        start = time.perf_counter()
        sx.runtime.check_agreement(config=vars(args), mesh=mesh)
        agree.append(time.perf_counter() - start)
    sx.print0(
        json.dumps(
            {
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "step_ms": 1e3 * statistics.median(times),
                "check_agreement_ms": 1e3 * statistics.median(agree[1:]),
            }
        )
    )


def run(cmd: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    line = next(line for line in proc.stdout.splitlines() if '"step_ms"' in line)
    return json.loads(line[line.index("{") :])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    me = [sys.executable, __file__, "--worker", "--steps", str(args.steps)]
    me += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    me += ["--width", str(args.width)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDAX_")}
    one = run(me, {**env, "SHARDAX_CPU_DEVICES": "8"})
    launch = [sys.executable, "-m", "shardax"]  # the shardax command
    two = run([*launch, "launch", "-n", "2", "--cpu-devices", "4", "--", *me], env)
    result = {
        "one_process": one,
        "two_processes": two,
        "step_ratio_two_over_one": two["step_ms"] / one["step_ms"],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'setting':<22}{'step ms (median)':>18}{'check_agreement ms':>20}")
    for name, r in (("1 process x 8 CPU", one), ("2 processes x 4 CPU", two)):
        print(f"{name:<22}{r['step_ms']:>18.2f}{r['check_agreement_ms']:>20.2f}")
    print(f"step time ratio, 2 processes / 1 process: {result['step_ratio_two_over_one']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
