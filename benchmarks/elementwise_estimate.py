"""The per-op model's prediction of the GPT step with ``GPTConfig(residual=, elementwise=)``
under precision="bf16", on a compile-only H100 (``sx.target("8xH100")``, one of its
devices; JAX 0.12 with the ``gpu-compile`` extra, no GPU). Prints each variant's predicted
step, its elementwise class (milliseconds and bytes) and the change against the default.

    uv run --extra gpu-compile python benchmarks/elementwise_estimate.py   # the 1.21B shape
    uv run --extra gpu-compile python benchmarks/elementwise_estimate.py --layers 2 --d-model 1024
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

VARIANTS = (("fp32", "autodiff"), ("bf16", "autodiff"), ("fp32", "recompute"),
            ("bf16", "recompute"))  # fmt: skip
"""``(residual, elementwise)``; the first is the default."""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--scan", action="store_true", help="layers in lax.scan")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.cost.calibration import H100
    from shardax.cost.opcost import price_hlo
    from shardax.models import gpt

    target = sx.target("8xH100")
    mesh = sx.make_mesh({"data": 1}, devices=target.devices[:1])
    shape = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    batch = {"inputs": shape, "targets": shape}

    def lm_loss(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    step = sx.make_train_step(lm_loss, mesh=mesh, precision="bf16")
    rows = []
    for residual, elementwise in VARIANTS:
        cfg = gpt.GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.heads,
                            max_seq_len=args.seq_len, scan_layers=args.scan,
                            residual=residual, elementwise=elementwise)  # fmt: skip

        def abstract(cfg: gpt.GPTConfig = cfg) -> sx.TrainState:
            return sx.TrainState.create(gpt.make_gpt(cfg), optax.adamw(1e-3))

        state = nnx.eval_shape(abstract)
        c = price_hlo(
            step.lower(step.abstract(state), batch).compile().as_text(), H100, num_devices=1
        )
        ew = c.classes["elementwise"]
        rows.append({"residual": residual, "elementwise": elementwise,
                     "step_ms": c.step_s * 1e3, "low_ms": c.low_s * 1e3, "high_ms": c.high_s * 1e3,
                     "elementwise_ms": ew.seconds * 1e3, "elementwise_bytes": ew.bytes,
                     "gemm_ms": c.classes["gemm"].seconds * 1e3})  # fmt: skip
    base = rows[0]
    for row in rows:
        row["elementwise_change"] = row["elementwise_ms"] / base["elementwise_ms"] - 1
        row["speedup"] = base["step_ms"] / row["step_ms"]
    return {"jax": jax.__version__, "config": vars(args), "rows": rows}


if __name__ == "__main__":
    print(json.dumps(run(parse_args(None)), indent=2))
