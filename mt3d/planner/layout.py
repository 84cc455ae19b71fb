"""What a plan is made of: one candidate layout (``Layout``), the bytes of each model state
(``Precision``), and the model states of one rank (``model_state_bytes``, after the ZeRO paper:
Rajbhandari et al. 2020: with mixed-precision Adam a parameter costs 2 (bf16 weight) + 2 (bf16
gradient) + 12 (fp32 master + two moments) bytes, partitioned over data parallel by stage)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..model.config import ModelConfig
from ..parallel.expert_layout import ExpertLayout
from ..parallel.layers import pad_vocab
from .choices import GRAD_DTYPES, OPTIMIZER_STATES  # their home imports nothing (the CLI parser reads it)


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


def fsdp_precision(prec: Precision) -> Precision:
    """FSDP's mixed precision at ZeRO-3: the fp32 shard is the weight (no master copy beside a 16-bit
    one), the gradient shard fp32 too (torch's FSDP casts the reduced shard back to the flat
    parameter's dtype unless ``keep_low_precision_grads``), Adam's two fp32 moments; 16-bit only
    when gathered: 16 bytes a parameter over the shards."""
    from dataclasses import replace

    return replace(prec, param=4, grad=4, master=0) if prec.name in ("bf16", "fp16") else prec


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
    """Expert-parallel degree: each rank holds experts / ep of every sparse layer."""
    etp: int | None = None
    """Expert-tensor degree (``mt3d.parallel.expert_tensor``; None: tp): the ranks splitting each expert.
    Below tp, or with ep not dividing dp, ep folds over tp x cp x dp (``mt3d.parallel.expert_layout``)."""
    sp_gathered: bool = False
    """With SP, column-parallel linears keep their all-gathered inputs (``gathered_sp_inputs``)."""
    selective: bool = False
    """Selective recompute (``train.recompute.granularity``): the attention core and the MLP's
    activation recomputed in every block (``recompute`` is full recompute of whole blocks)."""
    schedule: str = "1f1b"
    """The pipeline schedule (``mt3d.parallel.schedule``; "1f1b" at pipeline 1)."""

    @property
    def expert_tp(self) -> int:
        """The ranks splitting each expert's inner dimension (etp; tp unless folded)."""
        return self.tp if self.etp is None else self.etp

    def as_row(self) -> dict:
        """Its fields, as a plan row starts (``asdict`` without the deep copy: every field is a scalar)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def of_row(cls, row: dict) -> Layout:
        """The layout of a plan row (``asdict`` of one, with its figures beside)."""
        return cls(**{f.name: row[f.name] for f in fields(cls) if f.name in row})

    @property
    def experts(self) -> ExpertLayout:
        """The expert layout of these degrees (``mt3d.parallel.expert_layout``)."""
        return ExpertLayout(self.tp, self.cp, self.dp, self.ep, self.expert_tp)

    @property
    def data(self) -> int:
        """Ranks holding the same experts, which ZeRO partitions expert states over (edp): tp x cp x dp
        / (etp x ep), dp / ep x cp before folding (``mt3d.ds.experts``); without experts split over ep,
        everything's."""
        return self.experts.edp

    def partitioned(self, params: float, experts: float = 0.0) -> float:
        """Parameters of ``params`` (``experts`` of them routed experts' weights) whose optimizer states
        one rank holds: with ZeRO dense states over dp x cp and experts' over dp / ep x cp
        (``mt3d.ds.experts``), without ZeRO all of them."""
        if self.zero_stage == 0:
            return params
        return (params - experts) / self.dense + experts / self.data

    @property
    def dense(self) -> int:
        """Ranks dense gradients are averaged over: dp x cp."""
        return self.dp * self.cp

    @property
    def gpus(self) -> int:
        """Ranks of the layout."""
        return self.tp * self.pp * self.dp * self.cp


def lora_stage_params(cfg: ModelConfig, r: int, tp: int, pp: int) -> float:
    """LoRA adapter parameters (rank ``r``, every linear of the blocks: "all-linear") held by one GPU of
    the heaviest stage (``mt3d.parallel.lora``): a column-parallel base's A [r, in] whole and B
    [out / tp, r]; a row-parallel base's A [r, in / tp] and B [out, r] whole. Routed experts have none."""
    h, q, kv, f = cfg.hidden, cfg.q_size, cfg.kv_size, cfg.ffn
    attn = (h + q / tp) + 2 * (h + kv / tp) + (q / tp + h)
    ups = 2 if cfg.mlp in ("swiglu", "geglu") else 1
    dense = ups * (h + f / tp) + (f / tp + h)
    blocks = math.ceil(cfg.layers / pp)
    sparse = sum(cfg.is_sparse(i) for i in range(min(blocks, cfg.layers)))
    return r * (blocks * attn + (blocks - sparse) * dense)


def stage_expert_params(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> float:
    """The routed experts' part of ``stage_params``: experts / ep of each sparse block of the stage, each
    split over ``tp`` ranks (the expert-tensor degree etp)."""
    spec = cfg.moe_spec
    if spec is None:
        return 0.0
    sparse = cfg.sparse_layers / cfg.layers
    per_block = (spec.experts // ep) * cfg.mlp_params(spec.expert_ffn, spec.expert_bias) / tp
    return math.ceil(cfg.layers / pp) * sparse * per_block


def stage_params(cfg: ModelConfig, vocab: int, tp: int, pp: int, ep: int = 1,
                 etp: int | None = None) -> float:  # fmt: skip
    """Parameters held by one GPU of the heaviest pipeline stage (experts / ep of each sparse layer, split
    over ``etp`` ranks: tp when None)."""
    if etp is not None and etp != tp:  # the experts split over etp instead of tp
        moved = stage_expert_params(cfg, etp, pp, ep) - stage_expert_params(cfg, tp, pp, ep)
        return stage_params(cfg, vocab, tp, pp, ep) + moved
    blocks = math.ceil(cfg.layers / pp)
    per_block = cfg.block_params(ep=ep) / tp  # norms are replicated: a negligible overcount
    padded = pad_vocab(vocab, tp)
    embed = padded * cfg.hidden / tp + (cfg.max_seq_len * cfg.hidden if cfg.position == "learned" else 0)
    head = padded * cfg.hidden / tp
    first = blocks * per_block + embed + (head if pp == 1 and not cfg.tie_embeddings else 0)
    last = blocks * per_block + cfg.hidden * 2 + (head if (not cfg.tie_embeddings or pp > 1) else 0)
    if cfg.mtp is not None:  # the depths on the last stage (eh_proj counted as split: a small undercount),
        depths = cfg.mtp_spec.params(cfg, ep) / tp  # with its copy of an untied embedding
        first, last = (
            (first + depths, last)
            if pp == 1
            else (first, last + depths + (0 if cfg.tie_embeddings else embed))
        )
    return max(first, last)
