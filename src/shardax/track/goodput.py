"""The goodput ledger: every second of a run's wall time in one bucket.

The buckets (``BUCKETS``): ``startup`` (process start to the first step), ``compile``
(tracing, lowering, compiling or loading from the cache), ``data`` (the loop blocked on
input), ``step`` (training: the only productive bucket), ``eval``, ``checkpoint`` (the
part of a save that blocks the loop), ``hang`` (a step the watchdog ended) and ``lost``
(steps computed again after resuming from a checkpoint older than the last step
reached). Goodput is ``step / wall``.

A [`Ledger`][shardax.track.Ledger] is a stopwatch with one running bucket:
[`Ledger.switch`][shardax.track.Ledger.switch] charges the time since the last switch to
the running bucket and starts the next, so the buckets sum to the wall time by
construction. Counters (e.g. the compile seconds of
[`shardax.runtime.compile_stats`][shardax.runtime.compile_stats], the input iterator's
``wait_seconds``) move what they counted during an interval out of the running bucket into
theirs.

The ledger lives beside the checkpoints (``goodput.json``), one entry per session (process
start to exit), so it spans preemptions and resumes;
[`Ledger.resumed`][shardax.track.Ledger.resumed] moves the step time of the steps a
restart will compute again into ``lost``.

>>> ledger = Ledger(path=os.path.join(tmp_path, FILE))  # beside the checkpoints
>>> ledger.count("compile", lambda: sx.runtime.compile_stats().seconds)
>>> for step in range(1, 4):
...     _ = ledger.switch("step")
...     state, metrics = train_step(state, next(batches))
...     ledger.completed(step)
...     with ledger.phase("checkpoint"):
...         pass  # manager.save(step, state)
>>> ledger.close()  # writes goodput.json
>>> buckets = load(os.path.join(tmp_path, FILE))["sessions"][0]["buckets"]
>>> sorted(buckets) == sorted(BUCKETS) and buckets["step"] > 0
True
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from shardax._extras import pyplot
from shardax.checks import as_path, public

BUCKETS = ("startup", "compile", "data", "step", "eval", "checkpoint", "hang", "lost")
"""Where wall time goes; ``step`` is the productive one."""

FILE = "goodput.json"
"""The ledger's file name, in the checkpoint directory."""

_VERSION = 1


def _empty() -> dict[str, float]:
    return dict.fromkeys(BUCKETS, 0.0)


@public("sx.track.Ledger")
class Ledger:
    """One session's buckets, and the sessions before it read from ``path``.

    Args:
        path: the ledger file (``<checkpoint dir>/goodput.json``); None keeps it in memory.
        since: the session's start, a ``time.time()`` (default now; e.g. the process's
            start time, so imports count as start-up).
        bucket: the bucket that runs first.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        since: float | None = None,
        bucket: str = "startup",
    ) -> None:
        _check_bucket(bucket)
        self.path = (
            as_path("path", path, "None keeps the ledger in memory") if path is not None else None
        )
        self.previous: list[dict[str, Any]] = load(self.path)["sessions"] if self.path else []
        now = time.time()
        start = min(since, now) if since is not None else now
        self._perf = time.perf_counter() - (now - start)
        self.session: dict[str, Any] = {
            "start": start,
            "end": start,
            "first_step": None,
            "last_step": None,
            "steps": 0,
            "buckets": _empty(),
        }
        self.bucket = bucket
        self._counters: dict[str, tuple[Callable[[], float], float]] = {}

    def count(self, bucket: str, seconds: Callable[[], float], since: float | None = None) -> None:
        """What the monotonic counter ``seconds()`` adds is charged to ``bucket`` instead
        of the running one: from now on, or from its value ``since`` (e.g. its value when
        the ledger's session began, for what it counted before the ledger existed)."""
        _check_bucket(bucket)
        self._charge()
        value = float(seconds())
        if since is not None:  # counted already, while the running bucket ran
            buckets = self.session["buckets"]
            moved = min(max(value - since, 0.0), buckets[self.bucket])
            buckets[self.bucket] -= moved
            buckets[bucket] += moved
        self._counters[bucket] = (seconds, value)

    def _charge(self) -> None:
        now = time.perf_counter()
        elapsed = max(now - self._perf, 0.0)
        self._perf = now
        buckets = self.session["buckets"]
        for name, (read, last) in list(self._counters.items()):
            value = float(read())
            moved = min(max(value - last, 0.0), elapsed)
            self._counters[name] = (read, value)
            buckets[name] += moved
            elapsed -= moved
        buckets[self.bucket] += elapsed
        self.session["end"] = self.session["start"] + sum(buckets.values())

    def switch(self, bucket: str) -> str:
        """Charges the time since the last switch, runs ``bucket``; returns the one before."""
        _check_bucket(bucket)
        self._charge()
        before, self.bucket = self.bucket, bucket
        return before

    @contextlib.contextmanager
    def phase(self, bucket: str) -> Iterator[None]:
        """Runs ``bucket`` for the block, then the bucket that ran before."""
        before = self.switch(bucket)
        try:
            yield
        finally:
            self.switch(before)

    def completed(self, step: int, steps: int = 1) -> None:
        """Step ``step`` is done (``steps`` steps since the last call). Charges the
        running bucket up to now, so a later relabel (``close("hang")``) covers only the
        time after this step."""
        self._charge()
        if self.session["first_step"] is None:
            self.session["first_step"] = step - steps + 1
        self.session["last_step"] = step
        self.session["steps"] += steps

    def resumed(self, step: int) -> int:
        """This session resumes from a checkpoint of ``step``: the steps after it that an
        earlier session completed will be computed again, so their step time moves to
        ``lost`` (at the earlier sessions' mean step time). Returns how many steps."""
        reached = max((s["last_step"] or 0 for s in self.previous), default=0)
        lost = max(reached - step, 0)
        left = lost
        for s in reversed(self.previous):  # the latest sessions computed the latest steps
            if left <= 0 or not s["steps"]:
                continue
            n = min(left, s["steps"], max((s["last_step"] or 0) - step, 0))
            moved = s["buckets"]["step"] * n / s["steps"]
            s["buckets"]["step"] -= moved
            s["buckets"]["lost"] += moved
            s["steps"] -= n
            left -= n
        return lost

    def totals(self) -> dict[str, float]:
        """The seconds of each bucket, over every session, this one up to now."""
        self._charge()
        return totals([*self.previous, self.session])

    def scalars(self, prefix: str = "goodput/") -> dict[str, float]:
        """The totals as metric scalars: ``goodput/fraction`` and ``goodput/<bucket>_s``."""
        t = self.totals()
        return {f"{prefix}fraction": fraction(t), **{f"{prefix}{k}_s": v for k, v in t.items()}}

    def save(self) -> None:
        """Writes every session, this one up to now, to ``path`` (atomically)."""
        self._charge()
        if self.path is None:
            return
        data = {"version": _VERSION, "sessions": [*self.previous, self.session]}
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, self.path)
        except OSError as e:  # a full or read-only disk
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise OSError(
                e.errno, f"goodput ledger {self.path} could not be written: {e.strerror}"
            ) from e

    def close(self, running_as: str | None = None) -> None:
        """Ends the session and saves it; ``running_as`` relabels the running interval
        (e.g. ``"hang"`` when the watchdog ends the step that was running)."""
        if running_as is not None:
            _check_bucket(running_as)
            self.bucket = running_as
        self.save()


def _check_bucket(bucket: str) -> None:
    if bucket not in BUCKETS:
        raise ValueError(f"goodput bucket must be one of {list(BUCKETS)}, got {bucket!r}")


def load(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The ledger at ``path`` (a file, or a directory holding ``FILE``); an empty
    one when there is none. A file that is not a ledger (not JSON, a session without
    buckets, a bucket that is not a number of seconds >= 0) raises ``ValueError`` naming
    the file and the entry."""
    if path is None:
        return {"version": _VERSION, "sessions": []}
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, FILE)
    if not os.path.exists(path):
        return {"version": _VERSION, "sessions": []}
    try:
        with open(path) as f:
            data = json.load(f)
        sessions = data["sessions"] if isinstance(data, dict) else None
        if not isinstance(sessions, list):
            raise ValueError('it must be a JSON object with a "sessions" list')
        for i, s in enumerate(sessions):
            s["buckets"] = {**_empty(), **_check_buckets(s, i)}
            for key in ("first_step", "last_step"):
                s.setdefault(key, None)
            s.setdefault("steps", 0)
    except ValueError as e:  # json.JSONDecodeError too
        raise ValueError(
            f"goodput ledger {path} is not a ledger shardax can read: {e}. Delete it (or "
            "move it aside) to start a new one; the checkpoints do not depend on it"
        ) from None
    return data


def _check_buckets(session: Any, i: int) -> dict[str, float]:
    buckets = session.get("buckets") if isinstance(session, dict) else None
    if not isinstance(buckets, dict):
        raise ValueError(f'session {i} has no "buckets" object')
    for name, seconds in buckets.items():
        if name not in BUCKETS:
            raise ValueError(f"session {i} has bucket {name!r}, not one of {list(BUCKETS)}")
        number = isinstance(seconds, int | float) and not isinstance(seconds, bool)
        if not number or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"session {i} bucket {name!r} must be a number of seconds >= 0, got {seconds!r}"
            )
    return buckets


def totals(sessions: list[dict[str, Any]]) -> dict[str, float]:
    """The seconds of each bucket summed over ``sessions``."""
    out = _empty()
    for s in sessions:
        for k, v in s["buckets"].items():
            out[k] = out.get(k, 0.0) + v
    return out


def fraction(buckets: dict[str, float]) -> float:
    """Goodput: step seconds over wall seconds."""
    wall = sum(buckets.values())
    return buckets["step"] / wall if wall > 0 else 0.0


def table(buckets: dict[str, float], sessions: int | None = None) -> str:
    """The buckets as a text table: seconds and share of the wall time, then goodput."""
    wall = sum(buckets.values())
    lines = [f"{'bucket':<12}{'seconds':>12}{'share':>9}"]
    for k, v in buckets.items():
        lines.append(f"{k:<12}{v:>12.2f}{(v / wall if wall else 0):>9.1%}")
    lines.append(f"{'wall':<12}{wall:>12.2f}{1 if wall else 0:>9.1%}")
    more = f" over {sessions} session{'s' * (sessions != 1)}" if sessions is not None else ""
    lines.append(f"goodput {fraction(buckets):.1%}{more}")
    return "\n".join(lines)


def plot(buckets: dict[str, float], path: str | os.PathLike[str], title: str = "") -> None:
    """A PNG of the buckets as one stacked horizontal bar (needs matplotlib)."""
    plt = pyplot("the goodput plot")
    fig, ax = plt.subplots(figsize=(8, 2.2))
    left = 0.0
    for k, v in buckets.items():
        if v > 0:
            ax.barh([0], [v], left=left, label=f"{k} {v:.1f}s")
            left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds")
    ax.set_title(title or f"goodput {fraction(buckets):.1%}")
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
