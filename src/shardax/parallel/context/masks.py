"""Which keys each query sees, from true positions: the boolean mask of the causal mask,
the window and the segments, and whether a part of a block sees any key of another.

>>> pos = jnp.arange(4)
>>> attention_mask(pos, pos, None, None, causal=True, window=None)[0].astype(int).tolist()
[[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
"""

from __future__ import annotations

from typing import Any

import jax

from shardax.parallel.context.config import Config


def attention_mask(
    qpos: jax.Array,
    kpos: jax.Array,
    qseg: jax.Array | None,
    kseg: jax.Array | None,
    causal: bool,
    window: tuple[int, int] | None,
) -> jax.Array | None:
    """``(B or 1, T, S)`` boolean: which key each query sees, from true positions."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        mask = both(mask, kpos[None, :] <= qpos[:, None])
    if window is not None:
        left, right = window
        diff = qpos[:, None] - kpos[None, :]
        mask = both(mask, (diff <= left) & (diff >= -right))
    if mask is not None:
        mask = mask[None]
    if qseg is not None:
        mask = both(mask, qseg[:, :, None] == kseg[:, None, :])
    return mask


def parts_visible(cfg: Config, qpos: jax.Array, kpos: jax.Array) -> Any:
    """Whether the causal mask and the window let any query of a part (a contiguous run
    of positions ``qpos``) see any key of another (``kpos``); True without them."""
    visible: Any = True
    if cfg.causal:
        visible = kpos[0] <= qpos[-1]
    if cfg.window is not None:
        left, right = cfg.window
        near = (qpos[0] - kpos[-1] <= left) & (qpos[-1] - kpos[0] >= -right)
        visible = near if visible is True else visible & near
    return visible
