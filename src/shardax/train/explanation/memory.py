"""The step's memory at its compiled peak, in the user's words: the step compiled once with
XLA's dump of the optimized module, its live buffers at the peak named (``PeakBuffers``)
and printed as a table, for ``sx.explain`` and for a live step that ran out of memory
(``out_of_memory_note``, which ``step(state, batch)`` adds to XLA's ``RESOURCE_EXHAUSTED``).

>>> mesh = sx.make_mesh({"data": 8})
>>> state = sx.TrainState.from_params({"w": jnp.zeros((256, 64))},
...                                   lambda p, x: x @ p["w"], optax.adam(1e-3))
>>> step = sx.make_train_step(lambda m, b: jnp.mean(m(b["x"]) ** 2), mesh=mesh,
...                           plan=sx.fsdp(mesh))
>>> program = compile_step(step, state, {"x": jnp.zeros((64, 256))})
>>> program.memory().peak_bytes > 0
True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardax._format import format_bytes, rich_text, titled_table
from shardax.cost.accounting import abstract_tree, check_axes, mesh_of
from shardax.cost.buffers import COVERAGE, PeakBuffers, compile_dumped, input_kind, peak_buffers
from shardax.cost.estimation import analyse
from shardax.cost.remats import stderr_captured
from shardax.cost.report import HEADROOM, Estimate
from shardax.cost.sources import Lowered, Sources
from shardax.plan.tree import is_array


def fits(peak: float, budget: float | None) -> bool | None:
    """The peak fits ``budget`` with ``HEADROOM`` to spare (None: no budget)."""
    return None if not budget else peak <= (1 - HEADROOM) * budget


def param_shapes(state: Any, shardings: Any) -> set[tuple[int, ...]]:
    """The parameters' shapes with each dimension whole or split as placed (global,
    per-device, gathered over some axes), a stacked (scanned) leaf's layer shape, each in
    every order of its dimensions."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(state) if is_array(x)]
    flat = [s for s in jax.tree.leaves(shardings) if hasattr(s, "shard_shape")]
    if len(flat) != len(leaves):
        flat = [getattr(x, "sharding", None) for _, x in leaves]
    out: set[tuple[int, ...]] = set()
    for (path, leaf), sharding in zip(leaves, flat, strict=True):
        kind = input_kind("state" + jax.tree_util.keystr(path))
        if kind not in ("parameter", "optimizer state") or len(np.shape(leaf)) == 0:
            continue
        shape = tuple(np.shape(leaf))
        local = shape
        if sharding is not None and hasattr(sharding, "shard_shape"):
            local = tuple(sharding.shard_shape(shape))
        # gathered over some of its axes: each dimension whole or split
        shapes = set(itertools.product(*({g, n} for g, n in zip(shape, local, strict=True))))
        shapes |= {s[1:] for s in shapes if len(s) > 1}
        # XLA lays a weight out as it likes (a GPU's all-gather of (heads, k, d) as (d, k,
        # heads)): every order of its dimensions, up to rank 4
        out |= {p for s in shapes if len(s) <= 4 for p in itertools.permutations(s)} | shapes
    return {s for s in out if math.prod(s) > 1}


def split_shapes(state: Any, shardings: Any) -> set[tuple[int, ...]]:
    """The per-device shapes of the parameters the plan splits (smaller than their own),
    each in every order of its dimensions (up to rank 4)."""
    leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(state) if is_array(x)]
    flat = [s for s in jax.tree.leaves(shardings) if hasattr(s, "shard_shape")]
    if len(flat) != len(leaves):
        return set()
    out: set[tuple[int, ...]] = set()
    for (path, leaf), sharding in zip(leaves, flat, strict=True):
        if input_kind("state" + jax.tree_util.keystr(path)) != "parameter":
            continue
        shape = tuple(np.shape(leaf))
        local = tuple(sharding.shard_shape(shape))
        if local != shape and len(local) <= 4:
            out |= set(itertools.permutations(local))
    return out


def _unplaced(leaf: Any) -> Any:
    """A batch leaf's abstract value without a one-device sharding (the step places it)."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(leaf, jax.ShapeDtypeStruct) and not isinstance(sharding, NamedSharding):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return leaf


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A step compiled once with XLA's dump: its abstract ``state`` and ``batch``, ``mesh``,
    the executable, its ``HloLiveRange`` text (``""``: none written), the state's input
    shardings, the step's analysis (``sx.estimate``'s ``Estimate``), what the compile
    wrote to fd 2 (``log``: the partitioner's C++ warnings) and the lowered module's own
    lines (``lowered``: its sharding constraints, the ops the log names)."""

    state: Any
    batch: Any
    mesh: Any
    compiled: Any
    live: str
    shardings: Any
    estimate: Estimate
    log: str = ""
    lowered: Lowered | None = None

    @property
    def peak_bytes(self) -> int:
        """The compiler's peak bytes per device (``memory_analysis()``)."""
        return int(self.estimate.memory["peak"])

    @property
    def budget(self) -> float | None:
        """The device's memory budget, else its HBM (None: unknown, as on a CPU)."""
        return self.estimate.memory_budget or self.estimate.hbm_bytes

    @property
    def sources(self) -> Sources:
        """The module's stack frames (the user's lines)."""
        return Sources.of(self.compiled)

    def split_shapes(self) -> set[tuple[int, ...]]:
        """The split parameters' per-device shapes, as ``split_shapes`` gives them."""
        return split_shapes(self.state, self.shardings)

    def param_shapes(self) -> set[tuple[int, ...]]:
        """The parameters' shapes as ``param_shapes`` gives them."""
        return param_shapes(self.state, self.shardings)

    def memory(
        self, coverage: float = COVERAGE, sources: Sources | None = None
    ) -> PeakBuffers | None:
        """The buffers live at the peak (None: the backend wrote no live-range dump)."""
        if not self.live:
            return None
        return peak_buffers(
            self.compiled.as_text(),
            self.live,
            sources or self.sources,
            coverage,
            self.param_shapes(),
        )


def compile_step(step: Any, state: Any, batch: Any) -> CompiledStep:
    """``step(state, batch)`` (abstract values suffice, on live devices or a ``sx.target``)
    compiled once with XLA's dump of the optimized module."""
    if not hasattr(step, "lower"):
        raise TypeError(
            f"step must be a make_train_step step or a jax.jit function (with "
            f".lower), got {type(step).__name__}"
        )
    state, batch = abstract_tree(state), jax.tree.map(_unplaced, abstract_tree(batch))
    mesh = mesh_of(step, jax.tree.leaves((state, batch)))
    check_axes(state, mesh, "state")
    check_axes(batch, mesh, "batch")
    if hasattr(step, "abstract"):
        state = step.abstract(state)
    lowered = step.lower(state, batch)
    with stderr_captured() as log:  # the partitioner's rematerializations: C++ log lines
        compiled, live = compile_dumped(lowered)
    own = Lowered.of(lowered)
    try:
        shardings = compiled.input_shardings[0][0]
    except (AttributeError, IndexError, TypeError):
        shardings = None
    report = analyse(compiled, mesh, state=state, shardings=shardings, batch=batch)
    return CompiledStep(state, batch, mesh, compiled, live, shardings, report, log[0], own)


def memory_table(memory: PeakBuffers, peak: int, budget: float | None, fit: bool | None) -> Any:
    """The table of the buffers live at the peak."""
    verdict = "" if fit is None else (", fits" if fit else ", [red]does not fit[/]")
    room = "" if not budget else f" of a {format_bytes(budget)} budget{verdict}"
    table = titled_table(
        f"memory at the peak: {format_bytes(peak)} per device{room} (at "
        f"{memory.at}, {memory.phase} pass)"
    )
    for col in ("bytes", "array", "what", "is"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    table.add_column("your line", no_wrap=True)  # a path is kept whole, on one line
    for b in memory.buffers:
        table.add_row(
            format_bytes(b.bytes), f"{b.dtype}{list(b.shape)}", b.what, b.kind, b.source or "-"
        )
    kinds = ", ".join(
        f"{k} {format_bytes(v)}" for k, v in sorted(memory.by_kind().items(), key=lambda kv: -kv[1])
    )
    table.caption = (
        f"{len(memory.buffers)} buffers cover "
        f"{1 - memory.rest_bytes / max(memory.peak_bytes, 1):.0%} of the heap's "
        f"{format_bytes(memory.peak_bytes)} ({memory.rest} smaller left out): "
        f"{kinds}"
    )
    return table


def is_out_of_memory(error: BaseException) -> bool:
    """``error`` is XLA's ``RESOURCE_EXHAUSTED`` (an allocation that failed)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def out_of_memory_note(step: Any, state: Any, batch: Any) -> str:
    """The buffer table of ``step`` at its compiled peak, for a live run that ran out of
    memory (``RESOURCE_EXHAUSTED``); a line saying why where it cannot be made."""
    try:
        program = compile_step(step, state, batch)
        memory = program.memory()
    except Exception as e:  # never hide the allocator's error behind ours
        return f"shardax could not explain the step's memory: {type(e).__name__}: {e}"
    if memory is None:
        return "shardax: the backend gave no live-range dump to explain the peak"
    budget = program.budget
    table = memory_table(memory, program.peak_bytes, budget, fits(program.peak_bytes, budget))
    head = (
        "shardax: the step's buffers at its compiled peak (sx.explain(step, state, batch, "
        "fixes=True) proposes fixes, each compiled):"
    )
    return head + "\n" + rich_text(table, width=140)
