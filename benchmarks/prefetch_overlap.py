"""How much input time does prefetching hide behind compute?

The source sleeps ``T_in`` per batch (a slow reader or decoder that does not hold the CPU);
the step is a real jitted computation (a chain of matmuls) calibrated to take ``T_c``. A
loop that hides input entirely takes ``max(T_in, T_c)`` per step, one that hides nothing
``T_in + T_c``. The overlap

    eta = (T_in + T_c - T_measured) / min(T_in, T_c)

is 1 for a perfect overlap and 0 for none; ``T_in`` and ``T_c`` are measured alone in every
run, next to the loaders, since a shared machine's load changes. Loaders, side by side in
each run (medians over ``--runs``):

- ``sync``: ``device_put`` each batch, then the step;
- ``flax``: ``flax.jax_utils.prefetch_to_device`` (a deque filled on the main thread, no
  worker thread; batches stacked per device as it requires);
- ``shardax``: ``sx.prefetch_to_device`` (worker thread, bounded queue).

Each loader's data-wait fraction (``sx.track.StepClock`` over the loop's input iterator: the
share of wall time the loop stood blocked on ``next()``; the sync and flax loaders are
wrapped in ``sx.data.timed``) is reported beside it: near 0 when input is hidden, near
``T_in / (T_in + T_c)`` when it is not.

``--sync-every`` 1 (the default) reads the step's result on the host every step, as a loop
that logs its loss does; with ``--sync-every 0`` the host never waits for the step, so JAX's
asynchronous dispatch itself overlaps input with compute, whatever the loader.

    uv run python benchmarks/prefetch_overlap.py [--t-in 0.02 --t-c 0.02 --runs 5 --json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import jax_utils

import shardax as sx

WIDTH = 256


def source(t_in: float, steps: int, rows: int, stacked: bool = False) -> Iterator[Any]:
    """``steps`` batches, each after sleeping ``t_in``; ``stacked`` adds flax's device axis."""
    pool = [np.full((rows, WIDTH), i % 7, np.float32) / 7 for i in range(4)]
    for i in range(steps):
        time.sleep(t_in)
        x = pool[i % 4].copy()
        yield {"x": x[None] if stacked else x}


@jax.jit
def step(state: jax.Array, x: jax.Array, w: jax.Array, n: jax.Array) -> jax.Array:
    """``n`` rounds of ``tanh(a @ w)`` on the batch: the compute being overlapped."""
    a = jax.lax.fori_loop(0, n, lambda _, a: jnp.tanh(a @ w), x)
    return state + jnp.mean(a)


def calibrate(t_c: float, w: jax.Array, rows: int) -> tuple[jax.Array, float]:
    """The number of rounds that takes ``t_c`` (fastest of 7: the unloaded speed), and the
    time it then takes."""
    x, state = jnp.ones((rows, WIDTH)), jnp.zeros(())

    def timed(n: jax.Array, repeats: int = 7) -> float:
        jax.block_until_ready(step(state, x, w, n))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(state, x, w, n))
            times.append(time.perf_counter() - start)
        return min(times)

    n = 4
    for _ in range(4):
        n = max(1, round(n * t_c / timed(jnp.int32(n))))
    n = jnp.int32(n)
    return n, timed(n)


def run_loop(
    batches: Iterator[Any], do_step: Callable[[Any, Any], Any], sync_every: int
) -> tuple[float, float]:
    """Seconds per step, from the end of the first step (pipeline filled) to the last, and
    the data-wait fraction over the same steps (0 when ``batches`` counts no wait)."""
    timed = batches if hasattr(batches, "wait_seconds") else sx.data.timed(batches)
    clock = sx.track.StepClock(1, input=timed)
    state = jnp.zeros(())
    start, count = None, 0
    for i, batch in enumerate(timed):
        state = do_step(state, batch)
        if sync_every and i % sync_every == 0:
            float(state)  # the host reads the result, as logging a loss does
        if start is None:
            jax.block_until_ready(state)
            start = time.perf_counter()
            clock.start()
        else:
            count += 1
            clock.tick()
    jax.block_until_ready(state)
    return (time.perf_counter() - start) / count, clock.total().data_wait_fraction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t-in", type=float, default=0.02, help="source sleep per batch (s)")
    parser.add_argument("--t-c", type=float, default=0.02, help="step compute target (s)")
    parser.add_argument("--steps", type=int, default=40, help="batches per loop")
    parser.add_argument("--runs", type=int, default=5, help="runs; medians are reported")
    parser.add_argument("--rows", type=int, default=64, help="batch size")
    parser.add_argument("--buffer-size", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=1, help="host reads result every N")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    device = jax.devices()[0]
    w = jax.device_put(np.eye(WIDTH, dtype=np.float32) * 0.5, device)
    n, t_c = calibrate(args.t_c, w, args.rows)

    def plain(state, b):
        return step(state, jax.device_put(b["x"], device), w, n)

    loaders = {
        "sync": lambda: run_loop(source(args.t_in, args.steps, args.rows), plain, args.sync_every),
        "flax": lambda: run_loop(
            jax_utils.prefetch_to_device(
                source(args.t_in, args.steps, args.rows, stacked=True),
                args.buffer_size,
                devices=[device],
            ),
            lambda state, b: step(state, b["x"][0], w, n),
            args.sync_every,
        ),
        "shardax": lambda: run_loop(
            sx.prefetch_to_device(
                source(args.t_in, args.steps, args.rows), device, args.buffer_size
            ),
            lambda state, b: step(state, b["x"], w, n),
            args.sync_every,
        ),
    }
    # T_in and T_c are measured again in every run (the machine's load changes), each alone:
    # the source without compute, and the step on batches already in memory.
    parts = {
        "input": lambda: run_loop(source(args.t_in, args.steps, args.rows), lambda s, b: s, 0),
        "compute": lambda: run_loop(source(0.0, args.steps, args.rows), plain, args.sync_every),
    }
    for loader in (*parts.values(), *loaders.values()):  # warm up every path once
        loader()
    times: dict[str, list[float]] = {name: [] for name in (*parts, *loaders)}
    waits: dict[str, list[float]] = {name: [] for name in loaders}
    for _ in range(args.runs):  # interleaved, so all loaders see the same machine load
        for name, loader in (*parts.items(), *loaders.items()):
            seconds, wait = loader()
            times[name].append(seconds)
            if name in waits:
                waits[name].append(wait)

    def eta(run: int, t: float) -> float:
        t_in, t_c = times["input"][run], times["compute"][run]
        return (t_in + t_c - t) / min(t_in, t_c)

    results = {
        name: {
            "step_ms": 1e3 * statistics.median(times[name]),
            "eta": statistics.median(eta(r, t) for r, t in enumerate(times[name])),
            "etas": [round(eta(r, t), 3) for r, t in enumerate(times[name])],
            "data_wait_fraction": statistics.median(waits[name]),
        }
        for name in loaders
    }
    report = {
        "device": str(device),
        "t_in_ms": 1e3 * statistics.median(times["input"]),
        "t_c_ms": 1e3 * statistics.median(times["compute"]),
        "t_c_calibrated_ms": 1e3 * t_c,
        "rounds": int(n),
        "steps": args.steps,
        "runs": args.runs,
        "buffer_size": args.buffer_size,
        "sync_every": args.sync_every,
        # what a loop that hides no input waits: T_in / (T_in + T_c)
        "no_overlap_wait_fraction": statistics.median(
            i / (i + c) for i, c in zip(times["input"], times["compute"], strict=True)
        ),
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    t_in_ms, t_c_ms = report["t_in_ms"], report["t_c_ms"]
    print(
        f"{device}: T_in {t_in_ms:.1f} ms, T_c {t_c_ms:.1f} ms (medians measured alone in each "
        f"run; {int(n)} matmul rounds), {args.steps} steps x {args.runs} runs, "
        f"host sync every {args.sync_every or 'never'}"
    )
    print(f"ideal {max(t_in_ms, t_c_ms):.1f} ms/step, no overlap {t_in_ms + t_c_ms:.1f}")
    print(
        f"data-wait fraction with no overlap, T_in/(T_in+T_c): "
        f"{report['no_overlap_wait_fraction']:.2f}"
    )
    print(f"{'loader':<10}{'ms/step':>10}{'eta':>8}{'wait':>8}   eta per run")
    for name, r in results.items():
        print(
            f"{name:<10}{r['step_ms']:>10.1f}{r['eta']:>8.2f}{r['data_wait_fraction']:>8.2f}"
            f"   {r['etas']}"
        )


if __name__ == "__main__":
    main()
