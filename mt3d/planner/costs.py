"""Closed-form memory and time of one training layout (FORMULAS.md).

Model states follow the ZeRO paper (Rajbhandari et al. 2020): with mixed-precision Adam a
parameter costs 2 (bf16 weight) + 2 (bf16 gradient) + 12 (fp32 master + two moments) bytes,
partitioned over data parallel by stage. Activations are either the Korthikanti et al. (2022)
table (``korthikanti_layer_bytes``) or the tensors mt3d's own blocks keep for backward
(``mt3d_layer_bytes``; attention through scaled_dot_product_attention keeps no score matrix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model.config import GATED_MLPS, ModelConfig
from ..parallel.layers import pad_vocab
from ..pipeline.schedule import warmup
from .choices import GRAD_DTYPES, OPTIMIZER_STATES  # their home imports nothing (the CLI parser reads it)
from .offload import offload_traffic, tier_bytes
from .traffic import cp_bytes, dp_bytes, ep_layer_elements, pp_bytes, ring_factor, tp_bytes

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


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per activation element."""

    name: str
    param: int
    grad: int
    master: int
    optim: int
    activation: int

    @classmethod
    def of(cls, name: str, zero_stage: int, states: str = "fp32", grads: str = "param") -> Precision:
        """bf16 (mixed precision, fp32 master) or fp32 (DeepSpeed keeps an fp32 partition copy under
        ZeRO). ``states`` (``OPTIMIZER_STATES``), with 16-bit training: fp32 master weights and Adam
        moments (12 bytes per parameter), bf16 moments beside an fp32 master (8; stacks such as
        torchao's), or bf16 master weights and moments (6; DeepSpeed's bf16_master_weights_and_grads
        with bf16_optimizer_states, ZeRO 1-3). ``grads`` (``GRAD_DTYPES``): the gradients in the weights'
        dtype, or fp32 beside 16-bit weights (4 bytes per parameter instead of 2)."""
        if states not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer states must be one of {', '.join(OPTIMIZER_STATES)}, got {states!r}")
        if grads not in GRAD_DTYPES:
            raise ValueError(f"gradients must be one of {', '.join(GRAD_DTYPES)}, got {grads!r}")
        if name in ("bf16", "fp16"):
            master, optim = {"fp32": (4, 8), "bf16-moments": (4, 4), "bf16": (2, 4)}[states]
            return cls(name, 2, 4 if grads == "fp32" else 2, master, optim, 2)
        if name == "fp32":
            return cls(name, 4, 4, 4 if zero_stage >= 1 else 0, 8, 4)
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {name!r}")


def model_state_bytes(params: float, dp: int, zero_stage: int, prec: Precision) -> float:
    """Parameters + gradients + optimizer states per GPU for ``params`` parameters on this GPU's
    model slice (Psi' = Psi / (tp * pp)): plain DP 16 Psi', ZeRO-1 4 Psi' + 12 Psi'/d,
    ZeRO-2 2 Psi' + 14 Psi'/d, ZeRO-3 16 Psi'/d for bf16."""
    p, g, o = prec.param, prec.grad, prec.master + prec.optim
    if zero_stage == 0:
        return (p + g + o) * params
    if zero_stage == 1:
        return (p + g) * params + o * params / dp
    if zero_stage == 2:
        return p * params + (g + o) * params / dp
    if zero_stage == 3:
        return (p + g + o) * params / dp
    raise ValueError(f"ZeRO stage must be 0-3, got {zero_stage}")


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
                     tiled: bool = False, sp_gathered: bool = False,
                     selective: bool = False) -> float:  # fmt: skip
    """Activation bytes one of mt3d's blocks keeps for backward (no dropout masks; SDPA attention).

    Per token: the two norm inputs (sequence shards with SP), the inputs of the QKV and MLP-in
    linears (with SP their 1/t sequence shards, all-gathered again in the backward; the full
    sequence with ``sp_gathered``, and without SP), q/k/v and the attention output for the local
    heads, and the MLP's local inner activations (2 x ffn/t for GELU, 4 x ffn/t for SwiGLU; none
    with sequence tiles, ``tiled``: they are rebuilt a tile at a time in the backward).
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
    attn = (2 * cfg.q_size + 2 * cfg.kv_size) / t
    mlp = 0.0 if tiled else mlp_inner_elements(cfg, t, selective)
    return tokens * (norms + linear_inputs + attn + mlp) * elem


def mlp_inner_elements(cfg: ModelConfig, t: int, selective: bool = False) -> float:
    """Per token: the MLP's inner activations one TP rank keeps (2 x ffn/t GELU, 4 x ffn/t gated; a
    sparse block's k experts' and shared expert's, plus the k dispatched copies of its input). With
    selective recompute a dense MLP keeps half (the activation's input only; routed experts keep all)."""
    spec = cfg.moe_spec
    dispatched = 0.0 if spec is None else cfg.sparse_layers / cfg.layers * spec.top_k * cfg.hidden
    per = (4 if cfg.mlp in GATED_MLPS else 2) / (2 if selective and spec is None else 1)
    return per * cfg.mlp_token_width() / t + dispatched


@dataclass(frozen=True)
class Layout:
    """One candidate: degrees, batch split, ZeRO stage, recompute, sequence parallelism."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    grad_accum: int
    zero_stage: int
    recompute: bool
    sequence_parallel: bool
    virtual_stages: int = 1
    offload: str = "none"
    """none, opt-cpu, opt-nvme, cpu or nvme (``offload.OFFLOAD_OPTIONS``)."""
    cp: int = 1
    """Context-parallel degree: each rank holds seq_len / cp tokens of every sample."""
    tile_len: int = 0
    """Sequence tiles of the MLP and the loss (``train.recompute.tile_len``; 0: none)."""
    ep: int = 1
    """Expert-parallel degree (a split of dp): each rank holds experts / ep of every sparse layer."""
    sp_gathered: bool = False
    """With SP, column-parallel linears keep their all-gathered inputs (``gathered_sp_inputs``)."""
    selective: bool = False
    """Selective recompute (``train.recompute.granularity``): the attention core and the MLP's
    activation recomputed in every block (``recompute`` is full recompute of whole blocks)."""

    @property
    def data(self) -> int:
        """Ranks ZeRO partitions over: DeepSpeed's data axis, dp / ep x cp (ep ranks count in its model
        axis: ``mt3d.ds.experts``)."""
        return self.dp // self.ep * self.cp

    @property
    def dense(self) -> int:
        """Ranks dense gradients are averaged over: dp x cp."""
        return self.dp * self.cp

    @property
    def gpus(self) -> int:
        """Ranks of the layout."""
        return self.tp * self.pp * self.dp * self.cp


def posts_p2p(overlap: tuple[str, ...], lay: Layout, mt3d_engine: bool = True) -> bool:
    """Whether the layout's pipeline transfers are posted ahead (``overlap`` pp): only where the
    schedule that posts them runs (``config.rules.p2p_conflict``: pp >= 2 and micro-batches per step a
    multiple of pp, for mt3d's schedule engine, which also runs v = 1). Another stack
    (``mt3d_engine`` False) posts them only with interleaving, as Megatron-LM's overlap_p2p_comm,
    which its non-interleaved 1F1B refuses."""
    from ..config.rules import p2p_conflict

    if "pp" not in overlap or (not mt3d_engine and lay.virtual_stages == 1):
        return False
    return p2p_conflict(True, lay.pp, lay.grad_accum) is None


def in_flight_blocks(blocks: int, p: int, m: int, v: int, schedule_engine: bool = False) -> float:
    """Blocks' worth of activations the first stage holds at its peak.

    1F1B (DeepSpeed's TrainSchedule): up to p micro-batches of the stage's blocks. Interleaved
    (PTD-P; mt3d's schedule engine, which also runs v = 1 when ``schedule_engine``: posted transfers):
    the warm-up forwards of rank 0 plus the one in flight, each chunk 1/v of the stage's blocks:
    about p + (p - 2)/v stages' worth, a little more than 1F1B once v > 1, 2p - 1 at v = 1.
    tests/test_planner.py walks both schedules to check this.
    """
    if v == 1 and not schedule_engine:
        return blocks * min(p, m)
    chunks = min(warmup(p, v, m, 0) + 1, m * v)
    return blocks / v * chunks


def stage_params(cfg: ModelConfig, vocab: int, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters held by one GPU of the heaviest pipeline stage (experts / ep of each sparse layer)."""
    blocks = math.ceil(cfg.layers / pp)
    per_block = cfg.block_params(ep=ep) / tp  # norms are replicated: a negligible overcount
    padded = pad_vocab(vocab, tp)
    embed = padded * cfg.hidden / tp + (cfg.max_seq_len * cfg.hidden if cfg.position == "learned" else 0)
    head = padded * cfg.hidden / tp
    first = blocks * per_block + embed + (head if pp == 1 and not cfg.tie_embeddings else 0)
    last = blocks * per_block + cfg.hidden * 2 + (head if (not cfg.tie_embeddings or pp > 1) else 0)
    return max(first, last)


def ep_bytes(cfg: ModelConfig, tokens: int, micro_batches: int, ep: int, elem: int, blocks: int,
             recompute: bool) -> float:  # fmt: skip
    """Bytes one rank sends per step over its ep group: every sparse layer of the heaviest stage
    dispatches and combines each micro-batch's ``tokens`` rows (``traffic.ep_layer_elements``; every
    TP rank sends the whole rows, mt3d's experts being split over TP), and recompute repeats the
    forward's half."""
    spec = cfg.moe_spec
    if spec is None or ep <= 1:
        return 0.0
    sparse = blocks * cfg.sparse_layers / cfg.layers
    per_layer = ep_layer_elements(ep, tokens, spec.top_k, cfg.hidden, spec.experts) * elem
    return sparse * micro_batches * per_layer * (1.5 if recompute else 1.0)


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
) -> dict[str, float]:
    """Peak bytes per GPU of the heaviest stage, by component; ``cpu`` and ``nvme``: the bytes each
    rank keeps in CPU memory and on NVMe (offload; ``sub_group_size`` as in ``offload.tier_bytes``);
    ``overlap`` as ``step_time``'s. ``mt3d_engine``: the stack is mt3d's (posted pipeline transfers run
    mt3d's schedule engine, more micro-batches in flight at v = 1); False: another stack's 1F1B. The
    Korthikanti model keeps the attention scores only with the ``materialized`` kernel (FlashAttention
    keeps none)."""
    t, p = lay.tp, lay.pp
    params = stage_params(cfg, vocab, t, p, lay.ep)
    tiers = _model_state_tiers(params, lay, prec, overlap, mt3d_engine, sub_group_size)
    states = tiers["gpu"]
    sp = lay.sequence_parallel and t > 1
    local = seq_len // lay.cp  # tokens of each sample on this rank
    per_layer, working = _block_bytes(cfg, seq_len, lay, prec, activation_model, attention_kernel)
    blocks = math.ceil(cfg.layers / p)
    rows = min(local, lay.tile_len) if lay.tile_len > 0 else local  # sequence tiles: one tile's logits
    logits = rows * lay.micro_batch * pad_vocab(vocab, t) / t * logit_bytes(t, prec.activation)
    # 1F1B: stage 0 holds up to p micro-batches of activations, the last stage one, plus the logits.
    engine = mt3d_engine and posts_p2p(overlap, lay)
    in_flight = in_flight_blocks(blocks, p, lay.grad_accum, lay.virtual_stages, engine)
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
                       mt3d_engine: bool, sub_group_size: float | None) -> dict[str, float]:  # fmt: skip
    """``offload.tier_bytes`` of the stage's model states; DeepSpeed's BF16 optimizer partitions the
    master weights and moments as ZeRO-1 does, and holds the gradients ``bf16_optimizer_gradient_bytes``
    says."""
    bf16_optimizer = runs_bf16_optimizer(lay, prec, mt3d_engine)
    stage = 1 if bf16_optimizer else lay.zero_stage
    tiers = tier_bytes(params, lay.data, stage, prec, lay.offload, sub_group_size)
    if bf16_optimizer:
        folded = overlaps_reduction(lay, prec, overlap, True)
        tiers["gpu"] += params * (bf16_optimizer_gradient_bytes(prec, folded) - prec.grad)
    return tiers


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
    per_layer = mt3d_layer_bytes(cfg, local, lay.micro_batch, t, sp, lay.recompute, e, tiled, g, sel)
    full_layer = mt3d_layer_bytes(cfg, local, lay.micro_batch, t, sp, False, e, tiled, g, sel)
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
    return lay.zero_stage == 0 or (lay.zero_stage == 1 and prec.grad > prec.param)


def bf16_optimizer_gradient_bytes(prec: Precision, overlapped: bool) -> float:
    """Gradient bytes per parameter DeepSpeed's BF16 optimizer holds: its buffer in the accumulation
    dtype, and the weights' own gradients, zeroed each step but not freed, unless each is folded in as
    it is produced (bf16.immediate_grad_update, which mt3d sets with its ``overlapped`` reduction)."""
    return prec.grad + (0 if overlapped else prec.param)


def overlaps_reduction(lay: Layout, prec: Precision, overlap: tuple[str, ...], mt3d_engine: bool) -> bool:
    """Whether mt3d runs this layout with its overlapped gradient reduction (``mt3d.train.overlap.
    grad_reduce``, which ``--write-config`` sets with ``--overlap dp`` where it can run): it sets
    bf16.immediate_grad_update whatever dp is, and reduces buckets (``mt3d.ds.overlap``) where DeepSpeed's
    data-parallel group has more than one rank."""
    from ..config import Offload
    from ..config.rules import overlap_conflict

    if not mt3d_engine or "dp" not in overlap:
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
              fp8: str | None = None) -> dict[str, float]:  # fmt: skip
    """Seconds per step by component (compute, bubble, TP/PP/DP communication, offload) and throughput.

    Compute: with ``efficiency`` None and a ``device`` that has a GEMM calibration, the shape model
    of ``compute.micro_batch_seconds`` (the heaviest stage's blocks, plus the output layer) and the
    GPU optimizer step; otherwise the executed FLOPs at ``efficiency`` x peak. TP and PP transfers
    are overlapped with compute only as ``overlap`` says; ZeRO-3's parameter all-gathers and gradient
    reduce-scatters are, partly (``ZERO3_OVERLAP``): only their excess counts.
    ``attention_fraction``: the share of dense causal attention tiles the layers visit, averaged
    over layers (``sparsity.attention_speedup``): local layers' attention time counts the tiles
    they visit, while TFLOP/s and MFU count model FLOPs (``ModelConfig.flops_per_token``).
    ``gemm_fraction``: of the device's GEMM ceiling (default ``compute.GEMM_FRACTION``).
    ``pp_scatter_gather``: Megatron-LM's PTD-P splits each stage-boundary transfer over the TP
    ranks (1/t each across nodes, then an all-gather on NVLink); mt3d sends whole activations.
    ``overlap`` (``choices.OVERLAPS``): "dp" (``dp_hidden``), "tp" (``tp_hidden``), "pp"
    (``pp_posted_seconds``): each hides as much as the schedule allows; ``mt3d_engine`` as
    ``memory_bytes``'s (``posts_p2p``). ``grad_dtype``: the gradients' (``Precision.of``; what each
    stack sends: ``_dp_seconds``). ``fp8``: the blocks' linears in FP8 (``compute.micro_batch_seconds``;
    the shape model only); TFLOP/s and MFU still count model FLOPs against ``peak_tflops`` (bf16's).
    """
    gpus = lay.gpus
    tokens = global_batch * seq_len
    flops = cfg.flops_per_token(seq_len, vocab) * tokens
    v, m, t = lay.virtual_stages, lay.grad_accum, lay.tp
    blocks = math.ceil(cfg.layers / lay.pp)
    prec = Precision.of(precision, max(lay.zero_stage, 1), grads=grad_dtype)
    grads = stage_params(cfg, vocab, t, lay.pp, lay.ep)
    compute, optimizer = _compute_seconds(
        cfg, vocab, seq_len, tokens, lay, blocks, grads, peak_tflops=peak_tflops, efficiency=efficiency,
        device=device, attention_fraction=attention_fraction, attention_kernel=attention_kernel,
        gemm_fraction=gemm_fraction, fp8=fp8,
    )  # fmt: skip
    bubble = compute * (lay.pp - 1) / (v * m)  # PTD-P: interleaving divides it by v
    comm_bytes = prec.param
    act = seq_len // lay.cp * lay.micro_batch * cfg.hidden * comm_bytes
    timing = (peak_tflops, efficiency, device, gemm_fraction)
    tp_mode = "tp-comm" if "tp-comm" in overlap else ("tp" if "tp" in overlap else None)
    tp = _tp_seconds(cfg, seq_len, lay, act, blocks, bw, tp_mode, timing)
    cp = cp_bytes(cfg, seq_len, lay.micro_batch, t, lay.cp, m, comm_bytes, blocks, recompute=lay.recompute)
    cp = cp / (bw["cp"] * 1e9) if lay.cp > 1 else 0.0
    posted = posts_p2p(overlap, lay, mt3d_engine)
    pp = _pp_seconds(lay, act / (t if pp_scatter_gather else 1), compute, bw, posted)
    ep = ep_bytes(cfg, seq_len // lay.cp * lay.micro_batch, m, lay.ep, comm_bytes, blocks, lay.recompute)
    ep = ep / (bw["ep"] * 1e9) if lay.ep > 1 else 0.0
    dp = _dp_seconds(lay, grads, prec, compute, bw, "dp" in overlap, mt3d_engine)
    offload = _offload_seconds(grads, lay, prec, bw)
    total = compute + bubble + tp + cp + ep + pp + dp + offload + optimizer
    tflops = flops / gpus / total / 1e12
    return {
        "compute_s": compute,
        "bubble_s": bubble,
        "tp_comm_s": tp,
        "cp_comm_s": cp,
        "ep_comm_s": ep,
        "pp_comm_s": pp,
        "dp_comm_s": dp,
        "offload_s": offload,
        "optimizer_s": optimizer,
        "step_time_s": total,
        "tflops_per_gpu": tflops,
        "mfu": tflops / peak_tflops,
    }


def _dp_seconds(lay: Layout, grads: float, prec: Precision, compute: float, bw: dict, overlapped: bool,
                mt3d_engine: bool) -> float:  # fmt: skip
    """Exposed data-parallel transfer seconds of a step: ZeRO-3's beyond ``ZERO3_OVERLAP`` of the
    compute, else the reduction less ``dp_hidden`` when ``overlapped``. The weights travel in their
    dtype, the gradients in theirs (Megatron-Core reduce-scatters fp32 gradients); DeepSpeed's BF16
    optimizer all-reduces the gradients in the weights' dtype, then all-gathers the updated weights:
    ZeRO-1's count with the gradients' bytes twice (with fp32 gradients, 2 x 2 + 2 bytes per parameter
    and ring pass, as Megatron-Core's 4 + 2)."""
    zero_stage, elems = lay.zero_stage, (prec.param, prec.grad)
    if runs_bf16_optimizer(lay, prec, mt3d_engine):
        zero_stage, elems = 1, (prec.param, 2 * prec.param)
    gathers = 3 if lay.recompute else 2  # ZeRO-3: forward, recompute, backward
    # gradients are averaged over dp x cp: the slower of the two axes' links carries the ring
    dense_bw = min(bw["dp"], bw["cp"]) if lay.cp > 1 else bw["dp"]
    dp = dp_bytes(grads, *elems, lay.dense, zero_stage, gathers) / (dense_bw * 1e9)
    if lay.zero_stage == 3:
        return max(0.0, dp - ZERO3_OVERLAP * compute)  # partly hidden behind the compute it prefetches for
    if overlapped:
        return dp - dp_hidden(dp, grads, compute / lay.grad_accum, lay.recompute)
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
    return tp - blocks * m * (attention + dense * mlp)


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
                     device, attention_fraction, attention_kernel, gemm_fraction, fp8=None):  # fmt: skip
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
        )["total_s"]  # fmt: skip
        optimizer = 0.0
        if lay.offload == "none":
            optimizer = optimizer_seconds(grads / (lay.data if lay.zero_stage >= 1 else 1), device)
        return lay.grad_accum * per_micro, optimizer
    work = cfg.flops_per_token(seq_len, vocab, attended=seq_len * attention_fraction) * tokens
    executed = work * (4 / 3 if lay.recompute else 1)  # recompute repeats the forward pass
    if lay.selective and not lay.recompute:  # the attention core's forward again (a third of its work)
        attended = seq_len * attention_fraction
        core = cfg.flops_per_token(seq_len, vocab, attended=attended) - cfg.flops_per_token(
            seq_len, vocab, attended=0
        )
        executed += core * tokens / 3
    return executed / gpus / (peak_tflops * 1e12 * (efficiency or 0.5)), 0.0


def _offload_seconds(grads: float, lay: Layout, prec: Precision, bw: dict[str, float]) -> float:
    """PCIe and NVMe transfers and the CPU optimizer step, not overlapped with compute (an upper
    bound: DeepSpeed prefetches some of it behind the GPU's work)."""
    if lay.offload == "none":
        return 0.0
    moved = offload_traffic(grads, lay.data, lay.zero_stage, prec, lay.offload, lay.recompute)
    return (moved["pcie"] / (bw["pcie"] * 1e9) + moved["nvme"] / (bw["nvme"] * 1e9)
            + moved["cpu_adam_elements"] / bw["cpu_adam"])  # fmt: skip
