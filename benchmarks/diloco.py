"""DiLoCo against data parallelism: the small GPT on the built-in corpus, 2 islands x 4
devices, equal tokens, side by side in one run.

Each run trains the same GPT from the same init on the same global batches (the Python
standard library's sources, ``shardax.data.text``) with the same inner optimizer (AdamW,
linear warm-up, clipping, as ``shardax train --model gpt``):

- ``dp``: one step over all 8 devices, the gradients all-reduced across the islands
  every step (``data_axis=("island", "data")``);
- ``diloco H=...``: ``sx.DiLoCo(inner_steps=H)`` (outer Nesterov SGD 0.7, momentum 0.9),
  each island on its half of every batch, with and without compressed outer gradients.

It reports the validation loss at the end (DiLoCo: of the anchor, after the last outer
step), the bytes one device sends across islands per step (from the compiled HLO: DP's
all-reduce every step, DiLoCo's outer step / H), their ratio, and steps/s here (on
simulated CPU devices there is no slow link: the wall time is compute; the link's cost is
what ``sx.estimate`` prices, ``--links``).

    uv run python benchmarks/diloco.py                       # ~10 min on 2 CPU cores
    uv run python benchmarks/diloco.py --steps 200 --runs dp,10,50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="steps per run (equal tokens)")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plan", default="replicate", help="the GPT's plan inside an island")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="the outer Nesterov SGD's rate")
    parser.add_argument(
        "--runs",
        default="dp,10,50,100,50:bf16,50:int8,50:topk",
        help="comma-separated: dp, H, or H:compression",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.data.text import lm_batch, lm_eval_batch, load_corpus
    from shardax.models import gpt
    from shardax.train.islands import crossing

    mesh = sx.make_mesh({"island": 2, "data": 4})
    corpus = load_corpus()
    cfg = gpt.GPTConfig(layers=args.layers, d_model=args.d_model, heads=4,
                        max_seq_len=args.seq_len)  # fmt: skip
    schedule = optax.linear_schedule(0.0, args.lr, 50)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))

    def loss_fn(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    def init():
        return sx.TrainState.create(gpt.make_gpt(cfg, 0), tx, rng=0)

    abstract = nnx.eval_shape(lambda: gpt.make_gpt(cfg, 0))
    plan = gpt.plan(mesh, abstract, args.plan)
    val = lm_eval_batch(corpus.val, 256, args.seq_len)
    evaluate = sx.make_eval_step(loss_fn, mesh=mesh, plan=plan, data_axis=("island", "data"))
    batches = [
        lm_batch(corpus.train, args.batch_size, args.seq_len, 0, i + 1) for i in range(args.steps)
    ]
    params_bytes = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))

    def run(name: str) -> dict:
        if name == "dp":
            step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, data_axis=("island", "data"))
            state = step.init(init)
            hlo = step.lower(state, batches[0]).compile().as_text()
            per_step = crossing(hlo, mesh).bytes
            h, compress = None, None
        else:
            h, _, compress = name.partition(":")
            h, compress = int(h), compress or None
            outer = optax.sgd(args.outer_lr, momentum=0.9, nesterov=True)
            diloco = sx.DiLoCo(inner_steps=h, outer=outer, compress=compress)
            step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, diloco=diloco)
            state = step.init(init)
            per_step = step.traffic(state, batches[0]).per_step
        state, _ = step(state, batches[0])  # compile (and step 1)
        if h is not None:
            state = step.sync(state, 1)
        jax.block_until_ready(state)
        start = time.perf_counter()
        for i in range(1, args.steps):
            state, _ = step(state, batches[i])
            if h is not None:
                state = step.sync(state, i + 1)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start
        if h is not None:  # the anchor after the last outer step, evaluated as a plain state
            if args.steps % h:
                state = step.outer(state)
            plain = init().replace(params=jax.device_get(state.outer.anchor))
            state = evaluate.shard(plain)
        val_loss = float(evaluate(state, val)["loss"])
        return {
            "run": name,
            "H": h,
            "compress": compress,
            "val_loss": val_loss,
            "cross_island_bytes_per_step": per_step,
            "steps_per_s": (args.steps - 1) / seconds,
        }

    rows = []
    for name in args.runs.split(","):
        rows.append(run(name))
        print(json.dumps(rows[-1]), flush=True)
    dp = next((r for r in rows if r["run"] == "dp"), None)
    print(
        f"\nGPT {args.layers}x{args.d_model} ({params_bytes / 2**20:.2f} MiB of float32 "
        f"params, plan {args.plan} inside each island), {args.steps} steps x "
        f"{args.batch_size} x {args.seq_len} tokens, mesh island=2 x data=4, JAX {jax.__version__}"
    )
    print(
        f"{'run':>12} {'val loss':>9} {'vs DP':>7} {'bytes/step':>11} {'DP/this':>8} {'steps/s':>8}"
    )
    for r in rows:
        rel = f"{r['val_loss'] / dp['val_loss'] - 1:+.2%}" if dp else "-"
        ratio = (
            f"{dp['cross_island_bytes_per_step'] / r['cross_island_bytes_per_step']:.0f}x"
            if dp and r["cross_island_bytes_per_step"]
            else "-"
        )
        figures = f"{r['cross_island_bytes_per_step']:11.0f} {ratio:>8} {r['steps_per_s']:8.2f}"
        print(f"{r['run']:>12} {r['val_loss']:9.4f} {rel:>7} {figures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "jax": jax.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
