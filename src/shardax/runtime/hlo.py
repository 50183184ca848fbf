"""Collectives in compiled HLO text, and the bytes each device sends for them.

>>> hlo = "%ag = f32[64,16]{1,0} all-gather(f32[8,16]{1,0} %p), replica_groups=[1,8]<=[8]"
>>> [(c.op, c.bytes, c.group) for c in collectives(hlo)]
[('all-gather', 4096, 8)]
>>> collective_bytes(hlo)  # a ring all-gather sends (n - 1) / n of its output
3584.0
"""

from __future__ import annotations

import dataclasses
import math
import re

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(
    r"= (\(.*?\)|\S+) (" + "|".join(OPS) + r")(-start)?\((.*)$",
    re.MULTILINE,
)
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\})")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op: its name, the bytes of its result on one device, the number
    of devices in each of its groups, and its result's array shapes (several when XLA
    combined ops into one)."""

    op: str
    bytes: int
    group: int
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends, for ring algorithms over ``group`` devices:
        all-reduce ``2(n-1)/n·S``, all-gather and all-to-all ``(n-1)/n·S``,
        reduce-scatter ``(n-1)·S`` (its input is ``n·S``), collective-permute ``S``."""
        n, size = self.group, self.bytes
        if self.op == "collective-permute":
            return float(size)
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(self.op, (n - 1) / n)
        return factor * size


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each array type in ``text``, e.g. ``(f32[8,16], s32[])``."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _SHAPE.findall(text)
    ]


def collectives(hlo: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective of ``hlo`` (``compiled.as_text()``), in order.

    An async ``*-start`` op is counted once, by its result (the second half of its
    output tuple for all-gather and collective-permute, which carry their operand too).
    Groups left empty (``replica_groups={}``) span all ``num_devices``.
    """
    found = []
    for out, op, start, rest in _OP.findall(hlo):
        arrays = _arrays(out)
        if start and op in ("all-gather", "collective-permute") and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2 :]
        iota, listed = _GROUPS_IOTA.search(rest), _GROUPS_LIST.search(rest)
        if iota:
            group = int(iota.group(1).split(",")[-1])
        elif listed and listed.group(1) != "{}":
            group = listed.group(1).count(",") + 1
        else:
            group = num_devices or 1
        size = sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 4) for dtype, shape in arrays)
        found.append(Collective(op, size, group, tuple(shape for _, shape in arrays)))
    return found


def collective_bytes(hlo: str, num_devices: int | None = None) -> float:
    """Bytes one device sends per run of ``hlo``, summed over its collectives
    (:attr:`Collective.sent_bytes`)."""
    return sum(c.sent_bytes for c in collectives(hlo, num_devices))
