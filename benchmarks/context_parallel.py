"""Context parallelism: memory, bytes sent and the ring's schedule, from the compiler.

A GPT-like attention block (qkv projection, causal ``sx.attention``, output projection,
residual) at a sequence length where the activations dominate, forward and backward,
compiled over a ``"context"`` mesh axis of C = 1, 2, 4, 8 simulated CPU devices with
each scheme. Side by side in one run:

- temporaries per device (``compiled.memory_analysis().temp_size_in_bytes``) against
  the 1/C line from C = 1;
- bytes each device sends per step, parsed from the compiled HLO, against each
  scheme's formula (``shardax.parallel.context.sent_bytes``);
- the ring's forward HLO: is each block's collective-permute issued before the
  previous block's first dot (so the transfer can overlap it)?

    uv run python benchmarks/context_parallel.py
    uv run python benchmarks/context_parallel.py --seq-len 8192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re


def ring_permutes_lead(hlo: str) -> tuple[bool, list[tuple[int, int]]]:
    """Whether every collective-permute that sends a K/V block on is scheduled before
    the first dot that reads that block (so the transfer can overlap the compute).

    Reads each computation (the ring's loop body, or the unrolled entry) in the order
    the compiler scheduled it and follows def-use from each permute's operand, not
    through other permutes; a dot is a ``dot(`` or custom-call, or a fusion calling
    one. Returns ``(ok, [(permute index, first dot index), ...])``; ok is False when no
    permute feeds a dot.
    """
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name and line.strip() and not line.startswith("}"):
            bodies[name].append(line.strip())
    called = {n: _callees(lines) for n, lines in bodies.items()}
    has_dot = {n for n, lines in bodies.items() if any(" dot(" in x for x in lines)}
    while grown := {n for n in bodies if n not in has_dot and called[n] & has_dot}:
        has_dot |= grown  # through fusions and the branches of the causal ring's conds
    pairs = []
    for lines in bodies.values():
        names = [x.removeprefix("ROOT ").split(" =", 1)[0].lstrip("%") for x in lines]
        uses = [set(re.findall(r"%([\w.\-]+)", x.split("=", 1)[-1].split("metadata=")[0]))
                for x in lines]  # fmt: skip
        for i, x in enumerate(lines):
            sent = re.search(r"collective-permute(?:-start)?\(%?([\w.\-]+)", x)
            if not sent:
                continue
            reach = {sent.group(1)}
            for j, y in enumerate(lines):
                if "collective-permute" in y or not uses[j] & reach:
                    continue
                reach.add(names[j])
                if " dot(" in y or "custom-call(" in y or _callees([y]) & has_dot:
                    pairs.append((i, j))
                    break
    return bool(pairs) and all(p < d for p, d in pairs), pairs


def _callees(lines: list[str]) -> set[str]:
    """The computations these HLO lines call: fusions, and conditionals' branches."""
    pattern = _CALLS + r"=\{?([^}\s,]+(?:, *%?[\w.\-]+)*)"
    names = set()
    for line in lines:
        for group in re.findall(pattern, line):
            names |= {n.strip().lstrip("%") for n in group.split(",")}
    return names


_CALLS = r"(?:calls|branch_computations|true_computation|false_computation)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--contexts", default="1,2,4,8")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardax.parallel.context as attn
    from shardax.cost.hlo import collectives

    b, t, h, kh, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    e = h * d
    params = {
        "q": jax.ShapeDtypeStruct((e, h * d), jnp.float32),
        "kv": jax.ShapeDtypeStruct((e, 2 * kh * d), jnp.float32),
        "o": jax.ShapeDtypeStruct((h * d, e), jnp.float32),
    }

    def block(params, x, impl):
        q = (x @ params["q"]).reshape(b, t, h, d)
        k, v = jnp.split((x @ params["kv"]).reshape(b, t, 2 * kh, d), 2, axis=2)
        o = attn.attention(q, k, v, causal=True, impl=impl)
        y = x + o.reshape(b, t, h * d) @ params["o"]
        return jnp.mean(y**2)

    def compile_(c, impl):
        mesh = jax.make_mesh((c,), ("context",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:c])  # fmt: skip
        x = jax.ShapeDtypeStruct((b, t, e), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "context")))  # fmt: skip
        ps = {n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P()))
              for n, s in params.items()}  # fmt: skip
        grad = jax.grad(lambda p, x: block(p, x, impl), argnums=(0, 1))
        with jax.set_mesh(mesh):
            return jax.jit(grad).lower(ps, x).compile()

    contexts = [int(c) for c in args.contexts.split(",")]
    rows, base = [], None
    qs, ks = (b, t, h, d), (b, t, kh, d)
    print(f"attention block fwd+bwd, causal, B={b} T={t} H={h} K={kh} D={d} fp32; "
          f"per device")  # fmt: skip
    print(f"{'impl':<11}{'C':>3}{'temp MiB':>10}{'1/C line':>10}{'ratio':>7}"
          f"{'sent MiB':>10}{'formula':>9}{'dW MiB':>8}  ring permute")  # fmt: skip
    for c in contexts:
        for impl in ["none"] if c == 1 else list(attn.IMPLS):
            compiled = compile_(c, "auto" if c == 1 else impl)
            temp = compiled.memory_analysis().temp_size_in_bytes
            base = temp if c == 1 else base
            line = base / c
            text = compiled.as_text()
            found = [x for x in collectives(text, c) if x.group == c]
            # the replicated weights' gradients are all-reduced: not attention traffic
            grads = sum(x.sent_bytes for x in found if x.op == "all-reduce")
            sent = sum(x.sent_bytes for x in found if x.op != "all-reduce")
            formula = attn.sent_bytes(impl, qs, ks, c, 4, backward=True) if c > 1 else 0.0
            order = ""
            if impl == "ring":
                fwd = jax.jit(lambda q, k, v: attn.attention(q, k, v, causal=True, impl="ring"))
                mesh = jax.make_mesh((c,), ("context",), axis_types=(AxisType.Auto,),
                                     devices=jax.devices()[:c])  # fmt: skip
                z = jnp.zeros((b, t, h, d))
                with jax.set_mesh(mesh):
                    ok, pairs = ring_permutes_lead(fwd.lower(z, z, z).compile().as_text())
                order = f"{'leads' if ok else 'LATE'} ({len(pairs)})"
            row = {"impl": impl, "C": c, "temp_bytes": temp, "line_bytes": line,
                   "ratio": temp / line, "sent_bytes": sent, "formula_bytes": formula,
                   "weight_grad_allreduce_bytes": grads,
                   "ring_permute_leads": order or None}  # fmt: skip
            rows.append(row)
            mib = [x / 2**20 for x in (temp, line, sent, formula, grads)]
            print(f"{impl:<11}{c:>3}{mib[0]:>10.1f}{mib[1]:>10.1f}{temp / line:>7.2f}"
                  f"{mib[2]:>10.2f}{mib[3]:>9.2f}{mib[4]:>8.2f}  {order}")  # fmt: skip
    print("sent: the step's collectives over the context axis except the weight-gradient\n"
          "all-reduce (dW), as ring algorithms send them; formula: sent_bytes(impl,\n"
          "backward=True); ring permute: each K/V send scheduled before the first dot\n"
          "reading that block (number of sends checked)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
