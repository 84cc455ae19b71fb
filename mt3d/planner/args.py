"""``mt3d plan``'s flags and their translation into ``planner.search.plan``'s inputs: the one home of
both, read by the command and by the planner benchmark (which plans published runs through them)."""

from __future__ import annotations

from ..errors import UserError
from ..inputs import (
    OneLineParser,
    choices_list,
    nonnegative_float,
    positive_float,
    positive_int,
    positive_ints,
    world_size,
)

PLAN_EXAMPLES = """examples:
  mt3d plan --model gpt3-1.3b --gpus 8 --gpus-per-node 8 --gpu h100
  mt3d plan --model mtnlg-530b --gpus 2240 --gpu a100-80gb --global-batch 1920 --seq-len 2048
  mt3d plan --model ds_configs/megatron_8.3b_tp8.json --gpus 64 --gpus-per-node 8 --gpu h200 --json
  mt3d plan --model hf/llama --gpus 16 --gpus-per-node 8 --gpu h100 --write-config ds_configs/my_llama.json
"""


# `mt3d plan` flags that override a field of the GPU preset (planner.hardware.Device): flag -> (field, help)
DEVICE_FLAGS = {
    "--peak-tflops": ("peak_tflops", "the device's dense peak, TFLOP/s"),
    "--memory-gb": ("memory_gb", "the device's memory, GB"),
    "--gemm-tflops": ("gemm_tflops", "the device's GEMM ceiling, TFLOP/s (largest achievable matmul rate)"),
    "--gemm-tflops-fp8": ("gemm_tflops_fp8", "the device's FP8 GEMM ceiling, TFLOP/s (bench gemm --fp8)"),
    "--nvlink-gbps": ("intra_gbps", "GB/s per GPU inside a node (NVLink bus bandwidth)"),
    "--network-gbps": ("inter_gbps", "GB/s per node across nodes (all its NICs; shared by its GPUs)"),
    "--pcie-gbps": ("pcie_gbps", "GB/s per GPU between GPU and CPU memory (offload)"),
    "--nvme-gbps": ("nvme_gbps", "GB/s of a node's NVMe drives together (ZeRO-Infinity)"),
    "--host-memory-gb": ("host_memory_gb", "CPU memory per node, GB (offload)"),
    "--nvme-gb": ("nvme_gb", "NVMe capacity per node, GB (ZeRO-Infinity; 0 = none)"),
}


def add_plan_stack(p) -> None:
    """``mt3d plan``'s flags for another stack's choices: pinned degrees and batch split (each takes
    one value or a list to try) and how that stack runs (``planner.search.Stack``)."""
    from .choices import (
        ATTENTION_KERNELS,
        DEFAULT_OVERLAP,
        GRAD_DTYPES,
        OPTIMIZER_STATES,
        OVERLAPS,
        RECOMPUTE,
    )
    from .offload import OFFLOAD_OPTIONS

    p.add_argument("--tensor", type=positive_ints, default=None, help="tensor-parallel degrees to try")
    p.add_argument("--pipeline", type=positive_ints, default=None, help="pipeline degrees to try")
    p.add_argument("--data", type=positive_ints, default=None, help="data-parallel degrees to try")
    p.add_argument(
        "--expert", type=positive_ints, default=None, help="expert-parallel degrees to try (MoE models)"
    )
    p.add_argument(
        "--expert-tensor", type=positive_ints, default=None,
        help="expert-tensor degrees to try (mt3d.parallel.expert_tensor: ranks splitting one expert; 1: "
        "whole experts, ep folded over tp x cp x dp; default: every divisor of tp)",
    )  # fmt: skip
    p.add_argument("--micro-batch", type=positive_ints, default=(1, 2, 4, 8, 16), help="micro-batches to try")
    p.add_argument("--zero", type=choices_list((0, 1, 2, 3), "--zero"), default=(0, 1, 2, 3),
                   help="ZeRO stages to try (0-3)")  # fmt: skip
    p.add_argument("--offload", type=choices_list(OFFLOAD_OPTIONS, "--offload"), default=None,
                   help="offload tiers to try (none, opt-cpu, opt-nvme, cpu, nvme)")  # fmt: skip
    p.add_argument("--recompute", type=choices_list(RECOMPUTE, "--recompute"), default=RECOMPUTE,
                   help="recompute modes to try (none, full: whole blocks, selective: attention core and "
                   "activations)")  # fmt: skip
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="flash",
                   help="the attention kernel of the stack planned for (materialized: scores kept, as "
                   "Megatron-LM 2021)")  # fmt: skip
    p.add_argument(
        "--pp-scatter-gather",
        action="store_true",
        help="stage-boundary transfers split over the TP ranks (PTD-P's scatter/gather)",
    )
    p.add_argument("--other-stack", action="store_true",
                   help="plan for a stack other than mt3d: skip the rules of mt3d's DeepSpeed engine (ZeRO "
                   "stage with a pipeline or cp, MoE)")  # fmt: skip
    p.add_argument(
        "--gemm-fraction",
        type=positive_float,
        default=None,
        help="share of the GEMM ceiling a training step's GEMMs reach (default: the calibration)",
    )
    p.add_argument("--optimizer-states", choices=OPTIMIZER_STATES, default="fp32",
                   help="optimizer-state dtype of 16-bit training: fp32 master and moments (12 B/param), "
                   "bf16-moments (8), bf16 master and moments (6)")  # fmt: skip
    p.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="param",
                   help="gradients of 16-bit training in the weights' dtype (param: DeepSpeed's default), or "
                   "fp32 (mt3d: data_types.grad_accum_dtype fp32, DeepSpeed's BF16 optimizer at bf16 "
                   "ZeRO-1; Megatron-Core's default fp32 gradient buffer)")  # fmt: skip
    p.add_argument("--overlap", type=choices_list(OVERLAPS + ("none",), "--overlap"), default=DEFAULT_OVERLAP,
                   help="transfers the stack overlaps with compute (mt3d: tp always, the list adds to it; "
                   "--other-stack: the list, none for nothing): tp (each column-parallel linear's backward "
                   "transfers behind its GEMMs), dp "
                   "(gradient reduction during the last backward: mt3d.train.overlap.grad_reduce), pp "
                   "(pipeline transfers posted ahead: mt3d.train.overlap.p2p), tp-comm (--other-stack: "
                   "every TP transfer of an SP layout behind the GEMM beside it, Megatron-Core's "
                   "--tp-comm-overlap; without SP tp's), ep (the expert all-to-all pipelined behind the "
                   "routed experts in 4 chunks: mt3d.train.overlap.dispatch_chunks)")  # fmt: skip
    p.add_argument("--lora", type=positive_int, default=0, metavar="R",
                   help="LoRA of rank R on every linear of the blocks (mt3d.lora): optimizer states and "
                   "gradients of the adapters only, beside the frozen base's weights")  # fmt: skip
    _add_fp8_flags(p)
    p.add_argument("--activation-model", choices=("mt3d", "te", "korthikanti"), default="mt3d",
                   help="activation memory of mt3d's blocks, of TransformerEngine's (a gated MLP keeps 3 x "
                   "ffn/t, mt3d 4), or Korthikanti et al.'s Table 2 (Megatron)")  # fmt: skip
    p.add_argument("--ep-dispatch", choices=("whole", "sequence-shard"), default=None,
                   help="how tokens reach the experts: every TP rank sends whole rows (mt3d's, the default) "
                   "or only its sequence shard, the rows then gathered over the expert-TP ranks "
                   "(Megatron-Core with SP: the default with --other-stack)")  # fmt: skip
    p.add_argument("--fsdp", action="store_true",
                   help="--other-stack: ZeRO-3 as FSDP runs it (fp32 shards with no 16-bit copy, two blocks "
                   "gathered at a time)")  # fmt: skip


def _add_fp8_flags(p) -> None:
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: one momentum on the blocks' matrices instead of Adam's two moments, and "
                   "Newton-Schulz's GEMMs in the step (the written config's optimizer)")  # fmt: skip
    p.add_argument("--fp8", choices=("tensorwise", "rowwise", "blockwise", "mxfp8"), default=None,
                   help="the blocks' linears in FP8 with this recipe (train.fp8; bf16 only)")  # fmt: skip
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="the expert dispatch in FP8 (train.fp8.dispatch; a tiled --fp8)")  # fmt: skip


def plan_inputs(args, cfg, defaults: dict | None = None) -> dict:
    """``planner.search.plan``'s keyword arguments from parsed ``mt3d plan`` flags (``defaults``: those
    of a run config given as the model): the one translation, used by the command and the benchmarks."""
    from .hardware import get_device
    from .search import Cluster, Stack

    defaults = defaults or {}
    overrides = {
        field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in DEVICE_FLAGS.items()
    }
    if overrides["inter_gbps"] is not None:  # the flag is per node, the device field per GPU
        overrides["inter_gbps"] /= args.gpus_per_node

    def given(value, fallback):
        return value if value is not None else fallback

    pins = {ax: getattr(args, flag) for ax, flag in PLAN_PINS.items() if getattr(args, flag)}
    other = {"--fsdp": args.fsdp, "--ep-dispatch sequence-shard": args.ep_dispatch == "sequence-shard",
             "--activation-model te": args.activation_model == "te"}  # fmt: skip
    named = [flag for flag, on in other.items() if on]
    if named and not args.other_stack:
        raise UserError(f"{named[0]} states another stack's choice (mt3d does not run it): add --other-stack")
    if args.fp8_dispatch and args.fp8 not in ("blockwise", "mxfp8"):
        raise UserError("--fp8-dispatch casts the dispatch in a tiled recipe: add --fp8 blockwise or mxfp8")
    seq_len = given(args.seq_len, defaults.get("seq_len") or cfg.max_seq_len)
    _check_context(args.context, seq_len)
    return dict(
        cluster=Cluster(args.gpus, args.gpus_per_node, get_device(args.gpu, **overrides)),
        global_batch=given(args.global_batch, defaults.get("global_batch") or 512),
        seq_len=seq_len,
        vocab=given(args.vocab, cfg.vocab_size or defaults.get("vocab")),
        precision=args.precision,
        efficiency=args.efficiency,
        virtual_stages=args.virtual_stages,
        schedule=args.schedule,
        context=args.context,
        micro_batches=args.micro_batch,
        zero_stages=args.zero,
        **({"offloads": args.offload} if args.offload else {}),
        pins=pins,
        stack=Stack(
            args.recompute,
            args.attention_kernel,
            args.pp_scatter_gather,
            args.activation_model,
            args.optimizer_states,
            args.grad_dtype,
            args.gemm_fraction,
            not args.other_stack,
            planned_overlap(args.overlap, args.other_stack),
            args.fp8,
            args.ep_dispatch or ("sequence-shard" if args.other_stack else "whole"),
            args.fsdp,
            args.lora,
            args.fp8_dispatch,
            args.optimizer,
        ),  # fmt: skip
    )


def _check_context(context: tuple[int, ...] | None, seq_len: int) -> None:
    """Pinned ``--context`` degrees that no layout can use at this sequence length are bad input."""
    from ..config.rules import context_sequence_conflict

    why = [context_sequence_conflict(cp, 1, seq_len, False) for cp in context or ()]
    if why and all(why):
        raise UserError(f"--context {','.join(map(str, context))} --seq-len {seq_len}: {why[0]}")


def planned_overlap(given: tuple[str, ...], other_stack: bool) -> tuple[str, ...]:
    """``--overlap``'s transfers as the planner counts them: mt3d's layers always overlap tp (whatever
    the list says); another stack overlaps what the list names (``none``: nothing)."""
    chosen = tuple(x for x in given if x != "none")
    if "tp-comm" in chosen and not other_stack:
        raise UserError("--overlap tp-comm states another stack's TP overlap (Megatron-Core's "
                        "--tp-comm-overlap), which mt3d does not run: add --other-stack")  # fmt: skip
    return chosen if other_stack or "tp" in chosen else ("tp", *chosen)


PLAN_PINS = {"tp": "tensor", "pp": "pipeline", "dp": "data", "ep": "expert", "etp": "expert_tensor"}
"""Axis -> the ``mt3d plan`` flag (attribute) that pins its degrees."""


def plan_model(spec: str):
    """(ModelConfig, mt3d model section, config-file defaults) from a preset, config JSON or HF dir."""
    from pathlib import Path

    from ..config import load, resolve_model
    from ..inputs import read_json

    def load_raw(p):
        return read_json(p, "the config")

    path = Path(spec)
    if path.is_file():
        run = load(path)
        d = run.mt3d.data
        return (
            resolve_model(run.mt3d.model),
            run.mt3d.model,
            {
                "global_batch": run.deepspeed.batch_keys()["train_batch_size"],
                "seq_len": d.seq_len,
                "vocab": d.vocab_size if d.corpus != "indexed" else None,
                "data": (load_raw(path).get("mt3d") or {}).get("data"),
            },
        )
    if path.is_dir():
        return resolve_model({"from_hf": str(path)}), {"from_hf": str(path)}, {}
    return resolve_model({"preset": spec}), {"preset": spec}, {}


PLAN_DESCRIPTION = (
    "Enumerate every layout of a model on a cluster, reject impossible ones with a reason, "
    "predict memory per GPU (ZeRO model states, Korthikanti activations, 1F1B in-flight micro-batches) "
    "and step time (compute from GEMM shapes against the device's GEMM ceiling, or at --efficiency of "
    "peak; TP/PP/DP communication, offload, pipeline bubble) for the "
    "rest, and rank them by step time."
)


def add_plan_arguments(p) -> None:
    """Every ``mt3d plan`` flag, on parser ``p`` (the command's sub-parser, or ``plan_parser``'s)."""
    p.add_argument("--model", required=True, help="preset name, run config JSON, or HF model directory")
    p.add_argument("--gpus", type=world_size, required=True, help="total GPUs")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu", default="h100", help="a100-80gb, h100, h200 or cpu")
    p.add_argument(
        "--global-batch", type=positive_int, help="sequences per step (default: the config's, else 512)"
    )
    p.add_argument(
        "--seq-len",
        type=positive_int,
        help="tokens per sequence (default: the config's, else the model's max)",
    )
    p.add_argument("--vocab", type=positive_int, help="vocabulary size when the model does not fix it")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument(
        "--efficiency",
        type=positive_float,
        default=None,
        help="time compute at this fraction of peak instead of the GEMM shape model (the default; 0.5 "
        "on devices without a GEMM calibration)",
    )
    p.add_argument(
        "--virtual-stages",
        type=positive_ints,
        default=(1, 2, 4),
        help="interleaved-schedule chunks per pipeline rank to try (default 1,2,4)",
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=["1f1b", "zb-h1", "zbv"],
        help="pipeline schedule of every layout with pipeline >= 2 (mt3d.parallel.schedule; zb-h1 and zbv "
        "run their own chunks per rank: 1 and 2, and ignore --virtual-stages)",
    )
    p.add_argument(
        "--context",
        type=positive_ints,
        default=None,
        help="context-parallel degrees to try (default: every divisor of --gpus the sequence allows; 1: off)",
    )
    add_plan_stack(p)
    p.add_argument("--explain", action="store_true", help="print the time and memory components of the best "
                   "layout")  # fmt: skip
    for flag, (_, helptext) in DEVICE_FLAGS.items():
        p.add_argument(flag, type=nonnegative_float if flag == "--nvme-gb" else positive_float, help=helptext)
    p.add_argument("--top", type=positive_int, default=10, help="rows to show")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (feasible and rejected layouts) instead"
    )
    p.add_argument("--write-config", metavar="PATH", help="write the best layout as a ds_configs-style JSON")


def plan_parser():
    """A parser of ``mt3d plan``'s flags alone (the planner benchmark plans published runs with it)."""
    p = OneLineParser(prog="mt3d plan", description=PLAN_DESCRIPTION)
    add_plan_arguments(p)
    return p
