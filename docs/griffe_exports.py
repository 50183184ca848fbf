"""A griffe extension for the API reference: each namespace's ``__all__`` is its row of
``shardax._names.EXPORTS`` (``__all__ = _exports(__name__)``), which griffe cannot read from
the source; this hands griffe the same rows. The table is read from its file, without
importing shardax (and JAX)."""

import importlib.util
import pathlib

import griffe

_SOURCE = pathlib.Path(__file__).parents[1] / "src" / "shardax" / "_names.py"


def _exports() -> dict[str, tuple[str, ...]]:
    spec = importlib.util.spec_from_file_location("shardax_names", _SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EXPORTS


class Exports(griffe.Extension):
    """Sets each namespace's exports from ``shardax._names.EXPORTS``."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.path != "shardax":
            return
        for namespace, names in _exports().items():
            module = pkg if namespace == "shardax" else pkg.get_member(namespace.split(".", 1)[1])
            module.exports = list(names)
