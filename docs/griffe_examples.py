"""A griffe extension for the API reference: docstring examples render as code.

shardax's docstrings write their examples as bare doctest lines (``>>> ...`` and the output
below, as ``tests/test_docs.py`` runs them), without a Google ``Examples:`` heading. Markdown
reads such lines as nested blockquotes; this extension turns each doctest block (a ``>>>``
line and the lines after it up to a blank line) into an ``Examples:`` section, which
mkdocstrings renders as highlighted Python console code. The source stays as it is.

>>> as_examples_sections("Adds.\\n>>> 1 + 1\\n2\\n\\nMore.").splitlines()
['Adds.', '', 'Examples:', '    >>> 1 + 1', '    2', '', 'More.']
"""

import re

import griffe

_FENCE = re.compile(r"^\s*(```|~~~)")
# Doctest's own directives (# doctest: +SKIP) are for the test run, not for readers.
_DIRECTIVE = re.compile(r"\s*#\s*doctest:\s*[+-]\w+(?:\s*,\s*[+-]\w+)*\s*$")


def as_examples_sections(text: str) -> str:
    """``text`` with each top-level doctest block under an ``Examples:`` heading.

    A block already in a section (indented, as under ``Examples:``) or in a fenced code
    block is left as it is.
    """
    lines, out, i, fenced = text.splitlines(), [], 0, False
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        if out and out[-1].strip():
            out.append("")  # a section starts after a blank line
        out.append("Examples:")
        while i < len(lines) and lines[i].strip():
            out.append("    " + _DIRECTIVE.sub("", lines[i]))
            i += 1
    return "\n".join(out)


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:  # an alias is documented where it is defined
            yield from _objects(member)


class Examples(griffe.Extension):
    """Rewrites every docstring of the package's objects with :func:`as_examples_sections`."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        if pkg.path != "shardax":
            return
        for obj in _objects(pkg):
            if obj.docstring is not None and ">>>" in obj.docstring.value:
                obj.docstring.value = as_examples_sections(obj.docstring.value)
