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
