"""``sx.batches``: batches of in-memory (or memory-mapped) arrays, each process reading its share.

The order of an epoch depends only on ``seed`` and the epoch number, never on the number of
processes: global batch ``i`` is rows ``order[i*B:(i+1)*B]``, and process ``p`` of ``P``
reads only the ``p``-th of its ``P`` equal slices. So the batches that
[`shardax.global_batch`][shardax.global_batch] assembles are the same on 1, 2 or 64 hosts,
and the position ``(epoch, index)`` (see
[`Batches.get_state`][shardax.data.Batches.get_state]) resumes exactly on any number of
them.

>>> data = {"x": np.arange(10.0)[:, None], "y": np.arange(10)}
>>> it = batches(data, 4, shuffle=True, seed=0, policy="pad")
>>> [int(b["mask"].sum()) for b in it]
[4, 4, 2]
>>> with sx.prefetch_to_device(batches(data, 8, policy="drop"), sx.make_mesh()) as it:
...     for batch in it:
...         print(batch["x"].shape, batch["x"].sharding.spec)
(8, 1) P('data',)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from shardax.checks import as_count, expect_type, public
from shardax.data.policy import MASK, check_policy, num_batches, pad_batch
from shardax.plan.tree import is_array, path_str


def _num_examples(arrays: Any) -> int:
    """The leading dimension shared by every leaf of ``arrays``; raises naming them if not."""
    leaves = jax.tree_util.tree_leaves_with_path(arrays)
    if not leaves:
        raise ValueError("arrays has no leaves")
    sizes = {}
    for path, x in leaves:
        if not (is_array(x) or hasattr(x, "__getitem__")) or np.ndim(x) == 0:
            raise ValueError(
                f"leaf {path_str(path)!r} must be an array with a leading example "
                f"dimension, got {type(x).__name__} of shape {np.shape(x)}"
            )
        sizes[path_str(path)] = np.shape(x)[0]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the leaves of arrays differ in their number of rows: {sizes}")
    return next(iter(sizes.values()))


@public("sx.data.Batches")
class Batches(Iterator[Any]):
    """The iterator [`batches`][shardax.batches] returns; ``get_state()`` / ``set_state()`` give its
    position ``{"epoch", "index"}`` (index = the next batch of that epoch)."""

    def __init__(
        self,
        arrays: Any,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        policy: str,
        num_epochs: int | None,
        process_index: int,
        process_count: int,
    ) -> None:
        check_policy(policy)
        expect_type("shuffle", shuffle, bool, "True or False")
        batch_size = as_count("batch_size", batch_size)
        seed = as_count("seed", seed, minimum=0)
        process_count = as_count("process_count", process_count)
        process_index = as_count("process_index", process_index, minimum=0)
        if num_epochs is not None:
            num_epochs = as_count("num_epochs (or None for no end)", num_epochs)
        if not 0 <= process_index < process_count:
            raise ValueError(
                f"process_index must be in [0, process_count), got process_index="
                f"{process_index} and process_count={process_count}"
            )
        if batch_size % process_count:
            raise ValueError(
                f"the global batch_size {batch_size} is not divisible by "
                f"process_count {process_count}; each process reads an equal share"
            )
        if policy == "pad" and (not isinstance(arrays, dict) or MASK in arrays):
            raise ValueError(
                "policy='pad' adds a top-level 'mask' leaf, so arrays must be a dict "
                f"without one, got {type(arrays).__name__}"
                + (f" with keys {sorted(arrays)}" if isinstance(arrays, dict) else "")
            )
        self.num_examples = _num_examples(arrays)
        if self.num_examples == 0:
            raise ValueError(
                "arrays has 0 examples (every leaf has 0 rows); there is nothing to batch"
            )
        self.steps_per_epoch = num_batches(self.num_examples, batch_size, policy)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"batch_size {batch_size} is larger than the {self.num_examples} "
                f"examples, so policy={policy!r} leaves no batch; use a smaller batch_size or "
                "policy='pad'"
            )
        if batch_size > self.num_examples:
            warnings.warn(
                f"batches: batch_size {batch_size} is larger than the {self.num_examples} "
                f"examples: every batch is {1 - self.num_examples / batch_size:.1%} padding",
                stacklevel=3,
            )
        self.batch_size, self.local_batch_size = batch_size, batch_size // process_count
        self.shuffle, self.seed, self.policy, self.num_epochs = shuffle, seed, policy, num_epochs
        self.process_index, self.process_count = process_index, process_count
        self._arrays = arrays
        self._epoch, self._index = 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The example order of ``epoch``: a function of ``seed`` and ``epoch`` only."""
        if self._order is None or self._order[0] != epoch:
            n = self.num_examples
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(n) if self.shuffle else np.arange(n))
        return self._order[1]

    def local_batch(self, epoch: int, index: int) -> Any:
        """This process's share of global batch ``index`` of ``epoch``."""
        start = index * self.batch_size + self.process_index * self.local_batch_size
        positions = np.arange(start, start + self.local_batch_size)
        rows = self.order(epoch)[positions[positions < self.num_examples]]
        batch = jax.tree.map(lambda a: np.asarray(a[rows]), self._arrays)
        return pad_batch(batch, self.local_batch_size) if self.policy == "pad" else batch

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Any:
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        batch = self.local_batch(self._epoch, self._index)
        self._index += 1
        if self._index == self.steps_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return batch

    def get_state(self) -> dict[str, int]:
        """The position of the next batch, and what it depends on (checked on restore)."""
        return {
            "epoch": self._epoch,
            "index": self._index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": self.num_examples,
        }

    def set_state(self, state: dict[str, int]) -> None:
        """Moves to ``state`` (from [`get_state`][shardax.data.Batches.get_state], on any number of
        processes)."""
        mine = self.get_state()
        expect_type("state", state, dict, "a dict from get_state()")
        missing = [key for key in ("epoch", "index") if key not in state]
        if missing:
            raise ValueError(
                f"state must hold 'epoch' and 'index' (as get_state() "
                f"gives, e.g. {mine}); {', '.join(map(repr, missing))} missing from {state!r:.80}"
            )
        for key in ("seed", "batch_size", "num_examples"):
            if key in state and int(state[key]) != mine[key]:
                raise ValueError(
                    f"the state was saved with {key}={state[key]}, but this "
                    f"loader has {key}={mine[key]}; the position would not mean the same batch"
                )
        epoch = as_count("state['epoch']", state["epoch"], minimum=0)
        index = as_count("state['index']", state["index"], minimum=0)
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise ValueError(
                f"epoch must be >= 0 and index in [0, {self.steps_per_epoch}),"
                f" got epoch={epoch}, index={index}"
            )
        self._epoch, self._index = epoch, index


@public("sx.batches")
def batches(
    arrays: Any,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    policy: str = "error",
    num_epochs: int | None = 1,
    process_index: int | None = None,
    process_count: int | None = None,
) -> Batches:
    """Iterates over process-local shares of global batches of ``arrays``.

    Args:
      arrays: a pytree of arrays (NumPy, memory-mapped, ...) with the same number of rows.
      batch_size: the *global* batch size; each process gets ``batch_size // process_count``.
      shuffle, seed: a new permutation per epoch, from ``(seed, epoch)``.
      policy: for a last batch smaller than ``batch_size``: ``"error"`` (raised here, naming
        the sizes), ``"drop"`` or ``"pad"`` (zeros, and a boolean ``"mask"`` leaf in every
        batch; arrays must be a dict).
      num_epochs: how many epochs to yield; None for no end.
      process_index, process_count: this process's place; default ``jax.process_index()``
        and ``jax.process_count()``.

    Returns a [`Batches`][shardax.data.Batches] iterator with ``get_state()`` and ``set_state()``.
    """
    return Batches(
        arrays,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        policy=policy,
        num_epochs=num_epochs,
        process_index=jax.process_index() if process_index is None else process_index,
        process_count=jax.process_count() if process_count is None else process_count,
    )
