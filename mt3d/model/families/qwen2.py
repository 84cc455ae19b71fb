"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's block with q/k/v biases only.

Local layers: with ``use_sliding_window`` the layers listed as 'sliding_attention' in
``layer_types`` (or, without that list, layers from ``max_window_layers`` on) attend to the last
``sliding_window`` keys; without it every layer is global.
"""

from __future__ import annotations

from .base import FULL, SLIDING, attention_from_hf, attention_to_hf, get, positive, register
from .keys import COMMON, LLAMA_LIKE, WINDOWED, read
from .llama import LlamaLike


def windowed_layers_from_hf(hf: dict, where: str, layers: int) -> dict | None:
    """Qwen's use_sliding_window / sliding_window / max_window_layers / layer_types -> attention."""
    types = hf.get("layer_types")
    if not get(hf, "use_sliding_window", False):
        # transformers drops the window when use_sliding_window is off: every layer is global
        if types is not None:
            attention_from_hf({"layer_types": types}, where, layers, window=1)  # still a valid list?
        return None
    window = positive(hf, "sliding_window", where, 4096, integer=True)
    if types is None and window is not None:
        first = get(hf, "max_window_layers", 28)
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    return attention_from_hf({"layer_types": types}, where, layers, window)


def windowed_layers_to_hf(cfg) -> dict:
    """The Qwen keys for ``cfg.attention`` (layer_types explicit; max_window_layers for 4.x readers)."""
    window, types = attention_to_hf(cfg)
    leading_full = next((i for i, t in enumerate(types) if t == SLIDING), len(types))
    return dict(
        use_sliding_window=window is not None,
        sliding_window=window,
        max_window_layers=leading_full,
        layer_types=types,
    )


@register
class Qwen2(LlamaLike):
    """Qwen2 and Qwen2.5 dense models."""

    name = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_types = ("qwen2",)
    defaults = dict(
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        qkv_bias=True,
        mlp_bias=False,
        tie_embeddings=False,
        norm_eps=1e-6,
    )
    variable = frozenset({"attention", "tie_embeddings"})
    hf_defaults = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    transformers_module = "qwen2"
    hf_keys = {**COMMON, **LLAMA_LIKE, **WINDOWED, "use_sliding_window": read("bool"),
               "max_window_layers": read("int0+")}  # fmt: skip

    def options_from_hf(self, hf, where, layers):
        """Sliding-window layers."""
        return dict(attention=windowed_layers_from_hf(hf, where, layers))

    def options_to_hf(self, cfg):
        """Sliding-window layers."""
        return windowed_layers_to_hf(cfg)
