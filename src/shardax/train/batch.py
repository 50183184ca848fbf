"""Global batches for the train step: one batch size, divisible, microbatches.

>>> check_batch({"x": np.ones((16, 3)), "y": np.ones(16)}, divisor=8, what="the data axis size 8")
16
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardax.data.leaves import Leaves, batch_leaves, check_leaves, shapes_text
from shardax.plan.tree import is_key, path_str
from shardax.train.masks import MASK_KEY


def check_batch(batch: Any, *, divisor: int, what: str, flat: Leaves | None = None) -> int:
    """The global batch size of ``batch``, checked; raises ``ValueError`` naming the rule.

    Every array leaf needs the same leading dimension, divisible by ``divisor`` (``what``
    says where the divisor comes from). A top-level ``"mask"`` leaf must be boolean, with
    a shape that leads the batch's: ``(batch,)``, or ``(batch, seq)`` leading the shape of
    another leaf; a host (NumPy) mask must have a True entry (a device mask is not read
    back, which would wait for the device). A step checks the first batch of each
    structure (``batch_structure``), and the mask's values (``check_mask_has_examples``)
    on every batch. ``flat``: ``batch_leaves(batch)``, walked before (a step walks a batch
    once).
    """
    flat = batch_leaves(batch) if flat is None else flat
    mask_left = isinstance(batch, dict) and MASK_KEY in batch  # until checked, once
    if mask_left:
        # The mask is checked against the other leaves' size first, with its own
        # message; where they give no one size, against the batch's, below.
        mask_key = jax.tree_util.DictKey(MASK_KEY)
        rest = check_leaves([(k, x) for k, x in flat if k[0] != mask_key], arrays_only=True)
        sizes = {shape[0] for _, shape in rest if shape}
        if len(sizes) == 1:
            _check_mask(batch, *sizes, rest, flat)
            mask_left = False
    leaves = check_leaves(flat, dims=(0,), arrays_only=True)
    if not leaves:
        raise ValueError(f"the train step: the batch has no array leaves, got {batch!r}")
    for path, shape in leaves:
        if not shape:
            raise ValueError(
                f"the train step: batch leaf {path or '<root>'!r} is a scalar; every batch "
                f"leaf needs a leading batch dimension (leaf shapes: {dict(leaves)})"
                + (_KEY_HINT if path in _key_paths(batch) else "")
            )
    size = leaves[0][1][0]
    if mask_left:
        _check_mask(batch, size, rest, flat)
    if size % divisor:
        fit = -(-size // divisor) * divisor
        raise ValueError(
            f"global batch {size} is not divisible by {what}. Use a batch size that is a "
            f"multiple of {divisor}, drop the last {size % divisor} examples, or pad to {fit} "
            f"and add a boolean {MASK_KEY!r} leaf (True for real examples) so the padding "
            "does not count"
        )
    return size


_KEY_HINT = (
    ". A random key in the batch needs one per example: jax.random.split(key, batch_size) "
    "gives keys that travel with their rows, so 1 or N devices and any accumulation draw "
    "the same; or take loss_fn's 'rng' (one key per example) or 'step_rng' (one per step)"
)


def _key_paths(batch: Any) -> set[str]:
    """The paths (as ``check_leaves`` names them) of the typed-key leaves."""
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    return {path_str(p) for p, x in flat if is_key(x)}


def _check_mask(batch: dict, size: int, rest: list, flat: Leaves) -> None:
    """``batch``'s mask against ``size`` and ``rest``, the other leaves' (path, shape)."""
    mask = batch[MASK_KEY]
    shape = tuple(np.shape(mask))
    others = [shape for _, shape in rest]
    leads = len(shape) == 1 or any(other[: len(shape)] == shape for other in others)
    dtype = getattr(mask, "dtype", None)
    got = (
        f"dtype {dtype} and shape {shape}"
        if dtype is not None
        else f"a {type(mask).__name__} of shape {shape} (pass np.asarray(...) of it)"
    )
    if dtype is None or np.dtype(dtype) != np.bool_ or not shape or shape[0] != size or not leads:
        raise ValueError(
            f"batch[{MASK_KEY!r}] must be a boolean array whose shape leads the batch's: "
            f"(batch,) = ({size},), True for real examples, or (batch, seq) leading the shape "
            f"of another leaf, True for real tokens; got {got} "
            f"(leaf shapes: {shapes_text(check_leaves(flat))})"
        )
    check_mask_has_examples(batch)


def check_mask_has_examples(batch: Any) -> None:
    """Refuses a host (NumPy) ``batch["mask"]`` that is all False: a batch of padding only,
    whose loss would read 0.0 with no gradient. Values, not structure: a step runs it on
    every batch (one pass over the mask's booleans, no device wait); a device mask is
    not read back.

    >>> check_mask_has_examples({"x": np.ones((2, 3)), "mask": np.array([True, False])})
    """
    mask = batch.get(MASK_KEY) if isinstance(batch, dict) else None
    if isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and not mask.any():
        raise ValueError(
            f"batch[{MASK_KEY!r}] is all False, shape {mask.shape}: the batch has no real "
            "example, so its loss would read 0.0 with no gradient. Leave such batches out "
            "of the data (a batch of padding only)"
        )


def batch_structure(batch: Any) -> Any:
    """What the batch checks and the batch's shardings depend on: its tree structure and
    each leaf's type, shape and dtype (not its values); None when the structure is not
    hashable. A step checks each new structure once and reuses the result.

    >>> batch_structure({"x": np.ones((2, 3))}) == batch_structure({"x": np.zeros((2, 3))})
    True
    """
    leaves, treedef = jax.tree.flatten(batch)
    try:
        hash(treedef)
    except TypeError:
        return None
    return treedef, tuple(
        (type(x), getattr(x, "shape", None), str(getattr(x, "dtype", None))) for x in leaves
    )


def split_microbatches(batch: Any, k: int) -> Any:
    """Leaves ``(b, ...)`` to ``(k, b // k, ...)``; microbatch ``j`` holds the examples
    ``i`` with ``i % k == j``, so each stays spread over the devices that hold the batch."""
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), batch)
