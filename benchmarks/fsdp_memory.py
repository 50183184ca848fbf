"""Params + Adam state per device: FSDP vs replicated, on simulated devices.

Measured two ways, side by side in one run:
- placed: bytes of the shards each device holds (``addressable_shards``) after the state
  is created straight onto the plan with ``sx.plan.init_sharded``;
- compiled: ``memory_analysis()`` of the compiled train step (per-device arguments,
  outputs and temporaries of the SPMD program).

    uv run python benchmarks/fsdp_memory.py            # 8 simulated CPU devices
    uv run python benchmarks/fsdp_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--sizes", default="1024,2048,2048,1024", help="MLP layer widths")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    sizes = [int(s) for s in args.sizes.split(",")]
    mesh = sx.make_mesh({"data": args.devices})
    tx = optax.adam(1e-3)

    def init(key):
        keys = jax.random.split(key, len(sizes) - 1)
        params = [
            {"w": jax.random.normal(k, (a, b)) / math.sqrt(a), "b": jnp.zeros((b,))}
            for k, (a, b) in zip(keys, itertools.pairwise(sizes), strict=True)
        ]
        return {"params": params, "opt_state": tx.init(params)}

    def step(state, batch):
        def loss(params):
            x = batch["x"]
            for layer in params[:-1]:
                x = jax.nn.relu(x @ layer["w"] + layer["b"])
            return jnp.mean((x @ params[-1]["w"] + params[-1]["b"] - batch["y"]) ** 2)

        grads = jax.grad(loss)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    batch_sharding = NamedSharding(mesh, P("data"))
    batch = {
        "x": jax.ShapeDtypeStruct((args.batch, sizes[0]), jnp.float32, sharding=batch_sharding),
        "y": jax.ShapeDtypeStruct((args.batch, sizes[-1]), jnp.float32, sharding=batch_sharding),
    }
    batch_bytes = sum(math.prod(b.shape) * 4 for b in batch.values()) // args.devices

    results = {}
    for plan in (sx.replicate(mesh), sx.fsdp(mesh)):
        plan = sx.plan.follow_params(plan)
        state = sx.plan.init_sharded(init, plan, jax.random.key(0))
        n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
        device = jax.devices()[0]
        placed = sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(state)
            for s in leaf.addressable_shards
            if s.device == device
        )
        shardings = plan(state)
        jitted = jax.jit(step, in_shardings=(shardings, batch_sharding), out_shardings=shardings)
        mem = jitted.lower(state, batch).compile().memory_analysis()
        results[plan.name] = {
            "params": n_params,
            "placed_bytes_per_device": placed,
            "describe_bytes_per_device": sx.describe(state).total_bytes_per_device,
            "compiled_argument_bytes": mem.argument_size_in_bytes,
            "compiled_state_bytes": mem.argument_size_in_bytes - batch_bytes,
            "compiled_output_bytes": mem.output_size_in_bytes,
            "compiled_temp_bytes": mem.temp_size_in_bytes,
        }
        del state

    rep, fs = results["replicate+follow_params"], results["fsdp+follow_params"]
    print(
        f"MLP {sizes}: {rep['params'] / 1e6:.2f}M params, Adam; {args.devices} devices, "
        f"mesh {dict(mesh.shape)}, batch {args.batch}"
    )
    print(f"{'per device':<34}{'replicated':>14}{'fsdp':>14}{'fsdp/rep':>10}")
    ratios = {}
    for key in (
        "placed_bytes_per_device",
        "describe_bytes_per_device",
        "compiled_state_bytes",
        "compiled_argument_bytes",
        "compiled_output_bytes",
        "compiled_temp_bytes",
    ):
        ratios[key] = fs[key] / rep[key] if rep[key] else float("nan")
        print(
            f"{key:<34}{rep[key] / 2**20:>11.2f} MiB{fs[key] / 2**20:>10.2f} MiB"
            f"{ratios[key]:>10.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"sizes": sizes, "devices": args.devices, "results": results, "ratios": ratios},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
