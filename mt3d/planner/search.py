"""``mt3d plan``: enumerate layouts, predict memory and step time, rank the feasible ones.

For a model, a global batch and sequence length, and a cluster, every (tp, cp, pp, dp, micro-batch,
ZeRO stage, recompute, sequence parallel, offload) is either rejected with a reason (divisibility, TP
outside a node, DeepSpeed's engine limits, memory) or predicted: memory per GPU
(``costs.memory_bytes``) and step time (``costs.step_time``, with each axis's bandwidth chosen by
where the rank mapper puts its groups). Feasible layouts are ranked by step time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

from ..config import (
    Offload,
    context_sequence_conflict,
    context_zero_conflict,
    expert_conflict,
    folding_conflict,
    grad_accum_conflict,
    moe_conflict,
    optimizer_states_conflict,
    virtual_stage_conflict,
    zero_pipeline_conflict,
)
from ..errors import UserError
from ..model.config import ModelConfig
from ..parallel.axes import AXES, NAMES, AxisError, derive_degrees, expert_layout, shown
from ..parallel.topology import place, uniform_crossing
from ..pipeline.zero_bubble import SCHEDULES
from .choices import RECOMPUTE  # its home imports nothing (the CLI parser reads it)
from .costs import CPU_ADAM_ELEMENTS_PER_CORE_S, Layout, Precision, memory_bytes, step_time
from .hardware import Device
from .layout import fsdp_precision
from .muon import muon_conflict, muon_cost, muon_precision
from .offload import OFFLOAD_OPTIONS, offload_rule
from .sparsity import attention_speedup
from .timing import dispatch_hosts


@dataclass(frozen=True)
class Cluster:
    """GPUs, their grouping into nodes, and the device type."""

    gpus: int
    gpus_per_node: int
    device: Device


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending (trial division up to sqrt(n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def bandwidths(cluster: Cluster, tp: int, pp: int, expert_tensor: int | None = None,
               **degrees: int) -> dict[str, float]:  # fmt: skip
    """GB/s of each axis (NVLink when the mapper keeps its groups inside nodes, else the network),
    of each GPU's PCIe link and share of the node's NVMe, and the CPU optimizer's elements/s per GPU.
    With a folded expert layout (``expert_tensor``) the ep groups' from the mapper's placement. Where
    the ep groups cross hosts evenly, their split (``ep_hosts`` x ``ep_per_host``, for
    ``parallel.expert_dispatch`` "node") and the within-host bandwidth (``ep_within``)."""
    dev = cluster.device
    pl = None
    if expert_tensor is None:
        cross = uniform_crossing(cluster.gpus, cluster.gpus_per_node, tp, pp, **degrees)
    else:
        pl = place(cluster.gpus, tp, pp, gpus_per_node=cluster.gpus_per_node, expert_tensor=expert_tensor,
                   warn=False, **degrees)  # fmt: skip
        cross = {ax: pl.crossing(ax) > 0 for ax in pl.axes}
    bw = {ax: dev.inter_gbps if crosses else dev.intra_gbps for ax, crosses in cross.items()}
    if cross.get("ep"):  # the ep groups split by host: mt3d's dispatch crosses to each host once
        pl = pl or place(cluster.gpus, tp, pp, gpus_per_node=cluster.gpus_per_node, warn=False, **degrees)
        blocks = pl.ep_host_blocks()
        if blocks is not None and blocks.shape[1] > 1:
            bw.update(ep_hosts=blocks.shape[1], ep_per_host=blocks.shape[2], ep_within=dev.intra_gbps)
    per_node = min(cluster.gpus, cluster.gpus_per_node)
    return {**bw, "pcie": dev.pcie_gbps, "nvme": dev.nvme_gbps / per_node,
            "cpu_adam": dev.cpu_cores_per_gpu * CPU_ADAM_ELEMENTS_PER_CORE_S}  # fmt: skip


def structural_reason(cfg: ModelConfig, cluster: Cluster, tp: int, pp: int, cp: int = 1,
                      seq_len: int | None = None) -> str | None:  # fmt: skip
    """Why (tp, pp, cp) cannot work at all, or None."""
    if tp > cluster.gpus_per_node:
        return f"tp {tp} > {cluster.gpus_per_node} GPUs per node: TP groups would cross nodes"
    if min(cluster.gpus_per_node, cluster.gpus) % tp:
        return (
            f"tp {tp} does not divide the {cluster.gpus_per_node} GPUs of a node: TP groups would cross nodes"
        )
    if cfg.heads % tp:
        return f"{cfg.heads} heads not divisible by tp {tp}"
    if cfg.kv_heads % tp:
        return f"{cfg.kv_heads} kv heads not divisible by tp {tp}"
    if cfg.ffn % tp:
        return f"ffn {cfg.ffn} not divisible by tp {tp}"
    if cfg.moe_spec is not None and cfg.moe_spec.shared_ffn % tp:
        return f"shared expert ffn {cfg.moe_spec.shared_ffn} not divisible by tp {tp}"
    if pp > cfg.layers:
        return f"{cfg.layers} layers cannot fill {pp} stages"
    why = cfg.gdn_spec.parallel_conflict(tp, cp, seq_len) if cfg.gdn_spec is not None else None  # DeltaNet
    if why or seq_len is None:
        return _short(why)
    return _short(context_sequence_conflict(cp, tp, seq_len, False))


def _degrees(cfg: ModelConfig, cluster: Cluster, seq_len: int, reject,
             choices: dict[str, tuple[int, ...]] | None = None):  # fmt: skip
    """Step 1: every assignment of degrees to the configured axes (``axes.AXES``; dp what remains) that
    the structural rules allow, with the bandwidths of its axes. ``choices`` limits an axis to some
    degrees (axes the planner does not model yet are held at 1 by default)."""
    choices = {**({} if cfg.moe is not None else {"ep": (1,)}), **(choices or {})}
    configured = [a.name for a in AXES if a.key]
    options = [choices.get(ax) or divisors(cluster.gpus) for ax in configured]
    for combo in product(*options):
        given = dict(zip(configured, combo))
        for etp in _expert_tensors(given, choices.get("etp")):
            try:
                degrees = derive_degrees(cluster.gpus, given, expert_tensor=etp)
            except AxisError:
                continue
            if "dp" in choices and degrees["dp"] not in choices["dp"]:
                continue  # --data pins dp, which the others leave as what remains
            tp, pp = degrees["tp"], degrees["pp"]
            why = structural_reason(cfg, cluster, tp, pp, degrees["cp"], seq_len)
            why = why or _expert_reason(cfg, degrees)
            if why:
                reject({ax: degrees[ax] for ax in shown(degrees)} | _etp_of(degrees), why)
                continue
            etp = degrees.get("etp", tp) if expert_layout(degrees).folded else None
            yield degrees, bandwidths(cluster, tp, pp, expert_tensor=etp, cp=degrees["cp"], ep=degrees["ep"])


def _expert_tensors(given: dict[str, int], pinned: tuple[int, ...] | None):
    """The expert-tensor degrees to try with these degrees: the pinned ones (``--expert-tensor``), else
    every divisor of tp under expert parallelism (None: tp, the layout before folding)."""
    tp = given["tp"]
    if given.get("ep", 1) == 1:  # no experts split over ranks: nothing to fold
        return [None]
    if pinned:
        return [None if e == tp else e for e in pinned]
    return [None] + [e for e in divisors(tp) if e != tp]


def _etp_of(degrees: dict[str, int]) -> dict[str, int]:
    """``{"etp": etp}`` of derived degrees when it differs from tp (a folded layout's), else nothing."""
    return {"etp": degrees["etp"]} if "etp" in degrees else {}


def _expert_reason(cfg: ModelConfig, degrees: dict[str, int]) -> str | None:
    """Why the experts cannot be laid out at these degrees (``expert_conflict``; the expert inner size
    divides etp)."""
    spec = cfg.moe_spec
    why = expert_layout(degrees).fit_conflict(expert_ffn=spec.expert_ffn) if spec is not None else None
    return why or _short(expert_conflict(spec, degrees["ep"]))


# Step 2's rules, in order: the keys each depends on (a failure is reported once per distinct key)
# and the reason, or None, for a candidate c (tp, pp, dp, micro_batch, grad_accum, zero_stage,
# virtual_stages, and the model cfg and global_batch). Those that come from mt3d's DeepSpeed engine
# (ZeRO with a pipeline or cp, MoE) are skipped when planning for another stack (c["mt3d"] False).
SCHEDULE_RULES = (
    (
        ("micro_batch",),
        lambda c: (
            f"global batch {c['global_batch']} not divisible by micro {c['micro_batch']} x dp {c['dp']}"
            if c["global_batch"] % (c["micro_batch"] * c["dp"])
            else None
        ),
    ),
    (
        ("micro_batch", "zero_stage"),
        lambda c: _short(zero_pipeline_conflict(c["pp"], c["zero_stage"])) if c["mt3d"] else None,
    ),
    (
        ("micro_batch", "zero_stage"),
        lambda c: _short(context_zero_conflict(c["cp"], c["zero_stage"])) if c["mt3d"] else None,
    ),
    (
        ("micro_batch", "zero_stage"),
        lambda c: (
            _short(moe_conflict(c["zero_stage"], c["ep"])) if c["mt3d"] and c["cfg"].moe is not None else None
        ),
    ),
    (
        ("micro_batch", "zero_stage"),
        lambda c: (
            _short(folding_conflict(c["cfg"].moe_spec, c["degrees"], c["zero_stage"]))
            if c["mt3d"] and c["cfg"].moe is not None
            else None
        ),
    ),
    (
        ("micro_batch", "zero_stage", "virtual_stages"),
        lambda c: virtual_stage_conflict(
            c["pp"],
            c["virtual_stages"],
            micro_batches=c["grad_accum"],
            layers=c["cfg"].layers,
            schedule=c["schedule"],
        ),
    ),
)


def _short(reason: str | None) -> str | None:
    """The first clause of a config error, as a rejection reason."""
    return reason.split(" (")[0].split(";")[0] if reason else None


def _schedules(cfg, degrees, global_batch, micro_batches, zero_stages, virtual_stages, reject, mt3d=True,
               schedule="1f1b"):  # fmt: skip
    """Step 2: every (micro-batch, ZeRO stage, virtual stages) of one set of degrees that the batch,
    ZeRO/pipeline, ZeRO/context and interleaving rules (``SCHEDULE_RULES``) allow; a zero-bubble
    ``schedule`` (the degrees' own: "1f1b" at pipeline 1) runs its own chunks per rank
    (``zero_bubble.SCHEDULES``)."""
    failed: set = set()
    tp, pp, dp, cp = degrees["tp"], degrees["pp"], degrees["dp"], degrees["cp"]
    vs = (SCHEDULES[schedule],) if schedule != "1f1b" else virtual_stages if pp > 1 else (1,)
    for b, zero, v in product(micro_batches, zero_stages, vs):
        c = {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "ep": degrees["ep"], "degrees": degrees,
             "micro_batch": b, "zero_stage": zero, "virtual_stages": v,
             "grad_accum": global_batch // (b * dp), "cfg": cfg, "global_batch": global_batch, "mt3d": mt3d,
             "schedule": schedule}  # fmt: skip
        for keys, rule in SCHEDULE_RULES:
            key = (keys, *(c[k] for k in keys))
            if key in failed:  # already reported for these values
                break
            why = rule(c)
            if why:
                failed.add(key)
                shown_degrees = {ax: degrees[ax] for ax in shown(degrees)} | _etp_of(degrees)
                reject(shown_degrees | {k: c[k] for k in keys}, why)
                break
        else:
            yield b, c["grad_accum"], zero, v


def recompute_mode(row) -> str:
    """A layout's (or a plan row's) recompute mode, one of ``RECOMPUTE``."""
    get = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    return "full" if get("recompute") else "selective" if get("selective") else "none"


def _candidates(cfg, cluster, seq_len, global_batch, micro_batches, zero_stages, virtual_stages, offloads,
                reject, choices=None, recompute=RECOMPUTE, mt3d=True, schedule="1f1b"):  # fmt: skip
    """Every layout that passes the structural and schedule rules, with the bandwidths of its axes;
    the others go to ``reject`` with their reason. Step 3: offload, recompute and SP choices."""
    for degrees, bw in _degrees(cfg, cluster, seq_len, reject, choices):
        tp, pp, dp, cp = degrees["tp"], degrees["pp"], degrees["dp"], degrees["cp"]
        sched = schedule if pp > 1 else "1f1b"
        schedules = _schedules(cfg, degrees, global_batch, micro_batches, zero_stages, virtual_stages, reject,
                               mt3d, sched)  # fmt: skip
        sps = [
            sp
            for sp in (False, True)
            if not sp or (tp > 1 and not context_sequence_conflict(cp, tp, seq_len, sp))
        ]
        for b, m, zero, v in schedules:
            allowed = [o for o in offloads if not offload_rule(zero, o)]
            for off, mode, sp in product(allowed, recompute, sps):
                yield Layout(tp, pp, dp, b, m, zero, mode == "full", sp, v, off, cp, ep=degrees["ep"],
                             etp=degrees.get("etp"),
                             selective=mode == "selective", schedule=sched), bw  # fmt: skip


def _check_inputs(
    cfg: ModelConfig, cluster: Cluster, global_batch: int, seq_len: int, vocab, efficiency,
    precision: str = "bf16", fp8: str | None = None,
) -> int:  # fmt: skip
    """One line for each planner input that cannot be planned for; returns the vocabulary size."""
    if vocab is not None and vocab <= 0:
        raise UserError(f"--vocab must be positive, got {vocab}")
    vocab = vocab or cfg.vocab_size
    if not vocab:
        raise UserError("the model has no vocabulary size; give --vocab")
    if cluster.gpus <= 0 or cluster.gpus_per_node <= 0:
        raise UserError("--gpus and --gpus-per-node must be positive")
    for name, value in (("--global-batch", global_batch), ("--seq-len", seq_len)):
        if value <= 0:
            raise UserError(f"{name} must be positive, got {value}")
    limit = cfg.position_limit
    if limit is not None and seq_len > limit:
        why = "context parallelism splits the sequence, not the table"
        raise UserError(f"--seq-len {seq_len} exceeds the model's {limit} learned positions ({why})")
    if efficiency is not None and not 0.01 <= efficiency <= 1:
        raise UserError(f"--efficiency is a fraction of peak in [0.01, 1], got {efficiency:g}")
    dev = cluster.device
    if dev.peak_tflops <= 0 or dev.memory_gb <= 0:
        raise UserError("--peak-tflops and --memory-gb must be positive")
    if fp8 and (precision != "bf16" or not dev.gemm_tflops_fp8 or efficiency is not None):
        why = (f"FP8 trains beside bf16, not {precision}" if precision != "bf16" else
               f"{dev.name} has no FP8 GEMM rate (give --gemm-tflops-fp8)" if not dev.gemm_tflops_fp8 else
               "--fp8 is timed by the GEMM shape model; drop --efficiency")  # fmt: skip
        raise UserError(f"--fp8 {fp8}: {why}")
    if dev.gemm_tflops > dev.peak_tflops:
        raise UserError(
            f"--gemm-tflops {dev.gemm_tflops:g} exceeds the device's dense peak {dev.peak_tflops:g} TFLOP/s: "
            "a GEMM cannot beat the peak (give --peak-tflops too, or measure with python -m mt3d.bench gemm)"
        )
    if cluster.gpus % min(cluster.gpus_per_node, cluster.gpus):
        raise UserError(f"{cluster.gpus} GPUs is not a whole number of {cluster.gpus_per_node}-GPU nodes")
    return vocab


FLAG_OF = {
    "tp": "--tensor",
    "pp": "--pipeline",
    "dp": "--data",
    "ep": "--expert",
    "cp": "--context",
    "etp": "--expert-tensor",
}
"""The ``mt3d plan`` flag that pins each axis's degrees."""


def _check_pins(gpus: int, pins: dict | None) -> None:
    """Pinned degrees that cannot divide the GPUs are refused by name (pins that divide but multiply
    to no layout leave nothing to plan: ``output.explain_infeasible`` says so)."""
    pins = {ax: tuple(v) for ax, v in (pins or {}).items() if v}
    for ax, values in pins.items():
        bad = [v for v in values if gpus % v]
        if bad:
            raise UserError(f"{FLAG_OF.get(ax, ax)} {bad[0]} does not divide --gpus {gpus}")


@dataclass(frozen=True)
class Stack:
    """How the stack being planned for runs (``mt3d plan``'s flags for another stack's choices)."""

    recompute: tuple[str, ...] = RECOMPUTE
    """Recompute modes to try (``RECOMPUTE``)."""
    attention_kernel: str = "flash"
    """flash, or materialized scores (Megatron-LM 2021): ``compute.ATTENTION_KERNELS``."""
    pp_scatter_gather: bool = False
    """PTD-P's stage-boundary transfers split over the TP ranks."""
    activation_model: str = "mt3d"
    """Activation memory of mt3d's blocks, or Korthikanti et al.'s Table 2 (korthikanti)."""
    optimizer_states: str = "fp32"
    """Master weights and moments: ``costs.OPTIMIZER_STATES``."""
    grad_dtype: str = "param"
    """Gradients in the weights' dtype, or fp32 (``choices.GRAD_DTYPES``)."""
    gemm_fraction: float | None = None
    """Share of the GEMM ceiling its GEMMs reach (None: ``compute.GEMM_FRACTION``, the calibration)."""
    mt3d_rules: bool = True
    """The rules of mt3d's DeepSpeed engine apply (ZeRO stage with a pipeline or cp, MoE)."""
    overlap: tuple[str, ...] = ()
    """Transfers overlapped with compute (``choices.OVERLAPS``)."""
    fp8: str | None = None
    """The blocks' linears in FP8 with this recipe (``train.fp8``), at the device's FP8 GEMM ceiling."""
    ep_dispatch: str = "whole"
    """How tokens reach their experts: every TP rank sends the whole rows (mt3d), or only its sequence
    shard ("sequence-shard": Megatron-Core with SP)."""
    fsdp: bool = False
    """ZeRO-3 as FSDP runs it: the fp32 shard is the weight (no 16-bit copy), 16-bit weights gathered
    two blocks at a time."""
    lora: int = 0
    """LoRA rank on every linear of the blocks (0: a full fine-tune): memory of the adapters' states
    only beside the frozen weights (the step time is still a full step's, an upper bound)."""
    fp8_dispatch: bool = False
    """The expert dispatch in ``fp8``'s FP8 (``train.fp8.dispatch``; a tiled recipe)."""
    optimizer: str = "adamw"  # or "muon" (planner.muon: its states and its Newton-Schulz time)


def plan(
    cfg: ModelConfig,
    cluster: Cluster,
    *,
    global_batch: int,
    seq_len: int,
    vocab: int | None = None,
    precision: str = "bf16",
    efficiency: float | None = None,
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16),
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    virtual_stages: tuple[int, ...] = (1, 2, 4),
    offloads: tuple[str, ...] = OFFLOAD_OPTIONS,
    max_rejected: int = 500,
    context: tuple[int, ...] | None = None,
    pins: dict[str, tuple[int, ...]] | None = None,
    stack: Stack = Stack(),  # noqa: B008 - frozen: one shared default is safe
    schedule: str = "1f1b",
) -> dict:
    """Feasible layouts (fastest first) and rejected ones with reasons; see the module docstring.
    ``context``: the cp degrees to consider (default: every divisor of the GPUs the sequence allows);
    ``pins``: the degrees to consider of other axes by name (tp, pp, dp, ep), e.g. another stack's
    layout; ``stack``: how that stack runs (``Stack``); ``schedule``: the pipeline schedule of every
    layout with pipeline >= 2 (``mt3d.parallel.schedule``)."""
    vocab = _check_inputs(cfg, cluster, global_batch, seq_len, vocab, efficiency, precision, stack.fp8)
    if schedule not in SCHEDULES:
        raise UserError(f"unknown --schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    _check_pins(cluster.gpus, pins)
    feasible, rejected = [], []
    rejected_total = 0

    def reject(row: dict, reason: str) -> None:
        # Whole-degree rejections are always kept (few, and the most telling); per-configuration
        # ones are capped at max_rejected.
        nonlocal rejected_total
        rejected_total += 1
        if set(row) <= set(NAMES) or len(rejected) < max_rejected:
            rejected.append({**row, "reason": reason})

    smallest = math.inf  # GB per GPU of the smallest layout without offload
    candidates = _candidates(
        cfg, cluster, seq_len, global_batch, micro_batches, zero_stages, virtual_stages, offloads, reject,
        {**(pins or {}), **({"cp": tuple(context)} if context else {})} or None, stack.recompute,
        stack.mt3d_rules, schedule,
    )  # fmt: skip
    attention = attention_speedup(cfg, seq_len)
    for lay, bw in candidates:
        row, why = _evaluate(cfg, cluster, vocab, seq_len, global_batch, lay, bw, precision, efficiency,
                             stack, attention["tile_fraction"])  # fmt: skip
        if lay.offload == "none":
            smallest = min(smallest, row["memory_gb"])
        if why:
            reject({k: v for k, v in row.items() if k != "memory"}, why)
        else:
            feasible.append(row)
    feasible.sort(key=lambda r: (r["step_time_s"], r["memory_gb"]))
    dev = cluster.device
    return {
        "model": cfg.name,
        "params": cfg.num_params(vocab),
        "gpus": cluster.gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "device": dev.name,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "vocab": vocab,
        "precision": precision,
        "overlap": list(stack.overlap),
        "optimizer_states": stack.optimizer_states,
        "grad_dtype": stack.grad_dtype,
        **{k: getattr(stack, k) for k in ("fp8", "fp8_dispatch", "optimizer")},
        "efficiency": efficiency,
        "gemm_tflops": dev.gemm_tflops,
        "gemm_tflops_fp8": dev.gemm_tflops_fp8,
        "attention": attention,
        "feasible": feasible,
        "rejected": rejected,
        "rejected_total": rejected_total,
        "smallest_without_offload_gb": smallest if smallest < math.inf else None,
    }


def _evaluate(cfg, cluster: Cluster, vocab: int, seq_len: int, global_batch: int, lay: Layout, bw: dict,
              precision: str, efficiency, stack: Stack,
              tile_fraction: float) -> tuple[dict, str | None]:  # fmt: skip
    """Step 4: one candidate's memory per GPU and, when it fits, its step time: (row, why it does not fit
    or None)."""
    dev, per_node = cluster.device, min(cluster.gpus, cluster.gpus_per_node)
    prec = Precision.of(precision, lay.zero_stage, stack.optimizer_states, stack.grad_dtype)
    fsdp = stack.fsdp and lay.zero_stage == 3
    prec = fsdp_precision(prec) if fsdp else prec
    if stack.optimizer == "muon":
        prec = muon_precision(prec, muon_cost(cfg, vocab))
    mem = memory_bytes(cfg, vocab, seq_len, lay, prec, activation_model=stack.activation_model,
                       overlap=stack.overlap, attention_kernel=stack.attention_kernel,
                       mt3d_engine=stack.mt3d_rules, fsdp=fsdp, lora_rank=stack.lora)  # fmt: skip
    row = {**lay.as_row(), "memory_gb": mem["total"] / 1e9, "cpu_gb_per_node": mem["cpu"] * per_node / 1e9,
           "nvme_gb_per_node": mem["nvme"] * per_node / 1e9}  # fmt: skip
    why = tier_overflow(mem, per_node, (dev.memory_gb - dev.reserved_gb) * 1e9, dev)
    if stack.lora and lay.zero_stage == 3 and stack.mt3d_rules:
        why = "mt3d.lora with ZeRO-3 is not supported (the adapters' states are small: ZeRO 1 or 2)"
    if stack.optimizer == "muon" and not why:
        why = muon_conflict(lay, precision)
    if stack.mt3d_rules and not why:
        off = Offload.from_label(lay.offload)
        grads = "fp32" if stack.grad_dtype == "fp32" else ""
        why = grad_accum_conflict(grads, precision, lay.zero_stage, off, stack.optimizer_states, planned=True)
        why = why or optimizer_states_conflict(stack.optimizer_states, precision, lay.zero_stage, off, {})
    if why:
        return row, why
    t = step_time(
        cfg, vocab, seq_len, global_batch, lay, peak_tflops=dev.peak_tflops, efficiency=efficiency, bw=bw,
        device=dev, attention_fraction=tile_fraction, precision=precision,
        attention_kernel=stack.attention_kernel, pp_scatter_gather=stack.pp_scatter_gather,
        gemm_fraction=stack.gemm_fraction, overlap=stack.overlap, mt3d_engine=stack.mt3d_rules,
        grad_dtype=stack.grad_dtype, fp8=stack.fp8, ep_dispatch=stack.ep_dispatch, fsdp=fsdp,
        fp8_dispatch=stack.fp8_dispatch, optimizer_kind=stack.optimizer,
    )  # fmt: skip
    hosts = dispatch_hosts(bw, stack.ep_dispatch) if lay.ep > 1 else None
    if hosts:  # mt3d's dispatch over the hosts
        row.update(ep_hosts=hosts[0], ep_per_host=hosts[1])
    return {**row, **t, "memory": {k: v / 1e9 for k, v in mem.items()}}, None


def tier_overflow(mem: dict, per_node: int, budget: float, dev: Device) -> str | None:
    """Which memory tier a layout overflows: the GPU, the node's CPU memory or its NVMe (None: none)."""
    if mem["total"] > budget:
        return f"needs {mem['total'] / 1e9:.1f} GB > {budget / 1e9:.1f} GB usable"
    if mem["cpu"] * per_node > dev.host_memory_gb * 1e9:
        need = mem["cpu"] * per_node / 1e9
        return f"offload needs {need:.0f} GB of CPU memory > {dev.host_memory_gb:.0f} GB per node"
    if mem["nvme"] * per_node > dev.nvme_gb * 1e9:
        return f"offload needs {mem['nvme'] * per_node / 1e9:.0f} GB of NVMe > {dev.nvme_gb:.0f} GB per node"
    return None
