"""The ``model.mla`` option (multi-head latent attention, DeepSeek-V2/V3), parsed and checked: a leaf the
model config reads without importing the layer that builds it (``mt3d.model.mla``)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import ModelConfigError, option_fields


@dataclass(frozen=True)
class LatentSpec:
    """Sizes of multi-head latent attention (transformers' DeepseekV3Config names)."""

    kv_lora_rank: int
    """Width of the compressed key/value latent (512 in DeepSeek-V3)."""
    qk_rope_head_dim: int
    """Per-head width of the rotary part of queries and keys; the rotary key is shared by all heads."""
    qk_nope_head_dim: int
    """Per-head width of the position-free part of queries and keys."""
    v_head_dim: int
    """Per-head width of the values."""
    q_lora_rank: int | None = None
    """Width of the compressed query latent (with its own norm); None: queries straight from hidden."""
    rope_interleave: bool = False
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... of the rotary part (DeepSeek's layout)."""

    @classmethod
    def parse(cls, d) -> LatentSpec:
        """From the ``model.mla`` dict; one-line errors naming the key."""
        if isinstance(d, LatentSpec):
            return d
        required = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        spec = cls(**option_fields(cls, d, "mla", required))
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank"):
            v = getattr(spec, key)
            if (v is not None or key != "q_lora_rank") and (
                isinstance(v, bool) or not isinstance(v, int) or v <= 0
            ):
                raise ModelConfigError(f"model.mla.{key} must be a positive integer, got {v!r}")
        if spec.qk_rope_head_dim % 2:
            raise ModelConfigError(f"model.mla.qk_rope_head_dim must be even, got {spec.qk_rope_head_dim}")
        if not isinstance(spec.rope_interleave, bool):
            raise ModelConfigError(
                f"model.mla.rope_interleave must be true or false, got {spec.rope_interleave!r}"
            )
        return spec

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of queries and keys."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int, bias: bool) -> int:
        """Parameters of one latent attention layer, its norms and biases included (output bias apart)."""
        q = hidden * heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            r = self.q_lora_rank
            q = hidden * r + bias * r + r + r * heads * self.qk_head_dim
        kv_a = (hidden + bias) * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + heads * self.v_head_dim * hidden

    def matmul_params(self, hidden: int, heads: int) -> int:
        """Weights one token multiplies through in one layer (no norms or biases): its FLOPs / 2."""
        q = hidden * heads * self.qk_head_dim
        if self.q_lora_rank is not None:
            q = self.q_lora_rank * (hidden + heads * self.qk_head_dim)
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden

    def widths(self, hidden: int, heads: int, tp: int = 1) -> tuple[float, float]:
        """(input, output) widths per token of one TP rank's projections as GEMMs over the hidden size
        (``ModelConfig.attn_widths``): the down and up projections folded into an input width of the same
        FLOPs (the down projections replicated on every rank), the values out."""
        q = hidden * heads * self.qk_head_dim / tp
        if self.q_lora_rank is not None:
            q = self.q_lora_rank * (hidden + heads * self.qk_head_dim / tp)
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim) / tp
        return (q + kv) / hidden, heads * self.v_head_dim / tp

    def activation_width(self, heads: int, tp: int = 1) -> float:
        """Per token, what one TP rank keeps for the backward: q, k and the padded v at the qk head width,
        the output, and the latents (replicated)."""
        latents = (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim
        return heads * (3 * self.qk_head_dim + self.v_head_dim) / tp + latents
