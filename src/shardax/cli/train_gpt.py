"""``shardax train --model gpt``: the byte-level transformer of ``shardax.models.gpt``.

The corpus is the Python standard library's sources (no download), or ``--data PATH``;
every 10th file is held out for validation. Each step trains on random windows of
``--seq-len`` bytes; every ``--eval-every`` steps the validation loss is measured on a
fixed set of held-out windows. The history has one entry per step (``step``,
``train_loss``) and ``val_loss`` at evaluation steps. The loss is in nats per byte; the
corpus's unigram entropy (the best loss without context) is printed next to it.

Long sequences: ``--mesh data=2,context=4`` splits each row over the ``context`` axis
(``--attention``: ``gpt.ATTENTION``); the batches are reordered zig-zag
for causal load balance (``shardax.data.text.zigzag_batch``) and carry each token's
true position. ``--window L`` is sliding-window attention, ``--pack`` packed rows
(segment ids, positions restarting per document).

Attention takes the platform's fused kernel (cuDNN on a GPU, splash attention on a TPU;
[`shardax.parallel.choose_kernel`][shardax.parallel.choose_kernel]): on a GPU or TPU
``--precision`` defaults to bf16 for it (fp32 on CPU). The kernel the step compiled to
(``cudnn``, ``splash`` or ``dense``, read from the compiled HLO) is printed and is the
summary's ``attention_kernel``.

Experts: ``--experts E`` (``--top-k``, ``--moe-every``, ``--capacity-factor``) makes the
MLPs mixtures of experts, split over an ``expert`` mesh axis where there is one. The
loss is then the cross-entropy plus ``BALANCE_COEF`` × the load-balancing loss; the
balance loss and the dropped fraction are aux metrics (progress bar, history,
``summary.json``, TensorBoard ``train/balance_loss``, ``train/dropped_fraction``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import shardax as sx
from shardax.cli.common import (
    UsageError,
    nonneg_int,
    path_arg,
    plot_curves,
    positive_float,
    positive_int,
)
from shardax.cli.job import Job, build_steps, eval_batch, job_mesh, option, register
from shardax.data.text import LMBatches, batch_layout, lm_eval_batch, load_corpus, zigzag_batch
from shardax.mesh.axes import CONTEXT_AXIS, EXPERT_AXIS, STAGE_AXIS
from shardax.models import gpt
from shardax.models.gpt import ATTENTION, ELEMENTWISE, PLANS, POSITIONS, RESIDUALS, GPTConfig
from shardax.parallel.gpipe import stage_mesh
from shardax.parallel.remat_policy import POLICIES as REMAT_POLICIES

OPTIONS = (
    option("--steps", 200, type=positive_int, help="training steps"),
    option("--layers", 2, type=positive_int, help="transformer blocks"),
    option("--d-model", 64, type=positive_int, help="model width"),
    option("--heads", 4, type=positive_int, help="attention heads"),
    option("--seq-len", 64, type=positive_int, help="tokens per sequence"),
    option("--max-seq-len", 256, type=positive_int, help="the model's longest sequence"),
    option("--positions", "rotary", choices=POSITIONS, help="position encoding"),
    option("--remat", "none", choices=REMAT_POLICIES, help="activation remat policy per block"),
    option(
        "--scan-layers",
        False,
        action="store_const",
        const=True,
        help="run the layers in lax.scan: compile time independent of depth, and remat "
        "saves memory on XLA:CPU; compiled FLOPs then count one layer",
    ),
    option(
        "--residual",
        "fp32",
        choices=tuple(RESIDUALS),
        help="the residual stream's dtype between blocks (bf16: norm statistics stay fp32)",
    ),
    option(
        "--elementwise",
        "autodiff",
        choices=ELEMENTWISE,
        help="recompute: norms and GELU whose backward recomputes from their inputs "
        "(fewer bytes; the same parameters)",
    ),
    option(
        "--data", type=path_arg, help="a text file or directory of them (default: stdlib sources)"
    ),
    option("--eval-every", 50, type=positive_int, help="steps per eval"),
    option(
        "--microbatches",
        type=positive_int,
        help="run the blocks with sx.pipeline in this many microbatches per data shard "
        "(default with --plan pipeline: the stage axis size)",
    ),
    option(
        "--attention",
        "auto",
        choices=ATTENTION,
        help="context-parallel attention over a 'context' mesh axis (--mesh data=2,context=4):"
        f" {', '.join(ATTENTION)}; without one, jax.nn.dot_product_attention",
    ),
    option(
        "--window",
        type=nonneg_int,
        help="sliding-window attention: each token sees itself and the L tokens before it",
    ),
    option(
        "--pack",
        False,
        action="store_const",
        const=True,
        help="packed rows: documents joined with segment ids (attention stays within a "
        "document, positions restart)",
    ),
    option(
        "--experts",
        type=positive_int,
        help="mixture of experts: E experts in the MLP of every --moe-every-th block, split "
        "over an 'expert' mesh axis (--mesh data=2,expert=4) where there is one",
    ),
    option("--top-k", type=positive_int, help="experts per token (default: 2)"),
    option("--moe-every", type=positive_int, help="every n-th block is MoE (default: 1)"),
    option(
        "--capacity-factor",
        type=positive_float,
        help="expert capacity, as a multiple of an even share of the tokens (default: 1.25)",
    ),
    option(
        "--pipeline-repeats",
        type=positive_int,
        help="sx.pipeline repeats: > 1 is the circular schedule (default: 1)",
    ),
)
"""The options only this job takes (``shardax train --model gpt``), with their defaults:
the parser is built from them (``shardax.cli.job.add_job_arguments``)."""

EVAL_WINDOWS = 64
WARMUP_STEPS = 10
BALANCE_COEF = 1e-2
"""α in ``loss = cross-entropy + α · balance_loss`` with ``--experts`` (Switch's
load-balancing loss, 1.0 when routing is even; Switch and ST-MoE use 1e-2)."""


def config(args: argparse.Namespace) -> Any:
    """The ``GPTConfig`` of the options; bad sizes are usage errors naming them."""
    if args.seq_len > args.max_seq_len:
        raise UsageError(
            f"--seq-len {args.seq_len} is above the model's maximum sequence length "
            f"--max-seq-len {args.max_seq_len}"
        )
    if args.d_model % args.heads:
        raise UsageError(
            f"--heads {args.heads} must divide --d-model {args.d_model} "
            f"(remainder {args.d_model % args.heads})"
        )
    if args.experts is None:
        for name in ("top_k", "moe_every", "capacity_factor"):
            if getattr(args, name) is not None:
                raise UsageError(f"--{name.replace('_', '-')} needs --experts")
    moe = {
        "experts": args.experts,
        "top_k": args.top_k,
        "moe_every": args.moe_every,
        "capacity_factor": args.capacity_factor,
    }
    moe = {k: v for k, v in moe.items() if v is not None}
    try:
        return GPTConfig(
            **moe,
            attention=args.attention,
            window=args.window,
            layers=args.layers,
            d_model=args.d_model,
            heads=args.heads,
            max_seq_len=args.max_seq_len,
            positions=args.positions,
            residual=args.residual,
            elementwise=args.elementwise,
            scan_layers=bool(args.scan_layers),
            pipeline_microbatches=args.microbatches,
            pipeline_repeats=args.pipeline_repeats or 1,
        )
    except ValueError as e:
        raise UsageError(f"--d-model {args.d_model} --heads {args.heads}: {e}") from None


def mesh_config(args: argparse.Namespace, mesh: Any) -> Any:
    """``config`` once the mesh is known: ``--plan pipeline`` needs a ``stage`` axis,
    whose size is the default ``--microbatches``."""
    if args.plan == "pipeline":
        if STAGE_AXIS not in mesh.shape:
            raise UsageError(
                f"--plan pipeline needs a mesh with a 'stage' axis, got --mesh "
                f"{','.join(f'{k}={v}' for k, v in mesh.shape.items())}; e.g. data=2,stage=4"
            )
        if args.microbatches is None:
            args.microbatches = mesh.shape[STAGE_AXIS]
    elif args.pipeline_repeats is not None and args.microbatches is None:
        raise UsageError("--pipeline-repeats needs --microbatches (or --plan pipeline)")
    return config(args)


def check_context(args: argparse.Namespace, mesh: Any) -> int:
    """The context axis size C (1 without one), its rules as usage errors."""
    context = mesh.shape.get(CONTEXT_AXIS, 1)
    if context == 1:
        if args.attention != "auto":
            raise UsageError(
                f"--attention {args.attention} picks how the sequence is split over the "
                f"mesh's {CONTEXT_AXIS!r} axis, and --mesh {_mesh_text(mesh)} has none (or of "
                f"size 1), so plain attention would run; add {CONTEXT_AXIS}=C to --mesh, or "
                "drop --attention"
            )
        return 1
    if args.mode != "jit":
        raise UsageError(
            f"--mesh {_mesh_text(mesh)} splits the sequence over the {CONTEXT_AXIS!r} axis, "
            f"which the step does under --mode jit only (the batches are reordered zig-zag "
            f"for C={context} and placed over it); got --mode {args.mode}. Use --mode jit, "
            f"or drop {CONTEXT_AXIS}= from --mesh"
        )
    if args.microbatches is not None:
        raise UsageError(f"--mesh with a {CONTEXT_AXIS!r} axis does not run under sx.pipeline")
    if args.seq_len % (2 * context):
        raise UsageError(
            f"--seq-len {args.seq_len} is not divisible by 2 × the context axis size "
            f"{context} = {2 * context} (each device holds two chunks of a row, zig-zag)"
        )
    if args.attention == "ulysses" and args.heads % context:
        raise UsageError(
            f"--attention ulysses splits the heads over the context axis: --heads "
            f"{args.heads} is not divisible by its size {context}; use ring or all_gather"
        )
    return context


def _mesh_text(mesh: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.shape.items())


def check_experts(args: argparse.Namespace, mesh: Any) -> None:
    """An ``expert`` mesh axis splits the MoE blocks' experts: without ``--experts`` the
    model has none, and every device on that axis would repeat the same work; with them,
    its size must divide their number."""
    size = mesh.shape.get(EXPERT_AXIS, 1)
    if size > 1 and args.experts is not None and args.experts % size:
        raise UsageError(
            f"--experts {args.experts} is not divisible by the size {size} of the "
            f"{EXPERT_AXIS!r} axis of --mesh {_mesh_text(mesh)}, which splits the experts "
            f"evenly over its devices; use a multiple of {size} (e.g. "
            f"{-(-args.experts // size) * size}), or change {EXPERT_AXIS}= in --mesh"
        )
    if size > 1 and args.experts is None:
        raise UsageError(
            f"--mesh {_mesh_text(mesh)} has an {EXPERT_AXIS!r} axis of size "
            f"{mesh.shape[EXPERT_AXIS]}, which splits the experts of --experts, but "
            "--experts is not given: the devices on that axis would repeat the same work. "
            f"Pass --experts E (a multiple of {mesh.shape[EXPERT_AXIS]}), or drop "
            f"{EXPERT_AXIS}= from --mesh"
        )


def check_pipeline(args: argparse.Namespace, mesh: Any, model: Any, batches: list[int]) -> None:
    """sx.pipeline's rules (layers, microbatches, batch per data shard) as usage errors,
    before anything compiles."""
    _, stacked = model.layers()
    for rows in batches:
        x = jax.ShapeDtypeStruct((rows, args.seq_len, args.d_model), "float32")
        try:
            with jax.sharding.set_mesh(mesh):
                stage_mesh(stacked, x, args.microbatches, STAGE_AXIS, args.pipeline_repeats or 1)
        except ValueError as e:
            raise UsageError(
                f"--layers {args.layers} --microbatches {args.microbatches} --batch-size "
                f"{args.batch_size} --mesh {','.join(f'{k}={v}' for k, v in mesh.shape.items())}"
                f": {e}"
            ) from None


@register("gpt", OPTIONS, defaults={"batch_size": 16, "lr": 3e-3}, plans=PLANS)
def make_job(args: argparse.Namespace, out: Any) -> Job:
    """The GPT job: corpus, model, plan from the model's logical axes, validation."""
    mesh, data_size, cfg = job_mesh(args, lambda mesh: mesh_config(args, mesh))
    check_experts(args, mesh)
    context = check_context(args, mesh)
    layout = batch_layout(context)  # "zigzag:C": the C the batches were reordered for
    try:
        corpus = load_corpus(args.data)
        rows, pack = args.batch_size, bool(args.pack)
        loader = LMBatches(corpus.train, rows, args.seq_len, args.seed, pack=pack, context=context)
        eval_rows = max(EVAL_WINDOWS // data_size, 1) * data_size
        val = zigzag_batch(lm_eval_batch(corpus.val, eval_rows, args.seq_len), context)
    except ValueError as e:
        raise UsageError(str(e)) from None

    def loss_fn(model: Any, batch: dict[str, jax.Array]) -> Any:
        logits, aux = model(
            batch["inputs"],
            return_aux=True,
            positions=batch.get("positions"),
            segment_ids=batch.get("segment_ids"),
            layout=layout,
        )
        logits = logits.astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        if aux is None:
            return ce
        metrics = {"balance_loss": aux.balance_loss, "dropped_fraction": aux.dropped_fraction}
        return ce + BALANCE_COEF * aux.balance_loss, metrics

    abstract = nnx.eval_shape(lambda: gpt.make_gpt(cfg, args.seed, remat=args.remat))
    if cfg.pipeline_microbatches is not None:
        check_pipeline(args, mesh, abstract, [args.batch_size, eval_rows])
    try:
        plan = gpt.plan(mesh, abstract, args.plan)
    except ValueError as e:
        raise UsageError(
            f"--plan {args.plan} --heads {args.heads} --d-model {args.d_model} "
            f"--mesh {','.join(f'{k}={v}' for k, v in mesh.shape.items())}: {e}"
        ) from None
    # Linear warm-up, then constant: independent of --steps, so a run resumed with more
    # steps continues exactly where a shorter one stopped.
    schedule = optax.linear_schedule(0.0, args.lr, WARMUP_STEPS)
    # inject_hyperparams: the schedule's rate is in the state, so the step reports it.
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    # Over a context axis each device receives its part of every row (P("data", "context")).
    seq_axis = CONTEXT_AXIS if context > 1 else None
    step, evaluate_step = build_steps(args, loss_fn, mesh, plan, seq_axis)

    def init() -> Any:
        return sx.TrainState.create(gpt.make_gpt(cfg, args.seed, args.remat), tx, rng=args.seed)

    try:
        state = step.init(init)
    except ValueError as e:
        raise UsageError(f"--plan {args.plan} --mode {args.mode}: {e}") from None

    val_batch = eval_batch(mesh, val, getattr(evaluate_step, "seq_axis", None))

    def evaluate(state: Any) -> dict[str, float]:
        return {"val_loss": float(evaluate_step(state, val_batch)["loss"])}

    tokens = args.batch_size * args.seq_len

    moe_keys = ("balance_loss", "dropped_fraction") if cfg.experts else ()

    def records(first: int, window: list[dict[str, float]], val: dict, seconds: float):
        entries = [
            {"step": first + j, "train_loss": m["loss"], **{k: m[k] for k in moe_keys}}
            for j, m in enumerate(window)
        ]
        entries[-1].update(val, tokens_per_s=len(window) * tokens / seconds)
        return entries

    model_params = gpt.param_count(abstract)
    non_embedding = gpt.param_count(abstract, embeddings=False)
    per_token = gpt.flops_per_token(cfg, args.seq_len, non_embedding)
    unigram = corpus.unigram_entropy()

    def summary(common: dict[str, Any]) -> dict[str, Any]:
        evals = [h for h in common["history"] if "val_loss" in h]
        extra: dict[str, Any] = {}
        if cfg.experts:
            last = common["history"][-1]
            extra["moe"] = {
                "experts": cfg.experts,
                "top_k": cfg.top_k,
                "moe_every": cfg.moe_every,
                "capacity_factor": cfg.capacity_factor,
                "balance_coef": BALANCE_COEF,
                "balance_loss": last["balance_loss"],
                "dropped_fraction": last["dropped_fraction"],
            }
        return {
            **extra,
            "val_loss": evals[-1]["val_loss"],
            "unigram_entropy": unigram,
            "model_config": {
                "layers": cfg.layers,
                "d_model": cfg.d_model,
                "heads": cfg.heads,
                "seq_len": args.seq_len,
                "max_seq_len": cfg.max_seq_len,
                "positions": cfg.positions,
                "residual": cfg.residual,
                "elementwise": cfg.elementwise,
                "remat": args.remat,
                "scan_layers": cfg.scan_layers,
                "attention": cfg.attention,
                "window": cfg.window,
                "pack": bool(args.pack),
                "layout": layout,
            },
            "params": model_params,
            "non_embedding_params": non_embedding,
            "lr": args.lr,
            "tokens_per_step": tokens,
            "corpus": {
                "source": corpus.source,
                "files": corpus.files,
                "train_bytes": int(corpus.train.size),
                "val_bytes": int(corpus.val.size),
                "val_windows": eval_rows,
            },
        }

    def progress(m: dict[str, float]) -> str:
        text = f"loss {m['loss']:.4f}"
        if cfg.experts:
            text += f" drop {m['dropped_fraction']:.1%} balance {m['balance_loss']:.3f}"
        return text

    return Job(
        title=(
            f"a {cfg.layers}-layer GPT (d_model {cfg.d_model}, {cfg.heads} heads, "
            f"{model_params:,} params) on {corpus.source}"
        ),
        mesh=mesh,
        state=state,
        step=step,
        loader=loader,
        steps=args.steps,
        eval_every=args.eval_every,
        evaluate=evaluate,
        records=records,
        unit="tokens",
        items_per_step=tokens,
        progress=progress,
        summary=summary,
        estimate_flops=per_token * tokens,
        plot=plot,
        report=report,
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    """Train and validation loss per step, with the unigram entropy for reference."""
    what, note = (
        f"GPT ({summary['params']:,} params)",
        f"unigram entropy {summary['unigram_entropy']:.2f}",
    )
    plot_curves(summary, path, what, "step", [("loss", "cross-entropy (nats/byte)")], note)


def report(summary: dict[str, Any], out: Any) -> None:
    """Validation loss against the unigram entropy, time and throughput."""
    ok = summary["val_loss"] < summary["unigram_entropy"]
    if summary.get("attention_kernel"):
        out.print(f"attention kernel: {summary['attention_kernel']} (read from the compiled step)")
    out.print(
        f"validation loss [bold {'green' if ok else 'red'}]{summary['val_loss']:.4f}[/] "
        f"nats/byte (unigram entropy of the corpus: {summary['unigram_entropy']:.4f}) in "
        f"{summary['seconds']:.1f} s ({summary['tokens_per_s']:,.0f} tokens/s)"
    )
