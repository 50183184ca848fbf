"""Snapshots that outlive a host: each process keeps its own shards in its host's memory,
and a process whose copy is gone (a host replaced, its memory lost) fetches its shards
from a peer process that holds the same ones in another replica. The transport is
orbax's peer-to-peer manager (``orbax.checkpoint.experimental.emergency.p2p``); the
processes agree on the step and share the data position through JAX's own collectives.

Where the state is replicated across processes along the ``data`` axis (data
parallelism, or FSDP within a host and data parallelism across hosts), each replica is a
peer copy. Where it is sharded over ``data`` (FSDP, ZeRO-1 over every process), each
snapshot is taken on ``paired_mesh``: ``data`` split in two halves (``copies`` x
``data``), the leaves' specs kept, so the processes of each half hold a copy of the
other half's shards (a reshard by JAX's collectives before the copy to the host: twice
the sharded leaves' device memory for a moment, and twice their host memory). A run of
one process, an odd data axis, or a mesh on which a process has devices in both halves
has no second copy, and is refused by name.

``shardax launch --max-restarts K --snapshot-peers`` turns them on for ``shardax train``
and ``sx.loop.run``'s snapshots (``$SHARDAX_SNAPSHOT_PEERS``).

>>> replica_axis(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",)), {})
Traceback (most recent call last):
...
ValueError: peer snapshots: the mesh has no 'data' axis ...
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardax.checkpoint.convert import (
    abstract_saveable,
    array_leaves,
    from_saveable,
    other_leaves,
    to_saveable,
    with_other_leaves,
)
from shardax.checkpoint.manager import Restored
from shardax.checkpoint.quiet import _QUIET
from shardax.checkpoint.trees import check_json
from shardax.plan.tree import path_str


class _Chatter(logging.Filter):
    """Drops the warnings orbax's peer-to-peer manager logs on every start and save: a
    process directory not made yet, "global object size logging disabled"."""

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace(os.sep, "/")
        return record.levelno >= logging.ERROR or "/orbax/checkpoint/" not in path


AXIS = "data"
"""The mesh axis along which the processes hold copies of the same shards."""
COPIES = "copies"
"""The axis of ``paired_mesh``: two copies of a state sharded over ``data``."""


def _sharded_over(like: Any, axis: str) -> bool:
    """Whether a leaf of ``like`` is sharded over mesh axis ``axis``."""
    for _, leaf in array_leaves(like):
        spec = getattr(getattr(leaf, "sharding", None), "spec", ())
        if axis in {n for e in spec for n in (e if isinstance(e, tuple) else (e,))}:
            return True
    return False


def paired_mesh(mesh: jax.sharding.Mesh, axis: str = AXIS) -> jax.sharding.Mesh:
    """``mesh`` with ``axis`` split into two halves, ``(COPIES: 2, axis: n / 2)``: a leaf
    sharded over ``axis`` keeps its spec on it and is held twice, by each half's devices.

    >>> dict(paired_mesh(jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))).shape)
    {'copies': 2, 'data': 2}
    """
    names, size = list(mesh.axis_names), mesh.shape[axis]
    if size % 2:
        raise ValueError(
            f"peer snapshots: the state is sharded over {axis!r}, whose {size} devices do not "
            "split into two halves holding a copy each; use an even data axis, or plain "
            "snapshots"
        )
    at = names.index(axis)
    shape = (*mesh.devices.shape[:at], 2, size // 2, *mesh.devices.shape[at + 1 :])
    return jax.sharding.Mesh(mesh.devices.reshape(shape), (*names[:at], COPIES, *names[at:]))


def _on(mesh: jax.sharding.Mesh, tree: dict[str, Any]) -> Any:
    """The shardings of ``tree``'s leaves with their specs on ``mesh``."""
    return jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), tree)


def _abstract_on(mesh: jax.sharding.Mesh, tree: dict[str, Any]) -> Any:
    """``tree``'s leaves as ShapeDtypeStructs with their specs on ``mesh``."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, _on(mesh, tree)
    )


def _identity(tree: Any) -> Any:
    return tree


def _reshard(tree: dict[str, Any], shardings: Any) -> dict[str, Any]:
    """``tree`` placed on ``shardings``, moved by JAX's collectives (one restore)."""
    return jax.jit(_identity, out_shardings=shardings)(tree)


def _mesh(like: Any) -> jax.sharding.Mesh:
    """The one mesh of ``like``'s array leaves; ``ValueError`` when there is none."""
    for _, leaf in array_leaves(like):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    raise ValueError(
        "peer snapshots: the state has no array placed on a mesh (NamedSharding); place it "
        "with sx.prepare or a plan first"
    )


def replica_axis(mesh: jax.sharding.Mesh, like: Any, axis: str = AXIS) -> int:
    """The index of ``axis`` in ``mesh``, checked to hold a second copy of every
    process's shards: ``like``'s leaves replicated along it, and on each process's behalf
    a replica with none of its devices. ``ValueError`` naming what is missing."""
    if axis not in mesh.axis_names:
        raise ValueError(
            f"peer snapshots: the mesh has no {axis!r} axis (axes {dict(mesh.shape)}), so "
            "no process holds a copy of another's shards; use a mesh with a data axis "
            "across the processes, or plain snapshots (a lost host then resumes from the "
            "persistent checkpoint)"
        )
    for path, leaf in array_leaves(like):
        spec = getattr(getattr(leaf, "sharding", None), "spec", ())
        names = {n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,))}
        if axis in names:
            raise ValueError(
                f"peer snapshots: state leaf {path_str(path)!r} is sharded over the {axis!r} "
                f"axis ({spec}), so no other replica holds its shards; keep the data axis "
                "for replicas (fsdp over another axis, no zero1 over data), or use plain "
                "snapshots"
            )
    index = list(mesh.axis_names).index(axis)
    replicas = [
        {d.process_index for d in np.take(mesh.devices, [r], axis=index).flat}
        for r in range(mesh.devices.shape[index])
    ]
    alone = [p for p in range(jax.process_count()) if all(p in r for r in replicas)]
    if jax.process_count() < 2 or alone:
        who = "one process" if jax.process_count() < 2 else f"process {alone[0]}"
        raise ValueError(
            f"peer snapshots: {who} has devices in every replica along {axis!r} "
            f"({mesh.devices.shape[index]} of them), so no other process holds a copy of its "
            "shards; they need 2 or more processes and a data axis across them"
        )
    return index


def _split(tree: dict[str, Any], prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """A saveable tree's arrays on the mesh (nested: what orbax's local handler stores)
    and its other values (NumPy, numbers, an array on one device: path -> dtype, shape
    and data, kept in the JSON part)."""
    arrays: dict[str, Any] = {}
    host: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            inner, more = _split(value, f"{prefix}{key}/")
            if inner:
                arrays[key] = inner
            host.update(more)
        elif isinstance(getattr(value, "sharding", None), NamedSharding):
            arrays[key] = value  # on the mesh
        elif isinstance(value, jax.ShapeDtypeStruct):
            continue  # a target's host value: it comes from the JSON part
        else:  # NumPy, a number, an array on one device (an unplaced key)
            value = np.asarray(value)
            shape, data = list(value.shape), value.ravel().tolist()
            host[prefix + key] = {"dtype": str(value.dtype), "shape": shape, "data": data}
    return arrays, host


def _join(arrays: dict[str, Any], host: dict[str, Any]) -> dict[str, Any]:
    """``_split``'s inverse."""
    tree = dict(arrays)
    for path, value in host.items():
        *parents, name = path.split("/")
        node = tree
        for parent in parents:
            node[parent] = node = dict(node.get(parent, {}))
        data = np.asarray(value["data"], dtype=jax.numpy.dtype(value["dtype"]))
        node[name] = data.reshape(value["shape"])
    return tree


class PeerSnapshots:
    """The snapshot manager ``shardax.loop.Snapshots`` and a restart use, each process's
    copy in ``directory/process<i>`` (host memory: ``/dev/shm``), a peer's fetched where
    it is gone. ``like``: the state (its mesh and replica axis are checked here).
    Asynchronous; the ``max_to_keep`` newest kept."""

    def __init__(self, directory: str | os.PathLike[str], like: Any, max_to_keep: int = 2) -> None:
        from orbax.checkpoint.experimental.emergency.p2p import checkpoint_manager, options

        mesh = _mesh(like)
        self._target = _split(abstract_saveable(like))[0]  # the mesh arrays, abstract
        self.pairs = paired_mesh(mesh) if _sharded_over(self._target, AXIS) else None
        if self.pairs is not None:
            mesh, self._target = self.pairs, _abstract_on(self.pairs, self._target)
        index = replica_axis(mesh, self._target, AXIS if self.pairs is None else COPIES)
        self.root = Path(directory)
        self.directory = str(self.root / f"process{jax.process_index()}")
        self.fetched = False  # the last restore's shards came from a peer
        self._to_pairs: dict[Any, Any] = {}  # tree structure -> its jitted reshard
        local = options.LocalCheckpointOptions(save_interval_steps=1, max_to_keep=max_to_keep)
        opts = options.CheckpointManagerOptions(local=local, replica_axis_index=index)
        if mesh.devices.ndim == 1:  # orbax's replica_devices flattens an array it indexes
            mesh = jax.sharding.Mesh(mesh.devices[:, None], (*mesh.axis_names, "_"))
        # orbax's warnings on each start and save, and its error logs of a save that a
        # peer's death cut short (the launcher names the failure; the snapshot before it
        # is restored), off the output while this manager is open.
        self._chatter: _Chatter | None = _Chatter()
        logging.getLogger("absl").addFilter(self._chatter)
        _QUIET.acquire()
        try:
            self._manager = checkpoint_manager.CheckpointManager(
                mesh, self._target, self.directory, options=opts
            )
        except BaseException:
            self._quiet_off()
            raise

    def save(self, step: int, state: Any, data_state: Any = None) -> None:
        """Snapshots ``state`` and the JSON-able ``data_state`` as ``step``."""
        import orbax.checkpoint as ocp
        from orbax.checkpoint.experimental.emergency.p2p import args

        check_json("data_state", data_state)
        arrays, host = _split(to_saveable(state))
        if self.pairs is not None:  # each half of the processes holds the other's shards
            layout = jax.tree.structure(arrays)
            if layout not in self._to_pairs:  # compiled once, not at every snapshot
                shardings = _on(self.pairs, arrays)
                self._to_pairs[layout] = jax.jit(_identity, out_shardings=shardings)
            arrays = self._to_pairs[layout](arrays)
        meta = {"data_state": data_state, "leaves": other_leaves(state), "host": host}
        self._manager.save(
            step,
            args=args.Composite(state=ocp.args.PyTreeSave(arrays)),
            custom_metadata={"shardax": json.dumps(meta)},
            force=True,
        )

    def wait(self) -> None:
        """Blocks until the snapshot in flight is committed."""
        self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step of which every process's shards are held somewhere."""
        return self._manager.latest_step()

    def _meta(self, step: int) -> dict[str, Any] | None:
        """The data position and plain leaves saved with ``step`` here (None: not here)."""
        if not (Path(self.directory) / str(step)).is_dir():
            return None
        custom = self._manager.metadata(step).custom_metadata or {}
        return json.loads(custom["shardax"]) if "shardax" in custom else None

    def restore(self, like: Any, step: int | None = None) -> Restored:
        """Restores ``step`` (default: the latest) onto ``like``'s tree and shardings,
        this process's shards from its own copy or, where that is gone, a peer's."""
        import orbax.checkpoint as ocp
        from orbax.checkpoint.experimental.emergency.p2p import args

        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no snapshot in {self.root}")
        from orbax.checkpoint.experimental.emergency.path import sync_global_data

        mine = self._meta(step)  # every process's, by JAX's collectives
        metas = [m["meta"] for m in sync_global_data({"meta": mine}) if m["meta"] is not None]
        if not metas:
            raise FileNotFoundError(f"snapshot step {step}: no process holds its metadata")
        self.fetched = mine is None
        target = _split(abstract_saveable(like))[0]
        laid = target if self.pairs is None else _abstract_on(self.pairs, target)
        restored = self._manager.restore(
            step, args=args.Composite(state=ocp.args.PyTreeRestore(laid))
        )["state"]
        if self.pairs is not None:  # back onto the state's own shardings
            restored = _reshard(restored, jax.tree.map(lambda x: x.sharding, target))
        if self.fetched:
            print(
                f"shardax: process {jax.process_index()}: step {step}'s snapshot was not in "
                f"this host's memory ({self.directory}); its shards came from a peer's copy",
                file=sys.stderr,
                flush=True,
            )
        saved = _join(restored, metas[0]["host"])
        state = with_other_leaves(from_saveable(like, saved), metas[0]["leaves"])
        return Restored(state, metas[0]["data_state"], step)

    def _quiet_off(self) -> None:
        if self._chatter is not None:
            logging.getLogger("absl").removeFilter(self._chatter)
            _QUIET.release()
            self._chatter = None

    def close(self) -> None:
        try:
            self._manager.close()
        finally:
            self._quiet_off()

    def __enter__(self) -> PeerSnapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
