"""ZeRO-1/2, FSDP and replicate: compiled memory per device against the formula, and the
zero1 ÷ replicate step time, side by side in one run.

- memory: ``sx.auto_plan`` compiles each plan's train step on abstract values;
  ``memory_analysis().argument_size_in_bytes`` minus this device's slice of the batch is
  the state per device, set beside the formula's params + Adam state
  (``shardax.cost.memory.estimate``, ZeRO stage 0/1/2/3);
- time: replicate and zero1 steps on the same placed state, timed in turns after
  warm-up; medians and their ratio.

    uv run python benchmarks/zero_plans.py                # 8 simulated CPU devices
    uv run python benchmarks/zero_plans.py --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

from _common import time_in_turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--sizes", default="1024,2048,2048,1024", help="MLP layer widths")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per plan")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardax as sx
    from shardax.cost.memory import estimate

    sizes = [int(s) for s in args.sizes.split(",")]
    mesh = sx.make_mesh({"data": args.devices})
    tx = optax.adam(1e-3)

    def apply(params, x):
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return x @ params[-1]["w"] + params[-1]["b"]

    def init():
        keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
        params = [
            {"w": jax.random.normal(k, (a, b)) / math.sqrt(a), "b": jnp.zeros((b,))}
            for k, (a, b) in zip(keys, itertools.pairwise(sizes), strict=True)
        ]
        return sx.TrainState.from_params(params, apply, tx)

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(args.batch, sizes[0])).astype(np.float32),
        "y": rng.normal(size=(args.batch, sizes[-1])).astype(np.float32),
    }
    batch_slice = sum(x.nbytes for x in batch.values()) // args.devices
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(init).params))

    report = sx.auto_plan(mesh, init, loss_fn=loss_fn, batch=batch)
    stages = {"replicate": 0, "zero1": 1, "zero2": 2, "fsdp": 3}
    rows = {}
    print(
        f"MLP {sizes}: {n_params / 1e6:.2f}M params, Adam fp32; {args.devices} CPU devices, "
        f"batch {args.batch}; JAX {jax.__version__}"
    )
    print(
        f"{'plan':<10}{'compiled state':>16}{'formula':>12}{'ratio':>8}{'temp':>12}"
        f"{'peak':>12}{'sent/step':>12}"
    )
    for c in report.candidates:
        e = estimate(n_params, "fp32", data=args.devices, zero=stages[c.name])
        formula = e.params_bytes + e.master_bytes + e.optimizer_bytes
        state = c.argument_bytes - batch_slice
        rows[c.name] = {
            **c.to_dict(),
            "compiled_state_bytes": state,
            "formula_params_optimizer_bytes": formula,
            "compiled_over_formula": state / formula,
        }
        print(
            f"{c.name:<10}{state / 2**20:>12.2f} MiB{formula / 2**20:>8.2f} MiB"
            f"{state / formula:>8.3f}{c.temp_bytes / 2**20:>8.2f} MiB"
            f"{c.total_bytes / 2**20:>8.2f} MiB{c.collective_bytes / 2**20:>8.2f} MiB"
        )
    print(f"auto_plan pick: {report.name}: {report.reason}")

    steps, states = {}, {}
    placed = sx.distribute_batch(batch, sx.batch_sharding(mesh))
    for name, plan in (("replicate", sx.replicate(mesh)), ("zero1", sx.zero1(mesh))):
        steps[name] = sx.make_train_step(loss_fn, mesh=mesh, plan=plan)
        states[name] = steps[name].init(init)
    medians, _ = time_in_turns(steps, states, placed, rounds=args.repeats, warmup=3)
    ratio = medians["zero1"] / medians["replicate"]
    print(
        f"step time, median of {args.repeats} in turns: replicate "
        f"{medians['replicate'] * 1e3:.1f} ms, zero1 {medians['zero1'] * 1e3:.1f} ms, "
        f"zero1 / replicate = {ratio:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "sizes": sizes,
                    "devices": args.devices,
                    "jax": jax.__version__,
                    "plans": rows,
                    "pick": report.name,
                    "median_step_s": medians,
                    "zero1_over_replicate": ratio,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
