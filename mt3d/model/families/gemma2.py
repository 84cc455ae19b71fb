"""Gemma 2 (``Gemma2ForCausalLM``): the most option-rich family mt3d loads.

(1 + w) RMSNorms (weights stored around 0), embeddings scaled by sqrt(hidden), a GeGLU MLP with a
tanh-GELU gate, norms before *and* after attention and MLP (HF's post_attention_layernorm is the
norm after attention here, unlike Llama's), attention scores scaled by query_pre_attn_scalar^-0.5
and soft-capped, final logits soft-capped, and alternating local (sliding_window) and global
layers given by ``layer_types``: the first layer is local.
"""

from __future__ import annotations

from .base import SLIDING, attention_from_hf, attention_to_hf, get, positive, register
from .keys import COMMON, LLAMA_LIKE, WINDOWED, read
from .llama import LLAMA_BLOCK, LlamaLike


@register
class Gemma2(LlamaLike):
    """Gemma 2 2B/9B/27B."""

    name = "gemma2"
    architecture = "Gemma2ForCausalLM"
    model_types = ("gemma2",)
    activation = ("hidden_activation", "gelu_pytorch_tanh")
    block_modules = {
        **LLAMA_BLOCK,
        "norm2": ("pre_feedforward_layernorm",),
        "post_attn_norm": ("post_attention_layernorm",),
        "post_mlp_norm": ("post_feedforward_layernorm",),
    }
    defaults = dict(
        position="rope",
        norm="rmsnorm",
        norm_unit_offset=True,
        mlp="geglu",
        bias=False,
        mlp_bias=False,
        post_norms=True,
        scale_embedding=True,
        attn_softcap=50.0,
        logit_softcap=30.0,
        tie_embeddings=True,
        norm_eps=1e-6,
    )
    variable = frozenset(
        {"attention", "bias", "attn_softcap", "logit_softcap", "query_pre_attn_scalar", "tie_embeddings"}
    )
    hf_defaults = {
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    transformers_module = "gemma2"
    hf_keys = {
        **COMMON,
        **{k: v for k, v in LLAMA_LIKE.items() if k != "hidden_act"},
        **WINDOWED,
        "hidden_activation": read("str"),
        "attention_bias": read("bool"),
        **dict.fromkeys(
            ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"), read("num+")
        ),
    }

    def default_layer_types(self, hf: dict, where: str, layers: int) -> list[str]:
        """The layer types transformers assumes when the config lists none: even layers local, odd global."""
        return [SLIDING if i % 2 == 0 else "full_attention" for i in range(layers)]

    def options_from_hf(self, hf, where, layers):
        """Soft-caps (``hf_defaults``' when the config omits them; none where those have none), the score
        scale, attention_bias and the local/global layer list."""
        d = self.hf_defaults
        window = positive(hf, "sliding_window", where, d["sliding_window"], integer=True)
        if hf.get("layer_types") is None:
            hf = {**hf, "layer_types": self.default_layer_types(hf, where, layers)}
        bias = bool(get(hf, "attention_bias", False))
        return dict(
            bias=bias,
            qkv_bias=bias,
            attn_softcap=positive(hf, "attn_logit_softcapping", where, d.get("attn_logit_softcapping")),
            logit_softcap=positive(hf, "final_logit_softcapping", where, d.get("final_logit_softcapping")),
            query_pre_attn_scalar=positive(hf, "query_pre_attn_scalar", where, d["query_pre_attn_scalar"]),
            attention=attention_from_hf(hf, where, layers, window),
        )

    def options_to_hf(self, cfg):
        """The Gemma 2 keys (every one written: transformers' defaults are not mt3d's)."""
        window, types = attention_to_hf(cfg)
        return dict(
            attention_bias=cfg.bias,
            attn_logit_softcapping=cfg.attn_softcap,
            final_logit_softcapping=cfg.logit_softcap,
            query_pre_attn_scalar=cfg.query_pre_attn_scalar or cfg.head_dim,
            sliding_window=window,
            layer_types=types,
        )
