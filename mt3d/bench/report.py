"""Markdown tables from ``BENCH {json}`` lines (what launch/bench.sh collects)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(v, pct=False) -> str:
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
    """One Markdown section per benchmark record."""
    parts = []
    for r in records:
        m = r.get("machine", {})
        where = (
            f"{m.get('date')}, {m.get('gpu') or 'CPU'}, {m.get('cpu_cores')} cores, torch {m.get('torch')}"
        )
        name = r["bench"]
        if name == "overhead":
            rows = [
                [
                    k,
                    _f(v["mt3d_s"]),
                    _f(v["plain_s"]),
                    _f(v["hf_ds_s"]),
                    _f(v["mt3d/plain"]),
                    _f(v["mt3d/hf_ds"]),
                ]
                for k, v in r["rows"].items()
            ]
            body = _md(
                ["model/ZeRO", "mt3d s/step", "plain s/step", "HF+DS s/step", "mt3d/plain", "mt3d/HF+DS"],
                rows,
            )
        elif name == "bubble":
            rows = [
                [
                    x["p"],
                    x["m"],
                    _f(x["theory"]),
                    _f(x["measured_mean"]),
                    _f(x["busiest_stage"]),
                    _f(x["ratio"]),
                ]
                for x in r["rows"]
            ]
            body = _md(
                ["p", "m", "(p-1)/(m+p-1)", "measured mean idle", "busiest stage idle", "mean/theory"], rows
            )
        elif name == "comm":
            rows = [
                [
                    x["tp"],
                    x["sp"],
                    x["calls_per_layer_per_micro"],
                    _f(x["elements_per_layer"]),
                    _f(x["theory"]),
                    f"{x['ratio']:.2f}",
                ]
                for x in r["rows"]
            ]
            body = _md(
                ["tp", "SP", "calls per layer per micro-batch", "elements moved", "8bsh(t-1)/t", "ratio"],
                rows,
            )
        elif name == "memory":
            rows = [
                [
                    x["tp"],
                    x["pp"],
                    x["dp"],
                    x["zero"],
                    x["recompute"],
                    x["sp"],
                    _f(x["measured_mb"]),
                    _f(x["predicted_mb"]),
                    _f(x["ratio"]),
                ]
                for x in r["rows"]
            ]
            body = _md(
                ["tp", "pp", "dp", "ZeRO", "recompute", "SP", "measured MB", "planner MB", "ratio"], rows
            )
        elif name == "preprocess":
            rows = [
                [x["pipeline"], _f(x["mb_per_s"]), _f(x["tokens_per_s"]), _f(x["ratio"])] for x in r["rows"]
            ]
            body = _md(["pipeline", "MB/s", "tokens/s", "vs raw"], rows)
        elif name == "checkpoint":
            rows = [
                [
                    x["model"],
                    _f(x["gb"]),
                    _f(x["save_s"]),
                    _f(x["load_s"]),
                    _f(x["raw_write_gbps"]),
                    _f(x["save_gbps"]),
                    _f(x["save/raw"]),
                ]
                for x in r["rows"]
            ]
            body = _md(["model", "GB", "save s", "load s", "raw write GB/s", "save GB/s", "save/raw"], rows)
        elif name == "gpu":
            rows = [
                [
                    x["model"],
                    x["framework"],
                    _f(x["tokens_per_s"]),
                    _f(x["tflops"]),
                    _f(x["mfu_dense"], True),
                    _f(x["vs_transformers"]),
                ]
                for x in r.get("rows", [])
            ]
            body = _md(["model", "framework", "tokens/s", "TFLOP/s", "MFU (dense)", "vs transformers"], rows)
        elif name == "hfload":
            hf, mt = r["transformers"], max(r["mt3d_tp2"], key=lambda x: x["seconds"])
            rows = [
                ["transformers.from_pretrained", _f(hf["seconds"]), _f(hf["peak_rss_gb"])],
                ["mt3d from_pretrained tp=2, per rank", _f(mt["seconds"]), _f(mt["peak_rss_gb"])],
            ]
            body = _md(["loader", "seconds", "peak RSS GB"], rows)
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
