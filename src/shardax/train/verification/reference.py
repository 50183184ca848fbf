"""The reference: the step on one device, the mesh's first, over the whole probe batch.

It runs under a one-device mesh with the distributed mesh's axis names and types (so a
model's own sharding annotations and ``sx.constrain`` still apply) and in the distributed
mesh's sequence layout (a zig-zag batch keeps its C, ``laid_out_for``). A reference that
does not fit on the device, the state and batch alone or once it runs out of memory, is
refused plainly.

>>> ref = Reference.on(one_device_mesh(mesh), mesh, {"x": np.ones((8, 4))})
>>> ref.mesh1.axis_names, ref.mesh1.size, ref.examples
(('data',), 1, 8)
>>> ref(lambda x: x + 1, ref.put(np.ones(2))).sharding.device_set == {ref.device}
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardax.parallel.context import laid_out_for
from shardax.plan.tree import is_array, is_key
from shardax.train.verification.rows import batch_size


def one_device_mesh(mesh: Mesh) -> Mesh:
    """A mesh of ``mesh``'s first device with the same axis names and types (each of
    size 1), so a model's sharding annotations and ``sx.constrain`` still apply."""
    devices = np.asarray(mesh.devices.flat[0]).reshape((1,) * len(mesh.axis_names))
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def place(tree: Any, sharding: Any) -> Any:
    """The array leaves of ``tree`` put on ``sharding``."""
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if is_array(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class Reference:
    """Where the reference runs: ``device``, the first of the distributed ``mesh`` (None:
    the first device, no mesh), under ``mesh1``; ``sharding`` replicates on it;
    ``examples``: the probe batch's size (for the error when it does not fit)."""

    mesh: Mesh | None
    mesh1: Mesh | None
    device: Any
    sharding: Any
    examples: int

    @classmethod
    def on(cls, mesh1: Mesh | None, mesh: Mesh | None, batch: Any) -> Reference:
        """The reference on ``mesh1`` (``one_device_mesh`` of ``mesh``) or, with no
        mesh, on the first device."""
        if mesh1 is None:
            device = jax.devices()[0]
            return cls(mesh, None, device, device, batch_size(batch))
        sharding = NamedSharding(mesh1, PartitionSpec())
        return cls(mesh, mesh1, mesh1.devices.flat[0], sharding, batch_size(batch))

    def put(self, tree: Any) -> Any:
        """``tree``'s arrays on the device."""
        return place(tree, self.sharding)

    def copy(self, x: jax.Array) -> jax.Array:
        """A copy of ``x`` on the device, in a buffer of its own: the user's step may donate
        it. Moving a replicated array there reuses its shard's buffer, ``may_alias=False``
        or not (it holds for the same sharding only), so the copy is made there."""
        return jax.device_put(jax.device_put(x, self.sharding), self.sharding, may_alias=False)

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the one-device mesh, in the distributed mesh's sequence
        layout; running out of memory is said plainly."""
        try:
            if self.mesh is None:
                return fn(*args)
            with laid_out_for(self.mesh), jax.sharding.set_mesh(self.mesh1):
                return fn(*args)
        except Exception as e:
            if _out_of_memory(e):
                raise _too_big(self.device, self.examples, e) from e
            raise

    def check_fits(self, *trees: Any) -> None:
        """Refuses plainly when ``trees`` (the state and the batch) alone exceed the
        device's free memory."""
        stats = self.device.memory_stats() if hasattr(self.device, "memory_stats") else None
        if not stats or not stats.get("bytes_limit"):
            return
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if sum(_tree_bytes(t) for t in trees) > free:
            raise _too_big(self.device, self.examples)


def _tree_bytes(tree: Any) -> int:
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(tree)
        if is_array(x) and not is_key(x)
    )


def _too_big(device: Any, n: int, error: Exception | None = None) -> ValueError:
    why = f": {str(error).splitlines()[0]}" if error is not None else ""
    return ValueError(
        f"sx.verify runs the reference on one device ({device}) with the whole batch of "
        f"{n} examples and a whole copy of the state, and that does not fit{why}. Pass a "
        "smaller probe batch (a few examples per device is enough)"
    )


def _out_of_memory(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
