"""The partitioner's "involuntary full rematerializations", each with the user's line.

When XLA's SPMD partitioner cannot move an array from one sharding to another by an
all-to-all or a slice, it replicates the whole array on every device and partitions it
again, and says so only in a C++ log line (``spmd_partitioner.cc``: "Involuntary full
rematerialization. The compiler cannot go from sharding {...} to {...} ... for HLO
operation %add.2 = f32[8,16,4] add(...), metadata={... stack_frame_id=2}"), written to
the process's file descriptor 2, which Python never sees. ``stderr_captured`` holds fd 2
in a file around a compile (and writes it back after, so nothing is lost);
``rematerializations`` reads the lines into ``Reshard`` rows: the op's user line (from the
compiled module's stack frames: the partitioner's module shares them), the two shardings
as ``PartitionSpec`` text (XLA:CPU 0.10's device tiles, or 0.12's named meshes), the
array's full bytes and what one device receives to rebuild it, and a suggestion. A line
about a ``fake_parameter`` is left out: the dot's partitioner logs it while it prices a
strategy on a scratch computation, and may not take it (XLA:CPU 0.12, the GPT's
attention under fsdp+tp).

>>> from types import SimpleNamespace as NS
>>> mesh = NS(shape={"x": 4, "y": 2}, axis_names=("x", "y"))
>>> log = ("W1202 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. "
...        "The compiler cannot go from sharding {devices=[2,1,4]<=[4,2]T(1,0)} to "
...        "{devices=[1,8,1]<=[8]} efficiently for HLO operation %add.2 = f32[8,16,4]{2,1,0} "
...        'add(%p, %q), metadata={op_name="jit(f)/add" stack_frame_id=2}. As the last resort')
>>> (r,) = rematerializations(log, mesh)
>>> r.before, r.after, r.shape, r.bytes
("P('y', None, 'x')", "P(None, ('x', 'y'), None)", (16, 16, 16), 16384)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from shardax.cost.hlo.program import DTYPE_BYTES, arrays
from shardax.cost.reshards import Reshard
from shardax.cost.sources import Lowered, Sources, nearest

OP = "full rematerialization"
"""The ``Reshard.op`` of a row of this module."""
_LINE = re.compile(
    r"Involuntary full rematerialization\. The compiler (?:cannot go|was not able to go) "
    r"from sharding (.+?) to (.+?) (?:efficiently|without doing)"
    r"(?:.*?for HLO operation:? (%[\w.\-]+ = .*?))?(?:\. (?:As the last resort|You probably)|$)",
    re.MULTILINE,
)
_NAMED = re.compile(r"^\{@?\w*\[.*?\],\s*\[(.*?)\]")
_TILE = re.compile(r"devices=\[([\d,]+)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,]+))")
_LAST_DIMS = re.compile(r"last_tile_dims=\{([^}]*)\}")
_NAME = re.compile(r"%([\w.\-]+) =")


@contextlib.contextmanager
def stderr_captured() -> Iterator[list[str]]:
    """Holds file descriptor 2 (where XLA's C++ logs go) in a file while the block runs;
    after it, appends the text to the yielded list and writes it back to fd 2.

    >>> with stderr_captured() as text:
    ...     _ = os.write(2, b"")
    >>> text
    ['']
    """
    out: list[str] = []
    with _HOLDING, contextlib.ExitStack() as stack:  # fd 2 is the process's: one at a time
        try:
            held = stack.enter_context(tempfile.TemporaryFile())
            saved = os.dup(2)
        except OSError:  # no stderr (closed), or no room for the file: nothing captured
            held = None
        if held is None:
            out.append("")
            yield out
            return
        if sys.stderr is not None:
            sys.stderr.flush()
        os.dup2(held.fileno(), 2)
        try:
            yield out
        finally:
            if sys.stderr is not None:
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            data = held.read()
            view = memoryview(data)
            with contextlib.suppress(OSError):  # a closed pipe (| head) loses the echo only
                while view:  # written back: the user still sees XLA's own words
                    view = view[os.write(2, view) :]
            out.append(data.decode(errors="replace"))


_HOLDING = threading.RLock()


def _entry(axes: tuple[str, ...]) -> str:
    if not axes:
        return "None"
    return repr(axes[0]) if len(axes) == 1 else repr(axes)


def _tiles(text: str, mesh: Any, rank: int) -> list[tuple[str, ...]] | None:
    """The mesh axes along each of ``rank`` dimensions of an HLO tile sharding
    (``devices=[2,1,4]<=[4,2]T(1,0)``, devices in ``mesh.devices.flat`` order)."""
    found = _TILE.search(text)
    names = tuple(mesh.axis_names)
    sizes = [int(mesh.shape[a]) for a in names]
    if not found:
        return None
    tile = [int(d) for d in found.group(1).split(",")]
    if found.group(4):
        ids = np.array([int(d) for d in found.group(4).split(",")])
    else:
        ids = np.arange(math.prod(tile)).reshape([int(d) for d in found.group(2).split(",")])
        if found.group(3):
            ids = ids.transpose([int(d) for d in found.group(3).split(",")])
    if ids.size != math.prod(tile) or ids.size != math.prod(sizes):
        return None
    ids = ids.reshape(tile)
    coords = np.array(np.unravel_index(ids, sizes))  # (axes, *tile)
    out = []
    for d in range(min(rank, len(tile))):
        along = np.moveaxis(coords, d + 1, 1).reshape(len(names), tile[d], -1)[:, :, 0]
        first = {}  # axis -> the first step along d at which its coordinate changes
        for a in range(len(names)):
            changes = np.nonzero(along[a] != along[a, 0])[0]
            if changes.size:
                first[a] = int(changes[0])
        out.append(tuple(names[a] for a in sorted(first, key=lambda a: -first[a])))
    return out + [()] * (rank - len(out))


def spec_of(text: str, mesh: Any, rank: int) -> tuple[str, list[int]]:
    """An HLO sharding as ``PartitionSpec`` text over ``rank`` dimensions, and the shards
    along each (the text itself where it is neither tiles nor a named mesh's).

    >>> from types import SimpleNamespace as NS
    >>> mesh = NS(shape={"x": 4, "y": 2}, axis_names=("x", "y"))
    >>> spec_of("{mesh['x'=4,'y'=2], [{'y'}, {}, {'x'}]}", mesh, 3)
    ("P('y', None, 'x')", [2, 1, 4])
    """
    sizes = {str(k): int(v) for k, v in mesh.shape.items()}
    named = _NAMED.search(text)
    if named:
        dims = [tuple(re.findall(r"'([^']*)'", d)) for d in re.findall(r"\{([^}]*)\}", named[1])]
    elif text.strip("{} ") == "replicated":
        dims = [()] * rank
    else:
        dims = _tiles(text, mesh, rank) or []
        if not dims:
            return text, [1] * rank
    dims = (dims + [()] * rank)[:rank]
    ways = [math.prod(sizes.get(a, 1) for a in d) for d in dims]
    return f"P({', '.join(_entry(d) for d in dims)})", ways


def _suggest(before: str, after: str, made: str, asked: str) -> str:
    where = f"at {asked}" if asked and asked != made else "where the value is used"
    at = f"at {made}" if made else "that makes it"
    return (
        f"the partitioner replicates the whole array to go from {before} to {after}: "
        f"make the value {at} in {after} already (sx.constrain the op's inputs, or a rule "
        f"for the weight it comes from), or ask {where} for a layout one all-to-all "
        f"reaches from {before} (the same axes, one dimension moved)"
    )


def rematerializations(
    log: str, mesh: Any, sources: Sources | None = None, lowered: Lowered | None = None
) -> list[Reshard]:
    """A ``Reshard`` row (op ``OP``) per distinct full rematerialization the partitioner
    logged in ``log`` (see the module), on ``mesh``. The op's line: from ``lowered`` (the
    step's lowered module: the op of that name stack and global shape), else by the log's
    frame id in the compiled module's ``sources`` (XLA:GPU numbers them anew). A row whose
    op is in a function with a sharding constraint is named at the nearest (the layout
    asked for is set there), the op's own line kept in ``made``."""
    sources = sources or Sources({})
    axes_all = tuple(a for a in mesh.axis_names if int(mesh.shape[a]) > 1)
    seen, out = set(), []
    for found in _LINE.finditer(log):
        old, new, op = found.group(1), found.group(2), found.group(3) or ""
        key = (old, new, op.split(",", 1)[0])
        if key in seen or op.startswith("%fake_parameter"):
            continue  # a fake parameter: a strategy the dot's partitioner tried, not taken
        seen.add(key)
        head = op.split(")", 1)[0]
        dtype, local = (arrays(head) or [("", ())])[0]
        before, ways = spec_of(old, mesh, len(local))
        after, _ = spec_of(new, mesh, len(local))
        shape = tuple(n * w for n, w in zip(local, ways, strict=True))
        full = math.prod(shape) * DTYPE_BYTES.get(dtype, 4) if shape else 0
        part = math.prod(local) * DTYPE_BYTES.get(dtype, 4) if local else 0
        what = re.search(r'op_name="((?:[^"\\]|\\.)*)"', op)
        raw = what.group(1) if what else ""
        stack = raw.replace("\\'", "'")
        frame = lowered.frame(raw, shape) if lowered is not None else None
        frame = frame or sources.frame(op, tools=True)
        made = f"{frame[0]}:{frame[1]}" if frame else ""
        asked = nearest(frame, lowered.constraints() if lowered is not None else [])
        axes = tuple(a for a in axes_all if f"'{a}'" in before + after) or axes_all
        name = _NAME.search(op)
        out.append(
            Reshard(
                OP,
                axes,
                full,
                float(full - part),
                1,
                shape,
                dtype,
                asked or made,
                stack,
                before,
                after,
                "",
                _suggest(before, after, made, asked),
                name.group(1) if name else "",
                made if asked else "",
            )
        )
    return out


CARRIERS = ("all-gather", "all-reduce")
"""The collectives XLA rebuilds a rematerialized array with (the partitioner replicates it
by an all-gather of its full shape, or by a zero-padded all-reduce where a dimension is
smaller than its split); an async ``*-start`` row already carries its base op
(``collectives_explained``)."""


def _phase(what: str) -> int:
    """How deep in the backward pass an op's name stack is (``transpose(`` count)."""
    return what.count("transpose(")


def absorb(remats: tuple[Reshard, ...], collectives: tuple[Reshard, ...]) -> tuple[Reshard, ...]:
    """``remats`` each with the unasked collective that carries it folded in, then the
    other ``collectives``: one row per cause. The HLO lists the gather that rebuilds a
    rematerialized array as a collective of its own, so counted apart its bytes showed
    twice. A carrier has the array's full shape and dtype and spans no other mesh axes
    (one in the same pass, forward or backward, first); the row takes its bytes sent and
    its runs (a gather in a loop runs each trip). A remat with no carrier keeps the log's
    figures.

    >>> row = ("x",), 64, 48.0, 1, (4, 4), "f32", "a.py:3", "jit(f)/tanh", "", ""
    >>> remat, gather = Reshard(OP, *row), dataclasses.replace(Reshard("all-gather", *row), runs=3)
    >>> [(r.op, r.runs, r.sent_bytes) for r in absorb((remat,), (gather,))]
    [('full rematerialization', 3, 48.0)]
    """
    left, out = list(collectives), []
    for remat in remats:
        fits = [
            c
            for c in left
            if c.op in CARRIERS
            and not c.implied
            and (c.shape, c.dtype) == (remat.shape, remat.dtype)
            and set(c.axes) <= set(remat.axes)
        ]
        fits.sort(key=lambda c: _phase(c.what) != _phase(remat.what))  # stable: HLO order
        if not fits:
            out.append(remat)
            continue
        left.remove(fits[0])
        out.append(dataclasses.replace(remat, sent_bytes=fits[0].sent_bytes, runs=fits[0].runs))
    return (*out, *left)
