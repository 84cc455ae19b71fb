"""``python -m mt3d.bench <name>``: benchmarks that print measured figures beside the theory.

Each prints a table for people and one ``BENCH {json}`` line for programs (launch/bench.sh
collects them into a Markdown table).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..inputs import (
    OneLineParser,
    choices_list,
    non_negative_int,
    optional_positive_ints,
    positive_float,
    positive_int,
    positive_ints,
)

BENCHES = {
    "overhead": "step time of mt3d at tp=pp=dp=1 vs a plain PyTorch loop and transformers+DeepSpeed",
    "bubble": "measured pipeline idle fraction per stage vs theory: 1F1B, interleaved, zero-bubble",
    "preprocess": "mt3d preprocess MB/s and tokens/s with 1 and 2 workers vs raw tokenizers batch encoding",
    "comm": "calls and bytes of every TP collective per layer vs 8*b*s*h*(t-1)/t (tp 2/4, with/without SP); "
    "with --cp, each context-parallel exchange (all-to-all, all-gather, halo, Gated DeltaNet) vs its volume",
    "memory": "measured peak memory per rank vs the planner's prediction (ZeRO, tp, pp, recompute, offload)",
    "gpu": "one-GPU bf16 throughput and MFU of gpt3-1.3b / llama-1b vs transformers+DeepSpeed (--smoke: CPU)",
    "checkpoint": "checkpoint save/load time and bytes beside the raw disk write speed (tiny, 100m, 1b)",
    "hfload": "load time and peak memory per rank of a ~1B HF model at tp 2 vs transformers.from_pretrained",
    "attention": "local vs global layers as n grows (n*W vs n^2), and each local pattern's kernel vs dense "
    "causal beside its speed-of-light bound; --part sinks / qk-clip: the cost of sinks and of QK-clip's "
    "logit maxima",
    "longctx": "one long sequence at cp 1/2/4 with and without sequence tiles: per-rank peak memory vs the "
    "planner, and one process vs cp 4 under an address-space cap",
    "planner": "the planner's predicted TFLOP/s at published layouts (PTD-P, ZeRO-3, MT-NLG) vs the papers",
    "gemm": "a GEMM sweep of transformer shapes beside the planner's shape model (--smoke: CPU)",
    "overlap": "the share of a column-parallel linear's backward communication (tp 2, with and without SP), "
    "of the data-parallel gradient reduction (dp 2) and of pipeline transfers (pp 2) hidden behind compute, "
    "beside the schedule's prediction",
    "fp8": "training loss of FP8 linears (tensorwise, rowwise, blockwise, mxfp8) beside bf16 over N steps, "
    "and a plot",
    "muon": "training loss of Muon beside AdamW over N steps, at their usual learning rates, and a plot",
    "lora": "optimizer and gradient bytes of a LoRA step vs a full fine-tune, measured beside the planner "
    "(mt3d plan --lora R)",
    "packing": "packed fine-tuning data: document-masked attention vs causal and a dense mask, packing "
    "efficiency of the shipped chat corpus, supervised tokens/s packed vs padded",
    "autoep": "mt3d against DeepSpeed AutoEP on the same HF Mixtral at ep 2 (ZeRO-1, fp32): step time as a "
    "ratio over A/B pairs, losses side by side (builds AutoEP's own virtualenv when missing); then mt3d's "
    "whole experts folded over tp x dp (etp 1) against experts split over tp (etp 2) at tp 2",
    "gpu-suite": "every GPU item in one call (GEMM sweep, one-GPU MFU with recompute modes and optimizer "
    "offload beside the planner's step time and memory, local attention at 32k, long context), with a dated "
    "record in docs/benchmarks/",
}


def build_parser() -> argparse.ArgumentParser:
    """Arguments of every benchmark."""
    p = OneLineParser(prog="python -m mt3d.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="name", metavar="<benchmark>")
    o = sub.add_parser("overhead", help=BENCHES["overhead"])
    o.add_argument("--sizes", type=choices_list(("tiny", "small"), "--sizes"), default=("tiny", "small"),
                   help="comma-separated model sizes (tiny, small)")  # fmt: skip
    o.add_argument("--reps", type=positive_int, default=15)
    o.add_argument("--zero", type=choices_list((0, 1, 2, 3), "--zero"), default=(0, 1),
                   help="ZeRO stages of the mt3d engine to measure (dp=1: 0 is the fit)")  # fmt: skip
    o.add_argument("--seq-len", type=positive_int, default=64)
    o.add_argument("--micro", type=positive_int, default=4)
    o.add_argument("--global-batch", type=positive_int, default=16)
    b = sub.add_parser("bubble", help=BENCHES["bubble"])
    b.add_argument("--stages", type=positive_ints, default=(2, 4))
    b.add_argument("--micro-batches", type=positive_ints, default=(4, 8))
    b.add_argument("--steps", type=positive_int, default=5)
    b.add_argument("--hidden", type=positive_int, default=1024)
    b.add_argument("--layers-per-stage", type=positive_int, default=2)
    b.add_argument(
        "--virtual",
        type=positive_ints,
        default=(1, 2),
        help="virtual stages per rank to compare (1: DeepSpeed's 1F1B)",
    )
    b.add_argument(
        "--schedules",
        type=choices_list(("1f1b", "zb-h1", "zbv"), "--schedules"),
        default=("1f1b",),
        help="pipeline schedules to compare (1f1b at each --virtual; zb-h1 and zbv at their own chunks)",
    )
    b.add_argument("--memory", action="store_true",
                   help="a profiled step more per run: each rank's activation peak")  # fmt: skip
    pr = sub.add_parser("preprocess", help=BENCHES["preprocess"])
    pr.add_argument("--mb", type=positive_float, default=50.0, help="size of the generated jsonl input")
    c = sub.add_parser("comm", help=BENCHES["comm"])
    c.add_argument("--tp", type=optional_positive_ints, default=(2, 4), help="TP degrees ('' for none)")
    c.add_argument("--cp", type=optional_positive_ints, default=(),
                   help="context-parallel degrees to measure each exchange at, e.g. 2,4")  # fmt: skip
    c.add_argument(
        "--cp-seq-len", type=positive_int, default=64, help="sequence of the cp rows (the halo also at 2x)"
    )
    c.add_argument("--ep", type=optional_positive_ints, default=(),
                   help="expert-parallel degrees to measure the MoE all-to-all at: 2,4")  # fmt: skip
    c.add_argument("--ep-tokens", type=positive_int, default=280,
                   help="tokens per rank of the ep rows (a multiple of C(experts, k) per k)")  # fmt: skip
    c.add_argument("--ep-experts", type=positive_int, default=8, help="routed experts of the ep rows")
    c.add_argument("--ep-top-k", type=positive_ints, default=(2, 4),
                   help="experts per token of the ep rows: 2,4")  # fmt: skip
    c.add_argument("--layers", type=positive_int, default=2)
    c.add_argument("--hidden", type=positive_int, default=64)
    c.add_argument("--seq-len", type=positive_int, default=32)
    c.add_argument("--micro", type=positive_int, default=2)
    c.add_argument("--accum", type=positive_int, default=2)
    ov = sub.add_parser("overlap", help=BENCHES["overlap"])
    ov.add_argument("--reps", type=positive_int, default=7)
    ov.add_argument(
        "--bucket-elements", type=positive_int, default=2_000_000, help="gradient bucket of the dp rows"
    )
    ov.add_argument("--smoke", action="store_true", help="one shape, a small model (tests)")
    ov.add_argument("--parts", type=choices_list(("tp", "dp", "pp", "ep"), "--parts"),
                    default=("tp", "dp", "pp", "ep"), help="which rows to measure: tp,dp,pp,ep")  # fmt: skip
    ov.add_argument("--ep-chunks", type=positive_ints, default=(1, 2, 4),
                    help="chunk counts of the ep rows (train.overlap.dispatch_chunks): 1,2,4")  # fmt: skip
    mem = sub.add_parser("memory", help=BENCHES["memory"])
    mem.add_argument("--seq-len", type=positive_int, default=256)
    mem.add_argument("--micro", type=positive_int, default=4)
    mem.add_argument("--accum", type=positive_int, default=2)
    mem.add_argument("--layouts", type=positive_int, default=99, help="run only the first N layouts")
    mem.add_argument(
        "--vocab", type=positive_int, default=512, help="vocabulary of both models (the loss's logits)"
    )
    mem.add_argument("--keep-logits", action="store_true",
                     help="run DeepSpeed's own forward pass, whose last stage keeps its logits (what mt3d's "
                     "release saves)")  # fmt: skip
    mem.add_argument(
        "--rows", type=positive_ints, default=None, help="run only these layouts (1-based: 10,12)"
    )
    _add_device_and_model_parsers(sub)
    return p


def _add_device_and_model_parsers(sub) -> None:
    """gpu, gpu-suite and checkpoint (then ``_add_model_parsers``)."""
    from ..inputs import (
        choices_list,
        positive_int,
    )

    gp = sub.add_parser("gpu", help=BENCHES["gpu"])
    gp.add_argument("--seq-len", type=positive_int, default=2048)
    gp.add_argument("--micro", type=positive_int, default=8)
    gp.add_argument("--accum", type=positive_int, default=1)
    gp.add_argument("--steps", type=positive_int, default=10)
    gp.add_argument("--warmup", type=non_negative_int, default=3)
    gp.add_argument("--compile", action="store_true", help="also measure mt3d with compiled blocks")
    gp.add_argument("--compile-only", action="store_true", help="measure mt3d only with compiled blocks")
    gp.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check of the code path)")
    gp.add_argument("--recompute", type=choices_list(("none", "full", "selective"), "--recompute"),
                    default=("none",), help="mt3d rows per recompute mode")  # fmt: skip
    gp.add_argument("--offload", type=choices_list(("none", "opt-cpu"), "--offload"), default=("none",),
                    help="opt-cpu: one more mt3d row per model, its optimizer on the CPU")  # fmt: skip
    gp.add_argument("--fp8", type=choices_list(("tensorwise", "rowwise"), "--fp8"), default=(),
                    help="one more mt3d row per model and FP8 recipe (train.fp8)")  # fmt: skip
    gp.add_argument("--models", type=choices_list(("gpt3-1.3b", "llama-1b", "qwen3-moe-1.7b"), "--models"),
                    default=("gpt3-1.3b", "llama-1b"), help="which models to measure")  # fmt: skip
    gp.add_argument("--no-hf", action="store_true", help="skip the transformers + DeepSpeed rows")
    gp.add_argument("--profile", action="store_true",
                    help="also profile one step of the first mt3d row: its top kernels")  # fmt: skip
    su = sub.add_parser("gpu-suite", help=BENCHES["gpu-suite"])
    su.add_argument("--smoke", action="store_true", help="the suite's CPU check: gemm and gpu in smoke mode")
    from .gpu_suite import STEP_NAMES

    su.add_argument("--only", type=choices_list(STEP_NAMES, "--only"), default=None,
                    help="run these steps only (the device tool's 10-minute calls: gemm, then gpu, then "
                    "attention,longctx)")  # fmt: skip
    su.add_argument("--out", default="docs/benchmarks", help="directory of the dated record")
    ck = sub.add_parser("checkpoint", help=BENCHES["checkpoint"])
    ck.add_argument("--sizes", type=choices_list(("tiny", "100m", "1b"), "--sizes"), default=("tiny", "100m"),
                    help="tiny, 100m, 1b (1b needs ~20 GB of memory)")  # fmt: skip
    ck.add_argument("--dir", default="/tmp", help="where to write (the disk being measured)")
    _add_model_parsers(sub)


def _add_model_parsers(sub) -> None:
    """hfload, attention, longctx, planner, fp8 and gemm."""
    h = sub.add_parser("hfload", help=BENCHES["hfload"])
    h.add_argument("--hidden", type=positive_int, default=2048)
    h.add_argument("--layers", type=positive_int, default=18)
    h.add_argument("--tmp", default=None, help="directory for the 4 GB model (default: system temp)")
    at = sub.add_parser("attention", help=BENCHES["attention"])
    at.add_argument("--part", choices=["layers", "patterns", "both", "sinks", "qk-clip"], default="both")
    at.add_argument(
        "--seq-lens", type=positive_ints, default=(1024, 4096, 16384), help="layers: sequence lengths"
    )
    at.add_argument("--window", type=positive_int, default=256, help="layers: the local layer's window")
    at.add_argument("--hidden", type=positive_int, default=512, help="layers: block width")
    at.add_argument("--heads", type=positive_int, default=8)
    at.add_argument("--reps", type=positive_int, default=3)
    at.add_argument("--pattern-lens", type=positive_ints, default=None,
                    help="patterns: lengths (default 4096,16384; GPU 32768)")  # fmt: skip
    at.add_argument(
        "--pattern-window", type=positive_int, default=None, help="patterns: W (default 512; GPU 2048)"
    )
    at.add_argument(
        "--strides",
        type=optional_positive_ints,
        default=None,
        help="patterns: strided rows besides 1 and W (default 64; GPU 256)",
    )
    at.add_argument(
        "--dilation", type=positive_int, default=2, help="patterns: the dilated row's d (1: none)"
    )
    at.add_argument(
        "--head-dim", type=positive_int, default=None, help="patterns: head size (default 64; GPU 128)"
    )
    lc = sub.add_parser("longctx", help=BENCHES["longctx"])
    lc.add_argument("--part", choices=["memory", "cap", "both"], default="both")
    lc.add_argument("--cp", type=positive_ints, default=(1, 2, 4), help="memory: cp degrees")
    lc.add_argument("--seq-len", type=positive_int, default=4096, help="memory: tokens of the one sample")
    lc.add_argument("--tile-len", type=non_negative_int, default=512, help="memory: the tiled rows' tile_len")
    lc.add_argument("--cap-seq-len", type=positive_int, default=8192, help="cap: tokens of the one sample")
    lc.add_argument(
        "--cap-mb", type=positive_float, default=None, help="cap: MB per rank (default: measured midpoint)"
    )
    sub.add_parser("planner", help=BENCHES["planner"])
    f8 = sub.add_parser("fp8", help=BENCHES["fp8"])
    f8.add_argument("--steps", type=positive_int, default=300)
    f8.add_argument(
        "--hidden", type=positive_int, default=64, help="the tiny Llama's width (a multiple of 16)"
    )
    f8.add_argument("--lr", type=positive_float, default=2e-3)
    f8.add_argument("--plot", default=None, help="write the curves to this PNG")
    mu = sub.add_parser("muon", help=BENCHES["muon"])
    mu.add_argument("--steps", type=positive_int, default=300)
    mu.add_argument("--hidden", type=positive_int, default=128, help="the tiny Llama's width")
    mu.add_argument("--adam-lr", type=positive_float, default=2e-3, help="AdamW's peak rate (both runs)")
    mu.add_argument("--muon-lr", type=positive_float, default=2e-2, help="Muon's peak rate")
    mu.add_argument("--plot", default=None, help="write the curves to this PNG")
    _add_packing_parser(sub)
    ae = sub.add_parser("autoep", help=BENCHES["autoep"])
    ae.add_argument("--pairs", type=positive_int, default=4, help="A/B pairs of runs")
    ae.add_argument("--steps", type=positive_int, default=20, help="steps per run (3 are not timed)")
    ae.add_argument("--ep", type=positive_int, default=2, help="expert-parallel degree (= processes)")
    ae.add_argument("--dispatch", type=lambda s: s.split(","), default=["rank", "assignment"],
                    help="mt3d's parallel.expert_dispatch values, each run beside AutoEP in every round "
                    "(the first one's losses are compared)")  # fmt: skip
    ae.add_argument("--folded-pairs", type=int, default=2,
                    help="A/B pairs of the folded row: mt3d at tp 2, experts split over tp (etp 2) against "
                    "whole experts folded over tp x dp (etp 1), world 2 x ep; 0 skips it")  # fmt: skip
    ae.add_argument("--venv", default="~/.cache/mt3d/autoep-venv",
                    help="AutoEP's virtualenv, built when missing")  # fmt: skip
    lo = sub.add_parser("lora", help=BENCHES["lora"])
    lo.add_argument("--hidden", type=positive_int, default=256, help="the tiny Llama's width")
    lo.add_argument("--layers", type=positive_int, default=4)
    lo.add_argument("--rank", type=positive_int, default=8, help="LoRA r on every linear of the blocks")
    gm = sub.add_parser("gemm", help=BENCHES["gemm"])
    gm.add_argument("--reps", type=positive_int, default=20)
    gm.add_argument("--fp8", action="store_true",
                    help="also time each shape in FP8 (torch._scaled_mm; tensorwise, rowwise)")  # fmt: skip
    gm.add_argument(
        "--smoke", action="store_true", help="tiny fp32 shapes on the CPU (a check of the code path)"
    )


def _add_packing_parser(sub) -> None:
    pk = sub.add_parser("packing", help=BENCHES["packing"])
    pk.add_argument("--part", choices=["attention", "efficiency", "throughput", "all"], default="all")
    pk.add_argument("--tokens", type=positive_int, default=4096, help="attention: tokens of the sequence")
    pk.add_argument("--documents", type=positive_int, default=16, help="attention: documents in it")
    pk.add_argument("--heads", type=positive_int, default=8, help="attention: heads")
    pk.add_argument("--head-dim", type=positive_int, default=64, help="attention: head size")
    pk.add_argument("--reps", type=positive_int, default=3)
    pk.add_argument("--vocab", type=positive_int, default=2048, help="the chat corpus's BPE vocabulary")
    pk.add_argument("--seq-lens", type=positive_ints, default=(256, 512, 1024, 2048), help="efficiency")
    pk.add_argument("--seq-len", type=positive_int, default=512, help="throughput: sample length")
    pk.add_argument("--hidden", type=positive_int, default=128, help="throughput: the tiny Llama's width")
    pk.add_argument("--steps", type=positive_int, default=8, help="throughput: steps per path")


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = build_parser().parse_args(argv)
    if not args.name:
        build_parser().print_help()
        return 2
    import warnings

    warnings.filterwarnings(
        "ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning
    )
    from ..errors import EXIT_BAD_INPUT, UserError

    module = importlib.import_module(f"mt3d.bench.{args.name.replace('-', '_')}")
    try:
        why = module.check_args(args) if hasattr(module, "check_args") else None  # before any process
        if why:
            raise UserError(why)
        module.run(args)
    except (UserError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        print(f"python -m mt3d.bench {args.name}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
