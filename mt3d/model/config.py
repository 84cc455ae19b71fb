"""ModelConfig: the architecture of one decoder-only transformer (GPT-2 or Llama family).

One implementation covers both families; the fields below choose positions, norm, MLP, biases and
embedding tying. Counting helpers (parameters, FLOPs) live here so the planner, the metrics and
the presets agree on them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..errors import UserError


class ModelConfigError(UserError):
    """An architecture that cannot be built (or cannot be split as asked)."""


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
    """MLP inner size (None: 4h for GELU, the Llama rule 2/3*4h rounded to 256 for SwiGLU)."""
    head_dim: int | None = None
    """Per-head size (None: hidden / heads)."""
    max_seq_len: int = 2048
    """Longest sequence (size of the learned position table; RoPE has no table)."""
    position: str = "learned"
    """'learned' (GPT-2) or 'rope' (Llama)."""
    norm: str = "layernorm"
    """'layernorm' or 'rmsnorm'."""
    mlp: str = "gelu"
    """'gelu' (2-layer MLP, tanh-approximate GELU as GPT-2) or 'swiglu' (Llama gate/up/down)."""
    bias: bool = True
    """Biases on the attention and MLP linears."""
    tie_embeddings: bool = True
    """Share the input embedding with the output (LM head) weight."""
    norm_eps: float = 1e-5
    """Epsilon of the norms."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = None
    """HF-style RoPE scaling dict ('linear', 'dynamic', 'llama3' types), or None."""
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
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ModelConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
            self.head_dim = self.hidden // self.heads
        if self.ffn is None:
            if self.mlp == "swiglu":
                self.ffn = 256 * -(-int(2 * 4 * self.hidden / 3) // 256)
            else:
                self.ffn = 4 * self.hidden
        self.check()

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
            "mlp": ("gelu", "swiglu"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ModelConfigError(f"model.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        self._check_positive("hidden", "layers", "heads", "kv_heads", "ffn", "head_dim", "max_seq_len")
        if self.heads % self.kv_heads:
            raise ModelConfigError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ModelConfigError(f"RoPE needs an even head_dim, got {self.head_dim}")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ModelConfigError(f"model.{key} must be in [0, 1), got {getattr(self, key)}")

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

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        h, b = self.hidden, int(self.bias)
        attn = h * (self.q_size + 2 * self.kv_size) + b * (self.q_size + 2 * self.kv_size)
        attn += self.q_size * h + b * h
        if self.mlp == "swiglu":
            mlp = 3 * h * self.ffn + b * (2 * self.ffn + h)
        else:
            mlp = 2 * h * self.ffn + b * (self.ffn + h)
        norms = 2 * h * (2 if self.norm == "layernorm" else 1)
        return attn + mlp + norms

    def embedding_params(self, vocab: int | None = None) -> int:
        """Token (and learned position) embedding parameters."""
        v = vocab or self.vocab_size or 0
        return v * self.hidden + (self.max_seq_len * self.hidden if self.position == "learned" else 0)

    def num_params(self, vocab: int | None = None) -> int:
        """Total parameters (an untied head counted once more)."""
        v = vocab or self.vocab_size or 0
        final_norm = self.hidden * (2 if self.norm == "layernorm" else 1)
        head = 0 if self.tie_embeddings else v * self.hidden
        return self.embedding_params(v) + self.layers * self.block_params() + final_norm + head

    def flops_per_token(self, seq_len: int, vocab: int | None = None) -> float:
        """Training FLOPs per token without recompute (Narayanan et al. 2021, FORMULAS.md).

        72 * s * l * h^2 * (1 + s/(6h) + V/(12 l h)) per sequence for GPT-style blocks, with
        the dense terms taken from the actual attention/MLP shapes (GQA, SwiGLU) so that the
        GPT-2 case reduces exactly to the closed form.
        """
        v = vocab or self.vocab_size or 0
        h, s = self.hidden, seq_len
        # forward matmul FLOPs per token per layer: 2 * (weights) + attention scores/values 4*s*q
        dense = 2 * (h * (self.q_size + 2 * self.kv_size) + self.q_size * h)
        dense += 2 * (3 if self.mlp == "swiglu" else 2) * h * self.ffn
        attn = 2 * 2 * s * self.q_size
        logits = 2 * h * v
        return 3.0 * (self.layers * (dense + attn) + logits)

    def to_dict(self) -> dict:
        """Plain dict (JSON-serialisable) of every field."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Build from a dict; unknown keys are errors naming the valid ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ModelConfigError(f"unknown model keys {unknown}; valid keys: {sorted(names)}")
        return cls(**d)
