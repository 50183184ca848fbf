"""The formatting of shardax's reports (the plan's ``describe``, the cost estimate, the
auto search, ``verify``): bytes in binary units, a titled rich table, and a rich table as
plain text. It imports nothing from shardax, so every layer may use it.

>>> format_bytes(1536), format_bytes(3 * 2**40)
('1.50 KiB', '3.00 TiB')
"""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``: bytes in binary units, two decimals above 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def titled_table(title: str, **kwargs: Any) -> Table:
    """A rich ``Table`` at least as wide as its ``title``: rich wraps a title to the
    table's width, so a long title over narrow columns would print as several lines.

    >>> table = titled_table("a title longer than its one column")
    >>> table.add_column("n"); table.add_row("1")
    >>> rich_text(table, 80).splitlines()[0].strip()  # one line, not wrapped to "n"'s width
    'a title longer than its one column'
    """
    width = Text.from_markup(title).cell_len + 2  # as printed: markup out, wide glyphs 2
    return Table(title=title, **{**kwargs, "min_width": max(width, kwargs.get("min_width") or 0)})


def rich_text(renderable: Any, width: int) -> str:
    """``renderable`` (a rich table, or an object with ``__rich__``) printed as plain text
    ``width`` columns wide: the ``str()`` of every report."""
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False).print(renderable)
    return out.getvalue().rstrip()
