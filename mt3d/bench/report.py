"""Markdown tables from ``BENCH {json}`` lines (what launch/bench.sh collects)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def _f(v, pct=False) -> str:
    """A figure as the tables print it (3 significant digits, thousands separated, or a percentage)."""
    if v is None:
        return "n/a"
    if pct:
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def _md(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def render(records: list[dict]) -> str:
    """One Markdown section per benchmark record (each benchmark module's ``markdown`` gives the table)."""
    parts = []
    for r in records:
        m = r.get("machine", {})
        where = (
            f"{m.get('date')}, {m.get('gpu') or 'CPU'}, {m.get('cpu_cores')} cores, torch {m.get('torch')}"
        )
        name = r["bench"]
        try:
            module = importlib.import_module(f"mt3d.bench.{name}")
        except ImportError:
            module = None
        if hasattr(module, "markdown"):
            body = _md(*module.markdown(r))
        else:
            body = "```\n" + json.dumps(r)[:2000] + "\n```"
        parts.append(f"### {name} ({where})\n\n{body}\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    """``python -m mt3d.bench.report FILE...``: render BENCH lines found in the files."""
    records = []
    for path in argv:
        for line in Path(path).read_text().splitlines():
            if line.startswith("BENCH "):
                records.append(json.loads(line[6:]))
    print(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
