"""The GPU session: everything one lent GPU must measure, in one command that fits one
device call (at most 8 minutes on one H100 or H200).

    python benchmarks/gpu/session.py --out "$OUT"                 # on the GPU
    python benchmarks/gpu/session.py --out /tmp/gpu --budget 300   # a CPU smoke test (tiny GPT)

Three stages, each its own process under a share of ``--budget`` seconds (a stage that
runs over is killed, and what it wrote so far is kept), in order of importance:

1. ``core``: the calibration tables (``shardax.cost.calibrate``: GEMM rate by shape, stream
   bandwidth, cuDNN attention times, launch cost); shardax's GPT step at the default
   configuration; the same step hand-written with ``jax.jit`` (their ratio is shardax's
   overhead); and a profile of shardax's step read into time per op class beside each
   class's floor (``op_profile.py``).
2. ``torch``: the same GPT in PyTorch (``torch_gpt.py``: ``torch.compile``, SDPA flash
   attention, bf16 autocast over fp32 params, fused AdamW) at the default shape, and its
   loss from a shardax GPT's weights beside shardax's (the same model, checked).
3. ``sweep``: first the rows of issue 55 (``predicted_configs``: fp8 at the default
   shape and at d 4096 × 8 layers beside its bf16, the bf16 residual stream, the fused
   (recomputing) norm and GELU, both, and ZeRO-1 gathering the compute-dtype copy), each
   with its prediction written down before the session (``predictions.json``, by
   ``predict.py``: ``sx.estimate`` on a compile-only card) beside its measurement, and a
   profile read into the per-op model's classes (``op_profile.py``) beside the
   prediction's; then what decides speed, one change at a time from the default: the
   compiler settings (XLA's defaults against shardax's), 16k and 32k tokens per device,
   dense attention, scanned layers, remat minimal and full. A row that does not start
   25 s before the deadline is listed as skipped (the issue's rows come first).

The default configuration is the 1.21B GPT of ``benchmarks/mfu.py`` (24 × 2048, 16 heads
of 128, sequence 2048, vocabulary 256) at 4 sequences (8k tokens) per device, bf16 over
fp32 params, AdamW, layers unrolled, cuDNN attention, shardax's compiler settings; on a
CPU a tiny GPT (2 × 64) stands in, as a smoke test of every path. MFU counts model FLOPs
as MaxText and Megatron do: ``6·N + 6·L·T·d`` per token (N without the embedding lookup,
the LM head in it, attention causal-halved), over the device's dense bf16 peak.

Written under ``--out``: ``session.json`` (every figure), ``session.md`` (the tables),
``session.log`` (each stage's output), ``op_profile.json``, ``calibration.json`` (the
kernel tables as ``shardax calibrate`` writes them, on a GPU: copied to
``src/shardax/cost/tables/<kind>-<date>.json``, with its ``source`` naming the session's
record, they ship), and ``hlo/<name>.hlo.gz``: the default step's and each sweep
configuration's optimized program as it ran (XLA's dump), which
``benchmarks/cost_model_accuracy.py`` prices where it finds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SIZES = {
    "1b": {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 2048, "rows": 4},
    "tiny": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64, "rows": 2},
}
STAGES = ("core", "torch", "sweep")
SHARE = {"core": 0.35, "torch": 0.45, "sweep": 1.0}
"""Each stage's share of the time left when it starts (the sweep takes what is left)."""


def base_config(size: str, devices: int) -> Any:
    from jax_gpt import Config

    s = SIZES[size]
    return Config(layers=s["layers"], d_model=s["d_model"], heads=s["heads"],
                  seq_len=s["seq_len"], batch=s["rows"] * devices)  # fmt: skip


def sweep_configs(base: Any) -> list[tuple[str, Any]]:
    """One change at a time from ``base``, the most telling first."""
    import shardax as sx

    r, b = dataclasses.replace, base.batch
    cublas = {**sx.train.gpu_options(), "xla_gpu_enable_triton_gemm": False}
    return [
        ("before: MLP and head in fp32 (the GPT as of stage 4)", r(base, model="stage4")),
        ("compiler: XLA's defaults", r(base, compiler="xla")),
        ("compiler: shardax's with Triton GEMMs off (the recipes')", r(base, compiler=cublas)),
        ("16k tokens per device", r(base, batch=2 * base.batch)),
        ("remat minimal (dots_no_batch)", r(base, remat="dots_no_batch")),
        ("remat full", r(base, remat="full")),
        ("32k tokens per device, remat minimal", r(base, batch=4 * b, remat="dots_no_batch")),
        ("attention: dense", r(base, kernel="dense")),
        ("layers scanned", r(base, scan=True)),
        ("32k tokens per device, remat full", r(base, batch=4 * b, remat="full")),
    ]  # fmt: skip


def predicted_configs(base: Any) -> list[tuple[str, Any]]:
    """The rows of issue 55, each predicted before it is measured (``predict.py``): one
    change at a time from ``base``, except the wide shape's pair (d 4096 × 8 layers, 32
    heads of 128: bf16, then fp8, so that their ratio is measured in one call)."""
    r = dataclasses.replace
    wide = r(base, layers=max(base.layers // 3, 1), d_model=2 * base.d_model,
             heads=2 * base.heads)  # fmt: skip
    return [
        ("fp8", r(base, precision="fp8")),
        ("d 4096 x 8 layers, bf16", wide),
        ("d 4096 x 8 layers, fp8", r(wide, precision="fp8")),
        ("bf16 residual stream", r(base, residual="bf16")),
        ("fused norm and GELU (elementwise recompute)", r(base, elementwise="recompute")),
        ("bf16 residual + fused norm and GELU", r(base, residual="bf16",
                                                   elementwise="recompute")),
        ("ZeRO-1, compute-dtype gather (gather forward)", r(base, plan="zero1",
                                                            zero_gather="forward")),
        ("fp8 + bf16 residual + fused norm and GELU", r(base, precision="fp8", residual="bf16",
                                                        elementwise="recompute")),
    ]  # fmt: skip


def prediction(card: str | None, name: str, size: str,
               path: Path = HERE / "predictions.json") -> dict[str, Any] | None:  # fmt: skip
    """The prediction written down for row ``name`` on ``card`` (``"H200"``) at ``size``
    (``predict.py``'s), None where none was."""
    written = _load(path) or {}
    row = (written.get(card or "") or {}).get(name)
    return row if isinstance(row, dict) and row.get("size", "1b") == size else None


def _size(arg: str) -> str:
    """``arg``, or for ``"auto"`` 1b where ``nvidia-smi`` lists a GPU, else tiny (asked
    without importing JAX here, so this process holds no device memory)."""
    if arg != "auto":
        return arg
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "tiny"
    return "1b" if listed.returncode == 0 and "GPU" in listed.stdout else "tiny"


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def _free() -> None:
    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


def _error(e: BaseException) -> dict[str, str]:
    return {"error": f"{type(e).__name__}: {str(e)[:600]}",
            "where": traceback.format_exc(limit=3)[-800:]}  # fmt: skip


MEMORY_FRACTION = "0.95"
"""The share of the GPU's memory the JAX stages run with: the sweep's largest steps need
more than JAX's default 75%."""


def run_memory_fraction() -> float:
    """The memory fraction this process's JAX runs with (as ``run_stage`` set it)."""
    from shardax.cost.budget import gpu_memory_fraction

    return gpu_memory_fraction()


def stage_core(work: Path, size: str, steps: int) -> None:
    """Calibration, shardax's default step (+ profile), the hand-written step."""
    import jax
    import jax_gpt
    import op_profile

    from shardax.cost import calibrate

    out: dict[str, Any] = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                           "platform": jax.devices()[0].platform, "devices": jax.device_count(),
                           "size": size}  # fmt: skip
    # The memory JAX plans programs in here (its allocator's limit): a compile-only target
    # compiles with the same budget (sx.target's memory_fraction), or it rematerializes
    # steps that ran whole here.
    stats = jax.devices()[0].memory_stats() or {}
    out["memory"] = {"fraction": run_memory_fraction(), "bytes_limit": stats.get("bytes_limit")}
    path = work / "core.json"
    _write(path, out)
    out["calibration"] = calibrate.tables(quick=size == "tiny")
    ceilings = calibrate.summary(out["calibration"])
    out["ceilings"] = ceilings
    _write(path, out)
    base = base_config(size, jax.device_count())
    try:
        shardax_run = jax_gpt.run(base, steps=steps, hlo=True)
    except Exception as e:
        out["shardax"] = _error(e)
        _write(path, out)
        shardax_run = None
    if shardax_run is not None:
        fn, state, batch = shardax_run.pop("_run")
        text = shardax_run.pop("hlo_text")
        out["shardax"] = shardax_run
        _write(path, out)
        (work / "step.hlo.txt").write_text(text)
        (work / "hlo").mkdir(exist_ok=True)
        with gzip.open(work / "hlo" / f"{slug('default (shardax)')}.hlo.gz", "wt") as f:
            f.write(text)
        try:
            box = {"state": state}

            def profiled() -> None:
                for _ in range(3):
                    box["state"], loss = fn(box["state"], batch)
                jax.block_until_ready(loss)

            xplane = op_profile.capture(profiled, work / "trace")
            out["profile"] = op_profile.op_table(
                xplane, text, steps=3, step_seconds=shardax_run["seconds_per_step"],
                matmul_tflops=ceilings["matmul_tflops"], bandwidth_gbs=ceilings["bandwidth_gbs"],
            )  # fmt: skip
        except Exception as e:
            out["profile"] = _error(e)
        del fn, state, batch, box
        _write(path, out)
        _free()
    try:
        hand = jax_gpt.run(dataclasses.replace(base, impl="jit"), steps=steps)
        out["jit"] = {k: v for k, v in hand.items() if not k.startswith("_")}
    except Exception as e:
        out["jit"] = _error(e)
    _write(path, out)


def stage_torch(work: Path, size: str, steps: int) -> None:
    """The torch.compile GPT at the default shape; its loss from shardax's weights."""
    import torch_gpt

    s = SIZES[size]
    out: dict[str, Any] = {}
    path = work / "torch.json"
    try:
        import torch

        out["torch"] = torch.__version__
        device = "cuda" if torch.cuda.is_available() else "cpu"
        out["run"] = torch_gpt.run(layers=s["layers"], d_model=s["d_model"], heads=s["heads"],
                                   seq_len=s["seq_len"], batch=s["rows"],  # one device
                                   steps=steps, warmup=3, compile=True, device=device)  # fmt: skip
    except Exception as e:
        out["run"] = _error(e)
    _write(path, out)
    try:
        out["parity"] = parity()
    except Exception as e:
        out["parity"] = _error(e)
    _write(path, out)


def parity() -> dict[str, Any]:
    """The fp32 loss of a small shardax GPT (JAX, on the CPU) and of the torch GPT given
    the same weights: the same model if they agree to rounding."""
    import jax
    import jax_gpt
    import numpy as np
    import torch_gpt
    from flax import nnx

    from shardax.models import gpt

    cfg = gpt.GPTConfig(layers=2, d_model=128, heads=4, max_seq_len=64)
    with jax.default_device(jax.devices("cpu")[0]):
        model = gpt.make_gpt(cfg, seed=0)
        batch = jax_gpt.random_tokens(2, 64, seed=1)
        ours = float(jax_gpt.loss_fn(model, batch))
        params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    theirs = torch_gpt.loss_from_shardax_params(params, batch, dataclasses.asdict(cfg))
    return {"jax_loss": ours, "torch_loss": theirs, "relative": abs(ours - theirs) / abs(ours)}


def stage_sweep(
    work: Path, size: str, steps: int, deadline: float, extra: list[dict], only: str = "all"
) -> None:
    """The sweep, one configuration at a time while time is left: the ``extra`` ones,
    then those of :func:`predicted_configs` and :func:`sweep_configs` whose name holds one
    of ``only``'s comma-separated words (``"all"``: every one), in that order. The
    predicted ones (and an extra one with ``"profile": true``) are profiled after their
    timed steps, into op classes beside their prediction's."""
    import jax
    import jax_gpt

    from shardax.cost.accelerators import kind_of

    base = base_config(size, jax.device_count())
    configs = [(e.pop("name", "extra"), dataclasses.replace(
        base, **{k: v for k, v in e.items() if k != "profile"}), bool(e.get("profile")))
        for e in extra]  # fmt: skip
    words = [w.strip() for w in only.split(",") if w.strip()]
    chosen = lambda name: only == "all" or any(w in name for w in words)  # noqa: E731
    configs += [(n, c, True) for n, c in predicted_configs(base) if chosen(n)]
    configs += [(n, c, False) for n, c in sweep_configs(base) if chosen(n)]
    card = kind_of(str(jax.devices()[0].device_kind))
    ceilings = (_load(work / "core.json") or {}).get("ceilings") or {}
    rows: list[dict[str, Any]] = []
    path = work / "sweep.json"
    shutil.rmtree(work / "dump", ignore_errors=True)  # a killed earlier sweep's
    for name, config, profile in configs:
        said = prediction(card, name, size)
        row: dict[str, Any] = {"name": name, "label": config.label()}
        missing = f"no prediction written down for {card}"
        if said and said.get("config") != dataclasses.asdict(config):
            said, missing = None, f"the prediction for {card} was of another configuration"
        if profile:  # written down before this session: read before the row is measured
            row["prediction"] = said or {"missing": missing}
        if time.time() > deadline - 25:
            rows.append({**row, "skipped": "out of session time"})
            continue
        try:
            row.update(jax_gpt.run(config, steps=steps, keep=profile))
        except Exception as e:
            row.update(_error(e))
        run = row.pop("_run", None)
        if run is not None:
            row["profile"] = profile_row(work, run, row, config, ceilings)
        if said and "seconds_per_step" in row and "step_ms" in said:
            row["predicted_over_measured"] = said["step_ms"] / (row["seconds_per_step"] * 1e3)
        row["hlo"] = keep_program(work, name)
        rows.append(row)
        del run
        _write(path, rows)
        _free()
    _write(path, rows)


def profile_row(work: Path, run: Any, row: dict[str, Any], config: Any,
                ceilings: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Three more steps of a sweep row profiled into op classes (``op_profile.op_table``)
    of its program as XLA dumped it; the GEMMs' floor at the fp8 rate for an fp8 row (the
    measured fp8 ceiling, else 2x bf16's)."""
    import jax
    import op_profile

    fn, state, batch = run
    dumped = dumped_program(work)
    if dumped is None:
        return {"error": "XLA dumped no program to read the profile against"}
    matmul = ceilings.get("matmul_tflops")
    if config.precision == "fp8" and matmul:
        matmul = ceilings.get("fp8_matmul_tflops") or 2 * matmul
    try:
        box = {"state": state}

        def profiled() -> None:
            for _ in range(3):
                box["state"], loss = fn(box["state"], batch)
            jax.block_until_ready(loss)

        xplane = op_profile.capture(profiled, work / "trace" / slug(row["name"]))
        table = op_profile.op_table(xplane, dumped.read_text(), steps=3,
                                    step_seconds=row["seconds_per_step"], matmul_tflops=matmul,
                                    bandwidth_gbs=ceilings.get("bandwidth_gbs"))  # fmt: skip
    except Exception as e:
        return _error(e)
    finally:
        shutil.rmtree(work / "trace", ignore_errors=True)
    kept = ("classes", "sum_over_step", "traced_step_ms", "matmul_tflops", "notes")
    return {**{k: table.get(k) for k in kept}, "top_ops": (table.get("top_ops") or [])[:5]}


def slug(name: str) -> str:
    """A file name for a configuration's name."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def dump_flags(work: Path) -> str:
    """``XLA_FLAGS`` that make XLA write each optimized program's text under
    ``work/dump`` (read by :func:`keep_program`), so each configuration's program is
    priced as it ran, without compiling it twice."""
    return f"--xla_dump_to={work / 'dump'} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"


def dumped_program(work: Path) -> Path | None:
    """The step's optimized program XLA dumped under ``work/dump`` (shardax's step is
    ``jit_whole``, the hand-written one ``jit_step``; else the largest program), or None."""
    texts = sorted((work / "dump").glob("*after_optimizations.txt"), key=lambda f: f.stat().st_size)
    steps = [f for f in texts if ".jit_whole." in f.name or ".jit_step." in f.name]
    texts = steps or texts
    return texts[-1] if texts else None


def keep_program(work: Path, name: str) -> str | None:
    """The step's program XLA dumped since the last call (``dumped_program``), gzipped to
    ``work/hlo/<slug>.hlo.gz``; the dump emptied. Returns the file's name, or None."""
    dumped = dumped_program(work)
    kept = None
    if dumped is not None:
        (work / "hlo").mkdir(exist_ok=True)
        kept = f"{slug(name)}.hlo.gz"
        with open(dumped, "rb") as src, gzip.open(work / "hlo" / kept, "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(work / "dump", ignore_errors=True)
    return kept


def run_stage(stage: str, args: argparse.Namespace, seconds: float, log: Any) -> dict[str, Any]:
    """``stage`` in its own process, killed after ``seconds``; its output to ``log``."""
    cmd = [sys.executable, __file__, "--stage", stage, "--work", str(args.work),
           "--size", args.size, "--steps", str(args.steps),
           "--deadline", str(time.time() + seconds), "--extra", json.dumps(args.extra),
           "--sweep", args.sweep]  # fmt: skip
    env = dict(os.environ)
    if stage == "torch":  # JAX in that process only for the parity check, on the CPU
        env["JAX_PLATFORMS"] = "cpu"
    else:  # as `shardax train` and `shardax launch` set it (sx.train.compiler.ENVIRONMENT)
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        if not any(env.get(v) for v in ("XLA_CLIENT_MEM_FRACTION",
                                        "XLA_PYTHON_CLIENT_MEM_FRACTION")):  # fmt: skip
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = MEMORY_FRACTION
    if stage == "sweep":  # each configuration's program as it ran, for the cost model
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {dump_flags(args.work)}".strip()
    began = time.time()
    log.write(f"\n===== {stage} (up to {seconds:.0f} s) =====\n")
    log.flush()
    try:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=max(seconds, 5))  # fmt: skip
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = f"killed after {seconds:.0f} s"
    log.write(f"===== {stage}: {status} in {time.time() - began:.0f} s =====\n")
    log.flush()
    return {"stage": stage, "status": status, "seconds": time.time() - began}


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def assemble(work: Path, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """One record of the session, with the ratios the issue asks for."""
    core = _load(work / "core.json") or {}
    torch = _load(work / "torch.json") or {}
    sweep = _load(work / "sweep.json") or []
    shardax, jit, trun = core.get("shardax", {}), core.get("jit", {}), torch.get("run", {})
    ratios: dict[str, Any] = {}
    if "seconds_per_step" in shardax and "seconds_per_step" in jit:
        ratios["shardax_over_jit_step_time"] = shardax["seconds_per_step"] / jit["seconds_per_step"]
    if "tokens_per_s" in shardax and "tokens_per_s" in trun:
        ratios["shardax_over_torch_tokens_per_s"] = shardax["tokens_per_s"] / trun["tokens_per_s"]
    peak = None
    if isinstance(shardax.get("mfu"), float) and shardax["mfu"] > 0:
        peak = shardax["model_tflops_per_s_per_device"] / shardax["mfu"]  # TFLOP/s
    if peak and "tokens_per_s" in trun and "model_flops_per_step" in shardax:
        # The same model and shape: the same model FLOPs per token.
        per_token = (
            shardax["model_flops_per_step"]
            / shardax["config"]["batch"]
            / shardax["config"]["seq_len"]
        )
        trun["mfu"] = per_token * trun["tokens_per_s"] / (peak * 1e12)
    base = shardax.get("seconds_per_step")
    for row in sweep:
        if base and "seconds_per_step" in row:
            row["tokens_per_s_vs_default"] = row["tokens_per_s"] / shardax["tokens_per_s"]
    from shardax.cost.accelerators import kind_of  # JAX not initialised: no device memory held

    card = kind_of(str(core.get("device", "")))
    said = prediction(card, "default (shardax)", core.get("size", "1b"))
    same = said is not None and said.get("config") == shardax.get("config")
    if said and "step_ms" in said and base and same:  # the default's, for the ratios' sake
        shardax["prediction"] = said
        shardax["predicted_over_measured"] = said["step_ms"] / (base * 1e3)
    by = {r.get("name"): r for r in sweep}
    for fp8, bf16 in (("fp8", None), ("d 4096 x 8 layers, fp8", "d 4096 x 8 layers, bf16")):
        over = shardax if bf16 is None else by.get(bf16, {})
        if "tokens_per_s" in by.get(fp8, {}) and "tokens_per_s" in over:
            ratios[f"{fp8} over bf16 tokens_per_s"] = by[fp8]["tokens_per_s"] / over["tokens_per_s"]
        if bf16 is None and "last_loss" in by.get(fp8, {}) and "last_loss" in shardax:
            ratios["fp8_loss_minus_bf16"] = by[fp8]["last_loss"] - shardax["last_loss"]
    return {"stages": stages, "core": core, "torch": torch, "sweep": sweep, "ratios": ratios}


def _fmt(x: Any, spec: str) -> str:
    return format(x, spec) if isinstance(x, int | float) else "—"


def said(r: dict[str, Any]) -> str:
    """A row's written-down prediction for the table: ms, interval, over the measured."""
    p = r.get("prediction")
    if not isinstance(p, dict):
        return ""
    if "step_ms" not in p:
        return str(p.get("missing") or p.get("error", ""))[:80]
    over = r.get("predicted_over_measured")
    return (f"{p['step_ms']:.1f} ({p['low_ms']:.1f}–{p['high_ms']:.1f})"
            + (f", {over:.3f}" if isinstance(over, float) else ""))  # fmt: skip


def classes_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The predicted rows' op classes: the per-op model's (written down before) beside the
    profile's, ms per step."""
    from shardax.cost.ops import CLASSES

    lines: list[str] = []
    for r in rows:
        p, prof = r.get("prediction") or {}, r.get("profile") or {}
        predicted, measured = p.get("classes_ms") or {}, prof.get("classes") or {}
        if not predicted and not measured:
            continue
        fp8 = f"; fp8 GEMMs priced by the {p['fp8']} rate" if p.get("fp8") else ""
        made = f"Not predicted ({p.get('missing', 'none')})"
        if predicted:
            made = f"Predicted {p['made']} (JAX {p.get('jax')}, {p.get('calibration')}{fp8})"
        lines += [f"### {r['name']}", "", f"{made}; profiled "
                  f"{_fmt(prof.get('sum_over_step'), '.1%')} of the step.", "",
                  "| class | predicted ms | profiled ms |", "|---|---:|---:|"]  # fmt: skip
        for c in [*CLASSES, *sorted(set(measured) - set(CLASSES))]:
            if c in predicted or c in measured:
                got = (measured.get(c) or {}).get("ms_per_step")
                lines.append(f"| {c} | {_fmt(predicted.get(c), '.2f')} | {_fmt(got, '.2f')} |")
        lines.append("")
    return lines


def markdown(s: dict[str, Any]) -> str:
    """The session as markdown tables (steps, sweep, profile, calibration)."""
    core = s["core"]
    lines = [f"# GPU session: {core.get('device', '?')}, JAX {core.get('jax', '?')}, "
             f"torch {s['torch'].get('torch', '—')}", ""]  # fmt: skip
    lines += ["| stages | " + " · ".join(f"{x['stage']} {x['status']} ({x['seconds']:.0f} s)"
                                        for x in s["stages"]) + " |", "|---|", ""]  # fmt: skip
    lines += ["| step | ms / step (median) | tokens/s | MFU | compile s | loss first → last "
              "| predicted ms (interval), predicted / measured |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip

    def row(name: str, r: dict[str, Any]) -> str:
        if "error" in r or "skipped" in r:
            return f"| {name} | {r.get('error') or r.get('skipped')} | | | | | {said(r)} |"
        ms = r.get("seconds_per_step", float("nan")) * 1e3
        mfu = r.get("mfu")
        loss = f"{_fmt(r.get('first_loss'), '.4f')} → {_fmt(r.get('last_loss'), '.4f')}"
        tokens, compile_s = (
            _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(r.get("compile_seconds"), ".1f"),
        )
        return (f"| {name} | {ms:.1f} | {tokens} | {_fmt(mfu, '.1%')} | {compile_s} | {loss} "
                f"| {said(r)} |")  # fmt: skip

    for name, r in (("shardax (default)", core.get("shardax", {})),
                    ("hand-written jax.jit", core.get("jit", {})),
                    ("torch.compile", s["torch"].get("run", {}))):  # fmt: skip
        if r:
            lines.append(row(name, r))
    for r in s["sweep"]:
        lines.append(row(r.get("name", "?"), r))
    lines += ["", "Ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in s["ratios"].items()), ""]
    classes = classes_markdown(s["sweep"])
    if classes:
        lines += ["## Issue 55's rows by op class: predicted and profiled", "", *classes]
    parity = s["torch"].get("parity")
    if parity:
        lines += [f"Parity (same weights, fp32 loss): {parity}", ""]
    profile = core.get("profile")
    if isinstance(profile, dict) and "error" not in profile:
        import op_profile

        lines += ["## Profile of the default step", "", op_profile.markdown(profile), ""]
    elif profile:
        lines += [f"Profile: {profile}", ""]
    calib = core.get("calibration", {})
    lines += ["## Calibration", "", f"Ceilings: {core.get('ceilings')}", ""]
    if isinstance(calib.get("gemm"), list):
        lines += ["| GEMM m × n × k (bf16) | ms | TFLOP/s |", "|---|---|---|"]
        lines += [f"| {r['m']} × {r['n']} × {r['k']} | {r['ms']:.3f} | {r['tflops']:.0f} |"
                  for r in calib["gemm"]]  # fmt: skip
    if isinstance(calib.get("stream"), list):
        lines += ["", "| stream | bytes | ms | GB/s |", "|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['bytes']:.3g} | {r['ms']:.3f} | {r['gbs']:.0f} |"
                  for r in calib["stream"]]  # fmt: skip
    if isinstance(calib.get("attention"), list):
        lines += ["", "| attention b × s × h × d | causal | pass | ms | TFLOP/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in calib["attention"]:
            shape = f"{r['batch']} × {r['seq']} × {r['heads']} × {r['head_dim']}"
            rest = f"{r['ms']:.3f} | {r['tflops']:.0f}" if "ms" in r else r.get("error", "?")
            lines.append(f"| {shape} | {r['causal']} | {r['pass']} | {rest} |")
    if isinstance(calib.get("launch"), list):
        lines += [""] + [f"- {r['what']}: {r['us']:.1f} µs" for r in calib["launch"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="where the results go")
    p.add_argument("--work", type=Path, default=None, help="scratch (default: OUT/../work)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for all the stages")
    p.add_argument("--size", choices=("auto", *SIZES), default="auto")
    p.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    p.add_argument("--stages", default=",".join(STAGES), help="which stages, in order")
    p.add_argument("--extra", type=json.loads, default=[],
                   help='JSON list of extra sweep configurations first, e.g. \'[{"name": '
                        '"2 layers", "layers": 2, "compiler": "xla"}]\'')  # fmt: skip
    p.add_argument("--sweep", default="all",
                   help="the sweep's configurations whose name holds one of these words, "
                        "comma-separated (default: all)")  # fmt: skip
    p.add_argument("--stage", choices=STAGES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage is not None:  # one stage, in this process
        size = args.size
        args.work.mkdir(parents=True, exist_ok=True)
        if args.stage == "core":
            stage_core(args.work, size, args.steps)
        elif args.stage == "torch":
            stage_torch(args.work, size, args.steps)
        else:
            stage_sweep(args.work, size, args.steps, args.deadline, args.extra, args.sweep)
        return
    if args.out is None:
        p.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    args.size = _size(args.size)
    args.work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / "shardax-gpu-session"
    args.work.mkdir(parents=True, exist_ok=True)
    for old in [*args.work.glob("*.json"), *args.work.glob("hlo/*.hlo.gz")]:
        old.unlink()
    end = time.time() + args.budget
    stages = []
    with open(args.out / "session.log", "w") as log:
        for stage in args.stages.split(","):
            left = end - time.time()
            if left < 10:
                stages.append({"stage": stage, "status": "no time left", "seconds": 0.0})
                continue
            stages.append(run_stage(stage, args, left * SHARE[stage], log))
            session = assemble(args.work, stages)
            _write(args.out / "session.json", session)
            (args.out / "session.md").write_text(markdown(session))
    profile = session["core"].get("profile")
    if profile:
        _write(args.out / "op_profile.json", profile)
    calibration = session["core"].get("calibration")
    if isinstance(calibration, dict) and not calibration.get("quick"):
        _write(args.out / "calibration.json", calibration)  # as `shardax calibrate` writes it
    if (args.work / "hlo").is_dir():  # the sweep's programs as they ran (a few MB)
        shutil.copytree(args.work / "hlo", args.out / "hlo", dirs_exist_ok=True)
    print((args.out / "session.md").read_text())


if __name__ == "__main__":
    main()
