"""Model FLOPs by the common convention, and what a batch's rows are.

MFU divides a step's *model* FLOPs (the work the model needs, whatever the compiled
program does besides: recomputation, the masked half of attention) by the step time and
the peak. MaxText, PaLM and Megatron count them as ``CONVENTION`` says: ``6·N`` per
token for the matmuls over ``N`` parameters without the embedding lookup (a gather does
no matmul), the LM head included, plus attention's scores and weighted values with a
causal mask halved (``transformer_flops_per_token``).

Without ``model_flops=``, ``sx.estimate`` takes (``default_model_flops``):

- a batch of token ids (a 2-D integer leaf): ``6·N·tokens``, ``N`` without the lookup
  tables (``matmul_params``), attention not counted (pass ``model_flops=``);
- a batch of feature rows (no floating leaf above two dimensions): ``6·N·rows``, each
  weight used once per row as in an MLP;
- anything else (images, sequences of features): no formula, since a convolution or a
  recurrence reuses each weight at every position (``6·N·images`` was ~150× too low for a
  CNN); the compiled step's matmul FLOPs stand in, labelled so.

>>> batch_unit({"image": jax.ShapeDtypeStruct((8, 32, 32, 3), jnp.float32),
...             "label": jax.ShapeDtypeStruct((8,), jnp.int32)})
'images'
>>> batch_unit(jax.ShapeDtypeStruct((8, 1024), jnp.int32))
'tokens'
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

CONVENTION = (
    "6·N per token, N without the embedding lookup, the LM head included, attention "
    "causal-halved (MaxText, PaLM, Megatron)"
)
"""How model FLOPs are counted, stated in every ``sx.estimate`` report."""

_LOOKUP = re.compile(r"embed|\bwte\b|\bwpe\b|_emb\b", re.IGNORECASE)


def batch_unit(batch: Any) -> str:
    """What a batch's rows are: ``"tokens"`` (a 2-D integer leaf: token ids),
    ``"images"`` (its first leaf has four dimensions or more) or ``"rows"``."""
    leaves = [x for x in jax.tree.leaves(batch) if hasattr(x, "shape") and len(x.shape)]
    if any(len(x.shape) == 2 and np.issubdtype(np.dtype(x.dtype), np.integer) for x in leaves):
        return "tokens"
    if leaves and len(leaves[0].shape) >= 4:
        return "images"
    return "rows"


def matmul_params(params: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[int, dict[str, int]]:
    """``(N, lookups)``: the parameter count of ``params`` (``(path, shape)`` of each
    parameter leaf) without its embedding lookup tables, and those tables by path.

    A lookup table is a 2-D leaf whose path names an embedding (``embed``, ``wte``,
    ``wpe``, ``*_emb``). The largest is the token table: left out only where another leaf
    of its shape (or transposed) is a separate LM head; without one the table is the
    head too (tied embeddings), a matmul counted in ``N``.

    >>> matmul_params([("embed", (100, 8)), ("pos_embed", (16, 8)), ("mlp", (8, 8)),
    ...                ("head", (8, 100))])
    (864, {'embed': 800, 'pos_embed': 128})
    >>> matmul_params([("embed", (100, 8)), ("mlp", (8, 8))])  # tied: the head
    (864, {})
    """
    total = sum(math.prod(shape) for _, shape in params)
    tables = [(p, s) for p, s in params if len(s) == 2 and _LOOKUP.search(p)]
    lookups = {p: math.prod(s) for p, s in tables}
    if tables:
        path, shape = max(tables, key=lambda t: math.prod(t[1]))
        head = any(sorted(s) == sorted(shape) for p, s in params if p not in lookups)
        if not head:
            del lookups[path]
    return total - sum(lookups.values()), lookups


def default_model_flops(
    params: Sequence[tuple[str, tuple[int, ...]]],
    batch: Any,
    tokens: float,
    unit: str,
    executed: float,
) -> tuple[float, str, str]:
    """``(model FLOPs per step, short label, statement)`` where none were given:
    ``6·N·tokens`` (``N`` from ``matmul_params``), ``6·N·rows`` for feature rows, else
    ``executed`` (the compiled step's matmul FLOPs over all devices), labelled as such.

    >>> flops, label, _ = default_model_flops([("w", (4, 4))], None, 10.0, "rows", 0.0)
    >>> flops, label
    (960.0, '6·N·rows')
    >>> default_model_flops([("w", (3, 3, 3, 8))], None, 2.0, "images", 5e6)[:2]
    (5000000.0, 'unknown for images: the compiled matmul FLOPs')
    """
    n, lookups = matmul_params(params)
    leaves = [x for x in jax.tree.leaves(batch) if hasattr(x, "shape")]
    floating = [x for x in leaves if not np.issubdtype(np.dtype(x.dtype), np.integer)]
    if unit == "tokens" or (unit == "rows" and all(len(x.shape) <= 2 for x in floating)):
        left_out = (
            f" without the embedding lookup ({', '.join(f'{p} {v:,}' for p, v in lookups.items())})"
            if lookups
            else ""
        )
        attention = "; attention not counted: pass model_flops=" if unit == "tokens" else ""
        statement = f"model FLOPs: 6·N·{unit}, N = {n:,} parameters{left_out}{attention}"
        return 6.0 * n * tokens, f"6·N·{unit}", statement
    statement = (
        f"model FLOPs: unknown for {unit} (6·N·{unit} leaves out the reuse of each weight at "
        "every position, as a convolution's): the compiled step's matmul FLOPs stand in, so "
        "MFU here counts executed work; pass model_flops="
    )
    return float(executed), f"unknown for {unit}: the compiled matmul FLOPs", statement


__all__ = ["CONVENTION", "batch_unit", "default_model_flops", "matmul_params"]
