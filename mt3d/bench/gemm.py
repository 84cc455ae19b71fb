"""``gemm``: a GEMM sweep on this device beside the planner's shape model, to calibrate it.

Times (m x k) @ (k x n) products of transformer-like shapes (QKV, attention output, MLP in and out
for several hidden sizes, 8192 tokens) and large squares, bf16 on a GPU (fp32 on the CPU:
``--smoke``, a check of the code path). Prints measured TFLOP/s beside ``planner.compute``'s
prediction for the matching preset at its GEMM ceiling, and the best rate measured: pass that as
``mt3d plan --gemm-tflops`` (or into ``planner.hardware.DEVICES``) for this device type.
"""

from __future__ import annotations

import time

import torch

from .common import emit, table

PRESET_BY_NAME = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"))


def time_gemm(m: int, n: int, k: int, device: str, reps: int) -> float:
    """Measured TFLOP/s of (m x k) @ (k x n) (bf16 on GPU, fp32 on CPU), after 3 warm-up products."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    b = torch.randn(k, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * m * n * k * reps / (time.perf_counter() - t0) / 1e12


def time_fp8_gemm(m: int, n: int, k: int, device: str, reps: int, rowwise: bool) -> float:
    """Measured TFLOP/s of ``torch._scaled_mm`` on e4m3 operands already cast (the GEMM alone; a
    training step also pays the casts), one scale per tensor or per row, bf16 out."""
    from ..parallel.fp8 import E4M3

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=g).to(E4M3)
    b = torch.randn(n, k, device=device, generator=g).to(E4M3).t()  # column-major, as _scaled_mm wants
    sa = torch.ones(m, 1, device=device) if rowwise else torch.ones((), device=device)
    sb = torch.ones(1, n, device=device) if rowwise else torch.ones((), device=device)

    def mm():
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for _ in range(3):
        mm()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        mm()
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * m * n * k * reps / (time.perf_counter() - t0) / 1e12


def shapes(smoke: bool) -> list[tuple[str, int, int, int]]:
    """(label, m, n, k) of the sweep."""
    if smoke:
        return [("square 256", 256, 256, 256), ("mlp-in h128", 512, 512, 128)]
    tokens, out = 8192, []
    for h in (2048, 4096, 8192, 12288):
        out += [(f"qkv h{h}", tokens, 3 * h, h), (f"proj h{h}", tokens, h, h),
                (f"mlp-in h{h}", tokens, 4 * h, h), (f"mlp-out h{h}", tokens, h, 4 * h)]  # fmt: skip
    return out + [(f"square {s}", s, s, s) for s in (4096, 8192, 16384)]


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench gemm``."""
    from ..planner.compute import Gemm, gemm_seconds
    from ..planner.hardware import get_device

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    preset = next((p for key, p in PRESET_BY_NAME if key in name), None)
    dev = get_device(preset) if preset else None
    rows = []
    for label, m, n, k in shapes(args.smoke):
        measured = time_gemm(m, n, k, device, args.reps)
        row = {"shape": label, "m": m, "n": n, "k": k, "tflops": round(measured, 2)}
        if getattr(args, "fp8", False):
            for key, rowwise in (("fp8_tensorwise", False), ("fp8_rowwise", True)):
                row[key] = round(time_fp8_gemm(m, n, k, device, args.reps, rowwise), 2)
            row["rowwise/bf16"] = round(row["fp8_rowwise"] / measured, 3)
        if dev is not None:  # the shape model at the preset's full ceiling (no training fraction)
            predicted = 2 * m * n * k / gemm_seconds(Gemm(m, n, k), dev, fraction=1.0) / 1e12
            row.update(model_tflops=round(predicted, 1), measured_over_model=round(measured / predicted, 3))
        rows.append(row)
    best = max(r["tflops"] for r in rows)
    print(f"GEMM sweep on {name} ({'bf16' if device == 'cuda' else 'fp32'}), {args.reps} reps per shape")
    cols = ["shape", "m", "n", "k", "tflops", "model_tflops", "measured_over_model"]
    if getattr(args, "fp8", False):
        cols += ["fp8_tensorwise", "fp8_rowwise", "rowwise/bf16"]
    print(table(rows, cols))
    print(f"best measured: {best:.1f} TFLOP/s" + (f" (preset ceiling {dev.gemm_tflops:g})" if dev else ""))
    extra = {}
    if getattr(args, "fp8", False):
        extra = {f"best_{k}": max(r[k] for r in rows) for k in ("fp8_tensorwise", "fp8_rowwise")}
        rates = ", ".join(f"{k} {v:g} TFLOP/s" for k, v in extra.items())
        print(f"best FP8: {rates} (--gemm-tflops-fp8)")
    return emit("gemm", {"device": name, "preset": preset, "rows": rows, "best_tflops": best,
                         "smoke": bool(args.smoke), **extra})  # fmt: skip
