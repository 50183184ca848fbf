"""What a command needs beyond shardax's own dependencies: its extras, found before it
runs, and how to install one (the extra, and the package alone, which works whether
shardax came from a clone, a wheel or a package index).

The package each extra installs is read from shardax's installed metadata
(pyproject's ``[project.optional-dependencies]``), so the hint cannot drift from it.

>>> available("json"), available("no_such_module_here")
(True, False)
>>> install_hint("demo")  # doctest: +ELLIPSIS
"pip install 'shardax[demo]' (or the package alone: pip install 'scikit-learn>=...')"
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re


def available(module: str) -> bool:
    """Whether ``module`` (``"sklearn.datasets"``, ``"matplotlib"``) can be imported,
    found without importing it (its parent packages are imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def packages(extra: str) -> list[str]:
    """The requirements shardax's ``extra`` installs, from its installed metadata (empty
    where shardax is not installed as a distribution)."""
    try:
        requires = importlib.metadata.requires("shardax") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    marker = re.compile(rf"""extra\s*==\s*['"]{re.escape(extra)}['"]""")
    return [r.split(";")[0].strip() for r in requires if marker.search(r)]


def install_hint(extra: str) -> str:
    """How to install ``extra``: ``pip install 'shardax[extra]'``, and its packages alone."""
    alone = " ".join(f"'{p}'" for p in packages(extra))
    return f"pip install 'shardax[{extra}]'" + (
        f" (or the package alone: pip install {alone})" if alone else ""
    )


def missing(needs: dict[str, str]) -> dict[str, str]:
    """Of ``needs`` (``{module: extra}``), the modules that cannot be imported."""
    return {module: extra for module, extra in needs.items() if not available(module)}
