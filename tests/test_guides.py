"""The guides' examples run as written: each section's Python blocks, in order, in one
namespace (in this process, on its 8 simulated devices)."""

import re
from pathlib import Path

import pytest

GUIDES = Path(__file__).resolve().parent.parent / "docs" / "guides"


def sections():
    for guide in sorted(GUIDES.glob("*.md")):
        for section in guide.read_text().split("\n## ")[1:]:
            blocks = re.findall(r"```python\n(.*?)```", section, re.S)
            if blocks:
                heading = section.splitlines()[0]
                yield pytest.param(
                    guide.name, heading, "\n".join(blocks), id=f"{guide.stem}: {heading}"
                )


@pytest.mark.parametrize("guide,heading,code", list(sections()))
def test_guide_section_runs(guide, heading, code, capsys):
    exec(compile(code, f"{guide}: {heading}", "exec"), {"__name__": "guide"})
    assert capsys.readouterr().out.strip()  # each section prints what it shows
