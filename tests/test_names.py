"""The public surface is one table (``shardax._names``): each namespace's ``__all__`` is its
row, the names that left one warn from it, every door's error prefix is a name of it, and no
docstring sends a reader to a name that left it or to a page that does not exist."""

import ast
import importlib
import pathlib
import pkgutil
import re
import warnings

import shardax as sx
from shardax import _names, checks
from shardax.checks import public_name

SRC = pathlib.Path(sx.__file__).parent


def reach(name: str):
    """``sx.plan.fsdp`` from ``import shardax as sx``, as a user writes it; a moved name
    warns (an error here)."""
    obj = sx
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
    return obj


def every_module() -> list:
    modules = []
    for info in pkgutil.walk_packages(sx.__path__, "shardax."):
        if not info.name.endswith("__main__"):
            modules.append(importlib.import_module(info.name))
    return modules


def docstrings():
    """``(path, node name, docstring)`` of every module, class and function of shardax."""
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            if isinstance(node, kinds) and ast.get_docstring(node):
                name = getattr(node, "name", "")
                yield path.relative_to(SRC).as_posix(), name, ast.get_docstring(node)


def test_each_namespace_exports_its_row_and_binds_nothing_else():
    stray = []
    for namespace, row in _names.EXPORTS.items():
        space = importlib.import_module(namespace)
        assert space.__all__ == list(row), namespace
        assert not set(row) & set(_names.MOVED.get(namespace, {})), namespace
        for name in row:
            reach(f"{_names.spelled(namespace)}.{name}")
        if not hasattr(space, "__path__"):
            continue  # a module (artifex) defines its helpers beside its names
        for name, value in vars(space).items():
            submodule = getattr(value, "__name__", None) == f"{namespace}.{name}"
            if not (name.startswith("_") or name in row or submodule):
                stray.append(f"{namespace}.{name}")
    assert not stray, f"bound in a namespace but not in its row of shardax/_names.py: {stray}"


def test_every_door_is_named_as_users_import_it():
    doors = {}
    for module in every_module():
        for value in vars(module).values():
            name = public_name(value)
            if name is not None and getattr(value, "__module__", "").startswith("shardax."):
                doors[name] = value
    assert checks.REFUSED == [], "doors named for what users cannot call:\n" + "\n".join(
        checks.REFUSED
    )
    unreachable = []
    for name in doors:
        try:
            reach(name)
        except (AttributeError, DeprecationWarning) as e:
            unreachable.append(f"{name}: {e}")
    assert not unreachable, "error prefixes users cannot import:\n" + "\n".join(unreachable)
    assert {"sx.fsdp", "sx.plan.init_sharded", "sx.DataParallel.shard_batch"} <= set(doors)


def test_a_door_on_a_helper_is_refused_and_names_nothing():
    from shardax.plan import tree

    refused = checks.public("sx.plan.is_array")(tree.is_array)
    assert refused is tree.is_array and public_name(refused) is None
    assert checks.REFUSED.pop().startswith("@public('sx.plan.is_array') on shardax.plan.tree")


def test_no_docstring_names_a_name_that_left():
    old = {
        f"{_names.spelled(space)}.{name}"
        for table in (_names.MOVED, _names.RETIRED)
        for space, homes in table.items()
        for name in homes
    }
    found = []
    for path, node, doc in docstrings():
        if (path, node) == ("checks.py", "moved"):
            continue  # the one that shows how a moved name warns
        for ref in re.findall(r"\b(?:sx|shardax)(?:\.\w+)+", doc):
            parts = _names.spelled(ref).split(".") if ref.startswith("shardax") else ref.split(".")
            hits = {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & old
            found += [f"{path} ({node or 'module'}): {ref}" for _ in hits]
    assert not found, "docstrings naming a name that left (use its home):\n" + "\n".join(found)


def test_docstrings_link_with_autorefs_to_public_names():
    """``[`fsdp`][shardax.fsdp]`` resolves (``mkdocs build --strict`` checks the pages); a
    Sphinx role (``:func:`...```) would show as plain text, unchecked."""
    roles, broken = [], []
    for path, node, doc in docstrings():
        roles += [f"{path} ({node}): {r}" for r in re.findall(r":\w+:`[^`]+`", doc)]
        for target in re.findall(r"\]\[(shardax[\w.]*)\]", doc):
            try:
                reach(_names.spelled(target))
            except (AttributeError, DeprecationWarning):
                broken.append(f"{path} ({node}): {target}")
    assert not roles, "Sphinx roles (write [`name`][shardax.x.name] or ``name``):\n" + "\n".join(
        roles
    )
    assert not broken, "cross-references to no public name:\n" + "\n".join(broken)
