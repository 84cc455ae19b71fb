"""Llama (``LlamaForCausalLM``): RoPE, RMSNorm, SwiGLU, grouped-query attention, optional biases.

``LlamaLike`` is the shared base of the families that follow Llama's tensor names
(``model.layers.{i}.self_attn.q_proj`` ...): Mistral, Qwen2, Qwen3 and Gemma 2 change only the
options they fix, a few config keys and (Gemma 2) some norm names.
"""

from __future__ import annotations

from typing import ClassVar

from .base import (
    Family,
    HFError,
    Piece,
    attention_to_hf,
    common_kwargs,
    get,
    register,
    rope_from_hf,
    rope_to_hf,
    rotary_fraction_from_hf,
)
from .keys import COMMON, LLAMA_LIKE, read

LLAMA_BLOCK = {
    "norm1": ("input_layernorm",),
    "norm2": ("post_attention_layernorm",),
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.out": ("self_attn.o_proj",),
    "attn.q_norm": ("self_attn.q_norm",),
    "attn.k_norm": ("self_attn.k_norm",),
    "mlp.up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}


class LlamaLike(Family):
    """Families with Llama's tensor names and config keys; subclasses add their own options."""

    activation: ClassVar[tuple[str, str]] = ("hidden_act", "silu")
    """The config key naming the MLP activation and the value mt3d implements."""
    block_modules: ClassVar[dict[str, tuple[str, ...]]] = LLAMA_BLOCK
    """mt3d module inside a block -> the HF modules (under model.layers.{i}.) that make it up."""
    partial_rotary: ClassVar[bool] = False
    """Whether the family reads ``partial_rotary_factor`` (``ModelConfig.rotary_fraction``); else it
    is refused as RoPE over part of each head."""

    def config_kwargs(self, hf, where):
        """Sizes, RoPE and the family's options (``options_from_hf``)."""
        self.check_hf_keys(hf, where)
        key, want = self.activation
        if get(hf, key, want) != want:
            raise HFError(f"{where}: {key} {hf[key]!r} is not supported ({want})")
        kw = common_kwargs(hf, where, self.hf_defaults)
        kw["rope_theta"], kw["rope_scaling"] = rope_from_hf(hf, where, partial=self.partial_rotary)
        if self.partial_rotary:
            kw["rotary_fraction"] = rotary_fraction_from_hf(hf, where)
        kw.update(self.options_from_hf(hf, where, kw["layers"]))
        return kw

    def options_from_hf(self, hf: dict, where: str, layers: int) -> dict:
        """The block options this family's config keys set."""
        return {}

    def options_to_hf(self, cfg) -> dict:
        """The config keys describing this family's options."""
        return {}

    def hf_config(self, cfg, vocab):
        """Llama-style config keys plus the family's own."""
        return dict(
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.ffn,
            max_position_embeddings=cfg.max_seq_len,
            vocab_size=vocab,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            attention_dropout=cfg.attention_dropout,
            **{self.activation[0]: self.activation[1]},
            **rope_to_hf(cfg),
            **self.options_to_hf(cfg),
        )

    def pieces(self, cfg, role, block, local):
        """model.* names; fused mt3d tensors are their HF parts concatenated in table order."""
        module, _, leaf = local.rpartition(".")
        if role == "embed":
            return [Piece("model.embed_tokens.weight")]
        if role == "final_norm":
            return [Piece(f"model.norm.{leaf}")]
        if role == "head":
            return [Piece("lm_head.weight")]
        if role != "block" or module not in self.block_modules:
            raise HFError(f"{self.architecture} has no tensor for mt3d parameter {local!r} ({role})")
        return [Piece(f"model.layers.{block}.{m}.{leaf}") for m in self.block_modules[module]]


def window_of(cfg) -> int | None:
    """The one sliding window of ``cfg`` (None: no local layers)."""
    return attention_to_hf(cfg)[0]


def mixed_windows(cfg) -> str | None:
    """Why ``cfg`` does not fit a format whose ``sliding_window`` applies to every layer (None: it
    does, every layer local or none)."""
    if any(p is None for p in cfg.patterns) and any(p is not None for p in cfg.patterns):
        return "sliding_window applies to every layer; mixed local/global layers need another family"
    return None


@register
class Llama(LlamaLike):
    """Llama 1-3: attention_bias covers q/k/v and the output (so qkv_bias == bias), mlp_bias the MLP."""

    name = "llama"
    architecture = "LlamaForCausalLM"
    model_types = ("llama",)
    infer_rank = 1
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, norm_eps=1e-6
    )
    variable = frozenset({"bias", "mlp_bias", "tie_embeddings"})
    hf_defaults = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    transformers_module = "llama"
    hf_keys = {**COMMON, **LLAMA_LIKE, "attention_bias": read("bool"), "mlp_bias": read("bool")}

    def options_from_hf(self, hf, where, layers):
        """attention_bias, mlp_bias."""
        bias = bool(get(hf, "attention_bias", False))
        return dict(bias=bias, qkv_bias=bias, mlp_bias=bool(get(hf, "mlp_bias", False)))

    def options_to_hf(self, cfg):
        """attention_bias, mlp_bias."""
        return dict(attention_bias=cfg.bias, mlp_bias=cfg.mlp_bias)
