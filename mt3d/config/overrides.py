"""Reading a run config file and applying ``--set key.path=value`` overrides (any key, DeepSpeed's
too) before it is parsed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .schema import RunConfig, from_dict


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (['a', 'b', 'c'], value); the value is JSON when it parses, else a string."""
    if "=" not in text:
        raise ConfigError(f"--set expects key.path=value, got {text!r}")
    key, value = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set has an empty key in {text!r}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    return path, parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """A copy of ``raw`` with each ``key.path=value`` applied (intermediate objects created)."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, key in enumerate(path[:-1]):
            nxt = node.get(key)
            if nxt is None:
                nxt = node[key] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {text}: '{'.'.join(path[: i + 1])}' is not an object")
            node = nxt
        node[path[-1]] = value
    return out


def load(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a JSON config file, apply ``--set`` overrides, and parse it (not yet validated)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    return from_dict(apply_overrides(raw, overrides or []), path=str(p))
