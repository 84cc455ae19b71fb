"""ModelConfig: the architecture of one decoder-only transformer.

One block implementation covers every family (GPT-2, Llama, Mistral, Qwen2, Qwen3, Gemma 2); the
fields below are its options: positions, norm, MLP, biases, q/k norms, soft-capping, local
attention, embedding tying. Which options a family uses, and how its HF config maps onto them, is
the family's module (``mt3d.model.families``). Counting helpers (parameters, FLOPs) live here so the
planner, the metrics and the presets agree on them.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import asdict, dataclass, field, fields

from .options import BLOCK_OPTIONS, GATED_MLPS, ModelConfigError  # noqa: F401 - re-exported

PARSED = {
    "mla": (".mla_spec", "LatentSpec"),
    "moe": (".moe_spec", "MoESpec"),
    "linear_attention": (".gdn", "GdnSpec"),
    "mtp": (".mtp_spec", "MtpSpec"),
}
"""The options ``ModelConfig`` parses into specs (``mla_spec``, ``moe_spec``, ``gdn_spec``, ``mtp_spec``):
(module, class with a ``parse``), imported when first parsed."""


@dataclass
class ModelConfig:
    """Decoder-only transformer architecture."""

    hidden: int
    """Model width h."""
    layers: int
    """Number of transformer blocks l."""
    heads: int
    """Attention (query) heads a."""
    vocab_size: int | None = None
    """Real vocabulary size V (None: taken from the tokenizer / data at build time)."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention (None: same as heads, i.e. multi-head)."""
    ffn: int | None = None
    """MLP inner size (None: 4h for GELU, the Llama rule 2/3*4h rounded to 256 for gated MLPs)."""
    head_dim: int | None = None
    """Per-head size (None: hidden / heads); may differ from it (Gemma 2, Qwen3: heads * head_dim != h)."""
    max_seq_len: int = 2048
    """Longest sequence (size of the learned position table; RoPE has no table)."""
    family: str | None = None
    """Model family (``mt3d.model.families``: gpt2, llama, mistral, qwen2, qwen3, gemma2): the HF
    architecture it loads from and exports to. None: the first family whose block options this
    config matches (how configs saved before this field existed are read), else 'custom'."""
    position: str = "learned"
    """'learned' (GPT-2) or 'rope' (the others)."""
    norm: str = "layernorm"
    """'layernorm' or 'rmsnorm'."""
    norm_unit_offset: bool = False
    """RMSNorm scales by (1 + weight), weights starting at 0 (Gemma)."""
    mlp: str = "gelu"
    """'gelu' (2-layer MLP, tanh-approximate GELU as GPT-2), 'swiglu' (Llama gate/up/down with SiLU)
    or 'geglu' (the same gated MLP with a tanh-approximate GELU gate: Gemma)."""
    bias: bool = True
    """Biases on the attention output and MLP linears (and q/k/v unless ``qkv_bias`` says otherwise)."""
    qkv_bias: bool | None = None
    """Biases on the query/key/value projection (None: same as ``bias``; Qwen2 has only these)."""
    mlp_bias: bool | None = None
    """Biases on the MLP linears (None: same as ``bias``)."""
    qk_norm: bool | str = False
    """q/k RMSNorms before RoPE: true: over each query and key head (head_dim wide, one weight shared by
    all heads: Qwen3); "all": over all query heads at once and all key heads at once (one weight per
    dimension of q_size and kv_size: MiniMax-M2; under TP the ranks' sums of squares are added)."""
    rotary_fraction: float = 1.0
    """Share of each query and key head RoPE rotates: its first head_dim x this dims (in rotate-half
    pairs), the rest passing through (HF's partial_rotary_factor; GLM-4.5: 0.5)."""
    post_norms: bool = False
    """Norms on the attention and MLP outputs before they join the residual stream (Gemma 2)."""
    scale_embedding: bool = False
    """Multiply the token embeddings by sqrt(hidden) (Gemma)."""
    attn_softcap: float | None = None
    """Soft-cap attention scores: cap * tanh(scores / cap) (Gemma 2: 50). None: off."""
    logit_softcap: float | None = None
    """Soft-cap the output logits the same way (Gemma 2: 30). None: off."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by this ** -0.5 (Gemma 2). None: head_dim."""
    attn_sinks: bool = False
    """A learned sink logit per query head that joins every query's softmax once (gpt-oss)."""
    attention: dict | None = None
    """Local attention (``mt3d.model.attention``): {"window": W} makes every layer attend to its W
    most recent keys (itself included); add "layer_types" (HF's per-layer 'sliding_attention' /
    'full_attention') or "global_every": k to keep some layers global. None: all layers global."""
    tie_embeddings: bool = True
    """Share the input embedding with the output (LM head) weight."""
    mla: dict | None = None
    """Multi-head latent attention (``mt3d.model.mla_spec.LatentSpec``, DeepSeek-V2/V3): {"kv_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"} plus optional "q_lora_rank" and
    "rope_interleave"; head_dim is then qk_nope_head_dim + qk_rope_head_dim. None: standard attention."""
    linear_attention: dict | None = None
    """Gated DeltaNet layers in place of attention (``mt3d.model.gdn.GdnSpec``; Qwen3-Next / Qwen3.5):
    {"key_heads", "value_heads", "key_head_dim", "value_head_dim"} plus "conv_kernel" (4) and which
    blocks keep full attention: "full_every": k (every k-th) or "layer_types" (HF's per-block
    'linear_attention' / 'full_attention'); neither: every block. None: attention everywhere."""
    attn_output_gate: bool = False
    """A sigmoid gate on each attention output channel, computed with the query (Qwen3-Next: q_proj holds
    each head's query, then its gate)."""
    moe: dict | None = None
    """Mixture-of-experts MLPs (``mt3d.model.moe.MoESpec``): {"experts": E, "top_k": k, "expert_ffn": f}
    plus optional "norm_topk_prob", "shared_ffn", "sparse_step", "dense_layers", "aux_loss_coef",
    "z_loss_coef", "capacity_factor". None: every MLP dense."""
    mtp: dict | None = None
    """Multi-token prediction (``mt3d.model.mtp_spec``): {"layers": D, "loss_weight": w}. None: off."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = None
    """HF-style RoPE scaling dict ('linear', 'dynamic', 'llama3' types), or None."""
    rope_local: dict | None = None
    """The local (sliding-window) layers' own RoPE where it differs from the global layers' (Gemma 3):
    {"rope_theta": base} plus an HF scaling dict's keys ("rope_type", "factor", ...); None: every layer
    uses rope_theta and rope_scaling."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches and the embedding output."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Std of the normal init; output projections use init_std / sqrt(2 * layers)."""
    name: str = "custom"
    """Preset or source name (informational)."""
    extra: dict = field(default_factory=dict)
    """Free-form metadata kept with the model (e.g. the HF architecture it came from)."""

    def __post_init__(self) -> None:
        self._check_positive("hidden", "heads")  # used below, before check() sees the rest
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.head_dim is None and self.mla is not None:
            self.head_dim = self.mla_spec.qk_head_dim
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ModelConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
            self.head_dim = self.hidden // self.heads
        if self.ffn is None:
            if self.mlp in GATED_MLPS:
                self.ffn = 256 * -(-int(2 * 4 * self.hidden / 3) // 256)
            else:
                self.ffn = 4 * self.hidden
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.mlp_bias is None:
            self.mlp_bias = self.bias
        self.check()
        if self.family is None:
            from .families import infer_family

            self.family = infer_family(self)

    def _check_positive(self, *keys: str) -> None:
        for key in keys:
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ModelConfigError(f"model.{key} must be a positive integer, got {v!r}")

    def check(self) -> None:
        """Validate values that do not depend on the parallel layout."""
        choices = {
            "position": ("learned", "rope"),
            "norm": ("layernorm", "rmsnorm"),
            "mlp": ("gelu", *GATED_MLPS),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ModelConfigError(f"model.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        self._check_positive("hidden", "layers", "heads", "kv_heads", "ffn", "head_dim", "max_seq_len")
        if self.heads % self.kv_heads:
            raise ModelConfigError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ModelConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        f = self.rotary_fraction
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
            raise ModelConfigError(f"model.rotary_fraction must be a number in (0, 1], got {f!r}")
        if f != 1 and (self.position != "rope" or self.mla is not None):
            raise ModelConfigError("model.rotary_fraction below 1 needs position 'rope' and standard "
                                   "attention")  # fmt: skip
        d = self.head_dim * f
        if f != 1 and (d != int(d) or int(d) % 2 or d < 2):
            raise ModelConfigError(f"model.rotary_fraction {f} of head_dim {self.head_dim} must give an even "
                                   "number of rotated dims")  # fmt: skip
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ModelConfigError(f"model.{key} must be in [0, 1), got {getattr(self, key)}")
        for key in ("attn_softcap", "logit_softcap", "query_pre_attn_scalar"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
                raise ModelConfigError(f"model.{key} must be a positive number or null, got {v!r}")
        if self.attn_sinks and self.attn_softcap is not None:
            raise ModelConfigError("model.attn_sinks with attn_softcap is not supported (no family has both)")
        if self.norm_unit_offset and self.norm != "rmsnorm":
            raise ModelConfigError("model.norm_unit_offset needs norm 'rmsnorm'")
        if not (isinstance(self.qk_norm, bool) or self.qk_norm == "all"):
            raise ModelConfigError(f"model.qk_norm must be true, false or 'all', got {self.qk_norm!r}")
        if self.qk_norm and self.norm != "rmsnorm":
            raise ModelConfigError("model.qk_norm needs norm 'rmsnorm' (the q/k norms are RMSNorms)")
        for p in self.patterns:  # raises on a bad attention spec
            if p is not None and p.dilation > 1 and p.window * p.dilation > self.max_seq_len:
                raise ModelConfigError(
                    f"model.attention: dilation {p.dilation} x window {p.window} exceeds max_seq_len "
                    f"{self.max_seq_len} (a dilated window must fit in the sequence)"
                )
        if self.moe is not None:
            self.moe_spec.check_layers(self.layers)
        if self.linear_attention is not None:
            self.gdn_spec.check_layers(self.layers)
            if self.mla is not None:
                raise ModelConfigError("model.linear_attention does not combine with model.mla")
        if self.mla is not None:
            spec = self.mla_spec
            if self.head_dim != spec.qk_head_dim:
                raise ModelConfigError(
                    f"model.head_dim {self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                    f"{spec.qk_head_dim} with model.mla"
                )
            if self.kv_heads != self.heads or self.position != "rope" or self.norm != "rmsnorm":
                raise ModelConfigError("model.mla needs kv_heads = heads, position 'rope' and norm 'rmsnorm'")
            if self.attention is not None or self.attn_sinks or self.attn_softcap is not None or self.qk_norm:
                raise ModelConfigError(
                    "model.mla does not combine with local attention, sinks, soft-capping or q/k norms"
                )
        if self.family is not None:
            from .families import get_family

            get_family(self.family).check(self)

    @property
    def mla_spec(self):
        """The parsed ``mla`` option (``LatentSpec``), or None for standard attention."""
        return self._parsed("mla")

    def _parsed(self, option: str):
        """Option ``option`` parsed by its class in ``PARSED`` (None when unset), once per value of it:
        the counting helpers ask for it per block, RoPE per table, and the planner for every layout."""
        value = getattr(self, option)
        if value is None:
            return None
        cached = self.__dict__.get(f"_{option}_spec")
        # kept with a copy of the value it was parsed from: a value changed in place parses again
        if cached is None or cached[0] != value:
            module, name = PARSED[option]
            parse = getattr(importlib.import_module(module, __package__), name).parse
            cached = self.__dict__[f"_{option}_spec"] = (copy.deepcopy(value), parse(value))
        return cached[1]

    @property
    def rotary_dim(self) -> int:
        """Per-head width RoPE rotates: head_dim, or latent attention's qk_rope_head_dim."""
        if self.mla is not None:
            return self.mla_spec.qk_rope_head_dim
        return round(self.head_dim * self.rotary_fraction)

    @property
    def moe_spec(self):
        """The parsed ``moe`` option (``MoESpec``), or None for a dense model."""
        return self._parsed("moe")

    @property
    def gdn_spec(self):
        """The parsed ``linear_attention`` option (``GdnSpec``), or None."""
        return self._parsed("linear_attention")

    @property
    def mtp_spec(self):
        """The parsed ``mtp`` option (``mt3d.model.mtp_spec.MtpSpec``), or None."""
        return self._parsed("mtp")

    def is_linear(self, layer: int) -> bool:
        """Whether block ``layer`` is a Gated DeltaNet layer (``linear_attention``; MTP's are not)."""
        spec = self.gdn_spec
        return spec is not None and layer < self.layers and spec.linear(layer)

    @property
    def linear_blocks(self) -> int:
        """How many blocks are Gated DeltaNet layers."""
        spec = self.gdn_spec
        return 0 if spec is None else sum(map(spec.linear, range(self.layers)))

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture-of-experts MLP."""
        spec = self.moe_spec
        return spec is not None and spec.sparse(layer)

    @property
    def sparse_layers(self) -> int:
        """How many blocks have a mixture-of-experts MLP."""
        spec = self.moe_spec
        return 0 if spec is None else sum(spec.sparse_blocks(self.layers))

    @property
    def patterns(self) -> list:
        """Per layer: its ``LocalPattern`` (local attention) or None (global causal)."""
        from .attention import AttentionConfigError, layer_patterns

        try:
            return layer_patterns(self.attention, self.layers)
        except AttentionConfigError as e:
            raise ModelConfigError(str(e)) from None

    @property
    def position_limit(self) -> int | None:
        """Longest sequence the positions allow (the learned table's size; RoPE: no limit)."""
        return self.max_seq_len if self.position == "learned" else None

    def check_parallel(self, tp: int, pp: int) -> None:
        """Raise if the model cannot be split over ``tp`` tensor ranks and ``pp`` stages."""
        if self.heads % tp:
            raise ModelConfigError(f"attention heads ({self.heads}) are not divisible by tp={tp}")
        if self.kv_heads % tp:
            raise ModelConfigError(
                f"kv_heads ({self.kv_heads}) are not divisible by tp={tp}; use tp dividing {self.kv_heads}"
            )
        if self.ffn % tp:
            raise ModelConfigError(f"ffn size ({self.ffn}) is not divisible by tp={tp}")
        if self.gdn_spec is not None:
            self.gdn_spec.check(tp)
        spec = self.moe_spec
        for key in ("expert_ffn", "shared_ffn"):
            if spec is not None and getattr(spec, key) % tp:
                raise ModelConfigError(f"model.moe.{key} ({getattr(spec, key)}) is not divisible by tp={tp}")
        if self.layers < pp:
            raise ModelConfigError(
                f"{self.layers} layers cannot fill {pp} pipeline stages; use pp <= {self.layers}"
            )

    # --- counting ------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of all query heads."""
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads."""
        return self.kv_heads * self.head_dim

    def mlp_params(self, ffn: int | None = None, bias: bool | None = None) -> int:
        """Parameters of one dense MLP of inner size ``ffn`` (default: the model's), with biases when
        ``bias`` (default: ``mlp_bias``)."""
        ffn = self.ffn if ffn is None else ffn
        bias = self.mlp_bias if bias is None else bias
        inner = ffn * (2 if self.mlp in GATED_MLPS else 1)
        return self.hidden * inner + ffn * self.hidden + bias * (inner + self.hidden)

    def block_params(self, layer: int | None = None, active: bool = False, ep: int = 1) -> int:
        """Parameters of transformer block ``layer`` (None: an average block of the model); ``active``:
        only those one token uses (its top-k experts, the shared expert and the router); ``ep``: those
        one of ep expert-parallel ranks holds (experts / ep of the routed experts)."""
        if layer is None:  # sparse blocks are alike, and so are dense ones: one of each, counted
            spec = self.moe_spec
            sparse = list(spec.sparse_blocks(self.layers)) if spec is not None else [False] * self.layers
            n = sum(sparse)
            total = n * self.block_params(sparse.index(True), active, ep) if n else 0
            if n < self.layers:
                total += (self.layers - n) * self.block_params(sparse.index(False), active, ep)
            return round(total / self.layers)
        h = self.hidden
        qkv = self.q_size * (1 + self.attn_output_gate) + 2 * self.kv_size
        attn = h * qkv + self.qkv_bias * qkv + self.q_size * h + self.bias * h + self.attn_sinks * self.heads
        if self.mla is not None:
            attn = self.mla_spec.params(h, self.heads, self.qkv_bias) + self.bias * h
        if self.is_linear(layer):
            attn = self.gdn_spec.params(h)
        spec = self.moe_spec
        if spec is not None and spec.sparse(layer):
            used = spec.top_k if active else spec.experts // ep
            router = spec.experts * (h + spec.router_bias + spec.correction_bias)
            mlp = used * self.mlp_params(spec.expert_ffn, spec.expert_bias) + router
            if spec.shared_ffn:
                mlp += self.mlp_params(spec.shared_ffn) + h * spec.shared_gate
        else:
            mlp = self.mlp_params()
        per_norm = h * (2 if self.norm == "layernorm" else 1)
        qk_norms = 0 if self.is_linear(layer) else self.qk_norm_params
        norms = per_norm * (4 if self.post_norms else 2) + qk_norms
        return attn + mlp + norms

    @property
    def qk_norm_params(self) -> int:
        """Weights of one block's q and k norms (``qk_norm``)."""
        if self.qk_norm == "all":
            return self.q_size + self.kv_size
        return 2 * self.head_dim if self.qk_norm else 0

    def attn_widths(self, tp: int = 1) -> tuple[float, float]:
        """(input, output) widths of one TP rank's attention projections per token, as the planner's
        GEMMs over the hidden size see them: QKV's (q + 2 kv) / tp (and the output gate's q) and the
        output's q / tp; latent attention's ``LatentSpec.widths``; Gated DeltaNet blocks' averaged in."""
        from .gdn import per_kind

        full = (self.q_size * (1 + self.attn_output_gate) + 2 * self.kv_size) / tp, self.q_size / tp
        if self.mla is not None:
            full = self.mla_spec.widths(self.hidden, self.heads, tp)
        return per_kind(self, full, lambda spec: spec.widths(tp))

    def attn_activation_width(self, tp: int = 1) -> float:
        """Per token, the attention activations one TP rank keeps for the backward: q, k, v and the
        core's output (latent attention's ``LatentSpec.activation_width``); Gated DeltaNet blocks'
        (``GdnSpec.activation_width``) averaged in."""
        from .gdn import per_kind

        full = (2 * self.q_size + 2 * self.kv_size) / tp
        if self.mla is not None:
            full = self.mla_spec.activation_width(self.heads, tp)
        return per_kind(self, full, lambda spec: spec.activation_width(tp))

    def mlp_token_width(self) -> float:
        """Inner MLP width one token passes through, averaged over blocks: ffn for a dense block,
        top_k x expert_ffn + shared_ffn for a sparse one (what its GEMMs and activations scale with)."""
        spec = self.moe_spec
        if spec is None:
            return float(self.ffn)
        sparse = spec.top_k * spec.expert_ffn + spec.shared_ffn
        n = self.sparse_layers
        return (n * sparse + (self.layers - n) * self.ffn) / self.layers

    def embedding_params(self, vocab: int | None = None) -> int:
        """Token (and learned position) embedding parameters."""
        v = vocab or self.vocab_size or 0
        return v * self.hidden + (self.max_seq_len * self.hidden if self.position == "learned" else 0)

    def num_params(self, vocab: int | None = None) -> int:
        """Total parameters (an untied head counted once more)."""
        v = vocab or self.vocab_size or 0
        final_norm = self.hidden * (2 if self.norm == "layernorm" else 1)
        head = 0 if self.tie_embeddings else v * self.hidden
        blocks = sum(self.block_params(i) for i in range(self.layers))
        mtp = self.mtp_spec.params(self) if self.mtp else 0  # model.mtp's depths
        return self.embedding_params(v) + blocks + final_norm + head + mtp

    def active_params(self, vocab: int | None = None) -> int:
        """Parameters one token uses (dense models: all of them; MoE: top-k experts plus shared)."""
        blocks = sum(self.block_params(i, active=True) for i in range(self.layers))
        return self.num_params(vocab) - sum(self.block_params(i) for i in range(self.layers)) + blocks

    def attended_keys(self, seq_len: int) -> float:
        """Keys per query averaged over layers, as counted for FLOPs: ``seq_len`` for a global layer
        (the Narayanan et al. convention), the window for a local one (the work it really does)."""
        from .attention import keys_per_query

        return sum(keys_per_query(p, seq_len) for p in self.patterns) / self.layers

    def flops_per_token(self, seq_len: int, vocab: int | None = None, attended: float | None = None,
                        adapters: int | None = None) -> float:  # fmt: skip
        """Training FLOPs per token without recompute (Narayanan et al. 2021, FORMULAS.md; ``counts``)."""
        from .counts import flops_per_token

        return flops_per_token(self, seq_len, vocab, attended, adapters)

    def to_dict(self) -> dict:
        """Plain dict (JSON-serialisable) of every field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a dict; unknown keys are errors naming the valid ones.

        With a ``family``, its block options are the defaults of the keys not given.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ModelConfigError(f"unknown model keys {unknown}; valid keys: {sorted(names)}")
        if d.get("family") is not None:  # the family's block options, unless given
            from .families import get_family

            d = {**get_family(d["family"]).defaults, **d}
        return cls(**d)
