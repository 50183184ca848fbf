"""The one byte formatter of shardax's reports (the plan's ``describe``, the cost
estimate, the auto search). It imports nothing from shardax, so every layer may use it.

>>> format_bytes(1536), format_bytes(3 * 2**40)
('1.50 KiB', '3.00 TiB')
"""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``: bytes in binary units, two decimals above 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
