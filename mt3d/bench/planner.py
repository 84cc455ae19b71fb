"""``python -m mt3d.bench planner``: the planner's step-time model at published layouts.

For each published run the planner predicts the step time at exactly the published layout, stated
with ``mt3d plan``'s own flags and run through its parser and ``plan`` (``command_line``: the layout
pinned, ``--other-stack --attention-kernel materialized --recompute full --pp-scatter-gather
--activation-model korthikanti --precision fp16``), on the A100-80GB preset (one calibration: the
device's GEMM ceiling and HBM bandwidth, Selene's 25 GB/s per GPU InfiniBand and 240 GB/s NVLink).
A layout that ran but that the memory model rejects is timed anyway (``--memory-gb``) and reported
with the memory the planner asked for. Throughput is the papers' own count,
F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) FLOPs per step (recompute included), over GPUs x step time.

Sources: Narayanan et al. 2021 (PTD-P), Table 1 (weak scaling) and the PTD-P vs ZeRO-3 comparison
(Table 2 / Figure 10); Smith et al. 2022 (MT-NLG 530B), section 3. All fp16, s = 2048, V = 51200.
The ZeRO-Infinity paper reports throughput only in figures for V100 DGX-2 nodes, with no layout
table; mt3d has no V100 preset, so it is not in this table.
"""

from __future__ import annotations

import functools
import statistics

from ..model.config import ModelConfig
from .common import emit, table

SEQ, VOCAB = 2048, 51200

# (label, params B, heads, hidden, layers, tp, pp, gpus, batch, micro, v, zero, published TFLOP/s)
PTDP_TABLE1 = [
    ("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 0, 137),
    ("3.6B", 3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 0, 138),
    ("7.5B", 7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 0, 142),
    ("18.4B", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 0, 135),
    ("39.1B", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 0, 138),
    ("76.1B", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 0, 140),
    ("145.6B", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 0, 148),
    ("310.1B", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 0, 155),
    ("529.6B", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 0, 163),
    ("1008B", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 0, 163),
]
GPT3 = (175.0, 96, 12288, 96)
MTNLG = (529.6, 128, 20480, 105)
# PTD-P Table 2: ZeRO-3 without model parallelism vs PTD-P (TP 8; PP 12 for 175B, 35 for 530B)
PTDP_TABLE2 = [
    *((f"175B ZeRO-3 {g}", *GPT3, 1, 1, g, 1536, mb, 1, 3, tf) for g, mb, tf in
      ((384, 4, 144), (768, 2, 88), (1536, 1, 44))),
    *((f"530B ZeRO-3 {g}", *MTNLG, 1, 1, g, b, mb, 1, 3, tf) for g, b, mb, tf in
      ((640, 2560, 4, 138), (1120, 2240, 2, 98), (2240, 2240, 1, 48))),
    *((f"175B PTD-P {g}", *GPT3, 8, 12, g, 1536, 1, 1, 0, tf) for g, tf in
      ((384, 153), (768, 149), (1536, 141))),
    *((f"530B PTD-P {g}", *MTNLG, 8, 35, g, 2240, 1, 3, 0, tf) for g, tf in
      ((560, 171), (1120, 167), (2240, 159))),
]  # fmt: skip
# MT-NLG 530B on DeepSpeed's pipeline engine (1F1B) + Megatron TP + ZeRO-1, batch 1920
MTNLG_RUNS = [
    (f"MT-NLG 530B {g}", *MTNLG, 8, 35, g, 1920, 1, 1, 1, tf)
    for g, tf in ((2240, 126), (2800, 121), (3360, 113))
]


def published_flops(batch: int, layers: int, hidden: int) -> float:
    """The PTD-P paper's FLOPs per step with full recompute (its equation 3)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def command_line(row: tuple, device: str = "a100-80gb", fraction: float | None = None) -> list[str]:
    """The ``mt3d plan`` flags that state one published run: its layout pinned, and how Megatron-LM
    2021 ran (another stack; materialised attention scores, full recompute, PTD-P's scatter/gather of
    stage transfers, Korthikanti et al.'s activation memory, fp16, no transfer overlapped with compute:
    the asynchronous TP all-reduce came to Megatron-LM in 2022). The model goes in as ``cfg``."""
    label, _, heads, hidden, layers, tp, pp, gpus, batch, micro, v, zero, published = row
    argv = [
        "--gpus", str(gpus), "--gpus-per-node", "8", "--gpu", device, "--global-batch", str(batch),
        "--seq-len", str(SEQ), "--vocab", str(VOCAB), "--precision", "fp16", "--tensor", str(tp),
        "--pipeline", str(pp), "--data", str(gpus // (tp * pp)), "--micro-batch", str(micro),
        "--virtual-stages", str(v), "--zero", str(zero), "--offload", "none", "--context", "1",
        "--recompute", "full", "--attention-kernel", "materialized", "--activation-model", "korthikanti",
        "--other-stack", "--overlap", "none",
    ]  # fmt: skip
    if not label.startswith("MT-NLG"):  # MT-NLG ran on DeepSpeed's pipeline engine: whole transfers
        argv.append("--pp-scatter-gather")
    if fraction is not None:
        argv += ["--gemm-fraction", str(fraction)]
    return argv


@functools.cache
def _parser():
    """``mt3d plan``'s own parser (built once: predictions run thousands of times in a refit)."""
    from ..planner.args import plan_parser

    return plan_parser()


def predict(row: tuple, device: str = "a100-80gb", fraction: float | None = None) -> dict:
    """The planner's step time and TFLOP/s at one published layout, through ``mt3d plan``'s own
    parser and ``plan`` (``command_line``; ``fraction``: of the GEMM ceiling, instead of
    ``compute.GEMM_FRACTION``)."""
    label, _, heads, hidden, layers, tp, pp, gpus, batch, micro, v, zero, published = row
    cfg = ModelConfig(
        name=label, hidden=hidden, layers=layers, heads=heads, ffn=4 * hidden, max_seq_len=SEQ,
        vocab_size=VOCAB, position="learned", norm="layernorm", mlp="gelu", bias=True,
    )  # fmt: skip

    def planned(*extra):
        from ..planner.args import plan_inputs
        from ..planner.search import plan

        args = _parser().parse_args(["--model", "-", *command_line(row, device, fraction), *extra])
        inputs = plan_inputs(args, cfg)
        result = plan(cfg, inputs.pop("cluster"), **inputs)
        rows = [r for r in result["feasible"] if not r["sequence_parallel"]]  # Megatron-LM 2021: no SP
        return rows, result["rejected"]

    rows, rejected = planned()
    too_big = None
    if not rows:  # a layout that ran, which the memory model rejects: time it anyway, and say so
        too_big = next((r["memory_gb"] for r in rejected if "memory_gb" in r), None)
        if too_big is None:
            raise RuntimeError(f"{label}: the planner rejects the published layout ({rejected[:1]})")
        rows, _ = planned("--memory-gb", "10000")
    t, dp = rows[0], gpus // (tp * pp)
    tflops = published_flops(batch, layers, hidden) / gpus / t["step_time_s"] / 1e12
    return {
        "run": label,
        "layout": f"t{tp} p{pp} d{dp} mb{micro} m{t['grad_accum']} v{v} z{zero}",
        "published": published,
        "predicted": round(tflops, 1),
        "error": round(tflops / published - 1, 3),
        "step_s": round(t["step_time_s"], 2),
        "compute": round(t["compute_s"] / t["step_time_s"], 3),
        "bubble": round(t["bubble_s"] / t["step_time_s"], 3),
        "tp": round(t["tp_comm_s"] / t["step_time_s"], 3),
        "pp": round(t["pp_comm_s"] / t["step_time_s"], 3),
        "dp": round(t["dp_comm_s"] / t["step_time_s"], 3),
        "memory_gb": round(too_big or t["memory_gb"], 1),
        "rejected_for_memory_gb": round(too_big, 1) if too_big else None,
    }


def summary(rows: list[dict]) -> dict:
    """Median and worst absolute error of ``rows``, and how many are within 10%."""
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {
        "median_abs_error": round(statistics.median(errors), 3),
        "worst": f"{worst['run']} {worst['error']:+.1%}",
        "within_10pct": f"{sum(e <= 0.10 for e in errors)}/{len(rows)}",
    }


def calibrate(device: str = "a100-80gb") -> float:
    """The one fraction of the GEMM ceiling that minimises the median |error| over PTD-P's Table 1
    (a 0.01 grid from 0.40 to 1.00, then 0.001 steps around its best); every other row is predicted
    with it, out of sample."""

    def cost(f):
        return statistics.median(abs(predict(r, device, f)["error"]) for r in PTDP_TABLE1)

    coarse = min((x / 100 for x in range(40, 101)), key=cost)
    return min((round(coarse + x / 1000, 3) for x in range(-10, 11) if 0 < coarse + x / 1000 <= 1), key=cost)


def fidelity() -> dict:
    """Every row with ``compute.GEMM_FRACTION`` (the planner's) and with none (GEMMs at the
    published ceiling), the worst and median errors of each group, and the refitted fraction."""
    from ..planner.compute import GEMM_FRACTION
    from ..planner.hardware import get_device

    groups = {"PTD-P Table 1": PTDP_TABLE1, "PTD-P Table 2": PTDP_TABLE2, "MT-NLG": MTNLG_RUNS}
    out = {"gemm_ceiling_tflops": get_device("a100-80gb").gemm_tflops, "refitted_fraction": calibrate()}
    for name, fraction in (("planner", GEMM_FRACTION), ("ceiling", 1.0)):
        rows = [{**predict(r, fraction=fraction), "group": g} for g, rs in groups.items() for r in rs]
        out[name] = {
            "fraction": fraction,
            "rows": rows,
            "all": summary(rows),
            **{g: summary([r for r in rows if r["group"] == g]) for g in groups},
        }
    return out


def run(args) -> None:
    """Print both tables and their summaries."""
    result = fidelity()
    cols = [
        "run",
        "layout",
        "published",
        "predicted",
        "error",
        "step_s",
        "compute",
        "bubble",
        "tp",
        "pp",
        "dp",
        "memory_gb",
        "rejected_for_memory_gb",
    ]
    print("each row: python -m mt3d plan --model <its shape> " + " ".join(command_line(PTDP_TABLE1[0])))
    for name in ("planner", "ceiling"):
        part = result[name]
        tf = part["fraction"] * result["gemm_ceiling_tflops"]
        ceiling = result["gemm_ceiling_tflops"]
        print(f"\nGEMMs at {part['fraction']:g} x {ceiling:g} = {tf:.0f} TFLOP/s ({name}):")
        print(table(part["rows"], cols))
        for group, s in part.items():
            if isinstance(s, dict):
                within, med, worst = s["within_10pct"], s["median_abs_error"], s["worst"]
                print(f"  {group}: {within} within 10%, median |error| {med:.1%}, worst {worst}")
    fitted, used = result["refitted_fraction"], result["planner"]["fraction"]
    print(f"\nfraction refitted on Table 1 (smallest worst error): {fitted:g} (planner: {used:g})")
    emit("planner", result)


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of the fidelity table in the README (the planner's fraction)."""
    rows = []
    for x in r["planner"]["rows"]:
        t, p, d, mb, _, v, z = x["layout"].split()
        layout = f"{t[1:]}, {p[1:]}, {d[1:]}, {mb[2:]}, {v[1:]}, {z[1:]}"
        rows.append([x["run"], layout, x["published"], f"{x['predicted']:.0f}", f"{x['error']:+.1%}"])
    return ["run", "layout (t, p, d, micro, v, ZeRO)", "published", "predicted", "error"], rows
