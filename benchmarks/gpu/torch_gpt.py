"""A PyTorch GPT of shardax's reference GPT's architecture: the GPU benchmark's speed reference.

"Is shardax's training step as fast as a ``torch.compile`` GPT on the same GPU?" This is
that GPT, written as a PyTorch user tuning for speed would write it, and of exactly the
architecture and shapes of ``shardax.models.gpt`` (``GPTConfig`` defaults:
``positions="rotary"``, ``mlp_ratio=4``, ``vocab=256``, no biases anywhere):

- a byte embedding ``(256, d)``, normal(1.0);
- ``layers`` pre-norm blocks, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``, with
  RMSNorm of a learned scale (flax ``nnx.RMSNorm``: epsilon 1e-6, statistics in fp32);
- attention: q, k, v projections ``d -> (heads, head_dim)``, rotary positions as
  ``gpt.rotary`` computes them (halves, not interleaved; ``10000^(-i/half)``; in fp32,
  cast back), causal ``scaled_dot_product_attention``, an output projection back to ``d``;
- MLP ``down(gelu_tanh(up(x)))`` of hidden width ``4·d`` (``jax.nn.gelu``'s default);
- a final RMSNorm and an untied head ``(d, 256)``; the loss is the mean softmax
  cross-entropy of the fp32 logits against the next byte;
- the init stds of ``gpt.py`` (``d^-0.5``; the residual projections also
  ``/sqrt(2·layers)``; the MLP's down ``(4d)^-0.5/sqrt(2·layers)``).

The step: fp32 parameters, ``torch.autocast`` to bf16 (on the CPU too), the model and its
loss under ``torch.compile`` (``mode``: default, or ``"max-autotune-no-cudagraphs"``),
``AdamW(lr=1e-4, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)`` (fused on CUDA),
``zero_grad(set_to_none=True)``, TF32 matmuls allowed. On CUDA, SDPA is restricted to
the flash and cuDNN backends (``SDPA_BACKENDS``; ``--sdpa``), so it fails loudly rather
than fall back to the math kernel; which one ran is read from a profiled step. The data
is one fixed batch of random bytes on the device (data loading is not measured, as in
``benchmarks/mfu.py``: ``default_rng(seed)`` tokens ``(batch, seq + 1)``, inputs and
next-byte targets).

One difference remains, autocast's: the residual stream, norms and rotary stay in fp32
(autocast runs the matmuls and the attention in bf16), where shardax's
``precision="bf16"`` casts the params and runs everything in bf16.

:func:`loss_from_shardax_params` loads a shardax GPT's parameters into this model and
returns its fp32 loss (:func:`logits_from_shardax_params`: its logits);
``tests/test_torch_gpt.py`` checks both against the JAX model's.

    python benchmarks/gpu/torch_gpt.py --size 1b --json        # on the GPU
    python benchmarks/gpu/torch_gpt.py --size 1b --mode max-autotune-no-cudagraphs
    python benchmarks/gpu/torch_gpt.py --size tiny --steps 2   # a smoke test on the CPU

From another script: ``sys.path.insert(0, str(Path(__file__).parent))``, then
``import torch_gpt; torch_gpt.run(layers=24, d_model=2048, heads=16, seq_len=2048,
batch=4)``. torch is not a shardax dependency, and this file imports neither shardax
nor JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
EPSILON = 1e-6  # flax nnx.RMSNorm's default
SIZES = {
    # benchmarks/mfu.py's sizes (its batch per device: one GPU here)
    "1b": {"layers": 24, "d_model": 2048, "heads": 16, "seq_len": 2048, "batch": 4},
    "tiny": {"layers": 2, "d_model": 64, "heads": 4, "seq_len": 64, "batch": 2},
}
MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
SDPA_CHOICES = {"flash": ["FLASH_ATTENTION"], "cudnn": ["CUDNN_ATTENTION"]}
SDPA_CHOICES["flash,cudnn"] = SDPA_CHOICES["flash"] + SDPA_CHOICES["cudnn"]
SDPA_BACKENDS: list[str] = SDPA_CHOICES["flash,cudnn"]
"""The SDPA backends allowed on CUDA (``torch.nn.attention.SDPBackend`` names), in
torch's own priority order among them; set before :func:`run` (``--sdpa``)."""

# aten op -> the backend it is (read from a profiled step)
SDPA_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


@dataclasses.dataclass(frozen=True)
class Config:
    """The sizes; those of ``shardax.models.gpt.GPTConfig`` that shape the dense GPT."""

    layers: int
    d_model: int
    heads: int
    mlp_ratio: int = 4
    vocab: int = VOCAB

    def __post_init__(self) -> None:
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(f"heads={self.heads} must divide d_model={self.d_model} evenly "
                             "into an even head dim (rotary)")  # fmt: skip

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


class RMSNorm(nn.Module):
    """flax ``nnx.RMSNorm``: ``x * rsqrt(mean(x²) + 1e-6) * scale``, statistics in fp32."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPSILON)
        return (y * self.scale).to(x.dtype)


def rotary_tables(seq: int, head_dim: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape (seq, 1, half), fp32, at positions ``arange(seq)``."""
    half = head_dim // 2
    freq = 10_000.0 ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    angle = torch.arange(seq, dtype=torch.float32, device=device)[:, None] * freq
    return torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``gpt.rotary`` of ``x`` (batch, seq, heads, head_dim): the halves rotated in fp32."""
    half = x.shape[-1] // 2
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


def _linear(fan_in: int, fan_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(fan_in, fan_out, bias=False)
    nn.init.normal_(layer.weight, std=std)
    return layer


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        d, std = cfg.d_model, cfg.d_model**-0.5
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.q, self.k, self.v = (_linear(d, d, std) for _ in range(3))
        self.out = _linear(d, d, std / math.sqrt(2 * cfg.layers))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.heads, self.head_dim)
        q = rotary(self.q(x).view(shape), cos, sin)
        k = rotary(self.k(x).view(shape), cos, sin)
        v = self.v(x).view(shape)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        d, m = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        self.up = _linear(d, m, d**-0.5)
        self.down = _linear(m, d, m**-0.5 / math.sqrt(2 * cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm1, self.attn = RMSNorm(cfg.d_model), Attention(cfg)
        self.norm2, self.mlp = RMSNorm(cfg.d_model), MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """``forward(inputs, targets)`` -> the mean next-byte cross-entropy (fp32 logits)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=1.0)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = _linear(cfg.d_model, cfg.vocab, cfg.d_model**-0.5)

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(inputs.shape[1], self.cfg.head_dim, inputs.device)
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x)).float()

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def param_counts(model: GPT) -> tuple[int, int]:
    """``(params, non_embedding_params)``: as ``gpt.param_count`` (the head counts)."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.embed.weight.numel()


# ------------------------------------------------------------------ parity with shardax


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    flat: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "/"))
        else:
            flat[name] = np.asarray(getattr(value, "value", value), dtype=np.float32)
    return flat


def _config(cfg: Any) -> Config:
    """A :class:`Config` from a ``GPTConfig`` or its ``dataclasses.asdict``; refuses the
    options this model does not mirror."""
    fields = cfg if isinstance(cfg, Mapping) else dataclasses.asdict(cfg)
    unmirrored = {"positions": "rotary", "experts": 0, "window": None,
                  "pipeline_microbatches": None}  # fmt: skip
    for name, value in unmirrored.items():
        if fields.get(name, value) != value:
            raise ValueError(f"the torch GPT mirrors {name}={value!r} only, got {fields[name]!r}")
    return Config(
        **{f.name: fields[f.name] for f in dataclasses.fields(Config) if f.name in fields}
    )


@torch.no_grad()
def load_shardax_params(model: GPT, params: Mapping[str, Any]) -> None:
    """Copies a shardax GPT's parameters into ``model``: ``params`` is
    ``nnx.to_pure_dict(nnx.state(gpt_model, nnx.Param))`` (nested, numpy or JAX arrays),
    or the same flattened to ``"blocks/attn/q"``-style keys. Every parameter of both
    must be used: a name left over on either side is an error."""
    p = _flatten(params)
    d = model.cfg.d_model
    assigned: dict[str, np.ndarray] = {
        "embed.weight": p.pop("embed/embedding"),
        "norm.scale": p.pop("norm/scale"),
        "head.weight": p.pop("head").T,
    }
    for i in range(model.cfg.layers):
        for name in ("q", "k", "v"):  # (d, h, k) -> Linear's (h·k, d)
            assigned[f"blocks.{i}.attn.{name}.weight"] = (
                p[f"blocks/attn/{name}"][i].reshape(d, -1).T
            )
        assigned[f"blocks.{i}.attn.out.weight"] = p["blocks/attn/out"][i].reshape(-1, d).T
        assigned[f"blocks.{i}.mlp.up.weight"] = p["blocks/mlp/up"][i].T
        assigned[f"blocks.{i}.mlp.down.weight"] = p["blocks/mlp/down"][i].T
        assigned[f"blocks.{i}.norm1.scale"] = p["blocks/norm1/scale"][i]
        assigned[f"blocks.{i}.norm2.scale"] = p["blocks/norm2/scale"][i]
    stacked = {f"blocks/{n}" for n in ("attn/q", "attn/k", "attn/v", "attn/out", "mlp/up",
                                       "mlp/down", "norm1/scale", "norm2/scale")}  # fmt: skip
    for name in stacked:
        if p[name].shape[0] != model.cfg.layers:
            raise ValueError(f"{name} has {p[name].shape[0]} layers, the model {model.cfg.layers}")
    extra = sorted(set(p) - stacked)
    own = dict(model.named_parameters())
    if extra or set(own) != set(assigned):
        raise ValueError(f"parameters not mirrored: shardax {extra}, "
                         f"torch {sorted(set(own) ^ set(assigned))}")  # fmt: skip
    for name, value in assigned.items():
        if tuple(own[name].shape) != value.shape:
            raise ValueError(f"{name}: shape {value.shape}, the model's {tuple(own[name].shape)}")
        own[name].copy_(torch.tensor(value))


def loss_from_shardax_params(params_numpy: Mapping[str, Any], tokens: Any, cfg_dict: Any) -> float:
    """The fp32 loss (no autocast, no compile, on the CPU) of the torch GPT holding a
    shardax GPT's parameters (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``), on
    ``tokens``: an array (batch, seq + 1), inputs ``tokens[:, :-1]`` and targets
    ``tokens[:, 1:]``, or a batch ``{"inputs": ..., "targets": ...}`` (batch, seq).
    ``cfg_dict``: the shardax ``GPTConfig`` or its ``dataclasses.asdict``."""
    model = _shardax_model(params_numpy, cfg_dict)
    if isinstance(tokens, Mapping):
        inputs, targets = (_long(tokens[k]) for k in ("inputs", "targets"))
    else:
        inputs, targets = _long(tokens)[:, :-1], _long(tokens)[:, 1:]
    with torch.no_grad():
        return float(model(inputs, targets))


def _long(a: Any) -> torch.Tensor:
    return torch.tensor(np.asarray(a, dtype=np.int64))


def logits_from_shardax_params(
    params_numpy: Mapping[str, Any], inputs: np.ndarray, cfg_dict: Any
) -> np.ndarray:
    """The fp32 logits (batch, seq, 256) of ``inputs`` (batch, seq), as
    :func:`loss_from_shardax_params` computes them."""
    model = _shardax_model(params_numpy, cfg_dict)
    with torch.no_grad():
        return model.logits(_long(inputs)).numpy()


def _shardax_model(params: Mapping[str, Any], cfg: Any) -> GPT:
    model = GPT(_config(cfg))
    load_shardax_params(model, params)
    return model.eval()


# ------------------------------------------------------------------------ the benchmark


def _sdpa_backend(step: Any, device: torch.device) -> dict[str, Any]:
    """The SDPA ops one profiled step ran (forward and backward), and their backend."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key})
    backends = sorted({SDPA_OPS[n] for n in names if n in SDPA_OPS})
    return {"sdpa_ops": names, "sdpa_backend": ",".join(backends) or "unknown"}


def run(*, layers: int, d_model: int, heads: int, seq_len: int, batch: int, steps: int = 10,
        warmup: int = 3, compile: bool = True, mode: str = "default", device: str | None = None,
        seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Trains the torch GPT ``warmup`` steps (compiling; ``compile_seconds``), then times
    ``steps`` more, each on its own (CUDA events; wall clock after a synchronize on the
    CPU); returns the figures as a JSON-serialisable dict."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps}, {warmup}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    cfg = Config(layers=layers, d_model=d_model, heads=heads)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(dev)
    torch._dynamo.reset()  # each run compiles its own model (and no recompile limit)
    out = _train(cfg, dev, seq_len, batch, steps, warmup, compile, mode, seed)
    if cuda:  # the memory back to the device, for whatever runs next in this process (JAX)
        torch.cuda.empty_cache()
    seconds = out["step_seconds"]
    median = statistics.median(seconds)
    return {
        "framework": "torch",
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if cuda else (platform.processor() or "cpu"),
        "platform": dev.type,
        "config": {
            "layers": layers,
            "d_model": d_model,
            "heads": heads,
            "seq_len": seq_len,
            "batch": batch,
            "compile": compile,
            "mode": mode if compile else None,
            "autocast": "bfloat16",
            "sdpa_allowed": [b.lower() for b in SDPA_BACKENDS] if cuda else "any",
            "seed": seed,
        },
        "warmup": warmup,
        **out,
        "seconds_per_step": median,
        "tokens_per_s": batch * seq_len / median,
    }


def _train(cfg: Config, dev: torch.device, seq_len: int, batch: int, steps: int,
           warmup: int, compile: bool, mode: str, seed: int) -> dict[str, Any]:  # fmt: skip
    """:func:`run`'s measurement; what it built is freed when it returns."""
    cuda = dev.type == "cuda"
    torch.manual_seed(seed)
    with dev:  # initialised on the device: seconds, not a minute, for 1.2B on the CPU
        model = GPT(cfg)
    params, non_embedding = param_counts(model)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (batch, seq_len + 1))
    data = torch.from_numpy(tokens).to(dev)
    inputs, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01, fused=cuda)  # fmt: skip
    forward = torch.compile(model, mode=mode) if compile else model

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = forward(inputs, targets)
        loss.backward()
        opt.step()
        return loss.detach()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    allowed = [getattr(SDPBackend, name) for name in SDPA_BACKENDS]
    losses: list[torch.Tensor] = []
    seconds: list[float] = []
    with sdpa_kernel(allowed) if cuda else nullcontext():
        sync()
        began = time.perf_counter()
        for _ in range(warmup):
            losses.append(step())
        sync()
        compile_seconds = time.perf_counter() - began
        if cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(steps)]  # fmt: skip
            for start, end in events:
                start.record()
                losses.append(step())
                end.record()
            sync()
            seconds = [start.elapsed_time(end) / 1e3 for start, end in events]
        else:
            for _ in range(steps):
                began = time.perf_counter()
                losses.append(step())
                sync()
                seconds.append(time.perf_counter() - began)
        peak = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
        sdpa = _sdpa_backend(step, dev)  # one more step, profiled, after the timed ones
    return {
        "params": params,
        "non_embedding_params": non_embedding,
        "compile_seconds": compile_seconds,
        "step_seconds": seconds,
        "first_loss": float(losses[0]),
        "last_loss": float(losses[-1]),
        "peak_memory_gib": peak,
        **sdpa,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="tiny")
    for name in ("layers", "d_model", "heads", "seq_len", "batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"override the size's {name}")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing (compiling)")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--mode", choices=MODES, default="default", help="torch.compile's mode")
    p.add_argument("--sdpa", choices=tuple(SDPA_CHOICES), default="flash,cudnn",
                   help="the SDPA backends allowed on CUDA")  # fmt: skip
    p.add_argument("--device", default=None, help="cuda if available, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global SDPA_BACKENDS
    args = parser().parse_args(argv)
    SDPA_BACKENDS = SDPA_CHOICES[args.sdpa]
    shape = dict(SIZES[args.size])
    shape.update({k: getattr(args, k) for k in shape if getattr(args, k) is not None})
    out = run(**shape, steps=args.steps, warmup=args.warmup, compile=args.compile,
              mode=args.mode, device=args.device, seed=args.seed)  # fmt: skip
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['device']} torch {out['torch']} {out['config']}")
        print(f"params {out['params']:,} (non-embedding {out['non_embedding_params']:,}); "
              f"compile {out['compile_seconds']:.1f} s; SDPA {out['sdpa_backend']}")  # fmt: skip
        print(f"{out['seconds_per_step'] * 1e3:.2f} ms/step (median of {len(out['step_seconds'])})"
              f", {out['tokens_per_s']:,.0f} tokens/s; loss {out['first_loss']:.4f} -> "
              f"{out['last_loss']:.4f}")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
