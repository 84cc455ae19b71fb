"""The typed "mt3d" section of a run config: dataclasses with a docstring under every field, and
their parsing from JSON (unknown keys are errors with a "did you mean" hint, types are checked)."""

from __future__ import annotations

import difflib
import json
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from .deepspeed import DeepSpeedSection
from .errors import ConfigError


@dataclass
class RecomputeConfig:
    """Activation checkpointing (recompute) of transformer blocks."""

    interval: int = 0
    """Checkpoint every run of this many consecutive blocks (0: off; 1: every block)."""
    granularity: str = "full"
    """full: whole blocks, every ``interval`` (above). selective: in every block, recompute only the
    cheap, memory-heavy parts in the backward (Korthikanti et al. 2022; Megatron-Core's selective
    recompute): the attention core (q, k, v -> output: scores and softmax where the kernel keeps
    them) and the MLP's activation function (its output and the gate product are not kept)."""
    partition_activations: bool = False
    """Keep only 1/tp of each checkpointed input (sequence slice), all-gathered for the recompute."""
    tile_len: int = 0
    """Run every MLP and the loss over at most this many sequence positions at a time, recomputing one
    tile at a time in the backward (0: whole sequences). For long sequences: the MLP's inner
    activations and the logits (positions x vocabulary / tp) never exist whole, for about one more
    forward pass of the MLPs and the head. Counted as the layer sees the sequence: this cp rank's
    positions, all-gathered over tp with sequence parallelism."""
    gathered_sp_inputs: bool = False
    """With sequence parallelism, keep each column-parallel linear's all-gathered input (s x h per
    sample) for the backward, as mt3d did before, instead of its 1/tp sequence shard, which the
    backward all-gathers again while it computes the input gradient (Megatron's choice: 2 s h (1 -
    1/tp) fewer elements per block and sample, one more all-gather per linear, overlapped)."""


@dataclass
class OverlapConfig:
    """Communication overlapped with compute (beyond what always overlaps: with sequence parallelism,
    each column-parallel linear's backward all-gather and reduce-scatter run behind its GEMMs)."""

    grad_reduce: bool = False
    """All-reduce data-parallel gradients in buckets, in backward order, while the last micro-batch's
    backward still runs (Megatron-Core's overlap_grad_reduce), instead of in one step after it.
    Pipeline engine (ZeRO 0/1), fp32 or bf16; not with expert parallelism or optimizer offload."""
    p2p: bool = False
    """Post pipeline sends and receives without waiting at each exchange: a received tensor is waited
    for right before the pass that reads it, sends complete behind the compute that follows. Runs the
    pipeline on mt3d's schedule engine (``mt3d.ds.interleaved``, also at virtual_stages 1), which needs
    micro-batches per step to be a multiple of pp."""
    dispatch_chunks: int = 1
    """Cut each MoE layer's routed tokens into this many chunks and pipeline them over the expert
    all-to-all (Tutel's pipelining degree): chunk i+1's dispatch and chunk i-1's combine travel while
    chunk i's experts compute, and the backward mirrors it; the shared expert hides the first chunk's
    dispatch. Every token still goes once to each rank holding any of its experts; 1: one dispatch and
    one combine per layer. Needs expert parallelism (parallel.expert >= 2)."""
    bucket_elements: int = 40_000_000
    """Gradient elements per bucket (Megatron-Core's default size): smaller buckets start sooner and
    leave less of the reduction after the backward, larger ones cost fewer collective launches."""


@dataclass
class Fp8Config:
    """FP8 GEMMs in the transformer blocks' column- and row-parallel linears (``mt3d.parallel.fp8``),
    with bf16 everywhere else: master weights, optimizer states, norms, softmax, the router, routed
    experts, the embedding and the output layer keep their precision."""

    recipe: str = "tensorwise"
    """'tensorwise' (one scale per tensor; e4m3 inputs and weights, e5m2 output gradients),
    'rowwise' (one power-of-two scale per row along each GEMM's reduction dimension, all e4m3):
    torchao's float8 training recipes; 'blockwise' (DeepSeek-V3's: a scale per 1x128 tile of
    activations and gradients along the reduction dimension, per 128x128 block of weights, all e4m3)
    or 'mxfp8' (OCP MX: a power-of-two e8m0 scale per 1x32 tile of every operand, all e4m3); current
    (dynamic) scaling throughout."""
    all_gather: bool = False
    """With sequence parallelism, cast each column-parallel input's sequence shard to FP8 before the
    forward all-gather (half its bytes; tensorwise all-reduces one amax first). Without sequence
    parallelism it does nothing, and ``mt3d train`` says so."""
    experts: bool = False
    """The routed experts' GEMMs in FP8 too (a tiled recipe: blockwise or mxfp8, whose tiles take the
    experts' varying token counts), one FP8 GEMM per expert."""
    dispatch: bool = False
    """The expert-parallel dispatch's rows in FP8 (a tiled recipe: its activation tiles along the hidden
    dimension, e4m3 with their scales; DeepSeek-V3's): about half the bytes of bf16's. The combine and
    every gradient stay in bf16. Without expert parallelism there is no dispatch, and ``mt3d train``
    says so."""
    exclude_first_last: bool = False
    """Keep the first and the last transformer block in bf16 (their inputs and outputs are the most
    sensitive to rounding; a common choice for long runs). A model of 2 blocks or fewer would then
    have no FP8 linear: refused."""


@dataclass
class ParallelConfig:
    """How the model is split: one degree per configured axis (``mt3d.parallel.axes``); data
    parallelism is what remains of the world."""

    tensor: int = 1
    """Tensor-parallel degree tp (heads, KV groups and MLP split over tp ranks)."""
    context: int = 1
    """Context-parallel degree cp: each sample's sequence is cut into 2 cp chunks and cp rank i holds
    chunks i and 2cp-1-i (every rank the same attention work); needs seq_len divisible by 2 cp."""
    context_exchange: str = "auto"
    """How attention reaches the other cp ranks' tokens: 'alltoall' (Ulysses: DeepSpeed's
    DistributedAttention; needs heads / tp divisible by cp), 'allgather' (every rank gathers keys
    and values), or 'auto' (all-to-all when the heads divide, else all-gather). Local layers whose
    W*d - 1 keys fit in one chunk receive only that halo from the neighbouring rank, whatever this says."""
    expert: int = 1
    """Expert-parallel degree ep (experts of MoE layers split over ep ranks). With expert_tensor = tensor
    and ep dividing dp, the ep ranks are data-parallel ranks (the layout of every run before folding);
    otherwise ep folds over the tensor, context and data ranks of a pipeline stage
    (``mt3d.parallel.expert_layout``): expert_tensor x expert must divide tensor x context x data."""
    expert_tensor: int | None = None
    """Ranks that split one expert's inner dimension (etp; null: tensor). 1 keeps experts whole (one
    per rank and no expert-TP collectives: Megatron-Core's recommendation); it must divide tensor."""
    expert_dispatch: str = "rank"
    """How routed tokens reach their experts' ranks: 'rank', one all-to-all over the ep group, each
    token sent once to each rank holding any of its experts; 'node', two where the ep group spans hosts
    (DeepEP's inter-node route): once to each host holding any of its experts (to the ep rank at the
    sender's place there), then within that host to the experts' ranks, so a token crosses to another
    host at most once per host. 'node' needs the same number of ep ranks on each host of a group.
    'assignment': one all-to-all, each token sent once per expert it is routed to (Megatron's alltoall
    dispatcher, DeepSpeed AutoEP's): more rows, none of the routing metadata and bookkeeping the others
    carry, which is cheaper where rows are narrow (tiny models); no dispatch_chunks."""
    pipeline: int = 1
    """Pipeline stages pp (DeepSpeed's 1F1B pipeline engine)."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank nesting, innermost first; tp innermost keeps TP groups inside hosts. Axes left out take
    their default place (so 'tp-dp-pp' still reads)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP regions (needs tp > 1 to have an effect)."""
    stage_layers: list[int] | None = None
    """Transformer blocks per pipeline stage, e.g. [5, 6, 6, 5] (default: as even as possible); with
    virtual stages, per chunk in virtual-stage order (pipeline x virtual_stages entries)."""
    virtual_stages: int = 1
    """Chunks of layers per pipeline rank (PTD-P's interleaved 1F1B): rank r holds virtual stages
    r, r + pipeline, ...; the bubble shrinks by this factor for as many times the point-to-point
    traffic. Needs pipeline >= 2 and micro-batches per step a multiple of pipeline. 1: DeepSpeed's
    own schedule, unchanged."""
    schedule: str = "1f1b"
    """The pipeline schedule: '1f1b' (interleaved when virtual_stages > 1), 'zb-h1' or 'zbv'
    (zero-bubble, Qi et al. 2024: each backward split into B, the input gradient, and W, the
    linears' weight gradients, which fill the bubble; within 1F1B's activation memory; any number of
    micro-batches; on mt3d's schedule engine with posted transfers; with compile, each deferring
    linear runs outside the compiled graphs, between them). 'zb-h1' keeps one stage per rank
    (virtual_stages 1); 'zbv' places two chunks per rank in a V (virtual_stages 2: rank r holds
    stages r and 2 pipeline - 1 - r, so the embedding and the head share rank 0)."""
    hostfile: str | None = None
    """Hostfile describing the hosts (default: discovered from the launcher's local ranks)."""
    islands: str | None = None
    """NVLink islands as local ranks, e.g. '0,1;2,3' (default: each host is one island)."""
    allow_crossing: bool = False
    """Allow TP groups across hosts when hosts cannot hold whole TP groups (slow; warns)."""

    def degrees(self) -> dict[str, int]:
        """The configured degree of every axis that has a key (``Axis.key``), by axis name."""
        from ..parallel.axes import degree_keys

        return {name: getattr(self, key) for key, name in degree_keys().items()}


@dataclass
class DataConfig:
    """Where the tokens come from."""

    corpus: str = "builtin"
    """'builtin' (English text from the Python installation), 'synthetic' (stochastic grammar with
    a known entropy floor), or 'indexed' (preprocessed .bin/.idx prefixes in ``prefixes``)."""
    seq_len: int = 128
    """Tokens per training sample (the model sees seq_len, predicts seq_len)."""
    prefixes: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (P for P.bin + P.idx) for corpus 'indexed'."""
    weights: list[float] | None = None
    """Blend weights of ``prefixes`` (default: proportional to their sizes)."""
    tokenizer: str | None = None
    """HF tokenizer directory. For 'indexed' data, default: the one ``mt3d preprocess`` recorded in the
    prefixes' ``P.meta.json``, else the ``from_hf`` model's; builtin/synthetic make their own."""
    split: list[float] = field(default_factory=lambda: [98.0, 1.0, 1.0])
    """Train/valid/test split of the documents, as relative weights (valid may be 0 in a run that
    evaluates nothing: ``train.eval_batches`` 0)."""
    vocab_size: int = 2048
    """Vocabulary of the tokenizer trained for the builtin corpus."""
    cache_dir: str | None = None
    """Where built corpora, tokenizers and sample indices are cached (default ~/.cache/mt3d)."""
    seed: int | None = None
    """Seed of the sample order (default: train.seed)."""
    packing: bool | None = None
    """How whole documents with document masking (positions restart at every document, attention never
    crosses one: chat and prompt/completion data, or plain text with ``document_mask``) fill samples:
    true (default) packs several into each seq_len sample (first-fit, padding masked), false gives each
    its own padded sample. ``true`` on plain text turns ``document_mask`` on (``mt3d.data.packing``)."""
    document_mask: bool = False
    """Plain text as whole documents with document masking (Llama 3's pre-training), instead of one
    stream cut into samples where documents attend to the ones before them."""


@dataclass
class MuonConfig:
    """mt3d's Muon settings (with ``"optimizer": {"type": "Muon"}``; ``mt3d.training.muon``)."""

    scale: str = "deepspeed"
    """Each matrix's update factor: 'deepspeed' (max(1, rows / cols) ** 0.5, Keller Jordan's) or
    'match_rms' (Moonlight's 0.2 max(rows, cols) ** 0.5: AdamW's learning rate and decay reusable)."""
    ns_dtype: str = "fp32"
    """The Newton-Schulz iterations' dtype: 'fp32' or 'bf16'."""
    qk_clip: float | None = None
    """MuonClip's tau (Kimi K2): after each step, every attention head whose largest pre-softmax logit
    exceeded tau has its query and key weights scaled back to tau (``mt3d.training.qk_clip``; None: off)."""


@dataclass
class DpoConfig:
    """Direct preference optimisation (``train.objective`` "dpo"; ``mt3d.model.dpo``), with TRL's
    meanings."""

    beta: float = 0.1
    """How far the policy may move from the reference: the implicit reward is beta x the log-ratio."""
    loss_type: str = "sigmoid"
    """'sigmoid' (DPO: -log sigmoid(beta x margin)) or 'ipo' ((margin - 1 / (2 beta))^2 over log-probs
    averaged per completion token, TRL's IPO)."""
    label_smoothing: float = 0.0
    """The share of pairs assumed mislabelled (conservative DPO; sigmoid only), in [0, 0.5)."""
    reference: str = "precompute"
    """'precompute': the reference model is the starting policy (with LoRA: the frozen base, adapters
    off), its log-probabilities computed in one pass before training and kept with the run. 'model':
    a frozen model of its own (``reference_model``), loaded on the run's layout for that pass and freed
    (it never changes, so its log-probabilities are the same at every step)."""
    reference_model: str | None = None
    """With reference 'model': an HF directory or mt3d checkpoint (default: the policy's
    ``model.from_hf``)."""


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 100
    """Optimizer steps to run (global batches)."""
    seed: int = 1234
    """Seed of the weight init, dropout and data order."""
    log_interval: int = 10
    """Print a log line (and write metrics.jsonl) every this many steps."""
    eval_interval: int = 0
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Global batches per evaluation (0: no evaluation)."""
    save_interval: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    save_dir: str = "runs/default"
    """Run directory: checkpoints, metrics.jsonl, W&B files."""
    save_at_end: bool = True
    """Save a checkpoint when training ends."""
    resume: str = "none"
    """'none', 'auto' (newest complete checkpoint in save_dir) or a checkpoint directory."""
    overwrite: bool = False
    """Start afresh (resume 'none') in a save_dir that holds another run's checkpoints or metrics: they
    are moved to ``<save_dir>/replaced/<n>/``, never deleted. Without it such a save_dir is refused."""
    keep_last: int = 0
    """Keep only this many newest checkpoints (0: keep all); the newest complete one is never deleted."""
    max_bad_steps: int = 5
    """Stop (after saving the last good state) after this many consecutive non-finite steps."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation checkpointing."""
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    """Communication overlapped with compute."""
    optimizer_states: str = "fp32"
    """Dtype of the master weights and Adam moments in bf16 training: 'fp32' (12 bytes per parameter)
    or 'bf16' (6: DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states, ZeRO 1-3,
    gradients accumulated in bf16). The planner's 'bf16-moments' (fp32 master, bf16 moments) is not
    something DeepSpeed runs."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device for MFU (default: the detected GPU's dense bf16 peak; on CPU a
    matmul measured at start-up)."""
    run_name: str | None = None
    """W&B run name (default: the save_dir's name)."""
    wandb_mode: str = "offline"
    """W&B mode when enabled: 'offline' (default, no network), 'online' or 'disabled'.
    The WANDB_MODE environment variable wins when set."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    compile: bool = False
    """torch.compile each transformer block (fuses elementwise work on GPUs; first steps are slower)."""
    fp8: Fp8Config | None = None
    """FP8 GEMMs in the blocks' linears, e.g. {"recipe": "rowwise"} (needs bf16; None: off)."""
    objective: str = "lm"
    """'lm' (next-token cross entropy) or 'dpo' (preference pairs: ``dpo``)."""
    dpo: DpoConfig | None = None
    """DPO's settings (objective 'dpo'; None: the defaults)."""
    muon: MuonConfig | None = None
    """Muon's mt3d settings (``"optimizer": {"type": "Muon"}``; None: the defaults)."""


@dataclass
class LoraConfig:
    """LoRA fine-tuning (``mt3d.model.lora``): adapters on a frozen base, with PEFT's meanings. The
    optimizer, its states and the gradients cover the adapters only; checkpoints hold the adapters and
    their optimizer states, the base referenced by its path and fingerprint."""

    r: int | None = None
    """Adapter rank (default 8; from the adapter with ``from_adapter``)."""
    alpha: float | None = None
    """Scale numerator: the update is alpha / r * B A x (default: r, PEFT's lora_alpha 8 at r 8)."""
    dropout: float | None = None
    """Dropout on the adapter's input (default 0)."""
    target_modules: list[str] | str | None = None
    """HF module names (``q_proj``, ``v_proj``, ``gate_proj``, GPT-2's ``c_attn``, ...; a name matches a
    module whose full name ends with it), a regular expression over full names, or "all-linear"
    (every linear of the blocks). Required unless ``from_adapter`` gives them."""
    rslora: bool | None = None
    """Rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r (default false)."""
    from_adapter: str | None = None
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from; its r,
    alpha, targets and rslora apply (keys set here must agree)."""


@dataclass
class Mt3dConfig:
    """The "mt3d" section of the run config."""

    model: dict = field(default_factory=lambda: {"preset": "tiny"})
    """A preset name, {"preset": name, <overrides>}, {"from_hf": dir}, or explicit dimensions."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data source."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    lora: LoraConfig | None = None
    """LoRA fine-tuning of the model's linears, e.g. {"r": 16, "target_modules": "all-linear"}
    (None: every parameter trains)."""


@dataclass
class RunConfig:
    """A whole run: DeepSpeed's dict (without "mt3d") and mt3d's typed section.

    Subsystems receive the part they need (``run.mt3d.parallel``, ``.train``, ``.data``, the model
    section resolved to a ModelConfig, or ``run.deepspeed``: a read-only view of DeepSpeed's keys),
    not the whole run; only the session that composes them holds a RunConfig.
    """

    ds: dict
    mt3d: Mt3dConfig
    path: str | None = None

    def to_dict(self) -> dict:
        """The full JSON-able config (DeepSpeed keys + mt3d section)."""
        return {**self.ds, "mt3d": to_plain(self.mt3d)}

    @property
    def deepspeed(self) -> DeepSpeedSection:
        """DeepSpeed's section, read through its typed view (the one home of raw DeepSpeed keys)."""
        return DeepSpeedSection(self.ds)

    @property
    def precision(self) -> str:
        """bf16, fp16 or fp32, from DeepSpeed's ``bf16``/``fp16`` sections."""
        return self.deepspeed.precision


def to_plain(obj: Any) -> Any:
    """Dataclasses (nested) as plain dicts and lists."""
    if is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    return obj


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _optional_dataclass(tp: Any) -> type | None:
    """The dataclass of an ``X | None`` field (None for any other type)."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and is_dataclass(args[0]) else None


def build(cls: type, raw: Any, where: str) -> Any:
    """Instantiate dataclass ``cls`` from a dict, checking keys and types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f" (valid: {', '.join(names)})"
            raise ConfigError(f"unknown key '{where}.{key}'{hint}")
        tp = hints[key]
        inner = _optional_dataclass(tp)
        if is_dataclass(tp) or (inner is not None and value is not None):
            kwargs[key] = build(inner or tp, value, f"{where}.{key}")
            continue
        if not _type_ok(value, tp):
            raise ConfigError(
                f"'{where}.{key}' must be {_type_name(tp)}, got {json.dumps(value)} ({type(value).__name__})"
            )
        kwargs[key] = float(value) if tp is float else value
    return cls(**kwargs)


def from_dict(raw: dict, path: str | None = None) -> RunConfig:
    """Split a full config dict into DeepSpeed's part and the typed mt3d section."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    ds = {k: v for k, v in raw.items() if k != "mt3d"}
    section = raw.get("mt3d", {})
    if isinstance(section, dict) and isinstance(section.get("model"), str):
        section = {**section, "model": {"preset": section["model"]}}
    return RunConfig(ds=ds, mt3d=build(Mt3dConfig, section, "mt3d"), path=path)
