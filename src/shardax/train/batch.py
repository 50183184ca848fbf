"""Global batches for the train step: one batch size, divisible, microbatches.

>>> check_batch({"x": np.ones((16, 3)), "y": np.ones(16)}, divisor=8, what="the data axis size 8")
16
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.plan.tree import is_array, path_str
from shardax.train.loss import MASK_KEY


def _describe_sizes(batch: Any) -> str:
    sizes = [
        f"{path_str(path) or '<root>'!r}: {np.shape(leaf)}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(batch)
        if is_array(leaf)
    ]
    return ", ".join(sizes)


def _batch_error(batch: Any) -> ValueError:
    """The error for a batch whose leaves are scalars or disagree on the batch size."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        if is_array(leaf) and np.ndim(leaf) == 0:
            return ValueError(
                f"batch leaf {path_str(path)!r} is a scalar; every batch leaf needs a leading "
                f"batch dimension (leaf shapes: {_describe_sizes(batch)})"
            )
    return ValueError(
        "batch leaves disagree on the batch size (dimension 0); they must all have the same "
        f"leading dimension. Received {_describe_sizes(batch)}"
    )


def check_batch(batch: Any, *, divisor: int, what: str) -> int:
    """The global batch size of ``batch``, checked; raises ``ValueError`` naming the rule.

    Every array leaf needs the same leading dimension, divisible by ``divisor``
    (``what`` says where the divisor comes from). A top-level ``"mask"`` leaf must be
    boolean, with a shape that leads the batch's: ``(batch,)``, or ``(batch, seq)``
    leading the shape of another leaf.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError(f"the batch has no array leaves, got {batch!r}")
    try:
        sizes = {leaf.shape[0] for leaf in leaves}
    except (AttributeError, IndexError):
        raise _batch_error(batch) from None
    if isinstance(batch, dict) and MASK_KEY in batch and len(leaves) > 1:
        # The mask is checked against the other leaves' size, with its own message.
        rest = {leaf.shape[0] for leaf in jax.tree.leaves({**batch, MASK_KEY: None})}
        if len(rest) == 1:
            _check_mask(batch, *rest)
    if len(sizes) != 1:
        raise _batch_error(batch)
    (size,) = sizes
    if isinstance(batch, dict) and MASK_KEY in batch:
        _check_mask(batch, size)
    if size % divisor:
        fit = -(-size // divisor) * divisor
        raise ValueError(
            f"global batch {size} is not divisible by {what}. Use a batch size that is a "
            f"multiple of {divisor}, drop the last {size % divisor} examples, or pad to {fit} "
            f"and add a boolean {MASK_KEY!r} leaf (True for real examples) so the padding "
            "does not count"
        )
    return size


def _check_mask(batch: dict, size: int) -> None:
    mask = batch[MASK_KEY]
    shape = tuple(np.shape(mask))
    others = [
        tuple(np.shape(leaf))
        for key, value in batch.items()
        if key != MASK_KEY
        for leaf in jax.tree.leaves(value)
        if is_array(leaf)
    ]
    leads = len(shape) == 1 or any(other[: len(shape)] == shape for other in others)
    if np.dtype(mask.dtype) != np.bool_ or not shape or shape[0] != size or not leads:
        raise ValueError(
            f"batch[{MASK_KEY!r}] must be a boolean array whose shape leads the batch's: "
            f"(batch,) = ({size},), True for real examples, or (batch, seq) leading the shape "
            f"of another leaf, True for real tokens; got dtype {mask.dtype} and shape {shape} "
            f"(leaf shapes: {_describe_sizes(batch)})"
        )


def split_microbatches(batch: Any, k: int) -> Any:
    """Leaves ``(b, ...)`` to ``(k, b // k, ...)``; microbatch ``j`` holds the examples
    ``i`` with ``i % k == j``, so each stays spread over the devices that hold the batch."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), batch)
