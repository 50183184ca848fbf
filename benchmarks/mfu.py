"""MFU of the reference GPT: a dense ~1B-parameter GPT trained in bf16 on the accelerator.

One command, on whatever accelerator JAX finds (all its devices on one ``data`` axis,
FSDP over it when there are several): builds ``shardax.models.gpt`` at the size asked,
trains it with ``sx.make_train_step(..., precision="bf16")`` on random byte tokens, and
reports tokens/s per device and MFU. The attention is ``sx.attention``, so on a GPU in
bf16 it is cuDNN's flash kernel (``jax.nn.dot_product_attention``); ``--kernel dense``
forces the XLA einsums (the score matrix in memory) to measure what the fused kernel
gains. The kernel the step compiled to is read from its HLO (``attention_kernel``).

Two FLOP counts, side by side:

- **model FLOPs** (the MFU): PaLM's formula (Chowdhery et al. 2022, appendix B),
  ``6·N + 12·L·T·d`` per token, with causal attention counted halved (a query sees
  on average half the keys, and a flash kernel skips the masked blocks):
  ``6·N + 6·L·T·d``. N: non-embedding parameters, L layers, T sequence length,
  d model width;
- **the compiled step's** count (``shardax.cost.flops.compiled_flops``, times the
  devices): everything XLA emits (the optimizer, norms, the masked half of an XLA
  attention), with the cuBLAS and cuDNN calls XLA's ``cost_analysis()`` counts as zero
  added from the HLO.

MFU is achieved FLOP/s over the dense bf16 peak of the device's datasheet
(``shardax.cost.device_spec``: an H100 SXM or H200 is 989 TFLOP/s; n/a on CPU or an
unknown device). ``--size auto`` (default) is ``1b`` on an accelerator
and ``tiny`` on CPU, where this is a smoke test, no figure.

    uv run python benchmarks/mfu.py                  # 1B on the GPU/TPU, tiny on CPU
    uv run python benchmarks/mfu.py --size 1b --batch-size 8 --remat dots_no_batch --json
    uv run python benchmarks/mfu.py --kernel dense   # the same step, dense attention
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SIZES = {
    # 24 × 12·d² = 1.21e9 non-embedding parameters; head_dim 128 (cuDNN's flash kernel).
    # 4 sequences per device: on one H200 (docs/results.md, 2026-11-27) 4 ran at 49.9% MFU
    # and 8 at 53.1%, but 8's peak memory is unmeasured, so 4 keeps one command for an
    # 80 GB H100 too (before the MLP ran in bf16, 8 ran out of the H200 with scanned layers).
    "1b": {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 2048, "batch_per_device": 4},
    "tiny": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64, "batch_per_device": 2},
}


def model_flops_per_token(layers: int, d_model: int, seq_len: int, params: int) -> float:
    """PaLM's ``6·N + 12·L·T·d`` with causal attention halved: ``6·N + 6·L·T·d``.

    >>> model_flops_per_token(2, 8, 4, 100)
    984.0
    """
    return 6.0 * params + 6.0 * layers * seq_len * d_model


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains, times and returns the figures (see the module docstring)."""
    args = parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardax as sx
    from shardax.cost.flops import compiled_flops, utilization
    from shardax.cost.hlo import attention_kernel
    from shardax.models import gpt

    devices = jax.devices()
    platform = devices[0].platform
    size = args.size if args.size != "auto" else ("tiny" if platform == "cpu" else "1b")
    shape = dict(SIZES[size])
    for name in ("layers", "d_model", "heads", "seq_len"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    batch = args.batch_size or shape["batch_per_device"] * len(devices)
    seq = shape["seq_len"]
    cfg = gpt.GPTConfig(layers=shape["layers"], d_model=shape["d_model"], heads=shape["heads"],
                        max_seq_len=seq, scan_layers=args.scan_layers,
                        kernel=args.kernel)  # fmt: skip
    mesh = sx.make_mesh({"data": -1})

    def loss_fn(model: Any, b: dict[str, jax.Array]) -> jax.Array:
        logits = model(b["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    plan_name = "fsdp" if len(devices) > 1 else "replicate"
    abstract = jax.eval_shape(lambda: gpt.make_gpt(cfg, remat=args.remat))
    non_embedding = gpt.param_count(abstract, embeddings=False)
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=gpt.plan(mesh, abstract, plan_name),
                              precision="bf16")  # fmt: skip
    tx = optax.adamw(1e-4, weight_decay=0.01)
    state = step.init(lambda: sx.TrainState.create(gpt.make_gpt(cfg, remat=args.remat), tx))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch, seq + 1)).astype(np.int32)
    data = sx.distribute_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                               sx.batch_sharding(mesh))  # fmt: skip
    began = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_seconds = time.perf_counter() - began  # lowering and compiling
    xla = compiled_flops(compiled)
    kernel = attention_kernel(compiled.as_text())
    xla_total = None if xla is None else xla * len(devices)
    for _ in range(args.warmup):
        state, metrics = step(state, data)
    jax.block_until_ready(metrics["loss"])
    began = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = step(state, data)
    loss = float(metrics["loss"])
    seconds = (time.perf_counter() - began) / args.steps
    per_token = model_flops_per_token(cfg.layers, cfg.d_model, seq, non_embedding)
    model = utilization(per_token * batch * seq, seconds, len(devices))
    counted = utilization(xla_total, seconds, len(devices))
    return {
        "benchmark": "mfu",
        "device": str(devices[0].device_kind),
        "platform": platform,
        "devices": len(devices),
        "jax": jax.__version__,
        "size": size,
        "config": {
            "layers": cfg.layers,
            "d_model": cfg.d_model,
            "heads": cfg.heads,
            "seq_len": seq,
            "batch": batch,
            "remat": args.remat,
            "precision": "bf16",
            "plan": plan_name,
            "kernel": args.kernel,
        },
        "attention_kernel": kernel,
        "compile_seconds": compile_seconds,
        "params": gpt.param_count(abstract),
        "non_embedding_params": non_embedding,
        "loss": loss,
        "seconds_per_step": seconds,
        "tokens_per_s_per_device": batch * seq / seconds / len(devices),
        "flops_formula": "6·N + 6·L·T·d per token (PaLM's 6N + 12·L·T·d, causal halved)",
        "model_flops_per_step": per_token * batch * seq,
        "model_tflops_per_s_per_device": model["tflops_per_s_per_device"],
        "xla_flops_per_step": xla_total,
        "xla_tflops_per_s_per_device": counted["tflops_per_s_per_device"],
        "peak_tflops_per_device": model["peak_tflops_per_device"],
        "mfu": model["mfu"],
        "mfu_xla_flops": counted["mfu"],
    }


def parser() -> argparse.ArgumentParser:
    from shardax.parallel.fused import KERNELS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("auto", *SIZES), default="auto",
                   help="1b on an accelerator, tiny on CPU (default: auto)")  # fmt: skip
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None,
                   help="global (default: the size's, 4 per device for 1b)")  # fmt: skip
    p.add_argument("--remat", default="none", help="remat policy per block (default: none)")
    p.add_argument("--scan-layers", action="store_true", help="the blocks in lax.scan")
    p.add_argument("--kernel", choices=("auto", *KERNELS), default="auto",
                   help="sx.attention's kernel (default: auto, the platform's fused)")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> None:
    out = run(argv)
    if "--json" in (argv or __import__("sys").argv[1:]):
        print(json.dumps(out, indent=2))
        return
    fmt = lambda x: x if isinstance(x, str) else f"{x:.1%}"  # noqa: E731
    print(f"{out['size']} GPT ({out['params'] / 1e6:.0f}M params), bf16, {out['devices']} × "
          f"{out['device']} (JAX {out['jax']}), attention: {out['attention_kernel']}")  # fmt: skip
    print(f"  {out['tokens_per_s_per_device']:,.0f} tokens/s per device, "
          f"{out['seconds_per_step'] * 1e3:.1f} ms/step")  # fmt: skip
    print(f"  model FLOPs ({out['flops_formula']}): {out['model_tflops_per_s_per_device']:.3g} "
          f"TFLOP/s per device, MFU {fmt(out['mfu'])}")  # fmt: skip
    xla = out["xla_tflops_per_s_per_device"]
    print(f"  XLA cost_analysis: {'n/a' if xla is None else f'{xla:.3g}'} TFLOP/s per device, "
          f"MFU {fmt(out['mfu_xla_flops'])}")  # fmt: skip
    if out["platform"] == "cpu":
        print("  (CPU: a smoke test of the path, no figure; peak unknown, MFU n/a)")


if __name__ == "__main__":
    main()
