"""Which scheme ``impl="auto"`` takes: the bytes each sends per device, and the scores
all_gather and ulysses would hold.

>>> sent_bytes("ring", (1, 4096, 32, 128), (1, 4096, 8, 128), 4) / 2**20
24.0
"""

from __future__ import annotations

import logging

from shardax.checks import public
from shardax.parallel.context.checks import check_length

IMPLS: tuple[str, ...] = ("all_gather", "ring", "ulysses")
"""The context-parallel schemes; ``impl="auto"`` picks one with
[`choose_impl`][shardax.parallel.choose_impl]."""

SCORE_BYTES_LIMIT = 1 << 30
"""``impl="auto"`` takes the ring when the scores of all_gather / ulysses would exceed
this many bytes per device (they materialise ``H · T/C · S`` scores; the ring
``H · (T/C)²``)."""

_log = logging.getLogger("shardax")
_NAME = "sx.attention"


def sent_bytes(
    impl: str,
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    context: int,
    itemsize: int = 4,
    *,
    backward: bool = False,
) -> float:
    """Bytes one device sends for one call of scheme ``impl`` (forward, or forward and
    backward), from the global shapes q ``(B, T, H, D)`` and k ``(B, S, K, D)``:

    - all_gather: K and V gathered, ``2 (C-1)/C · B S K D``; backward reduce-scatters
      dK and dV, the same again;
    - ring: C-1 hops of a K/V block, ``2 (C-1)/C · B S K D``; backward sends K/V C-1
      hops and dK/dV C hops (home again), ``(4C-2)/C · B S K D``;
    - ulysses: all-to-all of q, k, v (kv heads repeated to H when ``K % C``) and the
      output, ``(C-1)/C² · B T D (2H + 2K')``; backward the same again.
    """
    (b, t, h, d), (_, s, kh, _) = q_shape, kv_shape
    c = context
    if c <= 1:
        return 0.0
    kv = b * s * kh * d * itemsize
    if impl == "all_gather":
        return 2 * (c - 1) / c * kv * (2 if backward else 1)
    if impl == "ring":
        return 2 * (c - 1) / c * kv + ((4 * c - 2) / c * kv if backward else 0)
    if impl == "ulysses":
        kh = kh if kh % c == 0 else h
        fwd = (c - 1) / c * b * (t // c) * d * (2 * h + 2 * kh) * itemsize
        return fwd * (2 if backward else 1)
    raise ValueError(f"sent_bytes: impl must be one of {list(IMPLS)}, got {impl!r}")


@public("sx.parallel.choose_impl")
def choose_impl(
    q_shape: tuple[int, ...],
    kv_shape: tuple[int, ...],
    context: int,
    itemsize: int = 4,
    *,
    score_limit: int = SCORE_BYTES_LIMIT,
) -> tuple[str, str]:
    """``(impl, reason)``: the scheme ``impl="auto"`` takes for global shapes q
    ``(B, T, H, D)``, k ``(B, S, K, D)`` over ``context`` devices, and why.

    The ring when all_gather's scores (``B H T/C S`` in fp32) would exceed
    ``score_limit`` bytes per device; otherwise the one that sends fewer bytes
    (``sent_bytes``), ulysses only when ``H % C == 0``.

    >>> choose_impl((1, 4096, 32, 128), (1, 4096, 8, 128), 4)[0]
    'all_gather'
    >>> choose_impl((1, 4096, 32, 128), (1, 4096, 32, 128), 4)[0]
    'ulysses'
    """
    (b, t, h, _), s = q_shape, kv_shape[1]
    if context <= 1:
        return "none", f"no context axis of size > 1 (C={context}): jax.nn.dot_product_attention"
    scores = b * h * (t // context) * s * 4
    if scores > score_limit:
        return "ring", (
            f"ring: all_gather/ulysses would hold {scores / 2**20:.0f} MiB of scores per device "
            f"(B·H·T/C·S, fp32) > {score_limit / 2**20:.0f} MiB; the ring holds (T/C)² blocks"
        )
    gather = sent_bytes("all_gather", q_shape, kv_shape, context, itemsize)
    if h % context:
        return "all_gather", (
            f"all_gather: heads {h} not divisible by C={context} (no ulysses); sends "
            f"{gather / 2**20:.2f} MiB per device like the ring, in one collective"
        )
    ulysses = sent_bytes("ulysses", q_shape, kv_shape, context, itemsize)
    if ulysses < gather:
        return "ulysses", (
            f"ulysses: sends {ulysses / 2**20:.2f} MiB per device vs all_gather's "
            f"{gather / 2**20:.2f} MiB (heads {h} divisible by C={context})"
        )
    return "all_gather", (
        f"all_gather: sends {gather / 2**20:.2f} MiB per device vs ulysses' "
        f"{ulysses / 2**20:.2f} MiB (few kv heads)"
    )


def pick_impl(impl, q_shape, kv_shape, c, itemsize, layout) -> str:
    (_, t, h, _), s = q_shape, kv_shape[1]
    check_length(t, s, c, layout)
    if impl == "auto":
        impl, reason = choose_impl(q_shape, kv_shape, c, itemsize)
        _log.info("%s: impl=%r: %s", _NAME, impl, reason)
    if impl == "ulysses" and h % c:
        raise ValueError(
            f"impl='ulysses' splits heads over the context axis, so heads must be "
            f"divisible by C={c}; got heads {h}. Use impl='ring' or 'all_gather'"
        )
    return impl
