"""Every option of the config tree, generated from the dataclasses (so it cannot drift from them),
with its one line from :data:`~policygrad.config.help.OPTION_HELP`: what ``policygrad train
--help`` lists after its usage, and the docs' configuration reference.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from policygrad.config.help import OPTION_HELP

__all__ = ["option_rows", "options_markdown", "options_text"]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def option_rows(cls: type, prefix: str = "") -> list[tuple[str, str, Any]]:
    """``(dotted name, type as written, default)`` of every leaf field of dataclass ``cls``,
    sections walked in their declaration order (a field whose default is a dataclass is a section).
    """
    rows = []
    for f in dataclasses.fields(cls):
        default = _default(f)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(default):
            rows.extend(option_rows(type(default), f"{name}."))
        else:
            rows.append((name, str(f.type), default))
    return rows


def _shown(value: Any) -> str:
    """A default as it would be written on the command line (YAML/JSON: null, true, [..])."""
    return json.dumps(value) if not isinstance(value, str) else value


def options_text(cls: type) -> str:
    """The options of ``cls`` (a ``TrainConfig``), one per line: ``--name=DEFAULT  type  what it
    does``, grouped by section."""
    lines, section = [], None
    rows = option_rows(cls)
    width = max(len(f"--{name}={_shown(default)}") for name, _, default in rows) + 2
    for name, kind, default in rows:
        here = name.split(".")[0] if "." in name else ""
        if here != section:
            section = here
            lines.append(f"\n{here or 'run'}:")
        option = f"--{name}={_shown(default)}"
        lines.append(f"  {option:<{min(width, 52)}} {kind:<16} {OPTION_HELP.get(name, '')}".rstrip())
    return "\n".join(lines).lstrip("\n") + "\n"


def options_markdown(cls: type) -> str:
    """The options of ``cls`` (a ``TrainConfig``) as markdown tables, one per section: option,
    default, type (the docs' configuration reference; a test keeps the page equal to it)."""
    out, section = [], None
    for name, kind, default in option_rows(cls):
        here = name.split(".")[0] if "." in name else "run"
        if here != section:
            section = here
            out += ["", f"## {here}", "", "| option | default | type | what it does |", "|:--|:--|:--|:--|"]
        shown, kind = _shown(default).replace("|", "/"), kind.replace(" | ", " or ")  # no | in a cell
        out.append(f"| `{name}` | `{shown}` | `{kind}` | {OPTION_HELP.get(name, '')} |")
    return "\n".join(out).lstrip("\n")
