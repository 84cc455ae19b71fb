"""Mistral (``MistralForCausalLM``): Llama's block with one sliding window on every layer.

``sliding_window`` null means global attention (Mistral 7B v0.2 and later); transformers' Mistral
ignores ``layer_types``, and so does mt3d.
"""

from __future__ import annotations

from . import register
from .base import positive
from .llama import LlamaLike, window_of


@register
class Mistral(LlamaLike):
    """Mistral 7B and its relatives: no biases, GQA, optional sliding window."""

    name = "mistral"
    architecture = "MistralForCausalLM"
    model_types = ("mistral",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, norm_eps=1e-6
    )
    variable = frozenset({"attention", "tie_embeddings"})
    hf_defaults = {
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "sliding_window": 4096,
    }

    def limits(self, cfg):
        """One window for every layer, or none."""
        if any(p is None for p in cfg.patterns) and any(p is not None for p in cfg.patterns):
            return "sliding_window applies to every layer; mixed local/global layers need another family"
        return None

    def options_from_hf(self, hf, where, layers):
        """sliding_window (a window on every layer; null: global)."""
        w = positive(hf, "sliding_window", where, self.hf_defaults["sliding_window"], integer=True)
        return dict(attention=None if w is None else {"window": w})

    def options_to_hf(self, cfg):
        """sliding_window."""
        return dict(sliding_window=window_of(cfg))
