"""Batch placement: how a step checks a batch and places it for its mesh and mode.

A ``BatchPlacement`` is built from a step's [`StepConfig`][shardax.train.StepConfig]:

- ``check``: a list of examples divisible by the data axis size
  (× ``accumulate``), or with a ``batch_spec`` arrays placed as it says; where rows are
  split as examples (shard_map, pmap, ``accumulate``), a batch whose type says it is
  not one (a graph batch, a sparse array) is refused, whatever its leaves' sizes;
- ``place`` (``"jit"``): rows over the data axis, the sequence over
  ``seq_axis``, or each leaf as ``batch_spec`` says; the step's ``place_batch``;
- ``on_device`` (``"single"``) and ``per_device``
  (``"pmap"``: ``(devices, per device, ...)``).

>>> placement = BatchPlacement(sx.train.StepConfig(mesh=sx.make_mesh({"data": -1})))
>>> placement.place({"x": np.ones((16, 4))})["x"].sharding.spec
P('data',)
"""

from __future__ import annotations

import collections
from typing import Any

import jax
from jax.sharding import SingleDeviceSharding

from shardax.data.leaves import Leaves, batch_leaves, check_leaves, not_examples
from shardax.data.placement import batch_sharding
from shardax.data.spec import batch_shardings, place_by_spec
from shardax.plan.core import axis_size
from shardax.plan.tree import path_str
from shardax.runtime.processes import device_put_global
from shardax.train.batch import batch_structure, check_batch, check_mask_has_examples
from shardax.train.config import StepConfig

BATCH_CACHE_SIZE = 16
"""How many batch structures a step keeps checked (and their ``batch_spec`` shardings)."""


class BatchPlacement:
    """The batch checks and placements of a step built with ``config``.

    Attributes: ``sharding`` (rows over the data axis), ``device`` (``"single"``'s
    device), ``by_leaf`` (whether the jit program takes the batch placed leaf by leaf:
    with ``seq_axis`` or ``batch_spec``).
    """

    def __init__(self, config: StepConfig) -> None:
        mesh, mode, data_axis = config.mesh, config.mode, config.data_axis
        self.mesh, self.seq_axis, self.batch_spec = mesh, config.seq_axis, config.batch_spec
        self.devices = 1 if mode == "single" else axis_size(mesh, data_axis)
        self.divisor = self.devices * config.accumulate
        self.what = f"the data axis size {self.devices}" if mode != "single" else "1"
        if config.accumulate > 1:
            self.what = f"{self.what} × accumulate={config.accumulate} = {self.divisor}"
        self.sharding = batch_sharding(mesh, data_axis)
        self.seq_sharding = None
        if self.seq_axis is not None:
            self.seq_sharding = batch_sharding(mesh, data_axis, seq_axis=self.seq_axis)
        self.device = SingleDeviceSharding(mesh.devices.flat[0])
        self.by_leaf = self.seq_axis is not None or self.batch_spec is not None
        # what splits the batch's rows as examples (shard_map, pmap, accumulate)
        self.splits_rows = [f"mode={mode!r}"] if mode in ("shard_map", "pmap") else []
        self.splits_rows += [f"accumulate={config.accumulate}"] if config.accumulate > 1 else []
        # batch structure -> its batch_spec shardings (True without one): checked once
        self._checked: collections.OrderedDict[Any, Any] = collections.OrderedDict()

    def check(self, batch: Any) -> Any:
        """A list of examples (``check_batch``), or with a ``batch_spec`` arrays placed as
        it says: checked once per batch structure (``batch_structure``), not per step; a
        host mask's values (``check_mask_has_examples``) on every batch, once (by
        ``check_batch`` on a new structure without a ``batch_spec``). Returns the
        ``batch_spec`` shardings (True without one)."""
        key = batch_structure(batch)
        known = self._checked.get(key) if key is not None else None
        if known is not None:
            check_mask_has_examples(batch)
            self._checked.move_to_end(key)
            return known
        flat = batch_leaves(batch)  # the one walk of the batch that its checks share
        if self.batch_spec is None:
            self._check_examples(flat)
            check_batch(batch, divisor=self.divisor, what=self.what, flat=flat)
            known = True
        else:
            check_mask_has_examples(batch)
            check_leaves(flat, arrays_only=True)
            known = batch_shardings(batch, self.mesh, self.batch_spec)
        if key is not None:
            self._checked[key] = known
            if len(self._checked) > BATCH_CACHE_SIZE:
                self._checked.popitem(last=False)
        return known

    def _check_examples(self, flat: Leaves) -> None:
        """Refuses a batch whose type says its leaves are not examples (a graph batch, a
        sparse array: ``not_examples``) where the step splits
        rows as examples, even when its leaves happen to agree on their size."""
        found = not_examples(flat) if self.splits_rows else []
        if not found:
            return
        path, what = found[0]
        where = f"batch leaf {path!r} is" if path else "the batch is"
        raise ValueError(
            f"{where} {what}, whose rows are not examples, but "
            f"{' and '.join(self.splits_rows)} splits every leaf's rows as if they were: "
            "each device or microbatch would get rows that do not make whole examples "
            "and train a different model, even where the leaves' sizes agree. Use "
            "mode='jit' with accumulate=1 (XLA sees the whole batch; batch_spec= says "
            "how each leaf is placed), or batch one example per row (e.g. one padded "
            "graph per row)"
        )

    def place(self, batch: Any) -> Any:
        """``batch`` placed as the step takes it under ``"jit"``: rows over the data axis,
        and with ``seq_axis`` dimension 1 of each leaf of rank >= 2 over that axis; with
        ``batch_spec``, each leaf as it says. Leaves already placed so pass untouched."""
        if self.batch_spec is not None:
            # the shardings of a structure the step checked (its mask's values were read)
            key = batch_structure(batch)
            known = self._checked.get(key) if key is not None else None
            shardings = self.check(batch) if known is None else known
            return place_by_spec(batch, self.mesh, self.batch_spec, shardings)

        def place(path: str, x: Any) -> Any:
            if not hasattr(x, "ndim") or x.ndim == 0:
                return x
            target = self.sharding
            if self.seq_sharding is not None and x.ndim >= 2:
                target = self.seq_sharding
                size = axis_size(self.mesh, self.seq_axis)
                if x.shape[1] % size:
                    raise ValueError(
                        f"batch leaf {path or '<root>'!r} has {x.shape[1]} positions along "
                        f"dimension 1 (the sequence), not divisible by seq_axis "
                        f"{self.seq_axis!r} of size {size}; pad the sequence to a multiple "
                        f"of {size}"
                    )
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(target, x.ndim):
                return x
            if isinstance(x, jax.ShapeDtypeStruct):  # lowering for abstract values
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
            return device_put_global(x, target)

        return jax.tree_util.tree_map_with_path(lambda p, x: place(path_str(p), x), batch)

    def on_device(self, batch: Any) -> Any:
        """The batch on the step's device; a batch placed over the mesh (``distribute_batch``,
        ``global_batch``, ``prefetch_to_device``) is gathered there."""
        device = self.device
        return jax.tree.map(
            lambda x: (
                jax.device_put(x, device)
                if isinstance(x, jax.Array) and x.sharding != device
                else x
            ),
            batch,
        )

    def per_device(self, batch: Any) -> Any:
        """``pmap``'s layout: each leaf reshaped to ``(devices, per device, ...)``."""
        n = self.devices
        return jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
