"""Predicted figures of Llama-shaped GPTs on clusters this machine does not have, beside
the published ones (docs/results.md, "Planned for a cluster you do not have").

Each case builds the built-in GPT abstractly (``nnx.eval_shape``: nothing is allocated),
compiles its train step for a compile-only target (``sx.target``) with ``sx.estimate``,
and writes the memory per device, the compiled FLOPs and the PREDICTED TFLOP/s per device
and MFU, beside the published figure. Needs the compile extras on the JAX 0.12 leg::

    JAX_PLATFORMS=cpu .venv-py312/bin/python benchmarks/target_estimates.py --json out.json
    ... --case llama2-7b-8xh100    # one case

Cases (published figures, their sources):

- ``llama2-7b-8xh100``: d 4096, 32 layers, 32 heads, seq 4096, vocab 32000, FSDP 8,
  per-device batch 4 (MaxText's ``configs/a3/llama_2_7b/1vm.sh``); MaxText's published
  492 TFLOP/s per chip on 1x A3 (``configs/a3/llama_2_7b/README.md``).
- ``llama3.1-70b-256xh200``: d 8192, 80 layers, 64 heads, seq 8192, vocab 128256; FSDP 8
  within a host, data parallel over 32 hosts; 508 TFLOP/s per device as issue 33 quotes it.
- ``llama3.1-8b-v6e-256``: d 4096, 32 layers, 32 heads, seq 8192, vocab 128256, FSDP
  over 256 chips; MaxText's published 45.46% MFU, 7,207 tokens/s per device
  (maxtext.readthedocs.io, reference/models/tiering.html, Trillium Gold).

The GPT's MLP is 4·d wide with two matrices (Llama's SwiGLU has three, 11008/14336/28672
wide) and no grouped-query attention, so the shapes are close, not equal: the table gives
the GPT's own parameter count. Model FLOPs are ``6·N + attention`` (causal halved), as
MaxText counts them.
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
        source="MaxText configs/a3/llama_2_7b/README.md (1x A3 h100-80gb-8), 1vm.sh",
    ),
    "llama3.1-70b-256xh200": dict(
        target="32x8xH200", layers=80, d_model=8192, heads=64, seq=8192, vocab=128256,
        per_device_batch=1, mesh={"replica": 32, "data": 8}, remat="full", params_bf16=True,
        published={"tflops_per_device": 508.0},
        source="as quoted in issue 33 (MaxText, Llama 3.1 70B on 256 H200)",
    ),
    "llama3.1-8b-v6e-256": dict(
        target="v6e-256", layers=32, d_model=4096, heads=32, seq=8192, vocab=128256,
        per_device_batch=2, mesh={"data": 256}, remat="full", params_bf16=False,
        published={"mfu": 0.4546, "tokens_per_s_per_device": 7207.0},
        source="maxtext.readthedocs.io reference/models/tiering.html (v6e Gold, 256 chips)",
    ),
}  # fmt: skip


_GPU = {  # until sx.target is merged: XLA's GPU description of each target's GPU
    "H100": ("NVIDIA H100 80GB HBM3", 84942979072, 3352320000000),
    "H200": ("NVIDIA H200", 150754820096, 4800000000000),
}
_CONFIG = """gpu_device_info {{ threads_per_block_limit: 1024 threads_per_warp: 32
shared_memory_per_block: 49152 shared_memory_per_core: 233472 threads_per_core_limit: 2048
core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
block_dim_limit_z: 65535 memory_bandwidth: {bw} l2_cache_size: 52428800 clock_rate_ghz: 1.98
device_memory_size: {mem} shared_memory_per_block_optin: 232448
cuda_compute_capability {{ major: 9 }} registers_per_core_limit: 65536
registers_per_block_limit: 65536 }}
platform_name: "CUDA" dnn_version_info {{ major: 9 minor: 8 }}
device_description_str: "{kind}"
"""


def target_devices(name: str) -> list[Any]:
    """``sx.target(name)`` where this shardax has it, else the same devices straight from
    ``jax.experimental.topologies`` (the benchmark's own fallback)."""
    import shardax as sx

    if hasattr(sx, "target"):
        return list(sx.target(name).devices if hasattr(sx.target(name), "devices")
                    else sx.target(name))  # fmt: skip
    from jax.experimental import topologies

    if name.startswith("v6e-"):
        side = int(int(name[4:]) ** 0.5)
        return topologies.get_topology_desc(f"v6e:{side}x{side}", platform="tpu").devices
    *hosts, gpu = name.split("x")
    hosts, per = (int(hosts[0]), int(hosts[1])) if len(hosts) == 2 else (1, int(hosts[0]))
    kind, mem, bw = _GPU[gpu]
    config = _CONFIG.format(kind=kind, mem=mem, bw=bw)
    return topologies.get_topology_desc(
        "", platform="cuda", topology=f"1 x {hosts} x {per}", target_config=config
    ).devices


def run_case(name: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardax as sx
    from shardax.cost.flops import transformer_flops_per_token
    from shardax.models import gpt

    c = CASES[name]
    import numpy as np

    devices = target_devices(c["target"])
    sizes = list(c["mesh"].values())
    mesh = jax.sharding.Mesh(np.array(devices).reshape(sizes), tuple(c["mesh"]))
    cfg = gpt.GPTConfig(c["layers"], c["d_model"], c["heads"], c["seq"], vocab=c["vocab"],
                        scan_layers=True)  # fmt: skip
    precision: Any = "bf16"
    if c["params_bf16"]:  # params and Adam in bf16: 8 bytes per parameter
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
    p = report.prediction
    params_total = gpt.param_count(model)
    bytes_per_param = 8 if c["params_bf16"] else 12  # params + Adam m, v
    formula = params_total * bytes_per_param / 8  # FSDP over the 8 devices of "data"
    if mesh.shape.get("data") != 8 or len(mesh.shape) == 1:
        formula = params_total * bytes_per_param / mesh.shape["data"]
    return {
        "case": name,
        "target": c["target"],
        "mesh": dict(mesh.shape),
        "params": params_total,
        "global_batch": batch,
        "seq": c["seq"],
        "precision": "bf16 params + Adam" if c["params_bf16"] else "fp32 params + Adam, bf16 math",
        "remat": c["remat"],
        "estimate": report.to_dict(),
        "params_plus_optimizer_bytes": report.memory["params"] + report.memory["optimizer"],
        "formula_params_plus_optimizer_bytes": formula,
        "fits_with_headroom": report.fits,
        "predicted_tflops_per_device": {
            "overlapped": p.model_tflops_per_device(True),
            "serial": p.model_tflops_per_device(False),
        },
        "predicted_mfu": {"overlapped": p.mfu(True), "serial": p.mfu(False)},
        "predicted_tokens_per_s_per_device": {
            "overlapped": p.tokens_per_s_per_device(True),
            "serial": p.tokens_per_s_per_device(False),
        },
        "published": c["published"],
        "source": c["source"],
        "wall_s": wall,
        "report": str(report),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    results = []
    for name in args.case or list(CASES):
        r = run_case(name)
        print(r["report"], flush=True)
        print({k: v for k, v in r.items() if k not in ("report", "estimate")}, flush=True)
        results.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
