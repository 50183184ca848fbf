"""A decoder-only byte-level transformer LM in Flax NNX: the reference transformer.

Copy it as a template. The pieces, top to bottom:

- ``GPTConfig``: sizes, checked once (heads divide ``d_model``, a known position scheme).
- ``Block``: one pre-norm layer, ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with
  causal self-attention and rotary (default) or learned positions.
- ``GPT``: byte embedding, the ``layers`` blocks stacked on a leading axis, a final norm
  and an output head over the 256 byte values.

**Logical axes, annotated once.** Every parameter carries logical names through
``nnx.with_partitioning``; nothing in the model names a mesh axis:

====================  ===========================  =================================
parameter             shape                        logical axes
====================  ===========================  =================================
embed/embedding       (vocab, d_model)             ("vocab", "embed")
pos/embedding         (max_seq_len, d_model)       (None, "embed")     (learned only)
blocks/attn/q,k,v     (L, d_model, heads, d_head)  ("layers", "embed", "heads", "kv")
blocks/attn/out       (L, heads, d_head, d_model)  ("layers", "heads", "kv", "embed")
blocks/mlp/up         (L, d_model, 4·d_model)      ("layers", "embed", "mlp")
blocks/mlp/down       (L, 4·d_model, d_model)      ("layers", "mlp", "embed")
blocks/norm*/scale    (L, d_model)                 ("layers", "embed")
norm/scale            (d_model,)                   ("embed",)
head                  (d_model, vocab)             ("embed", "vocab")
moe/router            (L/n, d_model, E)            ("layers", "embed", None)
moe/up                (L/n, E, d_model, 4·d_model) ("layers", "expert", "embed", "mlp")
moe/down              (L/n, E, 4·d_model, d_model) ("layers", "expert", "mlp", "embed")
====================  ===========================  =================================

With ``GPTConfig(experts=E, moe_every=n)`` every n-th block is an MoE block, stacked in
``moe_blocks`` (the ``moe/`` rows above), the other blocks in ``blocks``. Its MLP is E
experts of the MLP's shape through ``sx.moe``, split over the mesh's ``"expert"`` axis
by ``plan``. ``model(tokens, return_aux=True)`` also returns their ``sx.parallel.MoEAux``.

``AXIS_RULES`` maps them onto a mesh for each plan. Tensor parallelism is Megatron's:
q/k/v and ``mlp/up`` split their output columns (``heads``, ``mlp``) over ``model``;
``attn/out`` and ``mlp/down`` split their input rows the same way, so each block needs
one all-reduce after attention and one after the MLP. FSDP shards the ``embed`` dimension
of every weight over ``data``.

**Attention is ``sx.attention``** (causal; ``GPTConfig.window`` for a sliding window;
``segment_ids`` for packed rows), so on a GPU in bf16 it is cuDNN's flash kernel through
``jax.nn.dot_product_attention``, and over a ``"context"`` mesh axis it is context
parallel (``GPTConfig.attention``: ring, all_gather or ulysses), the residual stream
split along the sequence.

**Stacked layers, ready for a pipeline.** ``GPT.blocks`` is one ``Block`` built under
``nnx.vmap``: each of its parameters has a leading layer dimension ``L`` (logical name
``"layers"``). ``GPT.layers`` returns ``(layer_fn, stacked)``, where ``stacked`` is
that state and ``layer_fn(layer_params, x) -> x`` runs one layer from one slice. The model
runs them in a loop over the slices (or ``lax.scan``, ``GPTConfig.scan_layers``);
``sx.pipeline(layer_fn, stacked, x, axis="stage", ...)`` takes the same pair, with
``"layers"`` mapped to the ``stage`` mesh axis.

>>> cfg = GPTConfig(layers=1, d_model=16, heads=2, max_seq_len=8)
>>> model = make_gpt(cfg, seed=0)  # doctest: +SKIP
>>> model = nnx.eval_shape(lambda: make_gpt(cfg, seed=0))  # the same, abstract: no compute
>>> nnx.eval_shape(lambda: make_gpt(cfg)(jnp.zeros((2, 8), jnp.int32))).shape
(2, 8, 256)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardax.checks import as_bool, as_count, expect_type
from shardax.mesh.axes import DATA_AXIS, EXPERT_AXIS, REPLICA_AXIS
from shardax.models.elementwise import RMSNorm, gelu
from shardax.parallel.context import IMPLS, attention, layout_context, layout_positions
from shardax.parallel.experts import MoEAux, moe
from shardax.parallel.fused import KERNELS
from shardax.parallel.gpipe import pipeline
from shardax.parallel.remat_policy import check_policy, remat
from shardax.plan.activation import constrain
from shardax.plan.annotations import from_nnx
from shardax.plan.core import DEFAULT_FSDP_MIN_SIZE
from shardax.plan.named import MESH_PLANS

VOCAB = 256
"""Byte-level: one token per byte value."""

POSITIONS = ("rotary", "learned")
RESIDUALS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
"""``GPTConfig.residual``: the dtype of the residual stream between blocks."""
ELEMENTWISE = ("autodiff", "recompute")
"""``GPTConfig.elementwise``: the norms and GELU as ``nnx.RMSNorm`` and ``jax.nn.gelu``
differentiated by JAX, or ``shardax.models.elementwise``'s, whose backward passes
recompute from their inputs."""
ATTENTION: tuple[str, ...] = ("auto", *IMPLS)
"""``GPTConfig.attention``: ``sx.attention``'s ``impl`` over a ``"context"`` mesh axis,
``"auto"`` or one of ``shardax.parallel.context.IMPLS`` (without a context axis every
choice is ``jax.nn.dot_product_attention``, cuDNN's flash kernel on a GPU in bf16)."""

# Logical axis -> mesh axis (None: replicated) for each --plan of `shardax train --model gpt`.
AXIS_RULES: dict[str, dict[str, Any]] = {
    "replicate": {},
    "fsdp": {"embed": "data"},
    "tp": {"heads": "model", "mlp": "model", "vocab": "model"},
    "fsdp+tp": {"embed": "data", "heads": "model", "mlp": "model", "vocab": "model"},
    # Each stage of the "stage" axis holds L/S blocks; run with pipeline_microbatches set.
    "pipeline": {"layers": "stage"},
}
LOGICAL_AXES = ("layers", "vocab", "embed", "heads", "kv", "mlp")
PLANS: tuple[str, ...] = (*AXIS_RULES, *(p for p in MESH_PLANS if p not in AXIS_RULES))
"""The names ``plan`` builds (``shardax train --model gpt --plan``): those of
``AXIS_RULES``, from the model's logical axes, then the mesh's own plans
(``MESH_PLANS`` of ``shardax.plan.named``: the ZeRO plans over ``"data"``)."""


def axis_rules(plan: str) -> dict[str, Any]:
    """The logical-to-mesh mapping of ``plan`` (every logical axis named; None replicates).

    >>> axis_rules("tp")["mlp"]
    'model'
    """
    if plan not in AXIS_RULES:
        raise ValueError(f"plan must be one of {list(AXIS_RULES)} for axis rules, got {plan!r}")
    return {name: AXIS_RULES[plan].get(name) for name in LOGICAL_AXES}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The sizes of a ``GPT``.

    Attributes:
        layers: number of transformer blocks.
        d_model: width of the residual stream.
        heads: attention heads; must divide ``d_model``.
        max_seq_len: the longest sequence the model accepts (learned position table size).
        mlp_ratio: MLP hidden width as a multiple of ``d_model``.
        positions: ``"rotary"`` or ``"learned"``.
        vocab: vocabulary size (256 bytes).
        scan_layers: run the stacked layers in ``lax.scan`` (one compiled loop body:
            compile time independent of depth; remat's memory savings hold on XLA:CPU,
            whose scheduler ignores them in straight-line code), rather than a Python
            loop over the layer slices (default: XLA sees every layer, and its
            ``cost_analysis`` counts them all; it counts a loop body once).
        pipeline_microbatches: run the layers with ``sx.pipeline`` in this many
            microbatches: pipelined over a ``"stage"`` mesh axis (plan ``"pipeline"``),
            the plain scan without one (None: no ``sx.pipeline``).
        pipeline_repeats: ``sx.pipeline``'s ``repeats`` (> 1: the circular schedule).
        experts: E > 0 makes the MLP of every ``moe_every``-th block (blocks
            ``moe_every - 1, 2·moe_every - 1, ...``) a mixture of E experts (``sx.moe``,
            ``top_k`` per token, ``capacity_factor``); 0 (default): every MLP dense.
        attention: ``sx.attention``'s ``impl`` over the mesh's ``"context"`` axis
            (one of ``ATTENTION``: ``"auto"`` or a scheme); without a context
            axis of size > 1 it is ``jax.nn.dot_product_attention`` whatever the choice.
        window: sliding-window attention: each token sees itself and the ``window``
            tokens before it (``sx.attention``'s ``window=(window, 0)``); None: all.
        kernel: ``sx.attention``'s ``kernel``: ``"auto"`` (the platform's fused kernel
            where it can, cuDNN on a GPU, splash on a TPU), or one of
            ``shardax.parallel.fused.KERNELS`` forced (``"dense"``: the XLA einsums,
            e.g. to measure what the fused kernel gains).
        residual: the residual stream's dtype between blocks, ``"fp32"`` (default: the
            embedding and every block's sum in float32 whatever the compute dtype) or
            ``"bf16"`` (nanochat's: each sum stored in bfloat16, the norms' statistics
            still float32); under ``precision="bf16"`` it halves the bytes of the
            residual adds, the norms and their gradients.
        elementwise: ``"autodiff"`` (default: ``nnx.RMSNorm`` and ``jax.nn.gelu``,
            differentiated by JAX) or ``"recompute"``: ``shardax.models.elementwise``'s
            norm and GELU, whose backward passes recompute from their inputs, so the
            GELU's forward pass writes one tensor of the MLP's width, not two. The same
            parameters either way.
    """

    layers: int = 2
    d_model: int = 128
    heads: int = 4
    max_seq_len: int = 256
    mlp_ratio: int = 4
    positions: str = "rotary"
    vocab: int = VOCAB
    scan_layers: bool = False
    pipeline_microbatches: int | None = None
    pipeline_repeats: int = 1
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    capacity_factor: float = 1.25
    attention: str = "auto"
    window: int | None = None
    kernel: str = "auto"
    residual: str = "fp32"
    elementwise: str = "autodiff"

    def __post_init__(self) -> None:
        self._check_experts()
        if self.residual not in RESIDUALS:
            raise ValueError(
                f"GPTConfig.residual must be one of {tuple(RESIDUALS)}, got {self.residual!r}"
            )
        if self.elementwise not in ELEMENTWISE:
            raise ValueError(
                f"GPTConfig.elementwise must be one of {ELEMENTWISE}, got {self.elementwise!r}"
            )
        if self.attention not in ATTENTION:
            raise ValueError(
                f"GPTConfig.attention must be one of {ATTENTION}, got {self.attention!r}"
            )
        if self.kernel not in ("auto", *KERNELS):
            raise ValueError(
                f"GPTConfig.kernel must be 'auto' or one of {KERNELS}, got {self.kernel!r}"
            )
        if self.window is not None:
            window = as_count("GPTConfig.window (or None)", self.window, minimum=0)
            object.__setattr__(self, "window", window)
        names = ("layers", "d_model", "heads", "max_seq_len", "mlp_ratio", "vocab")
        names += ("pipeline_repeats",)
        if self.pipeline_microbatches is not None:
            names += ("pipeline_microbatches",)
        for name in names:  # NumPy integers pass, stored as Python ints
            object.__setattr__(self, name, as_count(f"GPTConfig.{name}", getattr(self, name)))
        object.__setattr__(self, "scan_layers", as_bool("GPTConfig.scan_layers", self.scan_layers))
        if self.d_model % self.heads:
            raise ValueError(
                f"GPTConfig: heads={self.heads} must divide d_model={self.d_model} "
                f"(d_model % heads = {self.d_model % self.heads})"
            )
        if self.positions not in POSITIONS:
            raise ValueError(
                f"GPTConfig.positions must be one of {POSITIONS}, got {self.positions!r}"
            )
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig: rotary positions need an even head dim, got d_model/heads = "
                f"{self.head_dim}"
            )

    def _check_experts(self) -> None:
        experts = as_count("GPTConfig.experts", self.experts, minimum=0)
        object.__setattr__(self, "experts", experts)
        if not self.experts:
            return
        for name in ("top_k", "moe_every"):
            object.__setattr__(self, name, as_count(f"GPTConfig.{name}", getattr(self, name)))
        if self.top_k > self.experts:
            raise ValueError(f"GPTConfig: top_k={self.top_k} must be <= experts={self.experts}")
        if self.layers % self.moe_every:
            raise ValueError(
                f"GPTConfig: moe_every={self.moe_every} must divide layers={self.layers} "
                "(every moe_every-th block has the experts)"
            )
        if self.pipeline_microbatches is not None:
            raise ValueError("GPTConfig: experts > 0 does not run under sx.pipeline yet")

    @property
    def moe_layers(self) -> int:
        """Blocks whose MLP is a mixture of experts: every ``moe_every``-th, 0 without."""
        return self.layers // self.moe_every if self.experts else 0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def mlp_dim(self) -> int:
        return self.mlp_ratio * self.d_model


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[Any, ...], std: float) -> nnx.Param:
    """A normal(std) parameter annotated with logical axis ``names``."""
    init = nnx.with_partitioning(nnx.initializers.normal(std), names)
    return nnx.Param(init(rngs.params(), shape))


def _norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The RMSNorm of ``cfg.elementwise`` (either: float32 statistics, the input's dtype
    out; ``nnx.RMSNorm`` gives float32 for a float32 input and bf16 params)."""
    if cfg.elementwise == "recompute":
        return RMSNorm(cfg.d_model, rngs)
    ones = nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",))
    return nnx.RMSNorm(cfg.d_model, scale_init=ones, rngs=rngs)


def rotary(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x`` (batch, seq, heads, head_dim) at ``positions``,
    ``(seq,)`` or ``(batch, seq)`` (packed rows: positions restart in each document)."""
    half = x.shape[-1] // 2
    freq = 10_000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # ([batch,] seq, half)
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Context:
    """What every block's attention needs beside ``x``, for one batch.

    Attributes:
        positions: each token's true position, ``(seq,)`` or ``(batch, seq)`` (packed
            rows restart at each document), for rotary embeddings; None: ``arange``
            in the ``layout``.
        segment_ids: ``(batch, seq)`` document ids of packed rows (attention stays
            within a document), or None.
        layout: how the sequence lies over the ``"context"`` axis: ``"contiguous"``,
            or ``"zigzag:C"`` (reordered by ``sx.parallel.zigzag`` for C devices, for
            causal load balance; ``sx.parallel.zigzag_layout(C)``).
    """

    positions: Any = None
    segment_ids: Any = None
    layout: str = "contiguous"


class Attention(nnx.Module):
    """Causal multi-head self-attention through ``sx.attention``; heads are the
    tensor-parallel dimension, the sequence the context-parallel one."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        d, h, k = cfg.d_model, cfg.heads, cfg.head_dim
        std = d**-0.5
        self.q = _param(rngs, (d, h, k), ("embed", "heads", "kv"), std)
        self.k = _param(rngs, (d, h, k), ("embed", "heads", "kv"), std)
        self.v = _param(rngs, (d, h, k), ("embed", "heads", "kv"), std)
        # Residual projections start small (GPT-2's 1/sqrt(2·layers)).
        self.out = _param(
            rngs, (h, k, d), ("heads", "kv", "embed"), std / math.sqrt(2 * cfg.layers)
        )
        self.rotary = cfg.positions == "rotary"
        self.impl = cfg.attention
        self.kernel = cfg.kernel
        self.window = None if cfg.window is None else (cfg.window, 0)
        # The matmuls' hook, as nnx.Linear's (precision="fp8" sets fp8_dot_general)
        self.dot_general = jax.lax.dot_general

    def __call__(self, x: jax.Array, ctx: Context | None = None) -> jax.Array:
        ctx = ctx or Context()
        # In the params' dtype (the compute dtype: bf16 under precision="bf16"): the
        # norm before may give float32, and cuDNN's fused attention takes bf16 only.
        x = x.astype(self.q[...].dtype)
        q = dense(self.dot_general, x, self.q[...])  # btd,dhk->bthk
        k = dense(self.dot_general, x, self.k[...])
        v = dense(self.dot_general, x, self.v[...])
        if self.rotary:
            positions = _positions(ctx, x.shape[1])
            q, k = rotary(q, positions), rotary(k, positions)
        y = attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=ctx.segment_ids,
            window=self.window,
            impl=self.impl,
            kernel=self.kernel,
            layout=ctx.layout,
        )
        return dense(self.dot_general, y, self.out[...], contract=2)  # bthk,hkd->btd


def dense(
    dot_general: Callable[..., jax.Array], x: jax.Array, w: jax.Array, contract: int = 1
) -> jax.Array:
    """``x``'s last ``contract`` dims times ``w``'s first ones through ``dot_general``
    (``jax.lax.dot_general``, or ``shardax.parallel.fp8.fp8_dot_general`` under
    ``precision="fp8"``): every block matmul of the GPT.

    >>> dense(jax.lax.dot_general, jnp.ones((2, 3, 4)), jnp.ones((4, 2, 5))).shape
    (2, 3, 2, 5)
    """
    lhs = tuple(range(x.ndim - contract, x.ndim))
    return dot_general(x, w, ((lhs, tuple(range(contract))), ((), ())))


def _positions(ctx: Context, seq: int) -> jax.Array:
    """``ctx.positions``, or the true positions of the layout over the context axis."""
    if ctx.positions is not None:
        return jnp.asarray(ctx.positions)
    return jnp.asarray(layout_positions(seq, layout_context(layout=ctx.layout), ctx.layout))


class MLP(nnx.Module):
    """``down(gelu(up(x)))``: ``up`` splits columns, ``down`` rows (Megatron)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        d, m = cfg.d_model, cfg.mlp_dim
        self.up = _param(rngs, (d, m), ("embed", "mlp"), d**-0.5)
        self.down = _param(rngs, (m, d), ("mlp", "embed"), m**-0.5 / math.sqrt(2 * cfg.layers))
        self.dot_general = jax.lax.dot_general  # as Attention's
        self.gelu = gelu if cfg.elementwise == "recompute" else jax.nn.gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        # In the params' dtype, as Attention: the norm before gives float32, and a float32
        # input made both matmuls float32 under precision="bf16" (two thirds of the
        # layer's FLOPs at the TF32 rate or below, and twice the activation bytes).
        x = x.astype(self.up[...].dtype)
        h = self.gelu(dense(self.dot_general, x, self.up[...]))
        return dense(self.dot_general, h, self.down[...])


class _PreNorm(nnx.Module):
    """The attention half of a pre-norm layer, which ``Block`` and ``MoEBlock``
    share: ``x + attn(norm1(x))``, and ``norm2`` of it for their MLP half."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        self.norm1 = _norm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.norm2 = _norm(cfg, rngs)
        self.residual = RESIDUALS[cfg.residual]

    def attend(self, x: jax.Array, ctx: Context | None) -> tuple[jax.Array, jax.Array]:
        """``(x + attn(norm1(x)), norm2 of that)``: the residual (in ``cfg.residual``'s
        dtype) and the MLP's input."""
        x = (x + self.attn(self.norm1(x), ctx)).astype(self.residual)
        return x, self.norm2(x)


class Block(_PreNorm):
    """One pre-norm transformer layer: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, ctx: Context | None = None) -> jax.Array:
        x, h = self.attend(x, ctx)
        return (x + self.mlp(h)).astype(self.residual)


def _expert(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ p["up"]) @ p["down"]


class MoEMLP(nnx.Module):
    """The MLP as E experts of the dense MLP's shape, ``sx.moe`` routing each token to
    ``top_k`` of them; the experts' leading dimension is the logical axis ``"expert"``."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        d, m, e = cfg.d_model, cfg.mlp_dim, cfg.experts
        self.router = _param(rngs, (d, e), ("embed", None), d**-0.5)
        self.up = _param(rngs, (e, d, m), ("expert", "embed", "mlp"), d**-0.5)
        down_std = m**-0.5 / math.sqrt(2 * cfg.layers)
        self.down = _param(rngs, (e, m, d), ("expert", "mlp", "embed"), down_std)
        self.top_k, self.capacity_factor = cfg.top_k, cfg.capacity_factor

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Any]:
        experts = {"up": self.up[...], "down": self.down[...]}
        return moe(
            x,
            self.router[...],
            _expert,
            experts,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
        )


class MoEBlock(_PreNorm):
    """``Block`` with a ``MoEMLP``; returns ``(x, aux)``."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, rngs)
        self.moe = MoEMLP(cfg, rngs)

    def __call__(self, x: jax.Array, ctx: Context | None = None) -> tuple[jax.Array, Any]:
        x, h = self.attend(x, ctx)
        y, aux = self.moe(h)
        return (x + y).astype(self.residual), aux


def _stacked(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> Any:
    """``count`` modules from ``make`` built at once, stacked on a leading "layers" axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stack(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return stack(rngs)


class GPT(nnx.Module):
    """Byte-level decoder-only transformer: ``tokens (batch, seq) -> logits (batch, seq, 256)``.

    Args:
        cfg: the sizes.
        rngs: parameter initialisation keys.
        remat: activation rematerialisation of each block, a policy name of
            [`shardax.remat`][shardax.remat] (``"none"`` keeps every activation).
    """

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs, remat: str = "none") -> None:
        self.cfg = cfg
        self.remat = check_policy(remat)
        self.embed = nnx.Embed(
            cfg.vocab,
            cfg.d_model,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed")),
            rngs=rngs,
        )
        if cfg.positions == "learned":
            self.pos = nnx.Embed(
                cfg.max_seq_len,
                cfg.d_model,
                embedding_init=nnx.with_partitioning(
                    nnx.initializers.normal(0.02), (None, "embed")
                ),
                rngs=rngs,
            )

        # L blocks built at once: every parameter gets a leading "layers" dimension.
        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs)

        if cfg.experts:  # L/moe_every MoE blocks; the other blocks dense, stacked apart
            self.moe_blocks = _stacked(lambda r: MoEBlock(cfg, r), cfg.moe_layers, rngs)
            if cfg.layers > cfg.moe_layers:
                self.blocks = _stacked(lambda r: Block(cfg, r), cfg.layers - cfg.moe_layers, rngs)
        else:
            self.blocks = stack(rngs)
        self.norm = _norm(cfg, rngs)
        self.head = _param(rngs, (cfg.d_model, cfg.vocab), ("embed", "vocab"), cfg.d_model**-0.5)

    def logits(self, x: jax.Array) -> jax.Array:
        """The head over the final norm of the residual stream ``x``, in the params' dtype
        (the compute dtype; the loss takes them to float32), as every other matmul."""
        head = self.head[...]
        return self.norm(x).astype(head.dtype) @ head

    def layers(
        self, ctx: Context | None = None
    ) -> tuple[Callable[[Any, jax.Array], jax.Array], Any]:
        """``(layer_fn, stacked)``: ``stacked`` holds every block's params with a leading
        layer dimension; ``layer_fn(stacked_slice, x) -> x`` is one block (attending with
        ``ctx``), rematerialised by the model's policy. ``lax.scan`` (here) or
        ``sx.pipeline`` runs them."""
        graphdef, stacked = nnx.split(self.blocks)

        def layer_fn(params: Any, x: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, params)(x, ctx)

        return remat(layer_fn, policy=self.remat), stacked

    def moe_layers(self, ctx: Context | None = None) -> tuple[Callable[[Any, jax.Array], Any], Any]:
        """``(layer_fn, stacked)`` of the MoE blocks, as ``layers``; ``layer_fn``
        returns ``(x, aux)``."""
        graphdef, stacked = nnx.split(self.moe_blocks)

        def layer_fn(params: Any, x: jax.Array) -> tuple[jax.Array, Any]:
            return nnx.merge(graphdef, params)(x, ctx)

        return remat(layer_fn, policy=self.remat), stacked

    def _run_moe(self, x: jax.Array, ctx: Context) -> tuple[jax.Array, Any]:
        """The blocks in periods of ``moe_every``: ``moe_every - 1`` dense, then one MoE;
        the MoE aux averaged over the MoE blocks (tokens per expert summed)."""
        n, periods = self.cfg.moe_every, self.cfg.moe_layers
        moe_fn, moe_stacked = self.moe_layers(ctx)
        dense_fn, dense = self.layers(ctx) if n > 1 else (None, None)
        if dense is not None:  # (L - L/n, ...) -> (L/n, n - 1, ...)
            dense = jax.tree.map(lambda a: a.reshape(periods, n - 1, *a.shape[1:]), dense)

        def period(h: jax.Array, params: tuple[Any, Any]) -> tuple[jax.Array, Any]:
            dense_p, moe_p = params
            for j in range(n - 1):
                h = split_batch(dense_fn(jax.tree.map(lambda a, j=j: a[j], dense_p), h))
            h, aux = moe_fn(moe_p, h)
            return split_batch(h), aux

        x = split_batch(x)
        if self.cfg.scan_layers:
            x, auxes = jax.lax.scan(period, x, (dense, moe_stacked))
        else:
            outs = []
            for p in range(periods):
                x, aux = period(x, jax.tree.map(lambda a, p=p: a[p], (dense, moe_stacked)))
                outs.append(aux)
            auxes = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        aux = MoEAux(
            *(jnp.mean(a, axis=0) for a in auxes[:3]), jnp.sum(auxes.tokens_per_expert, axis=0)
        )
        return x, aux

    def __call__(
        self,
        tokens: jax.Array,
        return_aux: bool = False,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        layout: str = "contiguous",
    ) -> Any:
        """Logits ``(batch, seq, vocab)``; with ``return_aux``, ``(logits, aux)`` where
        ``aux`` is the MoE blocks' ``sx.parallel.MoEAux`` (None without experts): add
        ``α · aux.balance_loss`` to the loss.

        ``positions`` (``(seq,)`` or ``(batch, seq)``), ``segment_ids`` (``(batch, seq)``,
        packed documents) and ``layout`` (``"zigzag:C"`` for a batch reordered by
        ``sx.parallel.zigzag`` for C devices) are as in ``Context``; over a
        ``"context"`` mesh axis the residual stream is split along the sequence and
        attention is ``sx.attention``'s context-parallel scheme ``GPTConfig.attention``."""
        seq = tokens.shape[-1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(
                f"GPT: sequence length {seq} is above the model's max_seq_len "
                f"{self.cfg.max_seq_len}"
            )
        ctx = Context(positions, segment_ids, layout)
        if self.cfg.pipeline_microbatches is not None and (
            segment_ids is not None or (positions is not None and jnp.ndim(positions) > 1)
        ):
            raise ValueError(
                "GPT: sx.pipeline splits the batch into microbatches, so per-row positions "
                "and segment ids (packed rows) are not supported with pipeline_microbatches"
            )
        x = self.embed(tokens)
        if self.cfg.positions == "learned":
            x = x + self.pos(_positions(ctx, seq))
        x = x.astype(RESIDUALS[self.cfg.residual])
        aux = None
        if self.cfg.experts:
            x, aux = self._run_moe(x, ctx)
            logits = self.logits(x)
            return (logits, aux) if return_aux else logits
        layer_fn, stacked = self.layers(ctx)
        if self.cfg.pipeline_microbatches is not None:
            x = pipeline(
                layer_fn,
                stacked,
                x,
                microbatches=self.cfg.pipeline_microbatches,
                repeats=self.cfg.pipeline_repeats,
            )
        elif self.cfg.scan_layers:
            x, _ = jax.lax.scan(
                lambda h, params: (split_batch(layer_fn(params, h)), None), split_batch(x), stacked
            )
        else:
            x = split_batch(x)
            for i in range(self.cfg.layers):
                x = split_batch(layer_fn(jax.tree.map(lambda a, i=i: a[i], stacked), x))
        logits = self.logits(x)
        return (logits, aux) if return_aux else logits


def split_batch(x: jax.Array) -> jax.Array:
    """The residual stream ``x`` (batch, seq, d_model) split by batch over every data axis
    of the mesh in context that it may constrain (not inside shard_map): ``"replica"``
    (HSDP: ``{"replica": hosts, "data": 8}`` computes a different slice of the batch on
    each host, as the step splits it), ``"data"`` and, with MoE, ``"expert"``; and by
    sequence over a ``"context"`` axis (context parallelism: each device holds T/C tokens
    of a row).

    Under ``fsdp+tp`` the weights split ``d_model`` over ``"data"``; left alone, XLA may
    follow them into the residual stream's gradients and then re-split them by batch, an
    "involuntary full rematerialization" that JAX 0.12 warns of (four of them for
    ``shardax train --model gpt --plan fsdp+tp``; one is left with this constraint).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if DATA_AXIS not in mesh.shape or DATA_AXIS in mesh.manual_axes:
        return x
    axes = (REPLICA_AXIS, DATA_AXIS, EXPERT_AXIS)
    names = tuple(a for a in axes if a in mesh.shape and a not in mesh.manual_axes)
    batch: Any = names[0] if len(names) == 1 else names
    if "context" in mesh.shape and "context" not in mesh.manual_axes:
        # Context parallelism: the sequence over the context axis, in every layer
        return constrain(x, jax.sharding.PartitionSpec(batch, "context"))
    return constrain(x, jax.sharding.PartitionSpec(batch))


def make_gpt(cfg: GPTConfig, seed: int = 0, remat: str = "none") -> GPT:
    """A ``GPT`` initialised from ``seed``, its annotations kept as logical names
    (no eager sharding: plans place it, see ``plan``)."""
    expect_type("make_gpt: cfg", cfg, GPTConfig, "a GPTConfig")
    seed = as_count("make_gpt: seed", seed, minimum=0)
    with nnx.use_eager_sharding(False):
        return GPT(cfg, nnx.Rngs(seed), remat=remat)


def plan(mesh: Any, model: Any, name: str) -> Any:
    """The plan ``name`` (one of ``PLANS``) of ``model`` over ``mesh``: the mesh's own
    plans (zero1, zero2) over ``"data"``, the others from its annotations through
    ``axis_rules``. TP needs ``mesh``'s ``model`` axis to divide the heads (and the MLP
    width and vocab), and ``pipeline`` its ``stage`` axis to divide the layers, in a model
    built with ``pipeline_microbatches``; each is checked with a clear error.

    >>> mesh = sx.make_mesh({"data": 4, "model": 2})
    >>> p = plan(mesh, model, "tp")
    """
    if name not in PLANS:
        raise ValueError(f"plan must be one of {list(PLANS)}, got {name!r}")
    if name not in AXIS_RULES:  # a mesh plan: the params as the model has them
        return MESH_PLANS[name](mesh, "data", DEFAULT_FSDP_MIN_SIZE)
    rules = axis_rules(name)
    if model.cfg.experts:  # the experts over the mesh's expert axis, where it has one
        rules["expert"] = "expert" if "expert" in mesh.shape else None
    used = {axis for axis in rules.values() if axis is not None}
    missing = sorted(used - set(mesh.shape))
    if missing:
        raise ValueError(
            f"plan {name!r} shards over mesh axes {sorted(used)}, but the mesh "
            f"{dict(mesh.shape)} has no {', '.join(map(repr, missing))} axis; "
            f"pass e.g. --mesh data=-1{''.join(f',{a}=2' for a in missing if a != 'data')}"
        )
    cfg = model.cfg
    if name == "pipeline" and cfg.pipeline_microbatches is None:
        raise ValueError(
            "plan 'pipeline' places the blocks over the stage axis, but the model runs them "
            "without sx.pipeline; build it with GPTConfig(pipeline_microbatches=M)"
        )
    sizes = {
        "heads": cfg.heads,
        "mlp": cfg.mlp_dim,
        "vocab": cfg.vocab,
        "embed": cfg.d_model,
        "layers": cfg.layers,
        "expert": cfg.experts,
    }
    for logical, size in sizes.items():
        axis = rules.get(logical)
        if axis is not None and size % mesh.shape[axis]:
            raise ValueError(
                f"plan {name!r} splits {logical}={size} over mesh axis {axis!r} of size "
                f"{mesh.shape[axis]}, which does not divide it"
            )
    return from_nnx(mesh, model, rules)


def param_count(model: GPT, embeddings: bool = True) -> int:
    """Number of parameters; without the input (and learned position) embeddings when
    ``embeddings`` is False, as in the 6·N FLOPs estimate (a lookup does no FLOPs)."""
    params = nnx.state(model, nnx.Param)
    total = sum(x.size for x in jax.tree.leaves(params))
    if embeddings:
        return total
    lookups = model.embed.embedding.size
    if model.cfg.positions == "learned":
        lookups += model.pos.embedding.size
    return total - lookups


def flops_per_token(cfg: GPTConfig, seq_len: int, non_embedding_params: int) -> float:
    """Training FLOPs per token the dense step executes, to check the compiled count
    against: ``6·N`` for the matmuls over N params without the embedding lookup (the head
    in them; forward 2·N, backward 4·N), plus attention's scores and weighted values,
    ``6 · 2·layers·seq_len·d_model`` (dense: XLA computes the masked half too). Model
    FLOPs for MFU halve causal attention's:
    ``shardax.cost.flops.transformer_flops_per_token``.

    >>> flops_per_token(GPTConfig(layers=1, d_model=8, heads=2), 4, 100)
    984.0
    """
    attention = 2 * 2 * cfg.layers * seq_len * cfg.d_model  # QK^T and AV, forward
    return 6.0 * non_embedding_params + 3.0 * attention
