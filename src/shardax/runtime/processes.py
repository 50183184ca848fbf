"""Working across processes: who prints, and host values reduced over every process.

In a multi-process run every process executes the same program. Printing and progress bars
come from process 0 ([`is_main_process`][shardax.is_main_process],
[`print0`][shardax.print0]); values computed on the host of each process are combined with
[`host_reduce`][shardax.runtime.host_reduce], and global arrays are brought to every host
with [`host_value`][shardax.runtime.host_value]. Both use XLA collectives (gloo on CPU,
NCCL on GPU) through ``jax.experimental.multihost_utils``.

>>> import shardax as sx
>>> sx.print0("printed once, by process 0")
printed once, by process 0
>>> float(sx.runtime.host_reduce(np.float32(2.0), "sum"))  # one process: unchanged
2.0
"""

from __future__ import annotations

import builtins
from typing import Any, Literal

import jax
import numpy as np
from jax.experimental import multihost_utils

from shardax.checks import public

_HOST_REDUCERS = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min}


def device_put_global(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` that also works for host values across processes.

    NumPy leaves are first cast to JAX's dtype for them (float64 -> float32 unless x64 is
    on). JAX checks that a host value put onto devices of every process is the same on
    each, by all-gathering it in JAX's dtype and comparing with the original: a float64
    value would fail that check on every process although all pass the same data. In a
    multi-process run, an array on this process's own devices (a model every process
    built alike) goes as its NumPy value, a PRNG key array as its key data, wrapped again.
    """

    several = jax.process_count() > 1
    keys: list[Any] = []  # each PRNG key leaf's implementation, None for the other leaves

    def canonical(x: Any) -> Any:
        if several and isinstance(x, jax.Array) and x.is_fully_addressable:
            # An array on this process's devices (a model built here, as every process
            # builds it) cannot go to devices of other processes: its value goes as NumPy,
            # a key array's as its data (wrapped again once placed).
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                keys.append(jax.random.key_impl(x))
                return np.asarray(jax.random.key_data(x))
            x = np.asarray(x)
        keys.append(None)
        if isinstance(x, np.ndarray | np.generic):
            return np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype))
        return x

    def rewrap(x: Any, impl: Any) -> Any:
        return x if impl is None else jax.random.wrap_key_data(x, impl=impl)

    try:
        placed = jax.device_put(jax.tree.map(canonical, tree), shardings)
        if not any(impl is not None for impl in keys):
            return placed
        leaves, treedef = jax.tree.flatten(placed)
        return jax.tree.unflatten(treedef, list(map(rewrap, leaves, keys)))
    except jax.errors.JaxRuntimeError as e:
        refused = compile_only_refusal(e, shardings)
        if refused is None:
            raise
        raise refused from None


def compile_only_refusal(error: BaseException, shardings: Any) -> ValueError | None:
    """The ``ValueError`` to raise for ``error``, a placement onto compile-only devices
    (``sx.target``'s: they hold no arrays) refused by JAX in its own words, naming the
    devices and what to do instead; None for any other error."""
    if "compile-only client" not in str(error):
        return None
    first = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    devices = sorted(first[0].device_set, key=lambda d: d.id) if first else []
    what = f"{len(devices)} x {devices[0].device_kind}" if devices else "compile-only devices"
    return ValueError(
        f"the devices to place on are compile-only ({what}, from sx.target): they hold no "
        "arrays and run nothing, so no value can be placed on them. Compile for abstract "
        "inputs instead (jax.eval_shape, nnx.eval_shape; sx.estimate(step, state, batch)), "
        "and place arrays on a mesh of this machine's devices (sx.make_mesh without devices=)"
    )


@public("sx.is_main_process")
def is_main_process() -> bool:
    """True on process 0, the one that prints, logs and draws progress bars."""
    return jax.process_index() == 0


@public("sx.print0")
def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on process 0 only; the other processes print nothing."""
    if is_main_process():
        builtins.print(*args, **kwargs)


@public("sx.runtime.host_reduce")
def host_reduce(tree: Any, op: Literal["mean", "sum", "max", "min"] = "mean") -> Any:
    """Reduces host values (NumPy or Python numbers) of the same shape over every process.

    Every process must call it, with the same tree structure and shapes; each gets
    the same NumPy result. With one process the values come back unchanged as NumPy.
    """
    if op not in _HOST_REDUCERS:
        raise ValueError(f"op must be one of {sorted(_HOST_REDUCERS)}, got {op!r}")
    fn = _HOST_REDUCERS[op]
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    gathered = multihost_utils.process_allgather(jax.tree.map(np.asarray, tree))
    return jax.tree.map(lambda x: fn(x, axis=0), gathered)


@public("sx.runtime.host_value")
def host_value(tree: Any) -> Any:
    """Every ``jax.Array`` leaf of ``tree`` as a NumPy array on every process.

    Replicated arrays (a loss or metrics from a jitted step) are read locally;
    arrays sharded across processes are all-gathered, so every process must call it.
    """

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.sharding.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(x) if isinstance(x, jax.Array) else x

    return jax.tree.map(one, tree)
