"""A griffe extension for the API reference: each namespace's ``__all__`` is its row of
``shardax._names.EXPORTS`` (``__all__ = _exports(__name__)``), which griffe cannot read from
the source; this hands griffe the same rows. The table is read from its file, without
importing shardax (and JAX).

The top-level page (``docs/api/shardax.md``, ``members_order: __all__``) reads in the order
of :data:`FIRST`, the calls of a first run, then the rest of the row, and the seed's artifex
facades (the row of ``shardax.artifex``) last."""

import importlib.util
import pathlib

import griffe

_SOURCE = pathlib.Path(__file__).parents[1] / "src" / "shardax" / "_names.py"

FIRST = (
    *("prepare", "make_mesh", "fsdp", "make_train_step", "TrainState", "batches"),
    *("prefetch_to_device", "verify", "describe", "initialize", "CheckpointManager"),
    *("make_eval_step", "keep_plan", "replicate", "zero1", "zero2", "rules", "from_nnx"),
    *("from_linen", "shard"),
)


def _exports() -> dict[str, tuple[str, ...]]:
    spec = importlib.util.spec_from_file_location("shardax_names", _SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXPORTS


def reading_order(names: tuple[str, ...], last: tuple[str, ...]) -> list[str]:
    """``names`` with :data:`FIRST` first and ``last`` last, the rest in between as given."""
    first = [n for n in FIRST if n in names]
    tail = [n for n in names if n in last and n not in first]
    rest = [n for n in names if n not in first and n not in tail]
    return first + rest + tail


class Exports(griffe.Extension):
    """Sets each namespace's exports from ``shardax._names.EXPORTS``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.path != "shardax":
            return
        exports = _exports()
        for namespace, names in exports.items():
            if namespace == "shardax":
                pkg.exports = reading_order(names, exports["shardax.artifex"])
            else:
                pkg.get_member(namespace.split(".", 1)[1]).exports = list(names)
