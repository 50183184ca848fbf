"""What the step benchmarks share: the regression MLP (pytree or NNX) with its shardax
state and its hand-written pieces, a batch placed over the mesh, and steps timed in turns.

    from _common import mlp, regression_batch, time_in_turns

>>> parts = mlp([256, 256, 10], "nnx")
>>> state = parts.new_state(optax.adam(1e-3))          # a shardax TrainState
>>> params = parts.params()                            # for a hand-written step
>>> loss = parts.loss(params, batch)                   # mean squared error
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


def step_parser(doc: str, *, width: int = 256, min_steps: int = 50) -> argparse.ArgumentParser:
    """The options every step benchmark takes: ``--steps --warmup --batch-size --width
    --json --cpu-devices``; parse with :func:`parse_steps`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help=f"timed rounds (>= {min_steps})")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--width", type=int, default=width, help="hidden width of the MLP")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--cpu-devices", type=int, default=8, help="simulated CPU devices with no accelerator"
    )
    parser.set_defaults(min_steps=min_steps)
    return parser


def parse_steps(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser``'s arguments, ``--steps`` checked against its minimum."""
    args = parser.parse_args(argv)
    if args.steps < args.min_steps:
        parser.error(f"--steps must be >= {args.min_steps} for a stable median, got {args.steps}")
    return args


class MLP(NamedTuple):
    """An MLP two ways: ``new_state(tx)`` for shardax, ``params()`` and ``loss(params,
    batch)`` for a hand-written ``jax.jit`` step."""

    new_state: Callable[[Any], Any]
    params: Callable[[], Any]
    loss: Callable[[Any, Any], Any]


def mse(model: Callable[[Any], Any], batch: dict[str, Any]) -> Any:
    """The loss every step benchmark trains: mean squared error of ``model(batch["x"])``
    against ``batch["y"]``, in float32 (whatever the compute dtype)."""
    import jax.numpy as jnp

    return jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)


def mlp(sizes: Sequence[int], framework: str = "pytree") -> MLP:
    """ReLU layers of ``sizes`` (input width first), as a list of ``(w, b)`` pairs
    (``"pytree"``) or an ``nnx.Module`` (``"nnx"``), initialised from seed 0."""
    import jax
    import numpy as np
    from flax import nnx

    import shardax as sx

    def forward(layers: Sequence[Callable[[Any], Any]], x: Any) -> Any:
        for i, layer in enumerate(layers):
            x = layer(x)
            x = jax.nn.relu(x) if i < len(layers) - 1 else x
        return x

    if framework == "pytree":

        def apply_fn(params: Any, x: Any) -> Any:
            return forward([lambda h, w=w, b=b: h @ w + b for w, b in params], x)

        def params() -> Any:
            keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
            return [
                (jax.random.normal(k, (m, n)) / np.sqrt(m), jax.numpy.zeros(n))
                for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
            ]

        return MLP(
            new_state=lambda tx: sx.TrainState.from_params(params(), apply_fn, tx),
            params=params,
            loss=lambda p, batch: mse(lambda x: apply_fn(p, x), batch),
        )
    if framework != "nnx":
        raise ValueError(f"framework must be 'pytree' or 'nnx', got {framework!r}")

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List(
                [nnx.Linear(m, n, rngs=rngs) for m, n in itertools.pairwise(sizes)]
            )

        def __call__(self, x: Any) -> Any:
            return forward(list(self.layers), x)

    graphdef = nnx.graphdef(Net(nnx.Rngs(0)))
    return MLP(
        new_state=lambda tx: sx.TrainState.create(Net(nnx.Rngs(0)), tx),
        params=lambda: nnx.state(Net(nnx.Rngs(0)), nnx.Param),
        loss=lambda p, batch: mse(nnx.merge(graphdef, p), batch),
    )


def regression_batch(mesh: Any, batch_size: int, width: int, outputs: int = 10) -> Any:
    """``{"x": (batch_size, width), "y": (batch_size, outputs)}`` of normal noise (seed 0),
    split over the mesh's data axis."""
    import numpy as np

    import shardax as sx

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch_size, width)).astype(np.float32)
    y = rng.normal(size=(batch_size, outputs)).astype(np.float32)
    return sx.distribute_batch({"x": x, "y": y}, sx.batch_sharding(mesh))


def time_in_turns(
    steps: dict[str, Callable[[Any, Any], Any]],
    states: dict[str, Any],
    batch: Any,
    rounds: int,
    warmup: int,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds per step of each of ``steps`` (``step(state, batch) -> (state,
    out)``), one of each per round in alternating order so drift hits all alike, each
    timed to ``block_until_ready`` after ``warmup`` untimed rounds; and each step's last
    ``out``. ``states`` is updated in place."""
    import jax

    times: dict[str, list[float]] = {name: [] for name in steps}
    outs: dict[str, Any] = {}
    names = list(steps)
    for round_ in range(warmup + rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            states[name], outs[name] = steps[name](states[name], batch)
            jax.block_until_ready((states[name], outs[name]))
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outs


def gpt_loss_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of a side-by-side GPT loss benchmark: the ``shardax train --model gpt``
    job's defaults (2 layers, d_model 64, 4 heads, sequence 64, batch 16), 200 steps."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of each")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices")
    return parser


def gpt_losses_side_by_side(
    args: argparse.Namespace, variants: dict[str, tuple[dict[str, Any], str]]
) -> dict[str, Any]:
    """Trains one GPT per variant, ``name: (GPTConfig fields, precision)``, from the same
    params on the same batches of the built-in corpus (AdamW at 3e-3 after 10 warmup
    steps, gradients clipped at 1.0, as the GPT job), and returns, per variant, the first
    loss, the training loss averaged over the last 20 steps and the validation loss (64
    held-out windows) after the last step, in nats per byte, with what it ran on."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardax as sx
    from shardax.data.text import LMBatches, lm_eval_batch, load_corpus
    from shardax.models import gpt

    mesh = sx.make_mesh({"data": -1})
    corpus = load_corpus()
    loader = LMBatches(corpus.train, args.batch_size, args.seq_len, args.seed)
    val = lm_eval_batch(corpus.val, 64, args.seq_len)

    def lm_loss(model, batch):
        logits = model(batch["inputs"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    schedule = optax.linear_schedule(0.0, 3e-3, 10)
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.01)
    tx = optax.chain(optax.clip_by_global_norm(1.0), adamw)
    size = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads}
    steps, evals, states = {}, {}, {}
    for name, (fields, precision) in variants.items():
        cfg = gpt.GPTConfig(**size, max_seq_len=max(256, args.seq_len), **fields)
        steps[name] = sx.make_train_step(lm_loss, mesh=mesh, precision=precision)
        evals[name] = sx.make_eval_step(lm_loss, mesh=mesh, precision=precision)
        model = gpt.make_gpt(cfg, seed=args.seed)
        states[name] = steps[name].shard(sx.TrainState.create(model, tx))
    losses: dict[str, list[float]] = {name: [] for name in variants}
    for _, batch in zip(range(args.steps), loader, strict=False):
        for name in variants:  # the same batch for each
            states[name], metrics = steps[name](states[name], batch)
            losses[name].append(float(metrics["loss"]))
    tail = min(20, args.steps)
    return {
        "devices": mesh.size,
        "platform": jax.devices()[0].platform,
        "jax": jax.__version__,
        "config": {
            **size,
            "seq_len": args.seq_len,
            "batch": args.batch_size,
            "steps": args.steps,
        },
        "corpus": corpus.source,
        "losses": {
            name: {
                "first_loss": losses[name][0],
                "train_loss": float(np.mean(losses[name][-tail:])),
                "val_loss": float(evals[name](states[name], val)["loss"]),
            }
            for name in variants
        },
    }
