"""Save and restore a train state and the data position with orbax-checkpoint.

Saves are atomic (orbax writes to a temporary directory and renames it on commit;
leftovers of an interrupted save are cleaned up), overwrites too (saved aside, swapped in
by renames). A :class:`CheckpointManager` keeps the ``max_to_keep`` highest steps; the
one-shot :func:`save_checkpoint` deletes none unless asked. A restore places every array
on the sharding of ``like``, whatever sharding it was saved with.

With ``async_save=True`` a save blocks only while the arrays are copied to host memory;
orbax writes them in a background thread and commits the step (the rename) when they
are written, so the loop goes on stepping. A step is listed, restored or counted by
:meth:`CheckpointManager.latest_step` only once committed; the next save, a restore and
:meth:`CheckpointManager.close` wait for the save in flight, and a save after a
preemption notice (SIGTERM) waits for its own commit before returning. A save still in
flight when the script ends is finished before the process exits or, where that cannot
be (Python 3.12+ starts no thread then, and orbax needs some), reported on stderr. A
save that fails (a read-only or full disk) raises ``OSError`` naming the step, the
directory and the cause, and leaves no orbax thread behind. One manager at a time
writes into a directory (:mod:`shardax.checkpoint.lock`).

>>> import shardax as sx
>>> state = {"w": jnp.ones((8, 4)), "step": jnp.int32(0)}
>>> sx.save_checkpoint(tmp_path / "ckpt", state, step=1)
>>> sx.restore_checkpoint(tmp_path / "ckpt", like=state).step
1
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from shardax.checkpoint import swap
from shardax.checkpoint.convert import (
    abstract_saveable,
    array_leaves,
    flat_paths,
    from_saveable,
    other_leaves,
    to_saveable,
    with_other_leaves,
)
from shardax.checkpoint.lock import DirectoryLock
from shardax.checkpoint.preemption import preemption_requested, reached_preemption
from shardax.checks import as_bool, as_count, as_path, public
from shardax.plan.tree import path_str
from shardax.runtime import compat


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "checkpoints need orbax-checkpoint: pip install 'shardax[checkpoint]'"
        ) from e
    return ocp


@public("sx.checkpoint.Restored")
class Restored(NamedTuple):
    """What a restore gives back."""

    state: Any
    data_state: Any
    step: int


@public("sx.CheckpointManager")
class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of a run in ``directory``.

    Every process of a multi-process run must make the same calls, in the same order:
    :meth:`save`, :meth:`restore`, and :meth:`wait`, :meth:`all_steps`,
    :meth:`latest_step`, :meth:`data_state` and :meth:`close`, which wait for a save in
    flight and the deletions it brings, and so synchronise the processes.
    ``async_save=True``: :meth:`save` returns once the arrays are on the host and writes
    them in the background (:meth:`wait` for the commit; a save not waited for is
    finished when the script ends). From its first save until :meth:`close` the manager
    holds the directory's writer lock: a second manager saving there raises
    ``RuntimeError`` naming the first.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 3,
        *,
        create: bool = True,
        async_save: bool = False,
    ) -> None:
        ocp = _ocp()
        self._quiet = False  # orbax's save-error logs filtered while this manager saves
        self.directory = check_directory("directory", directory)
        if max_to_keep is not None:
            max_to_keep = as_count("max_to_keep (or None to keep all)", max_to_keep)
        self.max_to_keep = max_to_keep
        if not create and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoint directory {self.directory}")
        self._stray: set[str] = set()
        self._displaced: list[int] = []
        self._lock: DirectoryLock | None = None
        self._in_flight: tuple[int, set[str]] | None = None  # (step, orbax operation ids)
        self.async_save = as_bool("async_save", async_save)
        swap.recover(self.directory)  # an overwrite interrupted by a crash
        # Old steps are deleted here (save), not by orbax, which deletes in the order of
        # its saves and so would drop a newer step to keep an older one just saved.
        self._manager = _orbax_manager(
            self.directory,
            None,
            create=create,
            step_name_format=_CheckpointSteps(ocp.step.standard_name_format(), self._warn_stray),
            async_save=self.async_save,
        )

    def _warn_stray(self, path: Any) -> None:
        if str(path) not in self._stray:
            self._stray.add(str(path))
            warnings.warn(
                f"checkpoint directory {self.directory}: skipping {path}, which is named like a "
                "step but holds no shardax checkpoint (no 'state' item); it is never read "
                "or deleted",
                UserWarning,
                stacklevel=4,
            )

    def wait(self) -> None:
        """Returns once the save in flight (``async_save=True``) is committed, and the
        steps it displaced under ``max_to_keep`` are deleted. A save that failed raises
        ``OSError`` naming the step, the directory and the cause; the steps committed
        before it are kept."""
        in_flight, self._in_flight = self._in_flight, None
        _UNFINISHED.discard(self)
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._displaced = []
            if in_flight is None:
                raise
            step, operations = in_flight
            compat.orbax_release_save(operations)  # else they block the exit for 300 s
            _QUIET.failed = True
            raise OSError(
                f"checkpoint step {step} was not saved in {self.directory}: "
                f"{getattr(e, 'strerror', None) or e}"
                + (f" ({e.filename})" if getattr(e, "filename", None) else "")
                + f". Nothing of step {step} was committed; the steps saved before it are kept"
            ) from e
        displaced, self._displaced = self._displaced, []
        if displaced:
            self._manager.reload()
            committed = set(self._manager.all_steps())
            # Every process has listed the steps before process 0 deletes any: a step
            # listed by one process and gone before it reads its metadata fails that
            # process's reload ("No step path found").
            swap.sync_processes(f"shardax-checkpoint-listed-{displaced}")
            for step in displaced:
                if step in committed:
                    self._manager.delete(step)

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first; interrupted saves are not among them (a
        save in flight is waited for first)."""
        self.wait()
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, data_state: Any = None, overwrite: bool = False) -> None:
        """Saves ``state`` (any pytree) and the JSON-able ``data_state`` as ``step``.

        A step that exists raises ``FileExistsError`` unless ``overwrite=True``, which
        replaces it atomically: the new version is saved aside and swapped in by renames,
        so a crash at any point leaves the old step or the new one, whole
        (:mod:`shardax.checkpoint.swap`); an overwrite is never asynchronous.

        With ``async_save=True`` it returns once the arrays are copied to the host (the
        state may then be donated or changed) and commits in the background, except
        after a preemption notice, when it returns only once the step is committed.

        With ``max_to_keep``, the steps kept are the ``max_to_keep`` highest: once the
        save is committed the lower ones are deleted. A step lower than all of those (it
        would be deleted at once, or cost a newer one) raises ``ValueError`` and writes
        nothing.
        """
        ocp = _ocp()
        step = as_count("checkpoint step", step, minimum=0)
        overwrite = as_bool("overwrite", overwrite)
        check_json("data_state", data_state)
        if not self._quiet:
            _QUIET.acquire()
            self._quiet = True
        leaves = other_leaves(state)
        check_json("state: leaf", leaves)
        check_not_donated(state)
        arrays = to_saveable(state)
        if not arrays:
            raise ValueError(
                f"state has no array or number leaf to save, got {state!r:.80}; "
                "plain values go in data_state"
            )
        self._take_lock()  # before reading the steps another writer could change
        steps = self.all_steps()
        exists = step in steps
        if exists and not overwrite:
            raise FileExistsError(
                f"checkpoint step {step} already exists in {self.directory}; pass "
                "overwrite=True to replace it"
            )
        keep = sorted({*steps, step})
        if self.max_to_keep is not None:
            keep = keep[-self.max_to_keep :]
        if step not in keep:
            raise ValueError(
                f"checkpoint step {step} is lower than the {self.max_to_keep} steps kept in "
                f"{self.directory} ({steps[-self.max_to_keep :]}, max_to_keep="
                f"{self.max_to_keep}): it would be deleted at once, or cost a newer step. "
                f"Save a step above {steps[-self.max_to_keep]}, or use max_to_keep=None. "
                "Nothing was written"
            )
        items = {"state": ocp.args.StandardSave(arrays)}
        items["data"] = ocp.args.JsonSave({"data_state": data_state, "leaves": leaves})
        args = ocp.args.Composite(**items)
        if not exists:
            # The steps it displaces go once it is committed (see wait), never before.
            self._displaced = [old for old in steps if old not in keep]
            before = compat.orbax_save_operations()
            self._manager.save(step, args=args, force=True)
            self._in_flight = (step, compat.orbax_save_operations() - before)
            if self.async_save:
                _finish_at_exit(self)
            if not self.async_save or preemption_requested():
                self.wait()
            return
        with _orbax_manager(os.path.join(self.directory, swap.STAGED), None) as staging:
            _save(staging, step, args)
        swap.swap_in(self.directory, step)
        self._manager.reload()

    def reached_preemption(self, step: int) -> bool:
        """Deprecated: call :func:`shardax.checkpoint.reached_preemption` (the one
        preemption API), or let :func:`shardax.loop.run` save and stop on a SIGTERM."""
        warnings.warn(
            "CheckpointManager.reached_preemption is deprecated and goes in the next release; "
            "call sx.checkpoint.reached_preemption(step), or let sx.loop.run save on SIGTERM",
            DeprecationWarning,
            stacklevel=3,  # the caller's line (the door is one frame)
        )
        return reached_preemption(step)

    def data_state(self, step: int | None = None) -> Any:
        """The data state saved with ``step`` (default: the latest), without the arrays."""
        ocp = _ocp()
        step = self._committed(step)  # (waits for a save in flight)
        return self._manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))[
            "data"
        ]["data_state"]

    def _committed(self, step: int | None) -> int:
        """``step``, or the latest; raises ``FileNotFoundError`` when it is not committed."""
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(
                f"checkpoint step {step} not in {self.directory}; available steps: {steps}"
            )
        return step

    def restore(self, like: Any, step: int | None = None) -> Restored:
        """Restores ``step`` (default: the latest) onto the structure and shardings of ``like``.

        ``like`` is a concrete state, or an abstract one (ShapeDtypeStructs with
        shardings, e.g. from a plan). A tree that differs from the saved one in
        structure, shape or dtype raises ``ValueError`` naming the path.
        """
        ocp = _ocp()
        if step is not None:
            step = as_count("step (or None for the latest)", step, minimum=0)
        step = self._committed(step)
        target = abstract_saveable(like)
        saved = self._manager.item_metadata(step)["state"]
        check_same_tree(flat_paths(_metadata_tree(saved)), flat_paths(target), step)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()
            ),
        )
        state = from_saveable(like, restored["state"])
        state = with_other_leaves(state, restored["data"].get("leaves", {}))
        return Restored(state, restored["data"]["data_state"], step)

    def _take_lock(self) -> None:
        if self._lock is None and jax.process_index() == 0:
            self._lock = DirectoryLock(self.directory)

    def close(self) -> None:
        """Waits for the save in flight and releases the manager and the directory."""
        try:
            self.wait()
        finally:
            self._manager.close()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if self._quiet:
                self._quiet = False
                _QUIET.release()

    def _finish_at_exit(self) -> None:
        if self._in_flight is None:
            return
        step = self._in_flight[0]
        try:
            self.close()
        except Exception as e:
            # Python 3.12+ starts no thread once the script has ended, and orbax needs new
            # ones to finish a save: then the save is reported, never silently dropped.
            print(
                f"shardax: {e}. The script ended with this asynchronous save in flight: "
                "call CheckpointManager.wait() or close() (or use a with block) before it ends",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(
                f"shardax: finished saving checkpoint step {step} in {self.directory} at exit "
                "(call CheckpointManager.close() or wait() to finish it yourself)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _OrbaxErrors(logging.Filter):
    """Drops the error logs of a failed orbax-checkpoint save, each with its traceback
    (tens of lines per thread, and one per write that fails after the first): orbax's
    own, and asyncio's "Task exception was never retrieved" for orbax's write tasks.
    shardax raises the failure itself, naming the step, the directory and the cause,
    with orbax's error chained to it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if "/orbax/checkpoint/" in record.pathname.replace(os.sep, "/"):
            return False
        return not (record.name == "asyncio" and "/orbax/checkpoint/" in _message(record))


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage().replace(os.sep, "/")
    except Exception:  # a record whose arguments do not format: keep it
        return ""


def _late_completions(previous: Any) -> Any:
    """An unraisable hook that drops asyncio's "Event loop is closed" raised where a
    native callback (tensorstore's) reports a write finishing after the failed save's
    loop was closed: harmless, and one traceback per write. Anything else goes to
    ``previous``."""

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if not (
            isinstance(error, RuntimeError)
            and str(error) == "Event loop is closed"
            and unraisable.object is None
        ):
            previous(unraisable)

    hook.shardax_late_completions = True  # type: ignore[attr-defined]
    return hook


class _Quiet:
    """The filters on orbax's save-error logs (:class:`_OrbaxErrors` on the ``absl`` and
    ``asyncio`` loggers) and the unraisable hook (:func:`_late_completions`), installed
    while at least one manager that saved is open, and removed (the previous hook put
    back) when the last one closes, so nothing stays on the process after; but once a
    save failed, the ``asyncio`` filter stays: orbax's failed write tasks report "Task
    exception was never retrieved" when they are garbage-collected, which can be after
    the last close (at exit). It drops only those reports of orbax's own tasks."""

    def __init__(self) -> None:
        self.users = 0
        self.failed = False  # a save failed in this process
        self.filters: list[tuple[logging.Logger, logging.Filter]] = []
        self.hook: Any = None
        self.previous: Any = None
        self.lock = threading.Lock()

    def acquire(self) -> None:
        with self.lock:
            self.users += 1
            if self.users > 1:
                return
            for name in ("absl", "asyncio"):  # orbax logs through absl, which logs here
                if any(logger.name == name for logger, _ in self.filters):
                    continue  # the asyncio filter a failed save left
                logger, kept = logging.getLogger(name), _OrbaxErrors()
                logger.addFilter(kept)
                self.filters.append((logger, kept))
            self.previous = sys.unraisablehook
            self.hook = sys.unraisablehook = _late_completions(self.previous)

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users > 0:
                return
            stays = [(lg, f) for lg, f in self.filters if self.failed and lg.name == "asyncio"]
            for logger, kept in self.filters:
                if (logger, kept) not in stays:
                    logger.removeFilter(kept)
            self.filters = stays
            if sys.unraisablehook is self.hook:  # else replaced since: left to its owner
                sys.unraisablehook = self.previous
            self.hook = self.previous = None


_QUIET = _Quiet()


_UNFINISHED: set[CheckpointManager] = set()
"""The async managers with a save in flight, finished at exit."""


def _finish_at_exit(manager: CheckpointManager) -> None:
    # Registered at the first async save, after the executors orbax's save uses, so that
    # it runs before they stop taking work (the hooks run last registered, first).
    if not getattr(_finish_at_exit, "registered", False):
        compat.before_thread_shutdown(_finish_saves_at_exit)
        _finish_at_exit.registered = True  # type: ignore[attr-defined]
    _UNFINISHED.add(manager)


def _finish_saves_at_exit() -> None:
    for manager in list(_UNFINISHED):
        manager._finish_at_exit()


def check_directory(name: str, directory: Any, *, writable: bool = False) -> str:
    """``directory`` as an absolute path; ``TypeError`` for a non-path, ``ValueError``
    for an empty one (which would mean the working directory), ``NotADirectoryError``
    for a file or a path under a file, and with ``writable`` a ``PermissionError`` for a
    directory (or, when it does not exist yet, the one it would be made in) that this
    process cannot write, each naming ``name`` and the path."""
    path = os.path.abspath(as_path(name, directory))
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{name} must be a directory, got {path}, which is a file")
    made_in = path
    while not os.path.exists(made_in):
        made_in = os.path.dirname(made_in)
    if not os.path.isdir(made_in):
        raise NotADirectoryError(
            f"{name} must be a directory, got {path}, which cannot be made: {made_in} is a file"
        )
    if writable and not os.access(made_in, os.W_OK | os.X_OK):
        read_only = os.statvfs(made_in).f_flag & os.ST_RDONLY
        why = "on a read-only file system" if read_only else "not writable by this process"
        where = "it" if made_in == path else f"{made_in}, where it would be made,"
        raise PermissionError(
            f"{name} must be a directory this process can write, got {path}; {where} is "
            f"{why}. Choose another directory, or make it writable"
        )
    return path


def _orbax_manager(
    directory: str,
    max_to_keep: int | None,
    *,
    create: bool = True,
    step_name_format: Any = None,
    async_save: bool = False,
) -> Any:
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=create,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
        step_name_format=step_name_format,
    )
    manager = ocp.CheckpointManager(
        directory,
        options=options,
        item_handlers={
            "state": ocp.StandardCheckpointHandler(),
            "data": ocp.JsonCheckpointHandler(),
        },
    )
    # orbax deletes unfinished "*.orbax-checkpoint-tmp" directories in a background future
    # that only its own save() awaits: a manager closed without saving (a refused save, a
    # restore) leaves it running, and it can delete the next manager's save in progress.
    # orbax has no public way to wait for it (checked on orbax-checkpoint 0.12.8).
    compat.orbax_await_tmp_cleanup(manager)
    return manager


def _save(manager: Any, step: int, args: Any) -> None:
    manager.save(step, args=args, force=True)
    manager.wait_until_finished()


class _CheckpointSteps:
    """orbax's standard step names, minus directories named like a step that hold no
    shardax checkpoint (no "state" item): ``on_stray(path)`` is told, and orbax never
    lists, reads or garbage-collects them."""

    def __init__(self, base: Any, on_stray: Any) -> None:
        self._base, self._on_stray = base, on_stray
        self.single_host_load_and_broadcast = getattr(base, "single_host_load_and_broadcast", False)

    def _ours(self, metadata: Any) -> bool:
        if os.path.isdir(os.path.join(os.fspath(metadata.path), "state")):
            return True
        self._on_stray(metadata.path)
        return False

    def build_name(self, step: int) -> str:
        return self._base.build_name(step)

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return iter([m for m in self._base.find_all(base_path) if self._ours(m)])

    def find_step(self, base_path: Any, step: int) -> Any:
        metadata = self._base.find_step(base_path, step)
        if not self._ours(metadata):
            raise ValueError(f"no shardax checkpoint for step {step} in {base_path}")
        return metadata


def check_not_donated(state: Any) -> None:
    """Raises ``ValueError`` naming the first leaf of ``state`` whose buffer was deleted
    (donated to a jitted step), before anything is written."""
    deleted = sorted(
        (
            path_str(path)
            for path, leaf in array_leaves(state)
            if isinstance(leaf, jax.Array) and leaf.is_deleted()
        ),
        key=_params_first,
    )
    if deleted:
        more = f" (and {len(deleted) - 1} more)" if len(deleted) > 1 else ""
        raise ValueError(
            f"state leaf {deleted[0]!r}{more} has been deleted: its buffer was "
            "donated to a step (donate=True, donate_argnums) that consumed it. Save the "
            "state the step returned, not the one passed into it. Nothing was written"
        )


def check_json(name: str, value: Any, path: str = "") -> None:
    """Raises ``TypeError`` naming the first entry of ``value`` that JSON cannot store
    as it is (a NumPy array or scalar, an object, a non-string key), before anything is
    written."""
    where = f"{name}{path}"
    if value is None or isinstance(value, str | int | float):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(
                    f"{where} has the key {key!r} ({type(key).__name__}); JSON keys must be "
                    f"strings (it would come back as {str(key)!r})"
                )
            check_json(name, item, f"{path}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json(name, item, f"{path}[{i}]")
        return
    hint = (
        "; convert it with .tolist() or int()/float()"
        if isinstance(value, np.ndarray | np.generic)
        else ""
    )
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which JSON "
        f"cannot store (it takes dicts, lists, strings, numbers, bools and None){hint}. "
        "Nothing was written"
    )


def _metadata_tree(metadata: Any) -> Any:
    return getattr(metadata, "tree", metadata)


def _params_first(path: str) -> tuple[bool, str]:
    """Sort key: the model's leaves before the optimizer's mirrors of them."""
    return ("opt_state" in path.split("/"), path)


def check_same_tree(saved: dict[str, Any], target: dict[str, Any], step: int) -> None:
    """Raises ``ValueError`` naming the first path whose presence, shape or dtype differ
    (the params before the optimizer state that mirrors them) and how many others do."""
    missing = sorted(set(target) - set(saved), key=_params_first)
    extra = sorted(set(saved) - set(target), key=_params_first)
    if missing or extra:
        raise ValueError(
            f"checkpoint step {step} does not match the tree of `like`: "
            + (f"not in the checkpoint: {missing}; " if missing else "")
            + (f"in the checkpoint but not in `like`: {extra}" if extra else "")
        )
    differ = []
    for path in sorted(target, key=_params_first):
        want, got = target[path], saved[path]
        if tuple(got.shape) != tuple(np.shape(want)):
            differ.append(
                f"leaf {path!r} has shape {tuple(got.shape)} in the checkpoint but "
                f"{tuple(np.shape(want))} in `like`"
            )
        elif np.dtype(got.dtype) != np.dtype(want.dtype):
            differ.append(
                f"leaf {path!r} has dtype {np.dtype(got.dtype)} in the checkpoint but "
                f"{np.dtype(want.dtype)} in `like`"
            )
    if differ:
        more = f" ({len(differ) - 1} more leaves differ)" if len(differ) > 1 else ""
        raise ValueError(f"checkpoint step {step}: {differ[0]}{more}")


@public("sx.save_checkpoint")
def save_checkpoint(
    directory: str | os.PathLike[str],
    state: Any,
    *,
    step: int,
    data_state: Any = None,
    max_to_keep: int | None = None,
    overwrite: bool = False,
) -> None:
    """Saves ``state`` and ``data_state`` as ``step`` in ``directory``; see
    :class:`CheckpointManager`. It deletes no step unless ``max_to_keep`` asks it to
    (keeping that many of the highest steps, as :meth:`CheckpointManager.save`)."""
    with CheckpointManager(directory, max_to_keep) as manager:
        manager.save(step, state, data_state, overwrite=overwrite)


@public("sx.restore_checkpoint")
def restore_checkpoint(
    directory: str | os.PathLike[str], like: Any, step: int | None = None
) -> Restored:
    """Restores ``step`` (default: latest) of ``directory`` onto ``like``'s shardings;
    returns ``Restored(state, data_state, step)``."""
    with CheckpointManager(directory, max_to_keep=None, create=False) as manager:
        return manager.restore(like, step)
