"""Qwen3 dense (``Qwen3ForCausalLM``): Qwen2's layout with per-head q/k RMSNorm and no q/k/v bias.

``attention_bias`` switches biases on q/k/v and the output together; ``head_dim`` is independent
of hidden / heads (128 in the published models).
"""

from __future__ import annotations

from .base import get, register
from .keys import read
from .llama import LlamaLike
from .qwen2 import Qwen2, windowed_layers_from_hf, windowed_layers_to_hf


@register
class Qwen3(LlamaLike):
    """Qwen3 0.6B-32B."""

    name = "qwen3"
    architecture = "Qwen3ForCausalLM"
    model_types = ("qwen3",)
    defaults = dict(
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        mlp_bias=False,
        qk_norm=True,
        tie_embeddings=False,
        norm_eps=1e-6,
    )
    variable = frozenset({"attention", "bias", "tie_embeddings"})
    hf_defaults = {
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "head_dim": 128,
    }
    transformers_module = "qwen3"
    hf_keys = {**Qwen2.hf_keys, "attention_bias": read("bool")}

    def options_from_hf(self, hf, where, layers):
        """attention_bias and sliding-window layers."""
        bias = bool(get(hf, "attention_bias", False))
        return dict(bias=bias, qkv_bias=bias, attention=windowed_layers_from_hf(hf, where, layers))

    def options_to_hf(self, cfg):
        """attention_bias and sliding-window layers."""
        return dict(attention_bias=cfg.bias, **windowed_layers_to_hf(cfg))
