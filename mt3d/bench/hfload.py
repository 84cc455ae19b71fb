"""``hfload``: importing a ~1B-parameter HF model at tp 2 against ``transformers.from_pretrained``.

A random GPT-2-style model (h 2048, 18 layers, vocab 50257: 1.0B parameters, 4 GB of fp32
safetensors) is written once; then, each in fresh processes, ``transformers`` loads it whole and
mt3d loads it at tp = 2 (two ranks, each reading only its slices). Figures: wall time to a ready
model and peak resident memory per process (``ru_maxrss``, which includes the file pages a process
touched), as ratios.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import emit, table

HF_SNIPPET = """
import json, resource, sys, time
import torch
t0 = time.perf_counter()
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "params": sum(p.numel() for p in m.parameters())}))
"""


def _mt3d_worker(path: str) -> dict:
    import resource

    from ..checkpoint.loading import from_pretrained

    t0 = time.perf_counter()
    model = from_pretrained(path, tp=2)
    dt = time.perf_counter() - t0
    return {
        "seconds": dt,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _make_model(path: Path, hidden: int, layers: int) -> int:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=16, vocab_size=50257, n_positions=2048)
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def check_args(args) -> str | None:
    """Where the benchmark writes must be writable (a one-line error otherwise, before any work)."""
    from ..config.preflight import writable_dir

    if args.tmp is not None:
        writable_dir(args.tmp, "--tmp")
    return None


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench hfload``."""
    from ..parallel.spawn import spawn

    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        path = Path(tmp) / "gpt_1b"
        params = _make_model(path, args.hidden, args.layers)
        size_gb = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
        hf = json.loads(
            subprocess.run(
                [sys.executable, "-c", HF_SNIPPET, str(path)], capture_output=True, text=True, check=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        ranks = spawn(_mt3d_worker, 2, str(path), timeout=1800)
    mt = {"seconds": max(r["seconds"] for r in ranks), "peak_rss_gb": max(r["peak_rss_gb"] for r in ranks)}
    rows = [
        {"loader": "transformers.from_pretrained", **{k: hf[k] for k in ("seconds", "peak_rss_gb")}},
        {"loader": "mt3d from_pretrained tp=2 (per rank)", **mt},
        {"loader": "ratio mt3d/transformers", "seconds": mt["seconds"] / hf["seconds"],
         "peak_rss_gb": mt["peak_rss_gb"] / hf["peak_rss_gb"]},
    ]  # fmt: skip
    print(f"loading a {params / 1e9:.2f}B-parameter GPT-2 ({size_gb:.1f} GB fp32 safetensors)")
    print(table(rows, ["loader", "seconds", "peak_rss_gb"]))
    return emit("hfload", {"params": params, "file_gb": size_gb, "transformers": hf, "mt3d_tp2": ranks})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    hf, mt = r["transformers"], max(r["mt3d_tp2"], key=lambda x: x["seconds"])
    rows = [
        ["transformers.from_pretrained", _f(hf["seconds"]), _f(hf["peak_rss_gb"])],
        ["mt3d from_pretrained tp=2, per rank", _f(mt["seconds"]), _f(mt["peak_rss_gb"])],
    ]
    return ["loader", "seconds", "peak RSS GB"], rows
