"""The per-op model's prediction of the GPT step under precision="fp8" against "bf16", on a
compile-only H100 (``sx.target("8xH100")``, one of its devices; JAX 0.12 with the
``gpu-compile`` extra, no GPU). Prints each step's predicted milliseconds, its interval,
the GEMM and elementwise classes, and the FLOPs priced at the datasheet's fp8 peak.

    uv run --extra gpu-compile python benchmarks/fp8_estimate.py      # the 1.21B shape
    uv run --extra gpu-compile python benchmarks/fp8_estimate.py --layers 2 --d-model 512
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
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
    cfg = gpt.GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.heads,
                        max_seq_len=args.seq_len, scan_layers=True)  # fmt: skip
    state = nnx.eval_shape(lambda: sx.TrainState.create(gpt.make_gpt(cfg), optax.adamw(1e-3)))
    shape = jax.ShapeDtypeStruct((args.batch, args.seq_len), jnp.int32)
    batch = {"inputs": shape, "targets": shape}

    def lm_loss(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    out = {}
    for precision in ("bf16", "fp8"):
        step = sx.make_train_step(lm_loss, mesh=mesh, precision=precision)
        hlo = step.lower(step.abstract(state), batch).compile().as_text()
        c = price_hlo(hlo, H100, num_devices=1)
        out[precision] = {
            "step_ms": c.step_s * 1e3, "low_ms": c.low_s * 1e3, "high_ms": c.high_s * 1e3,
            "gemm_ms": c.classes["gemm"].seconds * 1e3,
            "elementwise_ms": c.classes["elementwise"].seconds * 1e3,
            "fp8_datasheet_flops": c.fp8_datasheet_flops,
        }  # fmt: skip
    out["speedup"] = out["bf16"]["step_ms"] / out["fp8"]["step_ms"]
    return out


if __name__ == "__main__":
    print(json.dumps(run(parse_args(None)), indent=2))
