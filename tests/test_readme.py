"""README examples run as written (in this process, on its 8 simulated devices)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def first_python_block(heading: str) -> str:
    section = README.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.parametrize("heading", ["Sharding plans", "Auto or Explicit mesh axes"])
def test_readme_example_runs(heading, capsys):
    exec(compile(first_python_block(heading), f"README: {heading}", "exec"), {})
    out = capsys.readouterr().out
    if heading == "Auto or Explicit mesh axes":
        assert "float32[64@data,256@model]" in out
    else:
        assert "params/1/0" in out and "'model'" in out
