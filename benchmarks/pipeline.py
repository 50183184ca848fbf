"""Pipeline schedules: step time against microbatches, and activation memory per device.

An L-layer tanh MLP (``sx.pipeline`` over the stacked blocks) trains with
``sx.make_train_step`` on a ``{"data": D, "stage": S}`` mesh (8 simulated CPU devices,
or the accelerators present), the blocks placed ``P("stage")``.

1. **Bubble.** The microbatch size is fixed, so the work grows with M. Steps for every M
   (and the circular schedule, ``repeats=r``) run interleaved, in turns, and each
   schedule's median step times are fitted to a free line ``t(M) = a·M + c``. The
   schedule runs ``r·M + S - 1`` ticks of ``1/r`` of a stage's work, so the model says
   ``c / a = (S-1)/r`` idle microbatch slots (plus any fixed cost of the step), and the
   measured idle fraction ``c / (a·M + c)`` sits beside the model's
   ``(S-1)/(r·M+S-1)``. (The SPMD schedule computes on every tick, idle ones included,
   so the fit holds on a CPU whose simulated devices share cores, too.)
2. **Memory.** ``memory_analysis()`` of the compiled step, per device: temporary bytes
   (activations kept for the backward pass and buffers) for GPipe against circular at
   the same M and batch; and of the gradient of GPipe against 1F1B
   (``sx.pipeline_1f1b``) for every M, where GPipe's grows with M and 1F1B's should not.

    uv run python benchmarks/pipeline.py                 # table
    uv run python benchmarks/pipeline.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4, help="S, the stage axis size")
    parser.add_argument("--data", type=int, default=2, help="the data axis size")
    parser.add_argument("--layers", type=int, default=8, help="L, stacked layers")
    parser.add_argument("--width", type=int, default=256, help="layer width")
    parser.add_argument("--micro-size", type=int, default=16, help="examples per microbatch")
    parser.add_argument("--microbatches", default="4,8,16,32", help="the M values timed")
    parser.add_argument("--repeats", type=int, default=2, help="r of the circular schedule")
    parser.add_argument("--steps", type=int, default=15, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args(argv)


def fit(xs: list[int], times: list[float]) -> tuple[float, float, float]:
    """Least squares ``t = a·M + c``; returns ``(a, c, r²)``."""
    mx, my = statistics.fmean(xs), statistics.fmean(times)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, times, strict=True)) / sxx
    b = my - a * mx
    ss = sum((y - my) ** 2 for y in times)
    res = sum((y - (a * x + b)) ** 2 for x, y in zip(xs, times, strict=True))
    return a, b, 1 - res / ss if ss else 1.0


def run(args: argparse.Namespace) -> dict:
    import jax

    # Simulated CPU devices when no accelerator is present (ignored on GPU/TPU).
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import shardax as sx

    S, r, L, W = args.stages, args.repeats, args.layers, args.width
    mesh = sx.make_mesh({"data": args.data, "stage": S})
    plan = sx.rules(mesh, [(r"blocks", P("stage"))])
    ms = [int(m) for m in args.microbatches.split(",")]

    def layer(p, h):
        return jnp.tanh(h @ p["w"] + p["b"])

    def params():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {
            "w": jax.random.normal(k1, (L, W, W)) / np.sqrt(W),
            "b": jax.random.normal(k2, (L, W)) / 4,
        }

    def loss_fn(model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def schedule(m: int, repeats: int):
        def apply(p, x):
            return sx.pipeline(layer, p, x, microbatches=m, repeats=repeats)

        state = sx.TrainState.from_params(params(), apply, optax.sgd(1e-3))
        step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan)
        rng = np.random.default_rng(0)
        batch_size = args.data * m * args.micro_size
        batch = jax.device_put(
            {
                "x": rng.normal(size=(batch_size, W)).astype(np.float32),
                "y": rng.normal(size=(batch_size, W)).astype(np.float32),
            },
            sx.batch_sharding(mesh),
        )
        return step, step.shard(state), batch

    runs = {(m, rep): schedule(m, rep) for m in ms for rep in (1, r)}
    states = {key: state for key, (_, state, _) in runs.items()}
    times: dict[tuple[int, int], list[float]] = {key: [] for key in runs}
    for i in range(args.warmup + args.steps):
        keys = list(runs) if i % 2 else list(reversed(runs))
        for key in keys:
            step, _, batch = runs[key]
            start = time.perf_counter()
            states[key], metrics = step(states[key], batch)
            jax.block_until_ready(metrics)
            if i >= args.warmup:
                times[key].append(time.perf_counter() - start)
    medians = {key: statistics.median(t) for key, t in times.items()}

    rows, fits = [], {}
    for rep in (1, r):
        t = [medians[(m, rep)] for m in ms]
        a, c, r2 = fit(ms, t)
        fits[rep] = {
            "a_ms": 1e3 * a,
            "c_ms": 1e3 * c,
            "r2": r2,
            "idle_slots": c / a,
            "idle_slots_model": (S - 1) / rep,
        }
        for m, tm in zip(ms, t, strict=True):
            rows.append(
                {
                    "repeats": rep,
                    "microbatches": m,
                    "median_ms": 1e3 * tm,
                    "per_microbatch_ms": 1e3 * tm / m,
                    "bubble_model": sx.parallel.bubble(S, m, rep),
                    "bubble_measured": c / (a * m + c),
                }
            )

    # Activation memory: GPipe vs circular at the largest M, from the compiled step.
    memory = {}
    m = ms[-1]
    for rep in (1, r):
        step, _, batch = runs[(m, rep)]
        with jax.sharding.set_mesh(mesh):
            compiled = step._last.lower(states[(m, rep)], batch).compile()
        mem = compiled.memory_analysis()
        memory[rep] = {
            "temp_bytes": mem.temp_size_in_bytes,
            "argument_bytes": mem.argument_size_in_bytes,
        }
    # Gradient temp memory, GPipe vs 1F1B, over M (compiled only).
    from jax.sharding import NamedSharding

    def head_loss(w, h, y):
        return jnp.mean((h @ w - y) ** 2)

    placed = jax.device_put(params(), NamedSharding(mesh, P("stage")))
    head = jnp.zeros((W, W), jnp.float32)
    one_f_one_b = []
    for m in ms:
        rows = args.data * m * args.micro_size
        x = jax.ShapeDtypeStruct((rows, W), jnp.float32, sharding=sx.batch_sharding(mesh))

        def gpipe(p, x, w, y, m=m):
            return head_loss(w, sx.pipeline(layer, p, x, microbatches=m), y)

        def f1b(p, x, w, y, m=m):
            return sx.pipeline_1f1b(layer, p, x, head_loss, w, y, microbatches=m)

        entry = {"microbatches": m}
        with jax.sharding.set_mesh(mesh):
            for name, fn in (("gpipe", gpipe), ("1f1b", f1b)):
                compiled = jax.jit(jax.grad(fn, argnums=(0, 1, 2))).lower(placed, x, head, x)
                entry[f"{name}_temp_bytes"] = (
                    compiled.compile().memory_analysis().temp_size_in_bytes
                )
        one_f_one_b.append(entry)

    return {
        "one_f_one_b": one_f_one_b,
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "mesh": dict(mesh.shape),
        "layers": L,
        "width": W,
        "micro_size": args.micro_size,
        "steps": args.steps,
        "rows": rows,
        "fits": fits,
        "memory_microbatches": m,
        "memory": memory,
        "temp_ratio_circular_to_gpipe": memory[r]["temp_bytes"] / memory[1]["temp_bytes"],
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(
        f"{result['layers']} layers × {result['width']}, mesh {result['mesh']}, "
        f"{result['micro_size']} examples per microbatch per data shard; "
        f"{result['devices']} {result['platform']} devices, JAX {result['jax']}, "
        f"median of {result['steps']} interleaved steps"
    )
    print(
        f"{'repeats':>7} {'M':>4} {'median ms':>10} {'ms / M':>8} "
        f"{'bubble (S-1)/(rM+S-1)':>22} {'measured':>9}"
    )
    for row in result["rows"]:
        print(
            f"{row['repeats']:>7} {row['microbatches']:>4} {row['median_ms']:>10.2f} "
            f"{row['per_microbatch_ms']:>8.2f} {row['bubble_model']:>22.3f} "
            f"{row['bubble_measured']:>9.3f}"
        )
    for rep, f in result["fits"].items():
        print(
            f"fit repeats={rep}: t = {f['a_ms']:.2f} ms × M + {f['c_ms']:.2f} ms "
            f"(r² = {f['r2']:.4f}): idle slots c/a = {f['idle_slots']:.2f}, "
            f"model (S-1)/r = {f['idle_slots_model']:.2f}"
        )
    m = result["memory_microbatches"]
    for rep, mem in result["memory"].items():
        print(
            f"M={m}, repeats={rep}: temp {mem['temp_bytes'] / 2**20:.2f} MiB per device, "
            f"arguments {mem['argument_bytes'] / 2**20:.2f} MiB"
        )
    print(f"temp memory circular / GPipe: {result['temp_ratio_circular_to_gpipe']:.3f}")
    print("gradient temp memory per device, GPipe vs 1F1B:")
    for e in result["one_f_one_b"]:
        g, f = e["gpipe_temp_bytes"], e["1f1b_temp_bytes"]
        print(
            f"  M={e['microbatches']:>3}: GPipe {g / 2**20:.2f} MiB, 1F1B {f / 2**20:.2f} MiB "
            f"(1F1B / GPipe {f / g:.3f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
