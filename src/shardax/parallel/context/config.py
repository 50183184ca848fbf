"""The static part of one context-parallel call, shared by the schemes and the ring's
blocks."""

from __future__ import annotations

from typing import NamedTuple


class Config(NamedTuple):
    """The static part of one context-parallel call (hashable: custom_vjp's nondiff arg)."""

    axis: str
    size: int  # C, devices on the context axis
    causal: bool
    window: tuple[int, int] | None
    layout: str
    scale: float
    kernel: str = "auto"  # sx.attention's kernel= (shardax.parallel.fused)
