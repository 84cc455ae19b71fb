"""``gpu-suite``: every GPU item of the project in one call, for whoever is lent a GPU.

Each step is a ``python -m mt3d.bench`` run in its own process with its own time limit (a step that
fails or runs over is recorded as such and the next one runs), so one call of about 20 minutes
brings back every GPU figure:

1. ``gemm``: the GEMM sweep beside the planner's shape model; its best rate is ``--gemm-tflops``;
2. ``gpu``: one-GPU bf16 MFU of gpt3-1.3b and llama-1b (mt3d, also with compiled blocks, against
   transformers + DeepSpeed), mt3d with no, full and selective recompute (compiled at none only) and
   with the optimizer offloaded to the CPU, each beside the planner's step time and GPU memory;
3. ``attention``: the local-attention patterns at 32k tokens beside their speed-of-light bound;
4. ``longctx``: one 32k-token sample's memory with and without sequence tiles.

The record (every step's table and ``BENCH`` line, with the device and the time each took) goes to
``<out>/<date>-gpu-suite-<device>.log``. ``--smoke`` runs the GEMM and one-GPU steps in their CPU
smoke modes (the suite's own check; no GPU needed). ``--only gemm,gpu`` runs some steps (the record
is then named after them): the device tool runs a command for at most 10 minutes, so there the
suite runs in parts (``--only gemm``, ``--only gpu``, ``--only attention,longctx``) or in its own
process session across chained calls (docs/benchmarks.md).
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

STEPS = (
    ("gemm", ["gemm"], 300),
    ("gpu", ["gpu", "--compile", "--recompute", "none,full,selective", "--offload", "opt-cpu"], 600),
    ("attention", ["attention", "--part", "patterns"], 240),
    (
        "longctx",
        ["longctx", "--part", "memory", "--cp", "1", "--seq-len", "32768", "--tile-len", "4096"],
        240,
    ),
)
SMOKE = (
    ("gemm", ["gemm", "--smoke", "--reps", "2"], 300),
    (
        "gpu",
        ["gpu", "--smoke", "--models", "gpt3-1.3b", "--recompute", "none,selective", "--offload", "opt-cpu"],
        300,
    ),
)
STEP_NAMES = tuple(name for name, _, _ in STEPS)
"""What ``--only`` can name (this module imports torch only when it runs: the parser reads it)."""


def run_step(name: str, argv: list[str], limit: int) -> dict:
    """One benchmark in its own process: its status, seconds, BENCH record and output."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "mt3d.bench", *argv], capture_output=True, text=True,
                             timeout=limit)  # fmt: skip
        status, text = ("ok" if out.returncode == 0 else f"exit {out.returncode}"), out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        status = f"over its {limit} s"
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
    records = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("BENCH ")]
    return {"step": name, "argv": " ".join(argv), "status": status, "seconds": time.perf_counter() - t0,
            "record": records[-1] if records else None, "output": text}  # fmt: skip


def check_args(args) -> str | None:
    """Where the benchmark writes must be writable (a one-line error otherwise, before any work)."""
    from ..config.preflight import writable_dir

    if args.out is not None:
        writable_dir(args.out, "--out")
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench gpu-suite``."""
    import torch

    from .common import emit, table

    if not torch.cuda.is_available() and not args.smoke:
        print("gpu-suite: no GPU here (run it where one is; --smoke checks the suite on this CPU)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-smoke"
    only = getattr(args, "only", None)
    chosen = [step for step in (SMOKE if args.smoke else STEPS) if not only or step[0] in only]
    if not chosen:
        which = "--smoke" if args.smoke else "the suite"
        print(f"gpu-suite: --only {','.join(only)} names no step of {which}"
              f" (--smoke runs {', '.join(s[0] for s in SMOKE)})", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    steps = [run_step(*step) for step in chosen]
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    part = "-" + "-".join(only) if only else ""
    out = Path(args.out) / f"{datetime.date.today().isoformat()}-gpu-suite-{slug}{part}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        f.write(f"# python -m mt3d.bench gpu-suite{' --smoke' if args.smoke else ''} on {device}\n")
        for s in steps:
            took = f"{s['status']}, {s['seconds']:.0f} s"
            f.write(f"\n## {s['step']}: python -m mt3d.bench {s['argv']} ({took})\n")
            f.write(s["output"])
    summary = [{k: s[k] for k in ("step", "status", "seconds")} for s in steps]
    print(table(summary, ["step", "status", "seconds"]))
    print(f"record: {out}")
    rows = [{**row, "bench": s["record"]} for row, s in zip(summary, steps, strict=True)]
    return emit("gpu-suite", {"device": device, "record": str(out), "smoke": bool(args.smoke), "steps": rows})
