"""``sx.moe`` measured: expert bytes per device, bytes each dispatch sends, step time per
dispatch, and drops against capacity_factor, side by side in one run.

- **placement**: expert parameters placed ``P("expert")`` on meshes data × expert; bytes
  on one device (its addressable shard) against total / E_axis;
- **bytes sent** per training step (forward + backward of the layer) by one device, from
  the compiled HLO's collectives (``shardax.cost.hlo``), against each dispatch's
  formula: all_to_all sends its (E, C, d) buffers out and back, and their cotangents
  back and out, ``4 · (n-1)/n · E·C·d·b``; dense all-gathers the group's tokens and
  reduce-scatters the outputs (and the transposes in the backward pass),
  ``4 · (n-1) · T·d·b``, plus the (T, E) gate matrix's all-to-all, ``2 · (n-1)/n · T·E·4``;
  ragged (not compiled on XLA:CPU) would send only the kept assignments that leave the
  device, ``4 · Σ kept_off_device · d · b``, given from the routing;
- **step time**: one jitted gradient step of the layer for each dispatch, and for the
  data-only mesh (experts replicated, nothing travels), timed in turns; medians. A CPU
  figure on simulated devices, no claim about GPUs;
- **drops**: dropped fraction of token-assignments and the balance loss against
  capacity_factor, for a random router.

    uv run python benchmarks/moe.py                      # 8 simulated CPU devices
    uv run python benchmarks/moe.py --json out.json

Recorded (defaults: 8 SwiGLU experts, d=128, hidden 256, top-2, capacity_factor 1.25,
32 × 64 tokens; 2-core VM under load 9–16, 8 simulated CPU devices; JAX 0.10.2 and
0.12.0.1 gave the same bytes):

- placement: 3,145,728 / 1,572,864 / 786,432 / 393,216 bytes per device on expert
  axes 1 / 2 / 4 / 8, each exactly total / n;
- bytes per gradient step, data=2 × expert=4, T=256 per group, C=80: all_to_all
  983,040 (HLO, 4 all-to-alls) = formula; dense 1,585,152 (2 all-gathers, 2
  all-to-alls, 2 reduce-scatters) = formula; ragged 783,872 by formula (not compiled);
- step time, median of 15: dense ÷ all_to_all 6.2, 7.0, 7.5 (0.10), 7.7 (0.12); data=8
  (experts replicated) ÷ all_to_all 1.2–1.8;
- dropped fraction at capacity_factor 0.5 / 0.75 / 1.0 / 1.25 / 1.5 / 2.0 / 3.0: random
  tokens 0.50 / 0.25 / 0.045 / 0.0002 / 0 / 0 / 0 (balance loss 1.001); tokens sharing a
  direction 0.57 / 0.41 / 0.26 / 0.15 / 0.11 / 0.045 / 0 (balance loss 1.31).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--d", type=int, default=128, help="model width")
    parser.add_argument("--hidden", type=int, default=256, help="expert hidden width")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per dispatch")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax as sx
    from shardax.cost.hlo import collectives
    from shardax.parallel import choose_dispatch, moe
    from shardax.parallel.experts import capacity

    E, K, CF, d, h = args.experts, args.top_k, args.capacity_factor, args.d, args.hidden
    rng = np.random.default_rng(0)
    params = {
        "gate": rng.normal(size=(E, d, h)).astype(np.float32) / math.sqrt(d),
        "up": rng.normal(size=(E, d, h)).astype(np.float32) / math.sqrt(d),
        "down": rng.normal(size=(E, h, d)).astype(np.float32) / math.sqrt(h),
    }
    router = rng.normal(size=(d, E)).astype(np.float32) / math.sqrt(d)
    x = rng.normal(size=(args.batch, args.length, d)).astype(np.float32)
    total_bytes = sum(p.nbytes for p in params.values())

    def swiglu(p, t):
        return (jax.nn.silu(t @ p["gate"]) * (t @ p["up"])) @ p["down"]

    def grad_step(dispatch, capacity_factor=CF):
        def loss(x, r, p):
            y, aux = moe(x, r, swiglu, p, top_k=K, capacity_factor=capacity_factor,
                         dispatch=dispatch)  # fmt: skip
            return jnp.mean(y**2) + 1e-2 * aux.balance_loss, aux

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))

    def mesh_for(n):
        return sx.make_mesh({"data": args.devices // n, "expert": n})

    def placed(mesh):
        batch = sx.batch_sharding(mesh, ("data", "expert"))
        return (
            jax.device_put(x, batch),
            jax.device_put(router, NamedSharding(mesh, P())),
            jax.device_put(params, NamedSharding(mesh, P("expert"))),
        )

    figures: dict = {"config": vars(args), "jax": jax.__version__}

    # -- placement ------------------------------------------------------------------------
    rows = []
    n = 1
    while n <= args.devices:
        if E % n == 0 and args.devices % n == 0:
            p = placed(mesh_for(n))[2]
            on_one = sum(leaf.addressable_shards[0].data.nbytes for leaf in p.values())
            rows.append(
                {"expert_axis": n, "bytes_per_device": on_one, "total_over_n": total_bytes / n}
            )
        n *= 2
    figures["placement"] = rows
    print(f"\nexpert parameters: {total_bytes} bytes in all ({E} experts)")
    print(f"{'expert axis':>12} {'bytes/device':>14} {'total / n':>12} {'ratio':>7}")
    for r in rows:
        ratio = r["bytes_per_device"] / r["total_over_n"]
        print(
            f"{r['expert_axis']:>12} {r['bytes_per_device']:>14} "
            f"{r['total_over_n']:>12.0f} {ratio:>7.3f}"
        )

    # -- bytes sent ------------------------------------------------------------------------
    n = min(4, args.devices)
    mesh = mesh_for(n)
    groups = args.devices
    T = args.batch * args.length // groups  # tokens per routing group (one device)
    C = capacity(T, E, K, CF)
    b = 4
    formula = {
        "all_to_all": 4 * (n - 1) / n * E * C * d * b,
        "dense": 4 * (n - 1) * T * d * b + 2 * (n - 1) / n * T * E * 4,
    }
    inputs = placed(mesh)
    sent = {}
    with jax.set_mesh(mesh):
        for dispatch in ("all_to_all", "dense"):
            hlo = grad_step(dispatch).lower(*inputs).compile().as_text()
            ops = collectives(hlo, mesh.size)
            moved = [c for c in ops if c.op != "all-reduce"]
            sent[dispatch] = {
                "dispatch_bytes_hlo": sum(c.sent_bytes for c in moved),
                "dispatch_bytes_formula": formula[dispatch],
                "ops": [f"{op} ×{k}" for op, k in sorted(Counter(c.op for c in moved).items())],
                "all_reduce_bytes_hlo": sum(c.sent_bytes for c in ops if c.op == "all-reduce"),
            }
        _, aux = grad_step("all_to_all")(*inputs)
    # ragged: the kept assignments that leave their device, from a NumPy replay of routing
    x2 = x.reshape(groups, T, d)
    probs = np.exp(x2 @ router)
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, -1)[..., :K]
    off_device = 0.0
    for g in range(groups):
        counts = np.minimum(np.bincount(experts[g].ravel(), minlength=E), C)
        owner = np.arange(E) // (E // n)
        off_device += counts[owner != g % n].sum()
    sent["ragged"] = {
        "dispatch_bytes_hlo": None,
        "dispatch_bytes_formula": 4 * off_device / groups * d * b,
        "ops": ["ragged-all-to-all (XLA:CPU cannot compile it)"],
        "all_reduce_bytes_hlo": None,
    }
    figures["bytes_sent"] = {"mesh": dict(mesh.shape), "tokens_per_group": T, "capacity": C, **sent}
    print(f"\nbytes one device sends per gradient step, mesh {dict(mesh.shape)}, "
          f"T={T} tokens/group, C={C}, d={d}, fp32")  # fmt: skip
    print(
        f"{'dispatch':>11} {'HLO':>12} {'formula':>12} {'ratio':>7}  ops (all-reduce bytes apart)"
    )
    for name, s in sent.items():
        hlo_b = s["dispatch_bytes_hlo"]
        ratio = "" if hlo_b is None else f"{hlo_b / s['dispatch_bytes_formula']:.3f}"
        hlo_text = "—" if hlo_b is None else f"{hlo_b:.0f}"
        print(
            f"{name:>11} {hlo_text:>12} {s['dispatch_bytes_formula']:>12.0f} {ratio:>7}  "
            + ", ".join(s["ops"])
        )

    # -- step time ---------------------------------------------------------------------------
    runs = {}
    for name, n_exp, dispatch in [
        ("all_to_all", n, "all_to_all"),
        ("dense", n, "dense"),
        ("data only", 1, "all_to_all"),
    ]:
        m = mesh_for(n_exp)
        with jax.set_mesh(m):
            fn, args_ = grad_step(dispatch), placed(m)
            jax.block_until_ready(fn(*args_))
        runs[name] = (m, fn, args_)
    times = {name: [] for name in runs}
    for i in range(2 + args.steps):
        for name in list(runs) if i % 2 else list(runs)[::-1]:
            m, fn, args_ = runs[name]
            with jax.set_mesh(m):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args_))
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    figures["step_ms"] = medians
    base = medians["all_to_all"]
    print(f"\ngradient step of the layer, median of {args.steps} in turns "
          "(XLA:CPU, simulated devices: no GPU claim)")  # fmt: skip
    for name, ms in medians.items():
        where = f"expert={n}" if name != "data only" else f"data={args.devices}"
        print(f"{name:>11} {where:>10} {ms:9.2f} ms   ÷ all_to_all {ms / base:.2f}")
    auto = choose_dispatch(E, K, CF, n)
    print("     ragged  XLA:CPU cannot compile ragged_all_to_all: sx.moe refuses it here")
    print(f"  auto picks {auto[0]!r}: {auto[1]}")

    # -- drops ------------------------------------------------------------------------------
    # Random tokens through a router at init route nearly uniformly; tokens sharing one
    # direction (logits biased ~ N(0, 1) per expert) stand in for unbalanced routing.
    shift = rng.normal(size=d).astype(np.float32)
    skewed = jax.device_put(x + shift, inputs[0].sharding)
    rows = []
    with jax.set_mesh(mesh):
        for cf in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0):
            fn = jax.jit(
                lambda x, r, p, cf=cf: moe(x, r, swiglu, p, top_k=K, capacity_factor=cf)[1]
            )
            row = {"capacity_factor": cf, "capacity": capacity(T, E, K, cf)}
            for name, tokens in (("uniform", inputs[0]), ("skewed", skewed)):
                aux = fn(tokens, inputs[1], inputs[2])
                row[f"dropped_{name}"] = float(aux.dropped_fraction)
                row[f"balance_{name}"] = float(aux.balance_loss)
            rows.append(row)
    figures["drops"] = rows
    print(f"\ndropped token-assignments against capacity_factor ({T} tokens/group, top-{K} of "
          f"{E}); random tokens, and tokens sharing a direction")  # fmt: skip
    print(f"{'cf':>6} {'C':>5} {'dropped':>9} {'balance':>9} {'dropped sk':>11} {'balance sk':>11}")
    for r in rows:
        print(f"{r['capacity_factor']:>6} {r['capacity']:>5} {r['dropped_uniform']:>9.4f} "
              f"{r['balance_uniform']:>9.4f} {r['dropped_skewed']:>11.4f} "
              f"{r['balance_skewed']:>11.4f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2, default=str)


if __name__ == "__main__":
    main()
