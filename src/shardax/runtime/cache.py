"""JAX's persistent compilation cache in one call, and where compile time goes.

[`compile_cache`][shardax.compile_cache] points JAX's persistent cache at a directory
(default: a per-user one, ``default_dir``) so a second start of the same program loads its
executables instead of compiling them. It is safe with many processes on a shared
filesystem: JAX writes cache entries from process 0 only (``jax.distributed``'s process
id; the others read), and each entry is written to a temporary file and renamed into
place, so a reader never sees half an entry. A cache configured already
(``JAX_COMPILATION_CACHE_DIR`` or ``jax_compilation_cache_dir``, e.g. by a test suite) is
kept when no directory is given.

[`compile_stats`][shardax.runtime.compile_stats] counts, through ``jax.monitoring``
listeners, the seconds spent tracing, lowering and compiling (a cache hit's compile is the
time to load it; nested spans counted once) and the persistent cache's requests, hits and
misses, since the process started counting.

>>> sx.runtime.compile_cache()  # ~/.cache/shardax/jax-compile, or $XDG_CACHE_HOME  # doctest: +SKIP
>>> before = sx.runtime.compile_stats()
>>> _ = jax.jit(lambda x: x * 3 + 1)(jnp.ones(5))
>>> spent = sx.runtime.compile_stats() - before
>>> spent.seconds > 0, spent.cache_hits + spent.cache_misses >= 0
(True, True)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from shardax.checks import as_path, public

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_CACHE_EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "cache_requests",
    "/jax/compilation_cache/cache_hits": "cache_hits",
    "/jax/compilation_cache/cache_misses": "cache_misses",
}


def default_dir() -> str:
    """The per-user cache directory: ``$XDG_CACHE_HOME/shardax/jax-compile`` (default
    ``~/.cache/shardax/jax-compile``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "shardax", "jax-compile")


def configured_dir() -> str | None:
    """The directory JAX's persistent cache uses already (config or environment), or None."""
    return jax.config.jax_compilation_cache_dir or os.environ.get(ENV_DIR) or None


@public("sx.compile_cache")
def compile_cache(
    directory: str | os.PathLike[str] | None = None, *, min_compile_seconds: float = 0.0
) -> str:
    """Turns JAX's persistent compilation cache on in ``directory`` and returns it.

    Args:
        directory: where the executables go. None: the directory JAX is configured with
            already, else ``default_dir``. Created if missing.
        min_compile_seconds: programs that compiled faster are not written (JAX's
            ``jax_persistent_cache_min_compile_time_secs``, whose own default is 1 s;
            0 caches every program, which is what a restarted run wants).

    Call it before the first compilation; a cache JAX initialized already with another
    directory is reset to this one.
    """
    if min_compile_seconds < 0:
        raise ValueError(f"min_compile_seconds must be >= 0, got {min_compile_seconds}")
    if directory is not None:
        as_path("directory", directory)
    path = os.path.abspath(
        os.fspath(directory) if directory is not None else configured_dir() or default_dir()
    )
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(
            f"directory must be a directory for the compiled programs, got {path}, which is a file"
        )
    os.makedirs(path, exist_ok=True)
    changed = jax.config.jax_compilation_cache_dir != path
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_enable_compilation_cache", True)
    if changed:  # JAX reads the directory once, at its first compilation
        compilation_cache.reset_cache()
    return path


def disable_compile_cache() -> None:
    """Turns JAX's persistent compilation cache off for this process (``--compile-cache off``)."""
    jax.config.update("jax_enable_compilation_cache", False)


@public("sx.runtime.CompileStats")
@dataclasses.dataclass(frozen=True)
class CompileStats:
    """Seconds spent compiling (trace + lower + XLA compile or cache load) and the
    persistent cache's requests, hits and misses. ``a - b`` is what happened between two
    snapshots."""

    seconds: float = 0.0
    compiles: int = 0
    cache_requests: int = 0
    cache_hits: int = 0
    cache_misses: int = 0

    def __sub__(self, other: CompileStats) -> CompileStats:
        return CompileStats(
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def scalars(self, prefix: str = "compile/") -> dict[str, float]:
        return {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in dataclasses.fields(self)}


class _Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values = dict.fromkeys(
            ("seconds", "compiles", "cache_requests", "cache_hits", "cache_misses"), 0
        )
        self.values["seconds"] = 0.0
        self.spans: list[tuple[float, float]] = []

    def on_duration(self, event: str, duration: float, **kwargs: object) -> None:
        if event not in _COMPILE_EVENTS:
            return
        end = time.perf_counter()
        with self.lock:
            self._cover(end - duration, end)
            if event == _COMPILE_EVENTS[-1]:
                self.values["compiles"] += 1

    def _cover(self, start: float, end: float) -> None:
        """Adds ``[start, end]`` to the seconds, counting time already covered once: a
        program compiled while another is traced or lowered (an eager operation inside
        a traced function) reports a span inside the outer one's."""
        spans = self.spans
        while spans and spans[-1][0] >= start:  # inside the new span
            s, e = spans.pop()
            self.values["seconds"] -= e - s
            end = max(end, e)
        if spans and spans[-1][1] >= start:  # overlaps the one before
            s, e = spans.pop()
            self.values["seconds"] -= e - s
            start, end = s, max(end, e)
        spans.append((start, end))
        self.values["seconds"] += end - start
        del spans[:-64]

    def on_event(self, event: str, **kwargs: object) -> None:
        name = _CACHE_EVENTS.get(event)
        if name is not None:
            with self.lock:
                self.values[name] += 1


_counter: _Counter | None = None
_install_lock = threading.Lock()


def count_compiles() -> None:
    """Starts counting (once per process; [`compile_stats`][shardax.runtime.compile_stats] calls
    it)."""
    global _counter
    with _install_lock:
        if _counter is None:
            _counter = _Counter()
            jax.monitoring.register_event_duration_secs_listener(_counter.on_duration)
            jax.monitoring.register_event_listener(_counter.on_event)


@public("sx.runtime.compile_stats")
def compile_stats() -> CompileStats:
    """What was compiled since counting started (the first call starts it)."""
    count_compiles()
    with _counter.lock:
        return CompileStats(**_counter.values)
