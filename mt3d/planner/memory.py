"""Memory per GPU of one training layout (FORMULAS.md): model states over ZeRO's partitions and the
offload tiers, activations (the Korthikanti et al. (2022) table, ``korthikanti_layer_bytes``, or the
tensors mt3d's own blocks keep for backward, ``mt3d_layer_bytes``; attention through
scaled_dot_product_attention keeps no score matrix), the blocks in flight of the pipeline schedule,
buffers, and what the reduction and the optimizer step hold at the end of a step."""

from __future__ import annotations

import math

from ..model.config import GATED_MLPS, ModelConfig
from ..parallel.layers import pad_vocab
from ..pipeline.schedule import warmup
from .layout import Layout, Precision, lora_stage_params, stage_expert_params, stage_params
from .offload import tier_bytes


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, recompute: bool,
                            selective: bool = False) -> float:  # fmt: skip
    """Activation bytes of one transformer layer (16-bit), Korthikanti et al. 2022, Table 2
    (``selective``: the attention core recomputed, so its 5 a s / h term is not kept)."""
    sbh = s * b * h
    scores = 0.0 if selective else 5 * a * s / h
    if recompute:
        return 2 * sbh / (t if sp else 1)
    if t == 1:
        return sbh * (34 + scores)
    if sp:
        return sbh * (34 + scores) / t
    return sbh * (10 + 24 / t + scores / t)


def korthikanti_working_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, scores: bool) -> float:
    """Peak bytes of one block's backward beyond its checkpoint, in Korthikanti et al.'s accounting,
    when the block is recomputed: its whole activations (``korthikanti_layer_bytes`` without
    recompute) plus the largest pair of gradients alive at once, an operation's output gradient and its
    input gradient. With materialised scores (``scores``) that is the softmax's, 2 x 2 a s^2 b / t
    bytes; otherwise (flash kernels) the MLP activation's, 2 x 8 s b h / t. An upper bound: by then
    the MLP's activations are freed. (mt3d's blocks use the 2x measured on them instead.)"""
    full = korthikanti_layer_bytes(s, b, h, a, t, sp, False, not scores)
    grads = 2 * (2 * a * s * s * b if scores else 8 * s * b * h) / t
    return full + grads


def mt3d_layer_bytes(cfg: ModelConfig, s: int, b: int, t: int, sp: bool, recompute: bool, elem: int,
                     tiled: bool = False, sp_gathered: bool = False, selective: bool = False,
                     gated: float = 4) -> float:  # fmt: skip
    """Activation bytes one of mt3d's blocks keeps for backward (no dropout masks; SDPA attention).

    Per token: the two norm inputs (sequence shards with SP), the inputs of the QKV and MLP-in
    linears (with SP their 1/t sequence shards, all-gathered again in the backward; the full
    sequence with ``sp_gathered``, and without SP), q/k/v and the attention output for the local
    heads, and the MLP's local inner activations (2 x ffn/t for GELU, ``gated`` x ffn/t for SwiGLU: 4
    in mt3d, 3 in TransformerEngine's fused MLP; none with sequence tiles, ``tiled``: they are rebuilt
    a tile at a time in the backward).
    With full recompute only the block input stays. Selective recompute (``selective``) keeps the
    activation's input but not its output (nor, gated, the activated gate): half the MLP's inner
    elements; its attention core keeps the q/k/v projection output instead of q, k and v, the same
    count with a kernel that keeps no scores (FlashAttention, torch's CPU SDPA).
    """
    tokens = s * b
    h = cfg.hidden
    if recompute:
        return tokens * h * elem / (t if sp else 1)
    norms = 2 * h / (t if sp else 1)
    linear_inputs = 2 * h / (t if sp and not sp_gathered else 1)
    attn = cfg.attn_activation_width(t)
    mlp = 0.0 if tiled else mlp_inner_elements(cfg, t, selective, gated)
    return tokens * (norms + linear_inputs + attn + mlp) * elem


def mlp_inner_elements(cfg: ModelConfig, t: int, selective: bool = False, gated: float = 4) -> float:
    """Per token: the MLP's inner activations one TP rank keeps (2 x ffn/t GELU, ``gated`` x ffn/t
    gated; a sparse block's k experts' and shared expert's, plus the k dispatched copies of its input).
    With selective recompute a dense MLP keeps half (the activation's input only; routed experts keep
    all)."""
    spec = cfg.moe_spec
    dispatched = 0.0 if spec is None else cfg.sparse_layers / cfg.layers * spec.top_k * cfg.hidden
    per = (gated if cfg.mlp in GATED_MLPS else 2) / (2 if selective and spec is None else 1)
    return per * cfg.mlp_token_width() / t + dispatched


def posts_p2p(overlap: tuple[str, ...], lay: Layout, mt3d_engine: bool = True) -> bool:
    """Whether the layout's pipeline transfers are posted ahead (``overlap`` pp): only where the
    schedule that posts them runs (``config.rules.p2p_conflict``: pp >= 2 and micro-batches per step a
    multiple of pp, for mt3d's schedule engine, which also runs v = 1). Another stack
    (``mt3d_engine`` False) posts them only with interleaving, as Megatron-LM's overlap_p2p_comm,
    which its non-interleaved 1F1B refuses."""
    from ..config.rules import p2p_conflict

    if lay.schedule != "1f1b":  # the zero-bubble schedules always post them
        return True
    if "pp" not in overlap or (not mt3d_engine and lay.virtual_stages == 1):
        return False
    return p2p_conflict(True, lay.pp, lay.grad_accum) is None


def in_flight_blocks(blocks: int, p: int, m: int, v: int, schedule_engine: bool = False,
                     schedule: str = "1f1b") -> float:  # fmt: skip
    """Blocks' worth of activations the first stage holds at its peak.

    Zero-bubble (``schedule`` "zb-h1", "zbv"): 1F1B's, p micro-batches of a rank's blocks (their
    orders hold no more, counted from a forward to its W: ``pipeline.zero_bubble.memory_limit``).

    1F1B (DeepSpeed's TrainSchedule): up to p micro-batches of the stage's blocks. Interleaved
    (PTD-P; mt3d's schedule engine, which also runs v = 1 when ``schedule_engine``: posted transfers):
    the warm-up forwards of rank 0 plus the one in flight, each chunk 1/v of the stage's blocks:
    about p + (p - 2)/v stages' worth, a little more than 1F1B once v > 1, 2p - 1 at v = 1.
    tests/test_planner.py walks both schedules to check this.
    """
    if schedule != "1f1b" or (v == 1 and not schedule_engine):
        return blocks * min(p, m)
    chunks = min(warmup(p, v, m, 0) + 1, m * v)
    return blocks / v * chunks


def logit_bytes(tp: int, elem: int) -> float:
    """Peak bytes per logit in the loss's backward, when every block's activations are still held.

    tp = 1 (torch's cross entropy): the logits, the fp32 log-softmax it keeps, and in the backward
    the fp32 gradients of the NLL and of the log-softmax: elem + 12. tp > 1 (mt3d's vocab-parallel
    cross entropy): the logits and the fp32 softmax, whose buffer becomes the gradient in place, cast
    to 16-bit logits' dtype: elem + 4 (+ elem). Measured: ``python -m mt3d.bench longctx``."""
    if tp == 1:
        return elem + 12
    return elem + 4 + (elem if elem < 4 else 0)


def cp_gathered_bytes(cfg: ModelConfig, seq_len: int, b: int, tp: int, cp: int, elem: int) -> float:
    """Per layer, averaged over the layers: the other cp ranks' keys and values an all-gather layer
    keeps for its backward (the all-to-all keeps as many elements as it sends away; the halo's few
    W d - 1 rows are left out)."""
    if cp <= 1:
        return 0.0
    from ..parallel.context import exchange_for

    q, kv, chunk = cfg.heads // tp, cfg.kv_heads // tp, seq_len // (2 * cp)
    gathering = sum(exchange_for("auto", p, chunk, q, kv, cp) == "allgather" for p in cfg.patterns)
    return gathering / cfg.layers * 2 * cfg.kv_size / tp * (seq_len - seq_len // cp) * b * elem


def memory_bytes(
    cfg: ModelConfig,
    vocab: int,
    seq_len: int,
    lay: Layout,
    prec: Precision,
    *,
    activation_model: str = "mt3d",
    bucket_elems: float = 5e8,
    sub_group_size: float | None = None,
    overlap: tuple[str, ...] = (),
    attention_kernel: str = "flash",
    mt3d_engine: bool = True,
    fsdp: bool = False,
    lora_rank: int = 0,
) -> dict[str, float]:
    """Peak bytes per GPU of the heaviest stage, by component; ``cpu`` and ``nvme``: the bytes each
    rank keeps in CPU memory and on NVMe (offload; ``sub_group_size`` as in ``offload.tier_bytes``);
    ``overlap`` as ``step_time``'s. ``mt3d_engine``: the stack is mt3d's (posted pipeline transfers run
    mt3d's schedule engine, more micro-batches in flight at v = 1); False: another stack's 1F1B. The
    Korthikanti model keeps the attention scores only with the ``materialized`` kernel (FlashAttention
    keeps none). ``fsdp``: ZeRO-3 as FSDP runs it (no 16-bit copy beside the fp32 shard,
    ``layout.fsdp_precision``; two blocks' 16-bit parameters gathered at a time, the one computing
    and the one prefetched, instead of DeepSpeed's max_live_parameters). ``lora_rank``: LoRA on every
    linear of the blocks (``lora_stage_params``): gradients, master weights and moments of the adapters
    only, the frozen base's weights beside them."""
    t, p = lay.tp, lay.pp
    params = stage_params(cfg, vocab, t, p, lay.ep, lay.etp)
    experts = stage_expert_params(cfg, lay.expert_tp, p, lay.ep)
    live = 2 * params / math.ceil(cfg.layers / p) * 2 if fsdp and lay.zero_stage == 3 else None
    frozen = 0.0
    if lora_rank:  # routed experts have no adapters
        frozen, params, experts = params * prec.param, lora_stage_params(cfg, lora_rank, t, p), 0.0
    tiers = _model_state_tiers(params, lay, prec, overlap, mt3d_engine, sub_group_size, live, experts)
    states = tiers["gpu"] + frozen
    sp = lay.sequence_parallel and t > 1
    local = seq_len // lay.cp  # tokens of each sample on this rank
    per_layer, working = _block_bytes(cfg, seq_len, lay, prec, activation_model, attention_kernel)
    blocks = math.ceil(cfg.layers / p)
    rows = min(local, lay.tile_len) if lay.tile_len > 0 else local  # sequence tiles: one tile's logits
    logits = rows * lay.micro_batch * pad_vocab(vocab, t) / t * logit_bytes(t, prec.activation)
    # 1F1B: stage 0 holds up to p micro-batches of activations, the last stage one, plus the logits.
    engine = mt3d_engine and posts_p2p(overlap, lay)
    in_flight = in_flight_blocks(blocks, p, lay.grad_accum, lay.virtual_stages, engine, lay.schedule)
    first = in_flight * per_layer + working
    # One stage-boundary tensor (a block's input or output, a 1/t sequence shard with SP). Beside the
    # logits the loss holds two more: the final norm's input and its output, the head's input (its 1/t
    # shard with SP; sequence tiles keep the gathered hidden states for the loss to project tile by
    # tile). Traced per instruction on CPU (tp 2, pp 2, full recompute).
    boundary = local * lay.micro_batch * cfg.hidden * prec.activation / (t if sp else 1)
    head = boundary * (1 + (t if sp and lay.tile_len > 0 else 1))
    # The loss's backward frees what it kept (softmax, gradients) before the last block is recomputed,
    # and the logits are gone by then: mt3d releases the pipeline engine's reference to them once the
    # loss is computed (ds.engine.release_loss_outputs; DeepSpeed alone keeps two micro-batches' worth).
    last = blocks * per_layer + max(working, logits + head)
    # DeepSpeed's pipeline engine (v 1, transfers not posted) keeps one receive buffer of the boundary
    # tensor on every stage that receives (pipe_recv_buf, grad_layer: allocated once, each received
    # tensor cloned out of it), a 1/t part of it at tp > 1 without SP (pipe_partitioned and
    # grad_partitioned, DeepSpeed's defaults, which mt3d keeps there for dense models); mt3d's schedule
    # engine, like other stacks', allocates each transfer's anew.
    recv = 0.0
    if p > 1 and mt3d_engine and not engine and lay.virtual_stages == 1:
        recv = boundary / (t if not sp and cfg.moe is None else 1)
    acts = (max(first, last) if p > 1 else last) + recv
    held, at_end = reduction_bytes(params, lay, prec, overlap, mt3d_engine, bucket_elems)
    # what the reduction holds at the end of the last backward grows as that backward frees its
    # activations, and the step runs without them (DeepSpeed's receive buffer stays): only its excess
    # over the activations counts
    end_of_step = max(0.0, at_end - (acts - recv))
    total = states + held + acts + end_of_step
    return {"model_states": states, "activations": acts, "buckets": held, "end_of_step": end_of_step,
            "total": total, "cpu": tiers["cpu"], "nvme": tiers["nvme"]}  # fmt: skip


def _model_state_tiers(params: float, lay: Layout, prec: Precision, overlap: tuple[str, ...],
                       mt3d_engine: bool, sub_group_size: float | None,
                       live: float | None = None, experts: float = 0.0) -> dict[str, float]:  # fmt: skip
    """``offload.tier_bytes`` of the stage's model states; DeepSpeed's BF16 optimizer partitions the
    master weights and moments as ZeRO-1 does, and holds the gradients ``bf16_optimizer_gradient_bytes``
    says. ``experts``: the routed experts' part of ``params``, whose states ZeRO partitions over
    dp / ep x cp while the dense ones' span dp x cp (``Layout.partitioned``)."""
    bf16_optimizer = runs_bf16_optimizer(lay, prec, mt3d_engine)
    stage = 1 if bf16_optimizer else lay.zero_stage
    if lay.ep > 1 and stage > 0:
        dense = tier_bytes(params - experts, lay.dense, stage, prec, lay.offload, sub_group_size, live)
        mine = tier_bytes(experts, lay.data, stage, prec, lay.offload, sub_group_size, live)
        tiers = {k: dense[k] + mine[k] for k in dense}
    else:
        tiers = tier_bytes(params, lay.data, stage, prec, lay.offload, sub_group_size, live)
    if bf16_optimizer:
        folded = overlaps_reduction(lay, prec, overlap, True)
        tiers["gpu"] += params * (bf16_optimizer_gradient_bytes(prec, folded) - prec.grad)
    return tiers


ACTIVATION_MODELS = {"mt3d": 4, "te": 3, "korthikanti": None}
"""Activation accountings (``mt3d plan --activation-model``) and the elements per ffn/t a gated MLP
keeps in each: mt3d's blocks 4 (the fused gate/up output, the activated gate, their product),
TransformerEngine's fused LayerNormMLP 3 (its fc1 output and the SwiGLU output); Korthikanti et al.'s
table (GELU MLPs) has its own."""


def _block_bytes(cfg: ModelConfig, seq_len: int, lay: Layout, prec: Precision, activation_model: str,
                 attention_kernel: str) -> tuple[float, float]:  # fmt: skip
    """(bytes one block keeps for its backward, the working set of one block's backward beyond its
    checkpoint when recomputed) on this rank, in mt3d's or Korthikanti et al.'s accounting."""
    t = lay.tp
    sp = lay.sequence_parallel and t > 1
    local = seq_len // lay.cp  # tokens of each sample on this rank
    if activation_model == "korthikanti":
        args = (local, lay.micro_batch, cfg.hidden, cfg.heads, t, sp)
        scores = attention_kernel == "materialized" and not lay.selective
        per_layer = korthikanti_layer_bytes(*args, lay.recompute, not scores)
        return per_layer, korthikanti_working_bytes(*args, scores) if lay.recompute else 0.0
    e, tiled = prec.activation, lay.tile_len > 0
    g, sel = lay.sp_gathered, lay.selective
    gated = ACTIVATION_MODELS[activation_model]
    per_layer = mt3d_layer_bytes(cfg, local, lay.micro_batch, t, sp, lay.recompute, e, tiled, g, sel, gated)
    full_layer = mt3d_layer_bytes(cfg, local, lay.micro_batch, t, sp, False, e, tiled, g, sel, gated)
    if tiled:  # the tile being rebuilt in the backward, and its gradient
        full_layer += 2 * min(local, lay.tile_len) * lay.micro_batch * mlp_inner_elements(cfg, t) * e
    gathered = cp_gathered_bytes(cfg, seq_len, lay.micro_batch, t, lay.cp, e)
    per_layer += 0.0 if lay.recompute else gathered
    full_layer += gathered
    # recompute: one block's activations are rebuilt at a time, and its backward briefly holds
    # gradients of the same size (measured on CPU, mt3d.bench memory)
    return per_layer, 2 * full_layer if lay.recompute else 0.0


DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000
"""Gradients DeepSpeed's own data-parallel all-reduce flattens at a time (``MEMORY_OPT_ALLREDUCE_SIZE``:
plain DP and the BF16 optimizer; a tensor larger than that is sent alone, uncopied), cast to the
communication dtype."""


def runs_bf16_optimizer(lay: Layout, prec: Precision, mt3d_engine: bool) -> bool:
    """Whether mt3d trains this layout on DeepSpeed's BF16 optimizer: bf16 weights on its pipeline engine
    (ZeRO 0/1, every layout at those stages, one stage included), at ZeRO-0 (DeepSpeed picks it for a
    PipelineModule with gradients accumulated in bf16) or at ZeRO-1 with fp32 gradients, the optimizer
    on the accelerator. It partitions the master weights and moments over dp, keeps a whole gradient
    buffer in the accumulation dtype, all-reduces the gradients and all-gathers the updated weights."""
    from ..config import Offload

    if not mt3d_engine or prec.name != "bf16" or Offload.from_label(lay.offload).optimizer != "none":
        return False
    if lay.ep > 1 and lay.zero_stage == 1:  # mt3d.ds.experts builds DeepSpeed's ZeRO optimizer instead
        return False
    return lay.zero_stage == 0 or (lay.zero_stage == 1 and prec.grad > prec.param)


def bf16_optimizer_gradient_bytes(prec: Precision, overlapped: bool) -> float:
    """Gradient bytes per parameter DeepSpeed's BF16 optimizer holds: its buffer in the accumulation
    dtype, and the weights' own gradients, zeroed each step but not freed, unless each is folded in as
    it is produced (bf16.immediate_grad_update, which mt3d sets with its ``overlapped`` reduction)."""
    return prec.grad + (0 if overlapped else prec.param)


def overlaps_reduction(lay: Layout, prec: Precision, overlap: tuple[str, ...], mt3d_engine: bool,
                       moe: bool | None = None) -> bool:  # fmt: skip
    """Whether mt3d runs this layout with its overlapped gradient reduction (``mt3d.train.overlap.
    grad_reduce``, which ``--write-config`` sets with ``--overlap dp`` where it can run: not a mixture
    of experts at pipeline > 1; ``moe`` None: a sparse model when ep > 1):
    it sets bf16.immediate_grad_update whatever dp is, and reduces buckets (``mt3d.ds.overlap``) where
    DeepSpeed's data-parallel group has more than one rank."""
    from ..config import Offload
    from ..config.rules import overlap_conflict, overlap_moe_conflict

    if not mt3d_engine or "dp" not in overlap:
        return False
    if (lay.ep > 1 if moe is None else moe) and overlap_moe_conflict(True, lay.pp):
        return False
    return overlap_conflict(True, lay.zero_stage, lay.ep, Offload.from_label(lay.offload), prec.name) is None


def reduction_bytes(params: float, lay: Layout, prec: Precision, overlap: tuple[str, ...], mt3d_engine: bool,
                    bucket_elems: float) -> tuple[float, float]:  # fmt: skip
    """Bytes of the data-parallel gradient reduction and the optimizer step per GPU beyond the model
    states: (held all step, held once the activations are gone: at the end of the last backward and in
    the step), for ``params`` parameters on this GPU.

    Held: ZeRO's reduce bucket, in the gradient-accumulation dtype, which mt3d leaves at the weights'
    (DeepSpeed's default); for another stack with gradients in the weights' dtype it stands in for its
    communication buffers. fp32 gradients beside 16-bit weights reduce out of their own buffer:
    Megatron-Core's buckets are views of it, and DeepSpeed's BF16 optimizer (``runs_bf16_optimizer``)
    has no bucket.
    At the end: mt3d's overlapped reduction (``mt3d.ds.overlap``) all-reduces a flat copy of every
    bucket in the communication dtype (the weights') and writes them back once the backward is over;
    without it, DeepSpeed's own all-reduce (plain DP, the BF16 optimizer) flattens up to
    ``DEEPSPEED_ALLREDUCE_ELEMENTS`` gradients at a time and casts them to the weights' dtype. In the
    step, DeepSpeed's ZeRO-1/2 optimizer copies this rank's gradient partition into an fp32 flat buffer
    (at ZeRO-1 after freeing the gradients outside the partition), the BF16 optimizer casts the
    partition of a bf16 gradient buffer to fp32; with the optimizer offloaded DeepSpeed copies to the
    CPU instead (on a CPU, torch's unfused Adam adds temporaries of the partition's size: not counted,
    a GPU runs the fused kernel)."""
    from ..config import Offload

    fp32_grads, bf16_optimizer = prec.grad > prec.param, runs_bf16_optimizer(lay, prec, mt3d_engine)
    held = 0.0
    if lay.zero_stage >= 1 and not (fp32_grads and lay.zero_stage < 3) and not bf16_optimizer:
        held = min(bucket_elems, params) * prec.param
    if not mt3d_engine or lay.zero_stage == 3:
        return held, 0.0
    part, g = params / lay.data, prec.grad
    step = 0.0
    if Offload.from_label(lay.offload).optimizer != "none":
        step = 0.0  # the partition goes to the CPU
    elif bf16_optimizer:
        step = 0.0 if fp32_grads else part * 4
    elif lay.zero_stage == 2:
        step = part * (g + 4 * (g < 4))
    elif lay.zero_stage == 1:
        step = max(0.0, part * (g + 4 * (g < 4)) - params * g * (1 - 1 / lay.data))
    if overlaps_reduction(lay, prec, overlap, mt3d_engine) and lay.data > 1:
        return held, max(step, params * prec.param)
    if lay.zero_stage == 2 or (lay.zero_stage == 1 and not bf16_optimizer):  # ZeRO's own reduction
        return held, step
    if lay.zero_stage == 0 and lay.dense == 1:  # no other rank holds these weights: mt3d skips it
        return held, step
    if bf16_optimizer:
        # one gradient buffer per parameter group (mt3d: decay, then no-decay), flattened (copied) with
        # the next one when the first is within a batch (taken here as all of them)
        copy = params * g if params <= DEEPSPEED_ALLREDUCE_ELEMENTS else 0.0
    else:  # the weights' gradients, a batch at a time
        copy = min(DEEPSPEED_ALLREDUCE_ELEMENTS, params) * g
    cast = params * prec.param if fp32_grads else 0.0  # to the communication dtype
    return held, max(step, copy + cast)
