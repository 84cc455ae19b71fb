"""``attention``: local attention against dense causal attention, measured beside its theory.

Two tables, each case in a fresh process (peak memory is the peak resident set size above the
process once its inputs exist, glibc's mmap threshold set low so freed tensors leave at once; on a
GPU, CUDA's peak allocation):

* **layers**: one transformer block (tp = 1; fp32 on CPU, bf16 on a GPU), forward and backward on
  one sequence of n tokens, with global causal attention and with a sliding window, for several n.
  A global layer's attention work grows with n^2 and a local layer's with n * W: local step time
  should grow about 4x when n does, global time towards 16x as attention comes to dominate.
* **patterns**: the attention operation alone (forward + backward) for sliding, strided, blocked
  and dilated patterns with the kernel mt3d picks (block-local on CPUs, FlexAttention on GPUs)
  against dense causal SDPA (FlashAttention on GPUs), beside the speed-of-light bound of
  ``mt3d.planner.sparsity`` at the kernel's tile shape: measured speedup / bound is the headline.
* **sinks**: attention sinks (gpt-oss), forward + backward with and without them, global (SDPA with
  the sink column and key) and gpt-oss's 128-token window (block-local on CPUs, FlexAttention with the
  sink as key 0 on GPUs), GQA 64/8 heads of 64 on a GPU: the time ratio (its cost), and each
  kernel's largest error against transformers' way (a logit column) in fp32, forward and gradients.
* **qk-clip**: the same attention with and without QK-clip's logit maxima noted (``train.muon.qk_clip``:
  one more q.k product without autograd over the keys each query sees), its time ratio beside the
  theory: 8/7 for a kernel whose forward and backward are 7 n x n GEMMs of one head (QK^T and PV, then
  QK^T again, dV, dP, dQ, dK), the noting an eighth.
"""

from __future__ import annotations

import multiprocessing as mp

from .common import emit, table


def _setup(memory: bool = True):
    """torch, whether on CUDA, the device and dtype; ``memory``: freed CPU memory returned at once (for
    peak figures; it makes every allocation a fresh mapping, which times of many small tensors feel)."""
    import ctypes

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and memory:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed memory goes back
    return torch, cuda, ("cuda" if cuda else "cpu"), (torch.bfloat16 if cuda else torch.float32)


def _measure(torch, cuda: bool, step, reps: int) -> dict:
    """Median seconds of ``step`` after one warm-up call, and peak bytes above the state before it."""
    import resource
    import statistics
    import time

    step()  # warm-up (allocator, tables, masks, compilation)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/status") as f:
            base = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {"seconds": statistics.median(times), "peak_bytes": max(peak - base, 0)}


def layer_case(n: int, window: int | None, hidden: int, heads: int, reps: int) -> dict:
    """One block, global or sliding-window, forward + backward on an n-token sequence."""
    torch, cuda, device, dtype = _setup()
    from ..model.blocks import BuildContext, TransformerBlock
    from ..model.config import ModelConfig
    from ..parallel.state import AxisGroup

    cfg = ModelConfig(
        hidden=hidden, layers=1, heads=heads, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
        max_seq_len=n, attention=None if window is None else {"window": window},
    )  # fmt: skip
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), dtype=dtype, device=device), 0)
    x = torch.randn(1, n, hidden, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        block(x).backward(dy)
        x.grad = None
        for p in block.parameters():
            p.grad = None

    return _measure(torch, cuda, step, reps)


def pattern_case(
    n: int, pattern: tuple | None, heads: int, head_dim: int, reps: int, kernel: str = "auto"
) -> dict:
    """The attention operation alone, forward + backward; ``pattern`` (W, s, d) or None (dense causal);
    ``kernel``: the attention kernel (auto: the one mt3d picks)."""
    torch, cuda, device, dtype = _setup()
    from ..model.attention import LocalPattern, attend, choose_block, choose_kernel

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g, device=device, dtype=dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_()
    local = None if pattern is None else LocalPattern(*pattern)

    def step():
        attend(q, k, v, pattern=local, scale=head_dim**-0.5, kernel=kernel).sum().backward()
        q.grad = k.grad = v.grad = None

    out = _measure(torch, cuda, step, reps)
    out["kernel"] = choose_kernel(kernel, local, q.device, None, 0.0)
    out["tile"] = choose_block(local, head_dim, n) if local and out["kernel"] == "block-local" else 128
    return out


def sink_case(n: int, window: int | None, heads: int, kv_heads: int, head_dim: int, reps: int,
              sinks: bool, kernel: str = "auto", noted: bool = False,
              memory: bool = True) -> dict:  # fmt: skip
    """Attention with GQA, forward + backward, with or without sinks (and QK-clip's maxima noted:
    ``noted``); with sinks also the fp32 errors of the same kernel (at 512 tokens) against
    ``reference_attention``'s logit column. ``memory``: as ``_setup``'s."""
    torch, cuda, device, dtype = _setup(memory)
    from ..model.attention import LocalPattern, attend, choose_kernel, reference_attention
    from ..model.logit_max import LogitMax

    record = LogitMax(heads).note if noted else None

    local = None if window is None else LocalPattern(window)

    def inputs(length, kind):
        g = torch.Generator(device=device).manual_seed(0)
        shapes = [(1, heads, length, head_dim)] + [(1, kv_heads, length, head_dim)] * 2 + [(heads,)]
        return [torch.randn(s, generator=g, device=device, dtype=kind).requires_grad_() for s in shapes]

    q, k, v, s = inputs(n, dtype)

    def step():
        attend(
            q, k, v, pattern=local, scale=head_dim**-0.5, sinks=s if sinks else None, kernel=kernel,
            record=record,
        ).sum().backward()  # fmt: skip
        q.grad = k.grad = v.grad = s.grad = None

    out = _measure(torch, cuda, step, reps)
    out["kernel"] = choose_kernel(kernel, local, q.device, None, 0.0)
    if sinks:  # correctness of the same kernel in fp32 (FlexAttention compiles once more for it)
        xs = inputs(512, torch.float32)
        got = attend(*xs[:3], pattern=local, scale=head_dim**-0.5, sinks=xs[3], kernel=kernel)
        ref = reference_attention(*xs[:3], local, scale=head_dim**-0.5, sinks=xs[3])
        w = torch.randn_like(ref)
        ga, gb = torch.autograd.grad(got, xs, w), torch.autograd.grad(ref, xs, w)
        out["max_err"] = float((got - ref).detach().abs().max())
        out["max_grad_err"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ga, gb))
    return out


def run_sinks(args) -> list[dict]:
    """Global and gpt-oss-window attention with and without sinks, their time ratio and errors."""
    import torch

    cuda = torch.cuda.is_available()
    n, heads, kv, d = (4096, 64, 8, 64) if cuda else (2048, 8, 2, 64)
    rows = []
    cases = [(None, "auto"), (128, "auto")] + ([(None, "flex")] if cuda else [])
    for window, kernel in cases:
        plain = _isolated(sink_case, n, window, heads, kv, d, args.reps, False, kernel)
        sunk = _isolated(sink_case, n, window, heads, kv, d, args.reps, True, kernel)
        rows.append({"n": n, "attention": "global" if window is None else f"local {window}",
                     "heads": f"{heads}/{kv}", "kernel": sunk["kernel"], "ms": plain["seconds"] * 1e3,
                     "ms_sinks": sunk["seconds"] * 1e3, "sinks_vs_none": sunk["seconds"] / plain["seconds"],
                     "max_err": sunk["max_err"], "max_grad_err": sunk["max_grad_err"]})  # fmt: skip
    print(table(rows, ["n", "attention", "heads", "kernel", "ms", "ms_sinks", "sinks_vs_none", "max_err",
                       "max_grad_err"]))  # fmt: skip
    return rows


def run_qk_clip(args) -> list[dict]:
    """Global and local attention with and without QK-clip's maxima noted: the time ratio beside 8/7."""
    import torch

    cuda = torch.cuda.is_available()
    n, heads, kv, d = (4096, 64, 8, 128) if cuda else (2048, 8, 2, 64)
    rows = []
    for window in (None, 128):
        plain = _isolated(sink_case, n, window, heads, kv, d, args.reps, False, "auto", False, False)
        noted = _isolated(sink_case, n, window, heads, kv, d, args.reps, False, "auto", True, False)
        rows.append({"n": n, "attention": "global" if window is None else f"local {window}",
                     "heads": f"{heads}/{kv}", "kernel": noted["kernel"], "ms": plain["seconds"] * 1e3,
                     "ms_noted": noted["seconds"] * 1e3, "noted_vs_none": noted["seconds"] / plain["seconds"],
                     "theory": 8 / 7})  # fmt: skip
    print(table(rows, ["n", "attention", "heads", "kernel", "ms", "ms_noted", "noted_vs_none", "theory"]))
    return rows


def _isolated(fn, *args) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def run_layers(args) -> list[dict]:
    """Time local vs global blocks over the sequence lengths."""
    rows = []
    for n in args.seq_lens:
        for window in (None, args.window):
            r = _isolated(layer_case, n, window, args.hidden, args.heads, args.reps)
            rows.append({"n": n, "attention": "global" if window is None else f"local {window}", **r})
    by = {(r["n"], r["attention"]): r for r in rows}
    for r in rows:
        r["ms"], r["peak_mb"] = r["seconds"] * 1e3, r["peak_bytes"] / 2**20
        prev = by.get((r["n"] // 4, r["attention"]))
        if prev:  # growth when n grows 4x: 4 for linear cost, 16 for quadratic
            r["time_x_per_4x_n"] = r["seconds"] / prev["seconds"]
            r["mem_x_per_4x_n"] = r["peak_bytes"] / max(prev["peak_bytes"], 1)
        if r["attention"] != "global":
            r["local_vs_global_time"] = r["seconds"] / by[(r["n"], "global")]["seconds"]
    print(table(rows, ["n", "attention", "ms", "peak_mb", "time_x_per_4x_n", "mem_x_per_4x_n",
                       "local_vs_global_time"]))  # fmt: skip
    return rows


def pattern_specs(window: int, strides: tuple[int, ...], dilation: int) -> dict[str, tuple]:
    """Named (W, s, d) patterns: sliding, the given strides, blocked (s = W) and dilated."""
    specs = {"sliding": (window, 1, 1)}
    for s in strides:
        if 1 < s < window:
            specs[f"strided {s}"] = (window, s, 1)
    specs["blocked"] = (window, window, 1)
    if dilation > 1:
        specs[f"dilated {dilation}"] = (window, 1, dilation)
    return specs


def run_patterns(args) -> list[dict]:
    """Each pattern's kernel against dense causal attention, beside the speed-of-light bound (on a GPU
    also against dense causal attention in FlexAttention itself: the pattern's share of the bound
    apart from the gap between FlexAttention's and FlashAttention's dense rates)."""
    import torch

    from ..planner.sparsity import tiles

    rows = []
    for n in args.pattern_lens:
        dense = _isolated(pattern_case, n, None, args.heads, args.head_dim, args.reps)
        rows.append({"n": n, "pattern": "dense causal", **dense})
        flex_dense = None
        if torch.cuda.is_available():  # the local kernel's own dense rate: kernel gap apart from sparsity
            flex_dense = _isolated(pattern_case, n, None, args.heads, args.head_dim, args.reps, "flex")
            rows.append({"n": n, "pattern": "dense causal", **flex_dense})
        for name, (w, s, d) in pattern_specs(args.pattern_window, args.strides, args.dilation).items():
            r = _isolated(pattern_case, n, (w, s, d), args.heads, args.head_dim, args.reps)
            bound = tiles(n, w, s, d, r["tile"], r["tile"]).bound
            r.update(
                n=n, pattern=name, window=w, stride=s, dilation=d, speedup=dense["seconds"] / r["seconds"],
                bound=bound, bound_128=tiles(n, w, s, d, 128, 128).bound,
            )  # fmt: skip
            r["of_bound"] = r["speedup"] / bound
            if flex_dense is not None and r["kernel"] == "flex":
                r["of_bound_same_kernel"] = flex_dense["seconds"] / r["seconds"] / bound
            rows.append(r)
    for r in rows:
        r["ms"], r["peak_mb"] = r["seconds"] * 1e3, r["peak_bytes"] / 2**20
        prev = next((p for p in rows if p["n"] * 4 == r["n"] and p["pattern"] == r["pattern"]), None)
        if prev:
            r["mem_x_per_4x_n"] = r["peak_bytes"] / max(prev["peak_bytes"], 1)
    cols = ["n", "pattern", "kernel", "tile", "ms", "peak_mb", "mem_x_per_4x_n", "speedup", "bound",
            "of_bound", "of_bound_same_kernel", "bound_128"]  # fmt: skip
    print(table(rows, cols))
    return rows


# defaults of the pattern table: the CPU's, and the GNA paper's 1-D setting on GPUs
CPU_PATTERNS = {"pattern_lens": (4096, 16384), "pattern_window": 512, "strides": (64,), "head_dim": 64}
GPU_PATTERNS = {"pattern_lens": (32768,), "pattern_window": 2048, "strides": (256,), "head_dim": 128}


def check_args(args) -> str | None:
    """Why these arguments cannot run (None: they can)."""
    if args.hidden % args.heads:
        return f"--hidden {args.hidden} is not divisible by --heads {args.heads}"
    return None


def run(args) -> None:
    """Print the tables and one BENCH record per table."""
    import torch

    for key, value in (GPU_PATTERNS if torch.cuda.is_available() else CPU_PATTERNS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    common = {"hidden": args.hidden, "heads": args.heads, "reps": args.reps}
    if args.part in ("layers", "both"):
        emit("attention", {**common, "window": args.window, "rows": run_layers(args)})
    if args.part in ("patterns", "both"):
        emit("attention", {**common, "head_dim": args.head_dim, "patterns": run_patterns(args)})
    if args.part == "sinks":
        emit("attention", {"reps": args.reps, "sinks": run_sinks(args)})
    if args.part == "qk-clip":
        emit("attention", {"reps": args.reps, "qk_clip": run_qk_clip(args)})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's tables in the README (the layer table, then patterns)."""
    from .report import _f

    if r.get("sinks"):
        rows = [[x["n"], x["attention"], x["heads"], x["kernel"], _f(x["ms"]), _f(x["ms_sinks"]),
                 _f(x["sinks_vs_none"]), f"{x['max_err']:.1e}", f"{x['max_grad_err']:.1e}"]
                for x in r["sinks"]]  # fmt: skip
        return ["n", "attention", "heads", "kernel", "fwd+bwd ms", "with sinks ms", "sinks/none",
                "max err (fp32)", "max grad err (rel)"], rows  # fmt: skip
    if r.get("qk_clip"):
        rows = [[x["n"], x["attention"], x["heads"], x["kernel"], _f(x["ms"]), _f(x["ms_noted"]),
                 _f(x["noted_vs_none"]), _f(x["theory"])] for x in r["qk_clip"]]  # fmt: skip
        return [
            "n",
            "attention",
            "heads",
            "kernel",
            "fwd+bwd ms",
            "maxima noted ms",
            "noted/none",
            "theory",
        ], rows
    if r.get("rows"):
        rows = [
            [x["n"], x["attention"], _f(x["ms"]), _f(x["peak_mb"]), _f(x.get("time_x_per_4x_n")),
             _f(x.get("mem_x_per_4x_n")), _f(x.get("local_vs_global_time"))]
            for x in r["rows"]
        ]  # fmt: skip
        return [
            "n",
            "layer",
            "fwd+bwd ms",
            "peak MB",
            "time x per 4x n",
            "memory x per 4x n",
            "local/global",
        ], rows
    rows = [
        [x["n"], x["pattern"], x["kernel"], x.get("tile", ""), _f(x["ms"]), _f(x["peak_mb"]),
         _f(x.get("mem_x_per_4x_n")), _f(x.get("speedup")), _f(x.get("bound")), _f(x.get("of_bound")),
         _f(x.get("bound_128"))]
        for x in r["patterns"]
    ]  # fmt: skip
    headers = ["n", "pattern", "kernel", "tile", "fwd+bwd ms", "peak MB", "memory x per 4x n", "speedup",
               "bound (tile)", "speedup/bound", "bound (128)"]  # fmt: skip
    return headers, rows
