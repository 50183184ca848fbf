"""A command's settings in a file: ``--config run.yaml``, ``key=value`` overrides,
``--print-config``.

The schema is the command's own parser: a key is an option's ``dest`` (``batch_size``,
or its flag's spelling, ``batch-size``), and a value goes through the option's own type
and choices, as if given as the flag. So the file and the flags cannot drift: an option
added to ``shardax train`` is a key at once, and a key no option has is refused by name,
with the keys closest to it.

``expand`` turns the command line into the flags it means, before ``argparse`` reads
it: the file's settings first, then the ``key=value`` overrides (later wins), then the
flags given, which win over both. ``resolved`` is the inverse: a parsed run's settings as
a file holds them, which ``--print-config`` prints (YAML) and ``summary.json`` records,
so ``--print-config > run.yaml`` then ``--config run.yaml`` is the same run.

>>> import argparse
>>> parser = argparse.ArgumentParser(prog="shardax train")
>>> _ = parser.add_argument("--batch-size", type=int, default=None)
>>> _ = parser.add_argument("--verify", action="store_true")
>>> add_arguments(parser)
>>> expand(parser, ["batch_size=32", "verify=true"])
['--batch-size', '32', '--verify']
>>> resolved(parser.parse_args(["--batch-size", "32"]))
{'batch_size': 32, 'verify': False}
"""

from __future__ import annotations

import argparse
import difflib
import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml  # PyYAML: flax depends on it (and import shardax loads it)

OWN = ("help", "config", "print_config", "config_schema", "json")
"""The dests that are not settings of a run: help, this module's own options, and
``--json`` (how the result prints, given on the command line)."""

SUFFIXES = (".yaml", ".yml", ".json", ".toml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and ``--print-config``, and the schema (the parser's options so far,
    so add these last) as the parsed namespace's ``config_schema``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="settings from a YAML, JSON or TOML file, keys as the options' names "
        "(batch_size: 32); key=value arguments override it, and flags override both",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as YAML (JSON with --json), a file for --config, "
        "and exit",
    )
    parser.set_defaults(config_schema=schema(parser))


def schema(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The settings ``parser`` takes: its options by ``dest`` (help and ``--config``
    itself left out)."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest not in OWN}


def _keys(known: dict[str, argparse.Action]) -> dict[str, str]:
    """Every spelling of a key (``batch_size``, ``batch-size``) -> its ``dest``."""
    out = {}
    for dest, action in known.items():
        out[dest] = dest
        for flag in action.option_strings:
            out[flag.lstrip("-")] = dest
    return out


def _dest(key: str, known: dict[str, argparse.Action], where: str) -> str:
    """The ``dest`` of ``key``; an unknown key is a ``ValueError`` naming it and the
    known keys closest to it."""
    spellings = _keys(known)
    if key in spellings:
        return spellings[key]
    if key in OWN:
        raise ValueError(f"{where}: {key!r} is not a setting of a run; give it on the command line")
    close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=3, cutoff=0.6)
    hint = (
        f"did you mean {' or '.join(close)}?"
        if close
        else f"the keys are the options of --help: {', '.join(sorted(known))}"
    )
    raise ValueError(f"{where}: unknown key {key!r}; {hint}")


def load(path: str) -> dict[str, Any]:
    """The mapping in the file ``path`` (YAML, JSON or TOML, by its suffix)."""
    file = Path(path)
    if file.suffix not in SUFFIXES:
        raise ValueError(
            f"--config {path}: expected a {', '.join(SUFFIXES)} file, got suffix {file.suffix!r}"
        )
    try:
        text = file.read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    try:
        if file.suffix == ".json":
            data = json.loads(text)
        elif file.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as e:  # the parser's own message says where, in one line
        mark = getattr(e, "problem_mark", None)  # YAML's
        why = f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else e
        why = " ".join(str(why).split())
        raise ValueError(f"--config {path}: not valid {file.suffix[1:].upper()}: {why}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of keys to values, got {data!r}")
    return data


def _as_flags(dest: str, value: Any, action: argparse.Action, where: str) -> list[str]:
    """The command-line flags meaning ``dest: value`` (None: the option left out)."""
    flag = action.option_strings[-1]
    if value is None:
        return []
    if action.nargs == 0:  # store_true, store_const: on or off
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {dest} is on or off: expected true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        return [t for v in values for t in (flag, _text(dest, v, where))]
    return [flag, _text(dest, value, where)]


def _text(dest: str, value: Any, where: str) -> str:
    """``value`` as the flag's text: a number or string as written, a mapping (a mesh) as
    ``key=value,...``."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, bool | list):
        raise ValueError(f"{where}: {dest} takes one value, got {value!r}")
    return str(value)


def _takes_value(parser: argparse.ArgumentParser, token: str) -> bool:
    """Whether the option ``token`` (a flag without ``=``) reads the next argument."""
    action = parser._option_string_actions.get(token)
    return action is not None and action.nargs != 0


def expand(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--config FILE`` and ``key=value`` arguments turned into the
    flags they mean, placed first: the file's, then the overrides' (later wins), then
    the flags given. Unknown keys and bad files are ``parser.error``s (one line, exit 2)."""
    known = schema(parser)
    rest: list[str] = []
    overrides: list[tuple[str, str]] = []
    config = None
    tokens = list(argv)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            rest += tokens[i:]
            break
        if token.startswith("--config="):
            config = token.partition("=")[2]
        elif token == "--config":
            if i + 1 >= len(tokens):
                parser.error("argument --config: expected one argument")
            config, i = tokens[i + 1], i + 1
        elif token.startswith("-"):
            rest.append(token)
            if "=" not in token and _takes_value(parser, token) and i + 1 < len(tokens):
                rest.append(tokens[i + 1])
                i += 1
        elif "=" in token:
            key, _, value = token.partition("=")
            overrides.append((key.strip(), value))
        else:
            rest.append(token)
        i += 1
    if config is None and not overrides:
        return rest
    try:
        settings: dict[str, Any] = {}
        if config is not None:
            for key, value in load(config).items():
                settings[_dest(str(key), known, f"--config {config}")] = value
        for key, value in overrides:
            dest = _dest(key, known, f"{key}={value}")
            settings[dest] = _override(value, known[dest], key)
        flags = [
            t
            for dest, value in settings.items()
            for t in _as_flags(dest, value, known[dest], f"--config {config}" if config else dest)
        ]
    except ValueError as e:
        parser.error(str(e))
    return [*flags, *rest]


def _override(value: str, action: argparse.Action, key: str) -> Any:
    """A ``key=value`` argument's value: on/off options take true/false (yes/no, 1/0),
    every other option its text as the flag would."""
    if action.nargs != 0:
        return value
    words = {
        "true": True,
        "yes": True,
        "on": True,
        "1": True,
        "false": False,
        "no": False,
        "off": False,
        "0": False,
    }
    if value.strip().lower() not in words:
        raise ValueError(f"{key}={value}: {key} is on or off: expected true or false")
    return words[value.strip().lower()]


def resolved(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as a ``--config`` file holds them: every option of the schema
    that is set (None: left to its default, left out), a mesh as ``{axis: size}``, an
    ``A:B`` range as its text."""
    out: dict[str, Any] = {}
    for dest, action in args.config_schema.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if action.nargs == 0 and not isinstance(value, bool):  # store_const: on
            value = value == action.const
        elif dest == "mesh":
            value = {axis: size for axis, size in value}
        elif isinstance(value, tuple):
            value = ":".join(str(v) for v in value)
        out[dest] = value
    return out


def dump(settings: dict[str, Any]) -> str:
    """``settings`` as YAML, one key a line in the options' order."""
    return yaml.safe_dump(settings, sort_keys=False, default_flow_style=False)
