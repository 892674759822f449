"""Presets: a few params.yaml values for another setting (presets/h200.yaml: one GPU), written
into params.yaml in place. Only the values change; every comment, key and line stays, so
`git diff params.yaml` shows exactly what the preset set and DVC reruns exactly the stages
whose params it touched."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import yaml

from draftsmith.atomic import atomic_path
from draftsmith.config import load_config
from draftsmith.errors import ConfigError

# `key: value  # comment` at some indent; the value ends where two spaces start a comment
_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w]*):(?P<rest>.*)$")


def _split_comment(rest: str) -> tuple[str, str]:
    i = rest.find("  #")
    return (rest, "") if i < 0 else (rest[:i], rest[i:])


def _render(value) -> str:
    """A value as one line of YAML (strings plain where YAML reads them back unchanged)."""
    if isinstance(value, str) and value and re.fullmatch(r"[\w./{}@+-][\w./{}@+ -]*", value) \
            and yaml.safe_load(value) == value:
        return value
    if isinstance(value, list):
        return "[" + ", ".join(_render(v) for v in value) + "]"
    return json.dumps(value)  # JSON is YAML: lists, maps, numbers, null, quoted strings


def _flatten(preset: dict, sections: set[str], prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in preset.items():
        path = f"{prefix}{key}"
        if path in sections and isinstance(value, dict):
            flat.update(_flatten(value, sections, path + "."))
        else:
            flat[path] = value
    return flat


def _index(lines: list[str]) -> tuple[dict[str, int], set[str]]:
    """Dotted path -> line number of each key holding a value; the paths of the sections."""
    stack: list[tuple[int, str]] = []  # (indent, key) of the sections enclosing a line
    where: dict[str, int] = {}
    sections: set[str] = set()
    for i, line in enumerate(lines):
        m = _LINE.match(line.rstrip("\n"))
        if not m:
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [m["key"]])
        if _split_comment(m["rest"])[0].strip():
            where[path] = i
        else:
            sections.add(path)
            stack.append((indent, m["key"]))
    return where, sections


def apply(params_text: str, preset: dict) -> tuple[str, list[str]]:
    """params.yaml's text with the preset's values in place of its own, and the keys set.
    Raises ConfigError naming any key of the preset that params.yaml does not have."""
    lines = params_text.splitlines(keepends=True)
    where, sections = _index(lines)
    flat = _flatten(preset, sections)
    columns = Counter(lines[i].find("  #") + 2 for i in where.values() if "  #" in lines[i])
    column = columns.most_common(1)[0][0] if columns else 0
    for path, value in flat.items():
        if path not in where:
            raise ConfigError(f"the preset sets {path}, which params.yaml does not have",
                              "fix the key's name in the preset (`draftsmith config show` "
                              "lists every key)")
        m = _LINE.match(lines[where[path]].rstrip("\n"))
        comment = _split_comment(m["rest"])[1]
        new = f"{m['indent']}{m['key']}: {_render(value)}"
        if comment:  # the file's usual comment column, where the new value leaves room
            new = new.ljust(column) + comment.lstrip() if len(new) + 2 <= column \
                else f"{new}  {comment.lstrip()}"
        lines[where[path]] = new + "\n"
    return "".join(lines), sorted(flat)


def apply_file(preset_file: Path, params_file: Path) -> list[str]:
    """Write the preset into params_file (validated first, then written atomically); returns
    the keys it set."""
    preset = yaml.safe_load(Path(preset_file).read_text()) or {}
    if not isinstance(preset, dict):
        raise ConfigError(f"{preset_file} must be a mapping of params.yaml sections",
                          "see presets/h200.yaml for the layout")
    params_file = Path(params_file)
    text, keys = apply(params_file.read_text(), preset)
    trial = params_file.with_name(f".{params_file.name}.preset")  # beside it: relative paths hold
    try:
        trial.write_text(text)
        load_config(trial)  # a valid config, or params.yaml stays as it was
    finally:
        trial.unlink(missing_ok=True)
    with atomic_path(params_file) as tmp:
        tmp.write_text(text)
    return keys
