"""The causal ring skips what the mask hides, and zig-zag evens out what is left.

``sx.attention(impl="ring", causal=True)`` computes a K/V block (under ``layout=
"zigzag:C"``, each of its two chunks against each of the queries' two) only where the
causal mask lets some query see some key; the rest is skipped with ``lax.cond``. Side
by side in one run, over a ``"context"`` axis of C simulated CPU devices:

- the work each device does: the fraction of the full (non-causal) attention it
  computes, from the ring's own visibility rule, per layout (max/mean = load imbalance;
  on real accelerators the step waits for the busiest device);
- the median wall time of the causal ring's forward+backward, contiguous and zig-zag,
  against the same ring without a mask (on CPU the devices share the cores, so this is
  the total work, not the busiest device).

    uv run python benchmarks/causal_ring.py
    uv run python benchmarks/causal_ring.py --context 8 --seq-len 8192 --json out.json
"""

from __future__ import annotations

import argparse
import json


def work_per_device(context: int, length: int, layout: str) -> list[float]:
    """The fraction of full attention each device computes in the causal ring (``layout``
    ``"contiguous"`` or ``"zigzag"``: the ring's own layout, for ``context`` devices)."""
    import jax.numpy as jnp

    from shardax.parallel.context.config import Config
    from shardax.parallel.context.layout import block_positions
    from shardax.parallel.context.masks import parts_visible
    from shardax.parallel.context.ring import ring_parts

    cfg = Config("context", context, True, None, layout, 1.0)
    block = length // context
    parts = ring_parts(cfg, block)
    out = []
    for idx in range(context):
        qpos = block_positions(jnp.int32(idx), block, context, layout)
        done = 0
        for src in range(context):
            kpos = block_positions(jnp.int32(src), block, context, layout)
            for qi in parts:
                for kj in parts:
                    seen = parts_visible(cfg, qpos[qi], kpos[kj])
                    done += bool(seen) * (qi.stop - qi.start) * (kj.stop - kj.start)
        out.append(done / (block * length))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4, help="devices on the context axis")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.context)
    import jax.numpy as jnp
    import numpy as np
    from _common import time_in_turns
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardax.parallel.context import attention

    c, t, h, d = args.context, args.seq_len, args.heads, args.head_dim
    mesh = jax.make_mesh((c,), ("context",))
    shape = (1, t, h, d)
    qkv = [jax.random.normal(jax.random.key(i), shape) for i in range(3)]
    qkv = jax.device_put(qkv, NamedSharding(mesh, P(None, "context")))

    def grads(causal: bool, layout: str):
        def loss(q, k, v):
            o = attention(q, k, v, causal=causal, impl="ring", layout=layout)
            return jnp.sum(o * o)

        with jax.set_mesh(mesh):
            fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*qkv).compile()
        return lambda state, batch: (state, fn(*batch))

    runs = {"none": (False, "contiguous"), "contiguous": (True, "contiguous"),
            "zigzag": (True, f"zigzag:{c}")}  # fmt: skip
    steps = {name: grads(*how) for name, how in runs.items()}
    times, _ = time_in_turns(steps, dict.fromkeys(steps), qkv, args.repeats, warmup=1)
    base = times["none"]
    rows = []
    print(f"causal ring attention fwd+bwd, C={c}, T={t}, H={h}, D={d}, fp32, median of "
          f"{args.repeats} in turns, JAX {jax.__version__}")  # fmt: skip
    print(f"{'layout':<12}{'work per device (of full)':<34}{'max/mean':>9}{'time ratio':>12}")
    for layout in ("contiguous", "zigzag"):
        work = work_per_device(c, t, layout)
        row = {"layout": layout, "work_per_device": work,
               "imbalance": max(work) / float(np.mean(work)), "seconds": times[layout],
               "no_mask_seconds": base, "ratio": times[layout] / base}  # fmt: skip
        rows.append(row)
        shares = " ".join(f"{w:.3f}" for w in work)
        print(f"{layout:<12}{shares:<34}{row['imbalance']:>9.2f}{row['ratio']:>12.2f}")
    print(f"time ratio: median causal step / median step without a mask ({base * 1e3:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
