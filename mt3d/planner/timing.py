"""Step time of one training layout (FORMULAS.md): compute (the GEMM shape model of ``compute``, or
the executed FLOPs at an efficiency), the pipeline bubble, TP, CP, EP, PP and DP communication at the
bandwidths of where the mapper puts each axis, each hidden behind compute as far as the schedule
allows, offload transfers and the optimizer step."""

from __future__ import annotations

import math

from ..config.rules import overlap_moe_conflict
from ..model.config import GATED_MLPS, ModelConfig
from ..pipeline.zero_bubble import bubble_share
from .choices import DISPATCH_CHUNKS
from .layout import Layout, Precision, stage_expert_params, stage_params
from .memory import posts_p2p, runs_bf16_optimizer
from .muon import muon_seconds
from .offload import offload_traffic
from .traffic import cp_bytes, dp_bytes, ep_layer_traffic, ep_node_traffic, pp_bytes, ring_factor, tp_bytes

# DeepSpeedCPUAdam elements updated per second per core (fp32 AdamW, AVX-512): measured on this
# project's 2-core Xeon, one thread, 20M elements, median of 5 steps: 8.8e8. Scaled by
# Device.cpu_cores_per_gpu without a cap for the host's memory bandwidth (about 30 bytes move per
# element), so with many cores per GPU the CPU step is optimistic.
CPU_ADAM_ELEMENTS_PER_CORE_S = 8.8e8


# Share of the compute time behind which DeepSpeed's ZeRO-3 hides its parameter all-gathers and
# gradient reduce-scatters (prefetching). Fitted on PTD-P's Table 2 ZeRO-3 rows (175B and 530B on
# 384-2240 A100s, which it then predicts within 7%): 1.0 (all hidden) over-predicts the
# compute-bound rows by 31-41%, 0.0 under-predicts them.
ZERO3_OVERLAP = 0.5


def ep_bytes(cfg: ModelConfig, tokens: int, micro_batches: int, ep: int, elem: int, blocks: int,
             recompute: bool, hosts: tuple[int, int] | None = None, fp8_dispatch: str | None = None,
             chunks: int = 1) -> tuple[float, float]:  # fmt: skip
    """Bytes one rank sends per step for its expert dispatch, as (over the ep group, within the host):
    every sparse layer of the heaviest stage dispatches and combines each micro-batch's ``tokens``
    rows, each token once per rank holding any of its experts, with fp32 routing metadata, or at top-1
    once per assignment (``MoESpec.dispatch_once``), and int64 counts (``traffic.ep_layer_traffic``;
    every TP rank sends the whole rows, mt3d's experts being split over TP), group-limited routing
    counted, and recompute repeats the forward's half. With ``hosts`` = (hosts, ranks per host) of the
    ep group (``parallel.expert_dispatch`` "node"): once per token and host across hosts, then within
    the host (``traffic.ep_node_traffic``). ``fp8_dispatch`` (``train.fp8.dispatch``, the recipe): the
    forward's dispatch, one of the rows' four crossings, in e4m3 with its tiles' scales
    (``fp8.DispatchRows``). ``chunks`` (``train.overlap.dispatch_chunks``): the counts of each chunk,
    and above 1 the deduplicating exchange at top-1 too (its metadata: what ``SparseMoE`` runs)."""
    from ..parallel.fp8 import DispatchRows

    spec = cfg.moe_spec
    if spec is None or ep <= 1:
        return 0.0, 0.0
    scale = blocks * cfg.sparse_layers / cfg.layers * micro_batches * (1.5 if recompute else 1.0)
    row = elem
    if fp8_dispatch:  # bytes per row element, averaged over the four crossings
        row = (3 * elem + 1 + DispatchRows(fp8_dispatch).scale_bytes(cfg.hidden) / cfg.hidden) / 4
    size = lambda rows, meta, counts: (rows * row + meta * 4 + counts * chunks * 8) * scale  # noqa: E731
    shape = (tokens, spec.top_k, cfg.hidden, spec.experts)
    limit = (spec.n_group, spec.topk_group)
    dedup = spec.dispatch_once or chunks > 1
    if hosts is None or not dedup:
        return size(*ep_layer_traffic(ep, *shape, dedup, *limit)), 0.0
    across, within = ep_node_traffic(*hosts, *shape, *limit)
    return size(*across), size(*within)


def dispatch_hosts(bw: dict[str, float], ep_dispatch: str) -> tuple[int, int] | None:
    """(hosts, ranks per host) of the ep groups when mt3d routes over them (``expert_dispatch``
    "node", where ``search.bandwidths`` found the ep groups spanning hosts evenly), else None."""
    if "ep_hosts" not in bw or ep_dispatch == "sequence-shard":  # another stack's dispatch: one hop
        return None
    return int(bw["ep_hosts"]), int(bw["ep_per_host"])


def _ep_seconds(cfg: ModelConfig, lay: Layout, seq_len: int, vocab: int | None, comm_bytes: int, blocks: int,
                bw: dict[str, float], ep_dispatch: str, compute: float,
                fp8_dispatch: str | None = None, chunks: int = 1) -> tuple[float, float]:  # fmt: skip
    """(exposed, hidden) seconds of a step's expert all-to-all (``ep_bytes``; with Megatron-Core's
    "sequence-shard" dispatch each TP rank's shard and the expert-TP gather of the routed rows; mt3d's
    across hosts once per token and host, then within the host, where the ep groups cross hosts
    evenly: ``bw["ep_hosts"]``), the hidden part what the shared expert and, with ``chunks``, the routed
    experts cover (``dispatch_hidden``)."""
    if lay.ep <= 1:
        return 0.0, 0.0
    t, m, tokens = lay.tp, lay.grad_accum, seq_len // lay.cp * lay.micro_batch
    hosts = dispatch_hosts(bw, ep_dispatch)
    across, within = ep_bytes(cfg, tokens, m, lay.ep, comm_bytes, blocks, lay.recompute, hosts, fp8_dispatch,
                              chunks)  # fmt: skip
    # mt3d's TP ranks each send whole rows, or 1/(tp / etp) of them when experts split over fewer ranks
    share = t if ep_dispatch == "sequence-shard" else t // lay.expert_tp
    ep = (across / bw["ep"] + (within / bw["ep_within"] if within else 0.0)) / share / 1e9
    if ep_dispatch == "sequence-shard" and t > 1:  # the expert-TP gather of the routed rows
        ep += etp_bytes(cfg, tokens, m, t, comm_bytes, blocks, lay.recompute) / (bw["tp"] * 1e9)
    hidden = dispatch_hidden(cfg, compute, ep, seq_len, vocab, chunks)
    return ep - hidden, hidden


def dispatch_hidden(cfg: ModelConfig, compute: float, ep_seconds: float, seq_len: int, vocab: int | None,
                    chunks: int = 1) -> float:  # fmt: skip
    """Seconds of a step's expert all-to-all hidden behind compute (``mt3d.model.moe_exchange``).
    With ``chunks`` n (``train.overlap.dispatch_chunks``) each layer's tokens go in n chunks, chunk c+1's
    dispatch and chunk c-1's combine travelling while chunk c's experts compute, forward and backward:
    all but the first dispatch and the last combine (1/n of the traffic) hide, up to the routed experts'
    compute (6 k h e_ffn x the MLP's matrices FLOPs a token per sparse layer, over ``flops_per_token``).
    The shared expert computes while the first chunk's rows travel (and its backward while their
    gradients travel back): at most that chunk's dispatch (1/(2n) of the traffic) and the shared experts'
    share of the compute (``6 mats h s_ffn``). n = 1: the shared expert alone. Both hops of "node"
    pipeline: their counts are all exchanged before the first chunk's rows leave."""
    spec = cfg.moe_spec
    if spec is None or ep_seconds <= 0:
        return 0.0
    mats = 3 if cfg.mlp in GATED_MLPS else 2
    per_token = 6 * mats * cfg.hidden * cfg.sparse_layers / cfg.flops_per_token(seq_len, vocab)
    routed = min(ep_seconds * (1 - 1 / chunks), compute * per_token * spec.top_k * spec.expert_ffn)
    shared = min(ep_seconds / (2 * chunks), compute * per_token * spec.shared_ffn)
    return min(ep_seconds, routed + shared)


def etp_bytes(cfg: ModelConfig, tokens: int, micro_batches: int, t: int, elem: int, blocks: int,
              recompute: bool) -> float:  # fmt: skip
    """Bytes one rank sends per step over its expert-TP group beyond what ``tp_bytes`` counts, when
    each TP rank dispatches only its sequence shard (Megatron-Core's all-to-all dispatcher, which runs
    with SP under TP): after the all-to-all the rows routed to this rank's experts (about k tokens /
    t) are all-gathered over the t expert-TP ranks, reduce-scattered back after the experts, and both
    again in the backward, k times the sparse block's MLP region that ``tp_bytes`` counts once (as
    for mt3d's gathered rows): 4 (t - 1)/t (k - 1) tokens h more per sparse layer and micro-batch, the
    forward again with recompute."""
    spec = cfg.moe_spec
    if spec is None or t <= 1:
        return 0.0
    sparse = blocks * cfg.sparse_layers / cfg.layers
    per_layer = 4 * (t - 1) / t * tokens * (spec.top_k - 1) * cfg.hidden * elem
    return sparse * micro_batches * per_layer * (1.5 if recompute else 1.0)


def bucket_reduction_hidden(dp: float, last_bucket_share: float, backward: float) -> float:
    """Seconds of a gradient reduction (``dp``) hidden behind the backward that fills its buckets:
    they are reduced in backward order as they fill, so all but the last bucket (``last_bucket_share``
    of the gradients) can hide, and no more than that ``backward`` lasts. The one statement of the
    rule: ``dp_hidden`` plans with it, ``mt3d.bench overlap`` predicts its measured row with it."""
    return min(dp * (1 - last_bucket_share), backward)


def dp_hidden(dp: float, grads: float, micro_compute: float, recompute: bool) -> float:
    """Seconds of a data-parallel gradient reduction (``dp``) hidden behind the last micro-batch's
    backward (``bucket_reduction_hidden``) with buckets of ``GRAD_BUCKET_ELEMENTS``, the last one a
    whole bucket's share, and that backward 2/3 of a micro-batch's ``micro_compute`` (3/4 with full
    recompute)."""
    from .choices import GRAD_BUCKET_ELEMENTS

    buckets = max(1, math.ceil(grads / GRAD_BUCKET_ELEMENTS))
    backward = micro_compute * (3 / 4 if recompute else 2 / 3)
    return bucket_reduction_hidden(dp, 1 / buckets, backward)


def tp_hidden(columns: list[tuple[float, float]], gather: float, reduce: float) -> float:
    """Seconds of column-parallel linears' backward transfers hidden behind the GEMMs they run beside
    (``columns``: each linear's input- and weight-gradient GEMM seconds): the input gradient's
    reduction (``reduce``: seconds of its reduce-scatter with SP, its all-reduce without) behind the
    weight gradient, and the input shard's all-gather again (``gather`` seconds; 0 without SP) behind
    the input gradient. mt3d's layers run both (``parallel.layers.column_linear``); the forward's
    transfers and the row-parallel linears' stay exposed. ``python -m mt3d.bench overlap`` holds
    measured figures against it."""
    return sum(min(reduce, wgrad) + min(gather, dgrad) for dgrad, wgrad in columns)


def tp_comm_hidden(gemm: tuple[float, float, float], half: float, recompute: bool, column: bool) -> float:
    """Seconds of one linear's TP transfers hidden when every transfer is pipelined with the GEMM
    beside it, each up to that GEMM's time (``overlap`` tp-comm: Megatron-Core's ``--tp-comm-overlap``,
    TransformerEngine's userbuffers; sequence parallel only). ``gemm``: its (forward, input-gradient,
    weight-gradient) seconds; ``half``: one all-gather or reduce-scatter of b*s*h. A column linear:
    its input's all-gather behind the forward GEMM (again with full recompute), and in the backward the
    re-gather behind the input gradient and the input gradient's reduce-scatter behind the weight
    gradient (``tp_hidden``'s pair). A row linear: its output's reduce-scatter behind the forward GEMM
    (again with recompute) and the output gradient's all-gather behind the input gradient."""
    fwd, dgrad, wgrad = gemm
    hidden = min(half, fwd) * (2 if recompute else 1) + min(half, dgrad)
    return hidden + (min(half, wgrad) if column else 0.0)


def pp_posted_seconds(blocking: float, p: int, v: int, m: int, message: float, chunk_forward: float) -> float:
    """Pipeline transfer seconds left exposed when every transfer is posted ahead (``overlap`` pp:
    ``mt3d.train.overlap.p2p``; Megatron-Core's overlap_p2p_comm), from the schedule as
    ``pipeline.schedule.simulate`` runs it: while one message takes no longer than a chunk's forward
    only the first micro-batch's trip through the p v virtual stages and back waits for transfers
    (2 (p v - 1) messages, whatever m), and each step beyond that adds what a message outlasts the
    forward. m = p runs all forwards first: nothing hides. Never more than ``blocking``. This follows
    the simulation waiting for a needed message alone; mt3d's engine waits for the whole batch it came
    in and every batch before it (``simulate(in_order=True)``, as NCCL runs one stream's batches):
    the same while a message takes up to a quarter of a chunk's forward, more for longer messages
    (18.5 instead of 14 message times at p 8, v 1, m 16 with messages 0.8 of a forward;
    tests/test_interleaved.py), where this is optimistic."""
    if m <= p or m % p:
        return blocking
    return min(blocking, 2 * (p * v - 1) * message + m * v * max(0.0, message - chunk_forward))


def step_time(cfg: ModelConfig, vocab: int, seq_len: int, global_batch: int, lay: Layout, *,
              peak_tflops: float, efficiency: float | None, bw: dict[str, float], precision: str = "bf16",
              attention_fraction: float = 1.0, device=None, attention_kernel: str = "flash",
              pp_scatter_gather: bool = False, gemm_fraction: float | None = None,
              overlap: tuple[str, ...] = (), mt3d_engine: bool = True, grad_dtype: str = "param",
              fp8: str | None = None, ep_dispatch: str = "whole", fsdp: bool = False,
              fp8_dispatch: bool = False, optimizer_kind: str = "adamw") -> dict[str, float]:  # fmt: skip
    """Seconds per step by component (compute, bubble, TP/PP/DP communication, offload) and throughput.

    Compute: with ``efficiency`` None and a ``device`` that has a GEMM calibration, the shape model
    of ``compute.micro_batch_seconds`` (the heaviest stage's blocks, plus the output layer) and the
    GPU optimizer step; otherwise the executed FLOPs at ``efficiency`` x peak. Transfers overlap
    compute as ``overlap`` says; ZeRO-3's partly (``ZERO3_OVERLAP``): only their excess counts.
    ``attention_fraction``: the share of dense causal attention tiles the layers visit, averaged
    over layers (``sparsity.attention_speedup``): local layers' attention time counts the tiles
    they visit, while TFLOP/s and MFU count model FLOPs (``ModelConfig.flops_per_token``).
    ``gemm_fraction``: of the device's GEMM ceiling (``compute.GEMM_FRACTION``). Stage-boundary
    transfers send 1/t of the activation at tp > 1: with SP its sequence shard, on DeepSpeed's
    pipeline engine (mt3d's, ``mt3d_engine``) its TP partition, with ``pp_scatter_gather`` PTD-P's
    scatter (each then all-gathered over NVLink); another stack without either sends it whole.
    ``ep_dispatch`` "sequence-shard": each TP rank dispatches its sequence shard to the experts
    (Megatron-Core with SP), where mt3d's TP ranks each send the whole rows ("whole"). ``fsdp``:
    ZeRO-3 gathers 16-bit weights beside an fp32 shard (``memory_bytes``'s).
    ``overlap`` (``choices.OVERLAPS``): "dp" (``dp_hidden``), "tp" (``tp_hidden``), "pp"
    (``pp_posted_seconds``), "ep" (``dispatch_hidden`` at ``DISPATCH_CHUNKS``): each hides as much as
    the schedule allows; ``mt3d_engine`` as ``memory_bytes``'s (``posts_p2p``). ``grad_dtype``: the
    gradients' (``Precision.of``; what each stack sends: ``_dp_seconds``). ``fp8``: the blocks' linears
    in FP8 (``compute.micro_batch_seconds``; the shape model only); TFLOP/s and MFU still count model
    FLOPs against ``peak_tflops`` (bf16's).
    ``fp8_dispatch``: the dispatch in that FP8 (``ep_bytes``); ``optimizer_kind`` "muon": ``muon_seconds``.
    """
    gpus, tokens = lay.gpus, global_batch * seq_len
    flops = cfg.flops_per_token(seq_len, vocab) * tokens
    v, m, t, blocks = lay.virtual_stages, lay.grad_accum, lay.tp, math.ceil(cfg.layers / lay.pp)
    prec = Precision.of(precision, max(lay.zero_stage, 1), grads=grad_dtype)
    grads = stage_params(cfg, vocab, t, lay.pp, lay.ep, lay.etp)
    chunks = DISPATCH_CHUNKS if "ep" in overlap and lay.ep > 1 else 1  # train.overlap.dispatch_chunks
    compute, optimizer = _compute_seconds(
        cfg, vocab, seq_len, tokens, lay, blocks, grads, peak_tflops=peak_tflops, efficiency=efficiency,
        device=device, attention_fraction=attention_fraction, attention_kernel=attention_kernel,
        gemm_fraction=gemm_fraction, fp8=fp8, chunks=chunks,
    )  # fmt: skip
    optimizer += muon_seconds(cfg, vocab, lay, device, gemm_fraction, peak_tflops * (efficiency or 0.5)) \
        if optimizer_kind == "muon" else 0.0  # fmt: skip
    bubble = compute * bubble_share(lay.schedule, lay.pp, m, v)  # PTD-P: interleaving divides it by v
    comm_bytes = prec.param
    act = seq_len // lay.cp * lay.micro_batch * cfg.hidden * comm_bytes
    timing = (peak_tflops, efficiency, device, gemm_fraction)
    tp_mode = "tp-comm" if "tp-comm" in overlap else ("tp" if "tp" in overlap else None)
    tp = _tp_seconds(cfg, seq_len, lay, act, blocks, bw, tp_mode, timing)
    cp = cp_bytes(cfg, seq_len, lay.micro_batch, t, lay.cp, m, comm_bytes, blocks, recompute=lay.recompute)
    cp = cp / (bw["cp"] * 1e9) if lay.cp > 1 else 0.0
    posted = posts_p2p(overlap, lay, mt3d_engine)
    split = pp_scatter_gather or mt3d_engine or (lay.sequence_parallel and t > 1)
    pp = _pp_seconds(lay, act / (t if split else 1), compute, bw, posted)
    ep, ep_hidden = _ep_seconds(cfg, lay, seq_len, vocab, comm_bytes, blocks, bw, ep_dispatch, compute,
                                fp8 if fp8_dispatch else None, chunks)  # fmt: skip
    # mt3d does not run overlap.grad_reduce with a MoE at pipeline > 1 (rules.overlap_moe_conflict)
    moe_pp = mt3d_engine and cfg.moe is not None and overlap_moe_conflict(True, lay.pp)
    hide_dp = "dp" in overlap and not moe_pp
    dp = _dp_seconds(lay, grads, prec, compute, bw, hide_dp, mt3d_engine, 2 if fsdp else None)
    offload = _offload_seconds(grads, lay, prec, bw)
    total = compute + bubble + tp + cp + ep + pp + dp + offload + optimizer
    tflops = flops / gpus / total / 1e12
    return {
        "compute_s": compute,
        "bubble_s": bubble,
        "tp_comm_s": tp,
        "cp_comm_s": cp,
        "ep_comm_s": ep,
        "ep_hidden_s": ep_hidden,
        "dispatch_chunks": chunks,
        "pp_comm_s": pp,
        "dp_comm_s": dp,
        "offload_s": offload,
        "optimizer_s": optimizer,
        "step_time_s": total,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops,
    }


def _dp_seconds(lay: Layout, grads: float, prec: Precision, compute: float, bw: dict, overlapped: bool,
                mt3d_engine: bool, gathered_bytes: int | None = None) -> float:  # fmt: skip
    """Exposed data-parallel transfer seconds of a step: ZeRO-3's beyond ``ZERO3_OVERLAP`` of the
    compute, else the reduction less ``dp_hidden`` when ``overlapped``. The weights travel in their
    dtype, the gradients in theirs (Megatron-Core reduce-scatters fp32 gradients); DeepSpeed's BF16
    optimizer all-reduces the gradients in the weights' dtype, then all-gathers the updated weights:
    ZeRO-1's count with the gradients' bytes twice (with fp32 gradients, 2 x 2 + 2 bytes per parameter
    and ring pass, as Megatron-Core's 4 + 2). ZeRO-2 and 3 reduce-scatter every micro-batch's gradients
    (DeepSpeed's partitioned gradients, FSDP without no_sync) and ZeRO-3 gathers the weights for every
    micro-batch's passes; ``gathered_bytes``: the gathered weights' dtype where it is not the shard's
    (FSDP's 16-bit gathers of fp32 shards)."""
    zero_stage, elems = lay.zero_stage, (gathered_bytes or prec.param, prec.grad)
    if runs_bf16_optimizer(lay, prec, mt3d_engine):
        zero_stage, elems = 1, (prec.param, 2 * prec.param)
    m = lay.grad_accum if zero_stage >= 2 else 1
    gathers = 3 if lay.recompute else 2  # ZeRO-3: forward, recompute, backward
    # gradients are averaged over dp x cp: the slower of the two axes' links carries the ring
    dense_bw = min(bw["dp"], bw["cp"]) if lay.cp > 1 else bw["dp"]
    dp = m * dp_bytes(grads, *elems, lay.dense, zero_stage, gathers) / (dense_bw * 1e9)
    if lay.zero_stage == 3:
        return max(0.0, dp - ZERO3_OVERLAP * compute)  # partly hidden behind the compute it prefetches for
    if overlapped:
        return max(0.0, dp - dp_hidden(dp, grads, compute / lay.grad_accum, lay.recompute))
    return dp


def _tp_seconds(cfg, seq_len: int, lay: Layout, act: float, blocks: int, bw: dict, overlapped: str | None,
                timing: tuple) -> float:  # fmt: skip
    """Exposed TP transfer seconds of a step: ``tp_bytes``, less what ``overlapped`` hides ("tp":
    ``tp_hidden``; "tp-comm": ``tp_comm_hidden``; None: nothing). ``timing``: (peak_tflops,
    efficiency, device, gemm_fraction), timing the block's GEMMs as ``_compute_seconds`` does (the
    shape model on a calibrated device, else ``efficiency`` x peak)."""
    from .compute import COLUMN_GEMMS, block_gemm_seconds

    t, m = lay.tp, lay.grad_accum
    sp = lay.sequence_parallel and t > 1
    # a sparse block's experts take the gathered input whole (mt3d.model.moe): only its QKV linear
    # keeps a shard and overlaps its backward transfers (``ColumnParallelLinear``); its shared expert,
    # where there is one, is an MLP of its own with its own TP region (not credited with overlap)
    sparse = cfg.sparse_layers / cfg.layers
    shared = sparse if cfg.moe_spec is not None and cfg.moe_spec.shared_ffn else 0.0
    dense = 1 - sparse
    regathers = (1 + dense + shared) if sp and not lay.sp_gathered else 0.0  # mt3d's default SP path
    tp = tp_bytes(blocks, m, act, t, recompute=lay.recompute, regathers=regathers, mlps=1 + shared)
    tp -= sparse * blocks * m * _routed_region_saving(lay, sp) * act
    tp /= bw["tp"] * 1e9
    if not overlapped or t == 1 or (sp and lay.sp_gathered):  # kept whole: gathered by autograd, after
        return tp
    peak_tflops, efficiency, device, gemm_fraction = timing
    tokens = seq_len // lay.cp * lay.micro_batch
    fraction = _shape_model_fraction(device, efficiency, gemm_fraction)
    rate = None if fraction is not None else peak_tflops * 1e12 * (efficiency or 0.5)
    gemms = block_gemm_seconds(cfg, tokens, t, device, fraction or 0.0, rate)
    half = ring_factor(t) / 2 * act / (bw["tp"] * 1e9)  # an all-gather or reduce-scatter of b*s*h
    if overlapped == "tp-comm" and sp:
        parts = [tp_comm_hidden(g, half, lay.recompute, i in COLUMN_GEMMS) for i, g in enumerate(gemms)]
        attention, mlp = parts[0] + parts[1], parts[2] + parts[3]
    else:
        gather, reduce = (half, half) if sp else (0.0, 2 * half)
        attention, mlp = (tp_hidden([gemms[i][1:]], gather, reduce) for i in COLUMN_GEMMS)
    return max(0.0, tp - blocks * m * (attention + dense * mlp))  # all hidden: zero, not -1e-17


def _routed_region_saving(lay: Layout, sp: bool) -> float:
    """What a sparse block's routed-expert TP region sends less per micro-batch, in activations, when the
    experts split over etp < tp ranks (``parallel.expert_layout``): its all-reduces (reduce-scatters and
    all-gathers with SP) run over etp ranks, and without SP on 1/(tp / etp) of the tokens, which the
    tp / etp ranks holding the same tokens gather back (forward, again under recompute, and the
    gradient's in the backward: ``mt3d.model.moe.SparseMoE.forward``)."""
    t, e = lay.tp, lay.expert_tp
    if e == t:
        return 0.0
    o, passes = t // e, 2 + (1 if lay.recompute else 0)
    folded = ring_factor(e) if sp else ring_factor(e) / o + ring_factor(o) / 2
    return passes * (ring_factor(t) - folded)


def _pp_seconds(lay: Layout, message_bytes: float, compute: float, bw: dict, posted: bool) -> float:
    """Pipeline transfer seconds of a step: ``pp_bytes``, or with ``posted`` what
    ``pp_posted_seconds`` leaves exposed (a chunk's forward: a third of its compute, a quarter with
    recompute)."""
    if lay.pp == 1:
        return 0.0
    v, m = lay.virtual_stages, lay.grad_accum
    message = message_bytes / (bw["pp"] * 1e9)  # seconds of one transfer
    pp = pp_bytes(m, message, v)
    if not posted:
        return pp
    chunk_forward = compute / (m * v) * (1 / 4 if lay.recompute else 1 / 3)
    return pp_posted_seconds(pp, lay.pp, v, m, message, chunk_forward)


def _shape_model_fraction(device, efficiency, gemm_fraction) -> float | None:
    """The share of the GEMM ceiling to time GEMMs with by their shapes (``compute``): ``gemm_fraction``
    or the calibration, on a device with a GEMM calibration and no ``efficiency`` given; None: time
    the work at ``efficiency`` x peak instead."""
    if efficiency is None and device is not None and getattr(device, "sms", 0):
        from .compute import GEMM_FRACTION

        return GEMM_FRACTION if gemm_fraction is None else gemm_fraction
    return None


def _compute_seconds(cfg, vocab, seq_len, tokens, lay: Layout, blocks, grads, *, peak_tflops, efficiency,
                     device, attention_fraction, attention_kernel, gemm_fraction, fp8=None,
                     chunks: int = 1):  # fmt: skip
    """(compute, GPU optimizer step) seconds of one step: the GEMM shape model with a calibrated
    device, else the executed FLOPs at ``efficiency`` x peak (see ``step_time``)."""
    gpus = lay.gpus
    fraction = _shape_model_fraction(device, efficiency, gemm_fraction)
    if fraction is not None:
        from .compute import micro_batch_seconds, optimizer_seconds

        # with cp a rank computes seq_len / cp tokens, each against as many keys as at cp = 1
        per_micro = micro_batch_seconds(
            cfg, vocab, seq_len // lay.cp, lay.micro_batch, lay.tp, blocks, device,
            sp=lay.sequence_parallel and lay.tp > 1, recompute=lay.recompute, selective=lay.selective,
            attention=attention_kernel,
            keys=seq_len * attention_fraction,
            fraction=fraction,
            fp8=fp8,
            experts=(lay.ep, lay.expert_tp, chunks),
            scans=3 if lay.cp > 1 else 1,
        )["total_s"]  # fmt: skip
        optimizer = 0.0
        if lay.offload == "none":
            experts = stage_expert_params(cfg, lay.expert_tp, lay.pp, lay.ep)
            optimizer = optimizer_seconds(lay.partitioned(grads, experts), device)
        return lay.grad_accum * per_micro, optimizer
    work = cfg.flops_per_token(seq_len, vocab, attended=seq_len * attention_fraction) * tokens
    executed = work * (4 / 3 if lay.recompute else 1)  # recompute repeats the forward pass
    if lay.selective and not lay.recompute:  # the attention core's forward again (a third of its work)
        attended = seq_len * attention_fraction
        core = cfg.flops_per_token(seq_len, vocab, attended=attended) - cfg.flops_per_token(
            seq_len, vocab, attended=0
        )
        executed += core * tokens / 3
    if cfg.gdn_spec is not None and lay.cp > 1:  # the DeltaNet scan runs three times a pass under cp
        executed += (
            2 * 3 * cfg.linear_blocks * cfg.gdn_spec.core_flops() * tokens * (4 / 3 if lay.recompute else 1)
        )
    return executed / gpus / (peak_tflops * 1e12 * (efficiency or 0.5)), 0.0


def _offload_seconds(grads: float, lay: Layout, prec: Precision, bw: dict[str, float]) -> float:
    """PCIe and NVMe transfers and the CPU optimizer step, not overlapped with compute (an upper
    bound: DeepSpeed prefetches some of it behind the GPU's work)."""
    if lay.offload == "none":
        return 0.0
    moved = offload_traffic(grads, lay.data, lay.zero_stage, prec, lay.offload, lay.recompute)
    return (moved["pcie"] / (bw["pcie"] * 1e9) + moved["nvme"] / (bw["nvme"] * 1e9)
            + moved["cpu_adam_elements"] / bw["cpu_adam"])  # fmt: skip
