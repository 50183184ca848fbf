"""CONTRIBUTING.md against the code: each home its vocabulary table names exists."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
SRC = ROOT / "src" / "shardax"


def vocabulary_rows() -> dict[str, list[tuple[str, str]]]:
    """Each row of the vocabulary table: its ``(path, name)`` pairs (`` `x/y.py` `NAME` ``)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text[text.index("| vocabulary | home |") :].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        vocabulary, home = line.strip().strip("|").split("|", 1)
        rows[vocabulary.strip()] = re.findall(r"`([\w/]+\.py)` `(\w+)`", home)
    return rows


def top_level_names(path: pathlib.Path) -> set[str]:
    """The names ``path`` defines at module level (assignments, functions, classes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def test_the_vocabulary_table_names_homes_that_exist():
    rows = vocabulary_rows()
    assert "modes" in rows and len(rows) >= 6, rows
    assert all(rows.values()), f"rows naming no `path.py` `NAME` home: {rows}"
    wrong = []
    for vocabulary, homes in rows.items():
        for path, name in homes:
            if not (SRC / path).is_file():
                wrong.append(f"{vocabulary}: src/shardax/{path} does not exist")
            elif name not in top_level_names(SRC / path):
                wrong.append(f"{vocabulary}: {name} is not defined in src/shardax/{path}")
    assert not wrong, "CONTRIBUTING's vocabulary table:\n" + "\n".join(wrong)
