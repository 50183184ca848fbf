"""The optional extras (``pyproject.toml``'s ``[project.optional-dependencies]``), reached
where first used: ``import shardax`` loads none of them.

``require`` imports one, or raises an ``ImportError`` naming what needed it and the extra
that installs it; ``pyplot`` is matplotlib's on the non-interactive Agg backend.
``equinox`` imports nothing: an Equinox module (or ``eqx.nn.State``) can exist only once
the user has imported equinox, so where it is not imported no object is one.

>>> require("json", "none", "this example").dumps([1])
'[1]'
>>> is_equinox([1.0])
False
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


def require(module: str, extra: str, needed_by: str) -> ModuleType:
    """``module`` imported; where it is missing, an ``ImportError`` saying ``needed_by``
    needs it and ``pip install 'shardax[<extra>]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise ImportError(f"{needed_by} needs {package}: pip install 'shardax[{extra}]'") from e


def pyplot(needed_by: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no window), from ``shardax[plot]``."""
    require("matplotlib", "plot", needed_by).use("Agg")
    return require("matplotlib.pyplot", "plot", needed_by)


def equinox() -> ModuleType | None:
    """``equinox`` where the user has imported it, else None (then no object is an
    Equinox module, and equinox stays unloaded)."""
    return sys.modules.get("equinox")


def is_equinox(x: Any) -> bool:
    """Whether ``x`` is an Equinox module (``eqx.Module``)."""
    eqx = equinox()
    return eqx is not None and isinstance(x, eqx.Module)
