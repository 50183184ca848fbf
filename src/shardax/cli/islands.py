"""``shardax train --islands N``: the job's step as DiLoCo over N islands.

The mesh gains an ``island`` axis of size N in front of ``--mesh`` (``sx.make_mesh``
puts it across the processes: one island per host, or per group of hosts), the job's
plan applies inside each island, and the job's step becomes an
[`IslandStep`][shardax.train.IslandStep] with ``sx.DiLoCo(inner_steps=--inner-steps,
compress=--outer-compress)``. The loop runs it as any step: ``IslandLoopStep`` takes the
outer step every H inner steps and hands the loop the metrics of this process's island
(one number each, read with no communication); validation is of the anchor, the params
at the last outer step.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax

from shardax.cli.common import UsageError, positive_int
from shardax.mesh.axes import ISLAND_AXIS
from shardax.train.diloco import COMPRESSIONS, DiLoCo
from shardax.train.islands import IslandStep


def island_mesh(args: argparse.Namespace) -> None:
    """``--islands N``: the island axis put in front of ``--mesh`` (default data=-1)."""
    if args.islands == 1:
        return
    mesh = dict(args.mesh or {"data": -1})
    if ISLAND_AXIS in mesh:
        raise UsageError(
            f"--islands {args.islands} adds the {ISLAND_AXIS!r} axis; drop it from --mesh"
        )
    if args.verify:
        raise UsageError("--verify checks a data-parallel step; it does not take --islands")
    args.mesh = {ISLAND_AXIS: args.islands, **mesh}


class IslandLoopStep:
    """The loop's step under ``--islands``: the inner step, the outer step after every
    H-th, and this process's island's metrics. Anything else is the ``IslandStep``'s."""

    def __init__(self, step: IslandStep) -> None:
        self.step, self.count, self.last = step, None, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.step, name)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        if self.count is None:  # once (a resumed run's count): no read per step
            self.count = int(jax.device_get(state.step))
        state, metrics = self.step(state, batch)
        self.count += 1
        local = self.step.local(metrics)
        if self.last is not None and not _reads_examples(batch, self.step.islands):
            # This island's rows are all padding (an epoch's last, partial batch): its
            # loss reads NaN by the step's rule; it read nothing, so its last metrics stand.
            local = self.last
        self.last = local
        return self.step.sync(state, self.count), local


def _reads_examples(batch: Any, islands: int) -> bool:
    """Whether this process's first island's rows of ``batch`` (``islands`` blocks of
    rows) hold a real example (a batch without a ``"mask"`` always does); read from this
    process's shards only."""
    mask = batch.get("mask") if isinstance(batch, dict) else None
    if mask is None:
        return True
    if not hasattr(mask, "addressable_shards"):
        return bool(mask[: len(mask) // islands].any())
    rows = mask.shape[0] // islands
    shards = [(s.index[0].indices(mask.shape[0])[0] // rows, s) for s in mask.addressable_shards]
    first = min(island for island, _ in shards)
    return any(bool(s.data.any()) for island, s in shards if island == first)


def islands_job(args: argparse.Namespace, job: Any) -> Any:
    """``job`` with its step over the islands (``IslandLoopStep``), its state on them,
    and its evaluation of the anchor."""
    if args.islands == 1:
        return job
    diloco = DiLoCo(inner_steps=args.inner_steps, compress=args.outer_compress)
    try:
        step = IslandStep(job.step.loss_fn, job.step.config, diloco)
        state = step.shard(job.state)
    except ValueError as e:
        raise UsageError(
            f"--islands {args.islands} --plan {args.plan} --mode {args.mode}: {e}"
        ) from None
    plain, evaluate = job.state, job.evaluate

    def at_anchor(state: Any) -> dict[str, float]:
        return evaluate(plain.replace(step=state.step, params=state.outer.anchor))

    return dataclasses.replace(job, step=IslandLoopStep(step), state=state, evaluate=at_anchor)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--islands``, ``--inner-steps``, ``--outer-compress``."""
    parser.add_argument(
        "--islands",
        type=positive_int,
        default=1,
        help="train N islands apart with DiLoCo (sx.DiLoCo): each island its own rows of "
        "every batch with --plan inside it, averaged by an outer Nesterov step every "
        "--inner-steps; islands go across processes (default: 1, data parallel)",
    )
    parser.add_argument(
        "--inner-steps",
        type=positive_int,
        default=50,
        help="with --islands: H, steps between outer steps",
    )
    parser.add_argument(
        "--outer-compress",
        choices=[c for c in COMPRESSIONS if c],
        default=None,
        help="with --islands: the outer gradients across islands as bf16, int8 (per-block "
        "scales) or top-k with error feedback (default: float32)",
    )
