"""Predicted figures of Llama-shaped GPTs on clusters this machine does not have, beside
the published ones (docs/results.md, "Planned for a cluster you do not have").

Each case builds the built-in GPT abstractly (``nnx.eval_shape``: nothing is allocated),
compiles its train step for a compile-only target (``sx.target``) with ``sx.estimate``,
and writes the memory per device, the compiled FLOPs and the PREDICTED TFLOP/s per device
and MFU, beside the published figure. Needs the compile extras on the JAX 0.12 leg::

    JAX_PLATFORMS=cpu .venv-compile/bin/python benchmarks/target_estimates.py --json out.json
    ... --case llama2-7b-8xh100    # one case

The cases and their published figures' sources are in :data:`CASES`. The GPT's MLP is
4·d wide with two matrices (Llama's SwiGLU has three, 11008/14336/28672 wide) and no
grouped-query attention, so the shapes are close, not equal: the table gives the GPT's
own parameter count. Model FLOPs are ``6·N + attention`` (causal halved), as MaxText
counts them. A 70B step for 256 devices compiles in minutes on a 2-core machine, so
these run here, not in CI (CI compiles a scaled-down shape: tests/cost/test_estimate.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "llama2-7b-8xh100": dict(
        target="8xH100", layers=32, d_model=4096, heads=32, seq=4096, vocab=32000,
        per_device_batch=4, mesh={"data": 8}, remat="full", params_bf16=False,
        published={"tflops_per_device": 492.0},
        memory_fraction=0.85,  # 1vm.sh: XLA_PYTHON_CLIENT_MEM_FRACTION=0.85
        # that README's MaxText counted attention non-causally: 6N + 12·L·T·d per token
        causal=False,
        source="MaxText configs/a3/llama_2_7b/README.md (1x A3 h100-80gb-8), 1vm.sh",
    ),
    **{f"llama2-7b-{h}x8xh100": dict(
        target=f"{h}x8xH100", network="gcp-a3-high", layers=32, d_model=4096, heads=32,
        seq=4096, vocab=32000, per_device_batch=4, mesh={"replica": h, "data": 8},
        remat="full", params_bf16=False, published={"tflops_per_device": tflops},
        memory_fraction=0.85, causal=False,
        # the same model, batch and remat as the one-host case above, so the predicted
        # drop is the network's; MaxText's {h}vm.sh ran remat_policy=minimal_flash
        source=f"MaxText configs/a3/llama_2_7b/README.md ({h}x A3 h100-80gb-8: {tflops:g} "
        f"TFLOP/s/chip), {h}vm.sh (dcn_data_parallelism={h}, ici_fsdp_parallelism=8, "
        "per_device_batch_size=4, max_target_length=4096); A3 h100-80gb-8 is a3-highgpu-8g "
        "(4 x 200 Gb/s GPUDirect-TCPX)",
    ) for h, tflops in ((2, 422.0), (4, 407.0), (8, 409.0), (16, 375.0))},
    # A second published series from one host to many: torchtitan's Llama 3.1 8B under
    # FSDP on Meta's Grand Teton hosts (8 x H100 96GB HBM2e at 500 W, NVLink; 400 Gb/s of
    # RDMA per GPU between hosts, ib-ndr's per-GPU figure), local batch 2 of 8192 tokens,
    # selective activation checkpointing, on 8 and on 128 GPUs. Its GPUs are not the H100
    # SXM the tables price (lower power, HBM2e), so the absolute figures are not compared;
    # the drop from 8 to 128 GPUs is. Remat full here (the step must fit an 80 GB H100).
    **{f"llama3.1-8b-{n}xh100-torchtitan": dict(
        target=target, network="ib-ndr", layers=32, d_model=4096, heads=32, seq=8192,
        vocab=128256, per_device_batch=2, mesh={"data": n}, remat="full",
        params_bf16=False, published={"tokens_per_s_per_device": tps},
        memory_fraction=0.95,  # PyTorch's caching allocator: no fixed share
        source=f"pytorch/torchtitan docs/performance.md (torchtitan 9dec370, 2024-12-26), "
        f"Table {table}: 1D parallelism (FSDP), Llama 3.1 8B, {n} GPUs, local batch size 2, "
        f"selective activation checkpointing, 'FSDP' row (eager): {tps:,.0f} TPS/GPU; Grand "
        "Teton hosts, 8 x H100 96GB HBM2e (500 W), 400 Gb/s RDMA per GPU",
    ) for n, target, tps, table in ((8, "8xH100", 5762.0, 1), (128, "16x8xH100", 5605.0, 3))},
    "llama3.1-70b-256xh200": dict(
        target="32x8xH200", layers=80, d_model=8192, heads=64, seq=8192, vocab=128256,
        per_device_batch=1, mesh={"replica": 32, "data": 8}, remat="full", params_bf16=True,
        published={"tflops_per_device": 508.0}, network="gcp-a3-ultra",
        memory_fraction=0.85,  # MaxText's GPU scripts' (configs/a3/*/1vm.sh); not quoted
        source="as issue 33 quotes it (MaxText, Llama 3.1 70B on 256 H200); the page "
        "was not found with the search tool",
    ),
    "llama3-70b-128xh100": dict(
        target="16x8xH100", layers=80, d_model=8192, heads=64, seq=8192, vocab=128256,
        per_device_batch=2, mesh={"data": 128}, remat="full", params_bf16=True,
        published={"tflops_per_device": 506.597}, network="ib-ndr",  # DGX Cloud: InfiniBand
        memory_fraction=0.85,  # MaxText's GPU scripts'; the NGC page does not give its own
        # counted non-causally: 506.597 TFLOP/s x 15.570 s / 16,384 tokens per device is
        # 4.81e11 FLOPs per token, MaxText's count for Llama3-70B with attention whole
        # (weights 4.17e11 + 12·L·T·d 6.44e10); causal-halved it would be 4.49e11
        causal=False,
        source="NVIDIA NGC catalog, 'Maxtext Llama3 70B (DGXC Benchmarking)' 25.02 / "
        "25.04.01: 128 GPUs, ici_fsdp 8 x dcn_fsdp 16, per-device batch 2, GBS 256, seq "
        "8192, BF16; its log line 'TFLOP/s/device: 506.597'",
    ),
    "maxtext-16b-v5e-256": dict(
        target="v5e-256", layers=36, d_model=6144, heads=24, seq=2048, vocab=32000,
        per_device_batch=6, mesh={"data": 256}, remat="full", params_bf16=False,
        published={"tflops_per_device": 120.0, "mfu": 0.6110},
        source="MaxText MaxText/configs/v5e/README.md, 16B (emb 6144, mlp 24576, 36 "
        "layers, 24 heads of 256, seq 2048, per-device batch 6, remat full) on 1x "
        "v5e-256: 120 TFLOP/s/chip, 61.10% MFU",
    ),
    "llama3.1-8b-v6e-256": dict(
        target="v6e-256", layers=32, d_model=4096, heads=32, seq=8192, vocab=128256,
        per_device_batch=2, mesh={"data": 256}, remat="full", params_bf16=False,
        published={"mfu": 0.4546, "tokens_per_s_per_device": 7207.0},
        source="maxtext.readthedocs.io reference/models/tiering.html (v6e Gold, 256 chips)",
    ),
    # The prediction beside a measurement of ours: the 1B GPT's default step on the H200
    # this project was lent (docs/results.md, "On a GPU", the session of 2026-11-27: layers
    # unrolled, as there; that session's JAX took 95% of the card).
    "gpt-1b-1xh200": dict(
        target="1xH200", layers=24, d_model=2048, heads=16, seq=2048, vocab=256,
        per_device_batch=4, mesh={"data": 1}, remat="none", params_bf16=False,
        scan_layers=False,
        published={"tflops_per_device": 493.8, "mfu": 0.4993, "tokens_per_s_per_device": 62861.0},
        memory_fraction=0.95,
        source="measured: benchmarks/gpu/session.py's default step on 1 x NVIDIA H200, JAX "
        "0.11.2, 2026-11-27 (cuDNN attention; 130.3 ms per step of 4 x 2048 tokens; "
        "benchmarks/gpu/results/2026-11-27-h200-1/session.json, core.shardax)",
    ),
}  # fmt: skip


def causal_share(c: dict[str, Any], n: float) -> float:
    """A published non-causal TFLOP/s figure's causal share: ``(6N + 6·L·T·d) ÷
    (6N + 12·L·T·d)`` per token (the attention's score and value matmuls halved)."""
    attention = 6.0 * c["layers"] * c["seq"] * c["d_model"]
    return (6.0 * n + attention) / (6.0 * n + 2 * attention)


def comparison(results: list[dict[str, Any]]) -> str:
    """The per-op prediction against the published figure (on the causal count), as a
    markdown table: point and interval, predicted ÷ published, inside the interval."""
    rows = ["| case | predicted TFLOP/s per device (interval) | published (causal) | "
            "predicted ÷ published | published in interval |", "|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        q, pub = r.get("per_op_tflops_per_device"), r.get("published_causal_tflops_per_device")
        if q is None or pub is None:
            continue
        inside = "yes" if q["low"] <= pub <= q["high"] else "no"
        rows.append(f"| {r['case']} | {q['point']:.0f} ({q['low']:.0f}–{q['high']:.0f}) | "
                    f"{pub:.0f} | {q['point'] / pub:.3f} | {inside} |")  # fmt: skip
    return "\n".join(rows)


def run_case(name: str, per_device_batch: int | None = None) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.cost.flops import transformer_flops_per_token
    from shardax.models import gpt

    c = dict(CASES[name])
    if per_device_batch is not None:  # e.g. the largest that fits, where the published doesn't
        c["per_device_batch"] = per_device_batch
    # A GPU case compiles in the memory share its run's JAX had (XLA rematerializes
    # past it); a TPU case takes none.
    target = sx.target(c["target"], memory_fraction=c.get("memory_fraction"),
                       network=c.get("network"))  # fmt: skip
    mesh = sx.make_mesh(c["mesh"], devices=target)
    cfg = gpt.GPTConfig(c["layers"], c["d_model"], c["heads"], c["seq"], vocab=c["vocab"],
                        scan_layers=c.get("scan_layers", True))  # fmt: skip
    precision: Any = "bf16"
    if c["params_bf16"]:  # params and Adam's moments in bf16: 6 bytes per parameter
        precision = sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)

    def make() -> Any:
        return gpt.make_gpt(cfg, 0, remat=c["remat"])

    model = nnx.eval_shape(make)
    state = nnx.eval_shape(lambda: sx.TrainState.create(make(), optax.adam(1e-4)))
    data_axes = tuple(a for a in ("replica", "data") if a in mesh.shape)
    step = sx.make_train_step(
        lambda m, b: optax.softmax_cross_entropy_with_integer_labels(
            m(b["inputs"]).astype(jnp.float32), b["targets"]
        ).mean(),
        mesh=mesh,
        plan=gpt.plan(mesh, model, "fsdp"),
        precision=precision,
        data_axis=data_axes if len(data_axes) > 1 else "data",
    )
    batch = c["per_device_batch"] * mesh.size
    tokens = jax.ShapeDtypeStruct((batch, c["seq"]), jnp.int32)
    n = gpt.param_count(model, embeddings=False)
    flops = transformer_flops_per_token(n, c["layers"], c["seq"], c["d_model"]) * batch * c["seq"]
    start = time.perf_counter()
    report = sx.estimate(step, state, {"inputs": tokens, "targets": tokens}, model_flops=flops,
                         model_flops_note="6N + attention, causal halved")  # fmt: skip
    wall = time.perf_counter() - start
    params_total = gpt.param_count(model)
    # params + Adam's m and v: bf16 2 + 2 + 2 = 6 bytes, fp32 4 + 4 + 4 = 12; the GPT's
    # FSDP splits them over "data" (HSDP: within a host; the replica axis holds copies)
    bytes_per_param = 6 if c["params_bf16"] else 12
    formula = params_total * bytes_per_param / mesh.shape["data"]
    out: dict[str, Any] = {
        "case": name,
        "target": c["target"],
        "mesh": dict(mesh.shape),
        "params": params_total,
        "global_batch": batch,
        "per_device_batch": c["per_device_batch"],
        "seq": c["seq"],
        "precision": "bf16 params + Adam moments" if c["params_bf16"] else "fp32 params + Adam",
        "remat": c["remat"],
        "estimate": report.to_dict(),
        "params_plus_optimizer_bytes": report.memory["params"] + report.memory["optimizer"],
        "formula_params_plus_optimizer_bytes": formula,
        "fits_with_headroom": report.fits,
        "memory_fraction": target.memory_fraction,
        "network": report.network,
        "memory_budget_bytes": report.memory_budget,
        "peak_bytes": report.memory["peak"],
        "published": c["published"],
        "source": c["source"],
        "wall_s": wall,
        "report": str(report),
    }
    cost = report.per_op
    if cost is not None:  # the per-op model (GPU targets): its point and interval
        per_device = flops / mesh.size / 1e12
        out["per_op_tflops_per_device"] = {
            "point": per_device / cost.step_s, "low": per_device / cost.high_s,
            "high": per_device / cost.low_s, "calibration": cost.calibration,
        }  # fmt: skip
        published = c["published"].get("tflops_per_device")
        if published is not None:
            causal = published * causal_share(c, n) if c.get("causal") is False else published
            out["published_causal_tflops_per_device"] = causal
    p = report.roofline
    if p is not None:  # None: the compiler refused the step (out of memory)
        out["predicted_tflops_per_device"] = {
            "overlapped": p.model_tflops_per_device(True),
            "serial": p.model_tflops_per_device(False),
        }
        out["predicted_mfu"] = {"overlapped": p.mfu(True), "serial": p.mfu(False)}
        out["predicted_tokens_per_s_per_device"] = {
            "overlapped": p.tokens_per_s_per_device(True),
            "serial": p.tokens_per_s_per_device(False),
        }
    return out


def search_case(name: str) -> dict[str, Any]:
    """``sx.search_plans`` on the case's multi-host target with its default space (pure
    FSDP over every GPU, and the hybrid mesh's HSDP: FSDP within a host, data parallelism
    across hosts), the pick and its predicted gain over pure FSDP (the per-op model)."""
    import jax
    import jax.numpy as jnp
    import optax

    import shardax as sx
    from shardax.cost.flops import transformer_flops_per_token
    from shardax.models import gpt

    c = dict(CASES[name])
    target = sx.target(c["target"], memory_fraction=c.get("memory_fraction"),
                       network=c.get("network"))  # fmt: skip
    cfg = gpt.GPTConfig(c["layers"], c["d_model"], c["heads"], c["seq"], vocab=c["vocab"],
                        scan_layers=c.get("scan_layers", True))  # fmt: skip
    precision: Any = "bf16"
    if c["params_bf16"]:
        precision = sx.Precision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)

    def init() -> Any:
        return sx.TrainState.create(gpt.make_gpt(cfg, 0, remat=c["remat"]), optax.adam(1e-4))

    def loss(m: Any, b: Any) -> Any:
        logits = m(b["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

    batch = c["per_device_batch"] * len(target)
    tokens = jax.ShapeDtypeStruct((batch, c["seq"]), jnp.int32)
    n = gpt.param_count(jax.eval_shape(lambda: gpt.make_gpt(cfg, 0)), embeddings=False)
    flops = transformer_flops_per_token(n, c["layers"], c["seq"], c["d_model"]) * batch * c["seq"]
    config = sx.train.StepConfig(
        mesh=sx.make_mesh({"data": -1}, devices=target), precision=precision
    )  # any mesh: each candidate has its own
    space = sx.SearchSpace(devices=target, plans=("fsdp", "hsdp"), config=config)
    start = time.perf_counter()
    report = sx.search_plans(space, init, loss_fn=loss, batch={"inputs": tokens,
                             "targets": tokens}, model_flops=flops,
                             model_flops_note="6N + attention, causal halved")  # fmt: skip
    per_device = flops / len(target) / 1e12
    rows = {}
    for cand in report.candidates:
        cost = cand.estimate.per_op if cand.estimate is not None else None
        if cost is not None:
            rows[cand.name] = {"tflops_per_device": per_device / cost.step_s,
                               "step_s": cost.step_s, "interval_s": [cost.low_s, cost.high_s],
                               "inter_host_s": cost.inter_host_s,
                               "exposed_inter_host_s": cost.exposed_inter_host_s,
                               "fits": cand.estimate.fits}  # fmt: skip
    pick, fsdp = rows.get(report.name), rows.get("fsdp")
    gain = pick["tflops_per_device"] / fsdp["tflops_per_device"] if pick and fsdp else None
    return {"case": name, "target": c["target"], "network": c.get("network"),
            "pick": report.name, "reason": report.reason, "candidates": rows,
            "gain_over_fsdp": gain, "wall_s": time.perf_counter() - start,
            "report": str(report)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--per-device-batch", type=int, default=None, help="over the case's")
    parser.add_argument("--search", choices=list(CASES), default=None,
                        help="rank pure FSDP against HSDP on this case's target "
                        "(sx.search_plans' default space on several hosts)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.search:
        r = search_case(args.search)
        print(r["report"], flush=True)
        print({k: v for k, v in r.items() if k != "report"}, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1, default=str)
        return 0
    results = []
    for name in args.case or list(CASES):
        r = run_case(name, args.per_device_batch)
        print(r["report"], flush=True)
        print({k: v for k, v in r.items() if k not in ("report", "estimate")}, flush=True)
        results.append(r)
        if args.json:  # after each case: a long run keeps what it has
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)
    print(comparison(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
