"""Mistral (``MistralForCausalLM``): Llama's block with one sliding window on every layer; and
Ministral (``MinistralForCausalLM``): the same block with local and global layers (``layer_types``).

``sliding_window`` null means global attention (Mistral 7B v0.2 and later). transformers reads a
``mistral`` config that has ``layer_types`` as a Ministral one (its AutoConfig's heuristic for
alternating attention), and so does mt3d.
"""

from __future__ import annotations

from .base import attention_from_hf, attention_to_hf, positive, register
from .keys import COMMON, LLAMA_LIKE, WINDOWED
from .llama import LlamaLike, mixed_windows, window_of


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
    transformers_module = "mistral"
    hf_keys = {**COMMON, **LLAMA_LIKE, **WINDOWED}

    def reads(self, hf):
        """``mistral`` configs without ``layer_types`` (with them they are Ministral's)."""
        return hf.get("model_type") in self.model_types and "layer_types" not in hf

    def limits(self, cfg):
        """One window for every layer, or none."""
        return mixed_windows(cfg)

    def options_from_hf(self, hf, where, layers):
        """sliding_window (a window on every layer; null: global)."""
        w = positive(hf, "sliding_window", where, self.hf_defaults["sliding_window"], integer=True)
        return dict(attention=None if w is None else {"window": w})

    def options_to_hf(self, cfg):
        """sliding_window."""
        return dict(sliding_window=window_of(cfg))


@register
class Ministral(Mistral):
    """Ministral: Mistral's block with one window on the layers ``layer_types`` marks sliding."""

    name = "ministral"
    architecture = "MinistralForCausalLM"
    model_types = ("ministral",)
    infer_rank = 60  # after Mistral: a model with one window everywhere is exported as Mistral
    transformers_module = "ministral"

    def reads(self, hf):
        """``ministral`` configs, and ``mistral`` ones with ``layer_types`` (as transformers' AutoConfig)."""
        kind = hf.get("model_type")
        return kind in self.model_types or (kind == "mistral" and "layer_types" in hf)

    def limits(self, cfg):
        """Any mix of local and global layers, one window."""
        return None

    def options_from_hf(self, hf, where, layers):
        """sliding_window and layer_types (without them every layer is local, as in transformers)."""
        w = positive(hf, "sliding_window", where, self.hf_defaults["sliding_window"], integer=True)
        return dict(attention=attention_from_hf(hf, where, layers, w))

    def options_to_hf(self, cfg):
        """sliding_window and layer_types."""
        window, types = attention_to_hf(cfg)
        return dict(sliding_window=window, layer_types=types)
