"""The reference GPT's train step two ways, built and timed for the GPU session:
shardax's (``sx.make_train_step``) and a hand-written ``jax.jit`` step of the same model.

Both train ``shardax.models.gpt`` with bf16 compute over fp32 params and AdamW on one
fixed batch of random bytes (data loading is not measured), all devices on one
``"data"`` axis (FSDP over it with several). The hand-written step is what a JAX user
writes without shardax: cast the params to bf16 inside the loss, ``jax.value_and_grad``,
``optax`` update, donate the state, and the same ``compiler_options`` as shardax's
step, so their ratio is shardax's own overhead. (With several devices the hand-written
step replicates the params; on one device both programs hold the same state.)

    run(Config(layers=2, d_model=64, heads=4, seq_len=64, batch=2), steps=3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator
from typing import Any

ADAMW = {"learning_rate": 1e-4, "weight_decay": 0.01}


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the step: the model's shape, the batch (global rows), the
    remat policy, scanned or unrolled layers, the attention kernel and the compiler
    options (``"auto"``: shardax's for the platform; ``"xla"``: XLA's defaults; or a dict);
    shardax's step only: the precision (``"bf16"`` or ``"fp8"``), the GPT's residual
    stream and elementwise backward (``GPTConfig``'s ``residual``, ``elementwise``) and the
    plan (``"auto"``: FSDP over several devices, else replicated; ``"zero1"``:
    ``sx.zero1`` with ``zero_gather``)."""

    layers: int = 24
    d_model: int = 2048
    heads: int = 16
    seq_len: int = 2048
    batch: int = 4
    remat: str = "none"
    scan: bool = False
    kernel: str = "auto"
    compiler: Any = "auto"
    impl: str = "shardax"  # or "jit": the hand-written step
    model: str = "current"  # or "stage4": the GPT's MLP and head in float32, as before
    precision: str = "bf16"  # or "fp8"
    residual: str = "fp32"  # or "bf16"
    elementwise: str = "autodiff"  # or "recompute"
    plan: str = "auto"  # or "zero1"
    zero_gather: str = "update"  # or "forward" (plan "zero1")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def label(self) -> str:
        compiler = self.compiler if isinstance(self.compiler, str) else "custom"
        parts = [self.impl, f"{self.batch}×{self.seq_len}", f"remat {self.remat}",
                 "scanned" if self.scan else "unrolled", f"attention {self.kernel}",
                 f"compiler {compiler}"]  # fmt: skip
        changed = {k: getattr(self, k) for k, v in SHARDAX_ONLY.items() if getattr(self, k) != v}
        changed |= {"model": self.model} if self.model != "current" else {}
        return ", ".join(parts + [f"{k} {v}" for k, v in changed.items()])


SHARDAX_ONLY = {"precision": "bf16", "residual": "fp32", "elementwise": "autodiff",
                "plan": "auto", "zero_gather": "update"}  # fmt: skip
"""``Config``'s fields only shardax's step takes, with their defaults (the hand-written
step is bf16 and the GPT as it is)."""


def gpt_config(c: Config) -> Any:
    from shardax.models import gpt

    return gpt.GPTConfig(layers=c.layers, d_model=c.d_model, heads=c.heads,
                         max_seq_len=c.seq_len, scan_layers=c.scan, kernel=c.kernel,
                         residual=c.residual, elementwise=c.elementwise)  # fmt: skip


def shardax_step(c: Config, mesh: Any) -> tuple[Any, Any, str]:
    """``(step, make_model, plan name)``: shardax's train step of ``c`` over ``mesh`` (a
    GPU's, or a compile-only target's for a prediction) and the model's constructor."""
    import jax

    import shardax as sx
    from shardax.models import gpt

    cfg = gpt_config(c)
    make = lambda: gpt.make_gpt(cfg, remat=c.remat)  # noqa: E731
    if c.plan == "zero1":
        plan, name = sx.zero1(mesh, gather=c.zero_gather), f"zero1 (gather {c.zero_gather})"
    elif c.plan == "auto":
        name = "fsdp" if mesh.size > 1 else "replicate"
        plan = gpt.plan(mesh, jax.eval_shape(make), name)
    else:
        raise ValueError(f"Config.plan must be 'auto' or 'zero1', got {c.plan!r}")
    step = sx.make_train_step(loss_fn, mesh=mesh, plan=plan, precision=c.precision,
                              compiler_options=c.compiler)  # fmt: skip
    return step, make, name


def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
    """Next-byte cross-entropy of fp32 logits (the loss of ``benchmarks/mfu.py``)."""
    import jax.numpy as jnp
    import optax

    logits = model(batch["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def random_tokens(batch: int, seq_len: int, seed: int = 0) -> Any:
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (batch, seq_len + 1)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def model_flops_per_step(c: Config) -> tuple[float, int]:
    """``(model FLOPs per step, non-embedding params)``: ``6·N + 6·L·T·d`` per token
    (attention causal-halved, as MaxText and Megatron count it; the LM head in N)."""
    import jax

    from shardax.cost.flops import transformer_flops_per_token
    from shardax.models import gpt

    abstract = jax.eval_shape(lambda: gpt.make_gpt(gpt_config(c)))
    n = gpt.param_count(abstract, embeddings=False)
    per_token = transformer_flops_per_token(n, c.layers, c.seq_len, c.d_model, causal=True)
    return per_token * c.tokens, n


def build_shardax(c: Config) -> tuple[Any, Any, Any, dict[str, Any]]:
    """``(step, state, batch, info)``: shardax's step of ``c``, its state and placed batch."""
    import optax

    import shardax as sx

    mesh = sx.make_mesh({"data": -1})
    step, make, plan_name = shardax_step(c, mesh)
    tx = optax.adamw(**ADAMW)
    state = step.init(lambda: sx.TrainState.create(make(), tx))
    batch = step.place_batch(random_tokens(c.batch, c.seq_len))
    info = {"plan": plan_name, "compiler_options": dict(getattr(step, "compiler_options", {}))}

    def run(state: Any, batch: Any) -> tuple[Any, Any]:
        state, metrics = step(state, batch)
        return state, metrics["loss"]

    return (run, step.lower), state, batch, info


def build_jit(c: Config) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The hand-written ``jax.jit`` step of ``c`` (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import shardax as sx
    from shardax.models import gpt

    changed = [f"{k}={getattr(c, k)!r}" for k, v in SHARDAX_ONLY.items() if getattr(c, k) != v]
    if changed:
        raise ValueError(f"the hand-written step is bf16 over the GPT as it is; "
                         f"{', '.join(changed)} is shardax's step's only")  # fmt: skip
    options = resolve_options(c.compiler)
    model = gpt.make_gpt(gpt_config(c), remat=c.remat)
    graphdef, params = nnx.split(model)
    tx = optax.adamw(**ADAMW)
    mesh = sx.make_mesh({"data": -1})
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.device_put(params, replicated)
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

    def step(state: Any, batch: Any) -> tuple[Any, Any]:
        params, opt_state = state

        def loss(p: Any) -> Any:
            cast = jax.tree.map(
                lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, p
            )
            return loss_fn(nnx.merge(graphdef, cast), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    jitted = jax.jit(step, donate_argnums=(0,), compiler_options=options or None)
    batch = jax.device_put(random_tokens(c.batch, c.seq_len),
                           NamedSharding(mesh, PartitionSpec("data")))  # fmt: skip
    return (
        (jitted, jitted.lower),
        (params, opt_state),
        batch,
        {"plan": "replicate", "compiler_options": options},
    )


def _peak_gib() -> float | None:
    """The device's peak memory in use so far in this process (GiB; None where the
    backend keeps no statistics, as on a CPU): the high-water mark of every
    configuration this process ran, so a configuration's own when it ran first."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def resolve_options(setting: Any) -> dict[str, Any]:
    """The compiler options shardax's step takes for ``setting`` on this platform (the
    hand-written step gets the same)."""
    import jax

    import shardax as sx

    return sx.train.compiler_options(jax.devices()[0], setting)


@contextlib.contextmanager
def model_version(version: str) -> Iterator[None]:
    """``"current"``: the GPT as it is; ``"stage4"``: its MLP and head as they were before
    the fifth stage (their input left in the norm's float32, so under bf16 both MLP
    matmuls and the head ran in float32), to measure the change beside the version
    before it in one call."""
    from shardax.models import gpt

    if version == "current":
        yield
        return
    if version != "stage4":
        raise ValueError(f"model must be 'current' or 'stage4', got {version!r}")

    def mlp(self: Any, x: Any) -> Any:
        import jax

        return jax.nn.gelu(x @ self.up[...]) @ self.down[...]

    def logits(self: Any, x: Any) -> Any:
        return self.norm(x) @ self.head[...].astype(x.dtype)

    saved = gpt.MLP.__call__, gpt.GPT.logits
    gpt.MLP.__call__, gpt.GPT.logits = mlp, logits
    try:
        yield
    finally:
        gpt.MLP.__call__, gpt.GPT.logits = saved


def run(
    c: Config, *, steps: int = 8, warmup: int = 2, hlo: bool = False, keep: bool = False
) -> dict[str, Any]:
    """Builds ``c``'s step, compiles it (timed: the first call), runs ``warmup`` more
    steps, then times ``steps`` steps one by one; returns the figures. ``hlo``: also
    the compiled program's text (for the profile) and its FLOP count; ``keep``: also the
    step, its state and batch as ``_run`` (to profile more steps; not serialised)."""
    with model_version(c.model):
        return _run(c, steps=steps, warmup=warmup, hlo=hlo, keep=keep)


def _run(c: Config, *, steps: int, warmup: int, hlo: bool, keep: bool = False) -> dict[str, Any]:
    import jax

    from shardax.cost.flops import compiled_flops, utilization
    from shardax.cost.hlo import attention_kernel

    build = build_shardax if c.impl == "shardax" else build_jit
    began = time.perf_counter()
    (fn, lower), state, batch, info = build(c)
    build_seconds = time.perf_counter() - began
    out: dict[str, Any] = {"config": dataclasses.asdict(c), "label": c.label(), **info,
                           "build_seconds": build_seconds}  # fmt: skip
    began = time.perf_counter()
    state, loss = fn(state, batch)
    first_loss = float(loss)
    out["compile_seconds"] = time.perf_counter() - began  # the first call: compile + one step
    for _ in range(warmup):
        state, loss = fn(state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, loss = fn(state, batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    flops, non_embedding = model_flops_per_step(c)
    devices = jax.device_count()
    model = utilization(flops, seconds, devices)
    out.update(
        step_seconds=times,
        seconds_per_step=seconds,
        first_loss=first_loss,
        last_loss=float(loss),
        devices=devices,
        non_embedding_params=non_embedding,
        tokens_per_s=c.tokens / seconds,
        tokens_per_s_per_device=c.tokens / seconds / devices,
        model_flops_per_step=flops,
        model_tflops_per_s_per_device=model["tflops_per_s_per_device"],
        mfu=model["mfu"],
        peak_gib_so_far=_peak_gib(),
    )
    if hlo:
        compiled = lower(state, batch).compile()
        text = compiled.as_text()
        executed = compiled_flops(compiled)
        out["attention_kernel"] = attention_kernel(text)
        out["executed_flops_per_step"] = None if executed is None else executed * devices
        out["hlo_text"] = text
    if hlo or keep:
        out["_run"] = (fn, state, batch)  # the caller profiles with it (not serialised)
    return out
