"""Where a compiled instruction came from: the user's file and line, read from the HLO.

JAX records each op's traceback in the module it lowers (HLO's ``stack_frame_index``:
file names, function names, locations and frames, each frame pointing to its caller),
and each instruction's metadata names its innermost frame (``stack_frame_id=N``) beside
its name stack (``op_name``). XLA keeps both through optimization, so an instruction of
the compiled program, a fusion or a collective the partitioner inserted, still names the
line of the model that made it. ``Sources`` reads the table from the compiled module
(``compiled.runtime_executable().hlo_modules()``, its serialized ``HloModuleProto``) and
answers, for a frame id, the innermost frame of the user's code: not shardax's own (its
reference models excepted) nor an installed library's (flax, equinox, optax: JAX drops
its own frames itself). Older JAX without the table wrote ``source_file``/``source_line``
in the metadata; those are read too. ``Lowered`` reads a lowered step's module the same
way: its sharding constraints' lines, and the ops XLA's partitioner names in its log, found
by name stack and shape (XLA:GPU numbers the frames anew: the log's ids match no table).

>>> src = Sources({1: ("model.py", 12, "__call__", 0)})
>>> src.line('%d = f32[8]{0} dot(...), metadata={op_name="jit(f)/dot" stack_frame_id=1}')
'model.py:12'
"""

from __future__ import annotations

import os
import re
import sysconfig
from typing import Any

_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
_SOURCE = re.compile(r'source_file="([^"]*)"(?: source_line=(\d+))?')
_SHARDAX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODELS = os.path.join(_SHARDAX, "models")
_TOOLS = tuple(os.path.join(_SHARDAX, d) for d in ("plan", "parallel", "checks.py"))
_CONSTRAINT = re.compile(
    r'custom_call_target="Sharding"|op_name="[^"]*(?:sharding_constraint|reshard)"'
)
_LIBRARIES = tuple(
    {p for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")) if p}
)
_STACK_FRAME_INDEX = 17  # HloModuleProto.stack_frame_index


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _fields(data: bytes) -> list[tuple[int, Any]]:
    """``(field number, value)`` of one protobuf message: ints, or bytes for a
    length-delimited field (a string or a nested message)."""
    i, out = 0, []
    while i < len(data):
        key, i = _varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(data, i)
        elif wire == 2:
            size, i = _varint(data, i)
            value, i = data[i : i + size], i + size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, i = data[i : i + width], i + width
        else:  # groups: not in HloModuleProto
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def frame_table(module_proto: bytes) -> dict[int, tuple[str, int, str, int]]:
    """``{frame id: (file, line, function, parent frame id)}`` of a serialized
    ``HloModuleProto`` (ids from 1; a parent of 0 is the outermost frame)."""
    index = [v for n, v in _fields(module_proto) if n == _STACK_FRAME_INDEX]
    if not index:
        return {}
    parts = _fields(index[0])
    files = [v.decode(errors="replace") for n, v in parts if n == 1]
    functions = [v.decode(errors="replace") for n, v in parts if n == 2]
    locations = [dict(_fields(v)) for n, v in parts if n == 3]
    table = {}
    frames = [dict(_fields(v)) for n, v in parts if n == 4]
    for i, frame in enumerate(frames, start=1):
        loc = locations[frame.get(1, 1) - 1] if 0 < frame.get(1, 0) <= len(locations) else {}
        file = files[loc[1] - 1] if 0 < loc.get(1, 0) <= len(files) else ""
        function = functions[loc[2] - 1] if 0 < loc.get(2, 0) <= len(functions) else ""
        table[i] = (file, int(loc.get(3, 0)), function, int(frame.get(2, 0)))
    return table


def is_shardax_file(path: str) -> bool:
    """Whether ``path`` is shardax's own code (its reference models excepted)."""
    path = os.path.abspath(path) if path else ""
    return path.startswith(_SHARDAX) and not path.startswith(_MODELS)


def is_user_file(path: str) -> bool:
    """Whether ``path`` is the user's code: not shardax's own (its reference models are
    the user's templates, so they count) nor an installed library's."""
    path = os.path.abspath(path) if path else ""
    if not path:
        return False
    if path.startswith(_MODELS):
        return True
    return not path.startswith(_SHARDAX) and not path.startswith(_LIBRARIES)


class Sources:
    """The user's line of each instruction of one compiled module (see the module)."""

    def __init__(self, frames: dict[int, tuple[str, int, str, int]]) -> None:
        self.frames = frames

    @classmethod
    def of(cls, compiled: Any) -> Sources:
        """The frame table of a compiled program (empty where the backend does not give
        its module)."""
        try:
            module = compiled.runtime_executable().hlo_modules()[0]
            return cls(frame_table(module.as_serialized_hlo_module_proto()))
        except Exception:  # a backend without the modules: lines from metadata only
            return cls({})

    def stack(self, frame_id: int) -> list[tuple[str, int, str]]:
        """``(file, line, function)`` from the innermost frame out."""
        out, seen = [], set()
        while frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            file, line, function, parent = self.frames[frame_id]
            out.append((file, line, function))
            frame_id = parent
        return out

    def frame(self, hlo_line: str, tools: bool = False) -> tuple[str, int, str] | None:
        """``(file, line, function)`` of the user's innermost frame of one HLO instruction
        line (None: as ``line`` gives ``""``); ``tools``: shardax's in-model tools
        (``sx.constrain`` and its door, ``parallel``) called innermost are skipped, to the
        user's call."""
        found = _FRAME_ID.search(hlo_line)
        if not found:
            return None
        leading = True
        for file, line, function in self.stack(int(found.group(1))):
            if is_user_file(file):
                return file, line, function
            if tools and leading and os.path.abspath(file).startswith(_TOOLS):
                continue
            leading = False
            if is_shardax_file(file):
                return None
        return None

    def line(self, hlo_line: str) -> str:
        """``file:line`` of the user's innermost frame of one HLO instruction line, ``""``
        where none comes before shardax's own (an op of shardax's step, as the optimizer
        update: the user's frames beyond are where they called the step)."""
        found = _FRAME_ID.search(hlo_line)
        if found:
            for file, line, _ in self.stack(int(found.group(1))):
                if is_user_file(file):
                    return f"{file}:{line}"
                if is_shardax_file(file):  # the frames beyond are the step's call site
                    return ""
            return ""
        old = _SOURCE.search(hlo_line)
        if old and old.group(1):
            return f"{old.group(1)}:{old.group(2) or '?'}"
        return ""


_LOWERED_OP = re.compile(
    r"^\s*(?:ROOT )?[\w.\-]+ = \w+\[([\d,]*)\]\S* ([\w\-]+)\(.*?"
    r'op_name="((?:[^"\\]|\\.)*)" stack_frame_id=(\d+)'
)


class Lowered:
    """A lowered step's own frames (before the compiler numbers them anew): its sharding
    constraints' user lines, and an op's user line by its name stack and global shape
    (what the partitioner's log gives of an op)."""

    def __init__(self, sources: Sources, ops: list[tuple[str, tuple[int, ...], int, str]]) -> None:
        self.sources, self.ops = sources, ops  # (op_name, shape, frame id, line)

    @classmethod
    def of(cls, lowered: Any) -> Lowered:
        """From ``step.lower(...)`` (empty where JAX gives no HLO view of it)."""
        try:
            hlo = lowered.as_text(dialect="hlo", debug_info=True)
            proto = lowered.compiler_ir("hlo").as_serialized_hlo_module_proto()
        except Exception:  # a lowering without an HLO view: no lines from it
            return cls(Sources({}), [])
        ops = []
        for line in hlo.splitlines():
            found = _LOWERED_OP.search(line)
            if found:
                shape = tuple(int(d) for d in found.group(1).split(",") if d)
                ops.append((found.group(3), shape, int(found.group(4)), line))
        return cls(Sources(frame_table(proto)), ops)

    def constraints(self) -> list[tuple[str, int, str]]:
        """The user's ``(file, line, function)`` of each sharding constraint
        (``sx.constrain``, ``with_sharding_constraint``, ``reshard``)."""
        out = []
        for *_, line in self.ops:
            if _CONSTRAINT.search(line):
                frame = self.sources.frame(line, tools=True)
                if frame is not None and frame not in out:
                    out.append(frame)
        return out

    def frame(self, op_name: str, shape: tuple[int, ...]) -> tuple[str, int, str] | None:
        """The user's frame of the ops named ``op_name`` of global ``shape``, where they
        all have one (None: none, or several)."""
        frames = {
            self.sources.frame(line, tools=True)
            for name, s, _, line in self.ops
            if name == op_name and s == shape
        } - {None}
        return frames.pop() if len(frames) == 1 else None


def nearest(frame: tuple[str, int, str] | None, constraints: list[tuple[str, int, str]]) -> str:
    """``file:line`` of the constraint nearest ``frame``'s line in the same file and
    function (``""``: none there).

    >>> nearest(("m.py", 12, "f"), [("m.py", 13, "f"), ("m.py", 30, "g")])
    'm.py:13'
    """
    if frame is None:
        return ""
    same = [c for c in constraints if c[0] == frame[0] and c[2] == frame[2]]
    if not same:
        return ""
    file, line, _ = min(same, key=lambda c: abs(c[1] - frame[1]))
    return f"{file}:{line}"
