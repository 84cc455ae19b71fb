"""``attention``: forward+backward time and peak memory of local vs global attention layers.

One transformer block (tp = 1, fp32 on CPU, bf16 on a GPU) is run forward and backward on one
sequence of n tokens, with global causal attention (SDPA) and with a local window (the block-local
kernel of ``mt3d.model.attention``), for several n. Each case runs in a fresh process: peak memory
is the peak resident set size above the process's size once the inputs exist (glibc's mmap
threshold set low so freed tensors leave at once), or CUDA's peak allocation on a GPU.

Theory: a global layer's attention work grows with n^2 and a local layer's with n * W, so local
step time should grow about 4x when n does (the MLP and projections are linear in n as well),
while global time grows towards 16x as attention comes to dominate.
"""

from __future__ import annotations

import multiprocessing as mp

from .common import emit, table


def case(n: int, window: int | None, hidden: int, heads: int, reps: int, block: int | None) -> dict:
    """Median fwd+bwd seconds and peak bytes of one block on an n-token sequence (own process)."""
    import ctypes
    import resource
    import statistics
    import time

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed memory goes back
    from ..model.blocks import BuildContext, TransformerBlock
    from ..model.config import ModelConfig
    from ..parallel.state import AxisGroup

    attention = None if window is None else {"window": window, **({"block": block} if block else {})}
    cfg = ModelConfig(
        hidden=hidden, layers=1, heads=heads, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
        max_seq_len=n, attention=attention,
    )  # fmt: skip
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    block_ = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), dtype=dtype, device=device), 0)
    x = torch.randn(1, n, hidden, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        block_(x).backward(dy)
        x.grad = None
        for p in block_.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up (allocator, RoPE tables, tile masks)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/status") as f:
            base = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": statistics.median(times), "peak_bytes": max(peak, 0)}


def _isolated(*args) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(case, args)


def run(args) -> None:
    """Time local vs global blocks over the sequence lengths; print the table and the BENCH record."""
    lengths = [int(n) for n in args.seq_lens.split(",")]
    rows = []
    for n in lengths:
        for window in (None, args.window):
            r = _isolated(n, window, args.hidden, args.heads, args.reps, args.block)
            rows.append({"n": n, "attention": "global" if window is None else f"local {window}", **r})
    by = {(r["n"], r["attention"]): r for r in rows}
    for r in rows:
        r["ms"] = r["seconds"] * 1e3
        r["peak_mb"] = r["peak_bytes"] / 2**20
        prev = by.get((r["n"] // 4, r["attention"]))
        if prev:  # growth when n grows 4x: 4 for linear cost, 16 for quadratic
            r["time_x_per_4x_n"] = r["seconds"] / prev["seconds"]
            r["mem_x_per_4x_n"] = r["peak_bytes"] / max(prev["peak_bytes"], 1)
        if r["attention"] != "global":
            r["local_vs_global_time"] = r["seconds"] / by[(r["n"], "global")]["seconds"]
    cols = ["n", "attention", "ms", "peak_mb", "time_x_per_4x_n", "mem_x_per_4x_n", "local_vs_global_time"]
    print(table(rows, cols))
    emit(
        "attention",
        {"window": args.window, "hidden": args.hidden, "heads": args.heads, "reps": args.reps, "rows": rows},
    )


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [
        [
            x["n"],
            x["attention"],
            _f(x["ms"]),
            _f(x["peak_mb"]),
            _f(x.get("time_x_per_4x_n")),
            _f(x.get("mem_x_per_4x_n")),
            _f(x.get("local_vs_global_time")),
        ]
        for x in r["rows"]
    ]
    headers = ["n", "layer", "fwd+bwd ms", "peak MB", "time x per 4x n", "memory x per 4x n", "local/global"]
    return headers, rows
