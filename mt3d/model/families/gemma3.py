"""Gemma 3, text (``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 2's block with q/k RMSNorms
((1 + w), before RoPE), no soft-caps by default, five local layers to one global
(``sliding_window_pattern`` 6, or ``layer_types``), and RoPE per layer type: the global layers at base
1e6 with their scaling (linear x8 in the 4B-27B checkpoints), the local ones at
``rope_local_base_freq`` 1e4 unscaled (``ModelConfig.rope_local``). The multimodal ``gemma3``
(``Gemma3ForConditionalGeneration``) is not read: its vision tower is refused by model_type.
"""

from __future__ import annotations

from .base import HFError, get, positive, register, rope_from_hf
from .gemma2 import Gemma2
from .keys import COMMON, LLAMA_LIKE, WINDOWED, inert, read

FULL, SLIDING = "full_attention", "sliding_attention"


def _rope_by_type(hf: dict, where: str) -> tuple[dict, dict]:
    """The global and local layers' RoPE parameters (flat dicts with rope_theta) of a Gemma 3 config:
    transformers 5's ``rope_parameters`` by layer type, or the 4.x keys (``rope_theta``, ``rope_scaling``
    for the global layers, ``rope_local_base_freq`` for the local ones)."""
    params = hf.get("rope_parameters") or {}
    if params and not isinstance(params, dict):
        raise HFError(f"{where}: rope_parameters must be an object, got {params!r}")
    if params and not set(params) <= {FULL, SLIDING}:  # one flat dict: both layer types share it
        params = {FULL: params, SLIDING: params}
    full = dict(params.get(FULL) or {})
    if not full:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": get(hf, "rope_theta", 1_000_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local = dict(params.get(SLIDING) or {"rope_type": "default"})
    local.setdefault("rope_theta", get(hf, "rope_local_base_freq", 10_000.0))
    return full, local


@register
class Gemma3(Gemma2):
    """Gemma 3 1B/4B/12B/27B, the language model."""

    name = "gemma3"
    architecture = "Gemma3ForCausalLM"
    model_types = ("gemma3_text",)
    defaults = {**Gemma2.defaults, "qk_norm": True, "attn_softcap": None, "logit_softcap": None}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    }
    transformers_module = "gemma3"
    _multimodal = inert("read by the multimodal Gemma3ForConditionalGeneration only, not the text model")
    hf_keys = {
        **COMMON,
        **{k: v for k, v in LLAMA_LIKE.items() if k != "hidden_act"},
        **WINDOWED,
        "hidden_activation": read("str"),
        "attention_bias": read("bool"),
        **dict.fromkeys(
            ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"), read("num+")
        ),
        "rope_local_base_freq": read("num+"),
        "sliding_window_pattern": read("int+"),
        **dict.fromkeys(
            ("text_config", "vision_config", "image_token_id", "mm_tokens_per_image", "get_text_config"),
            _multimodal,
        ),
    }

    def config_kwargs(self, hf, where):
        """Gemma 2's reading, with RoPE by layer type."""
        full, local = _rope_by_type(hf, where)
        kw = super().config_kwargs({**hf, "rope_parameters": full, "rope_scaling": None}, where)
        theta, scaling = rope_from_hf({"rope_parameters": local}, where)
        kw["rope_local"] = {"rope_theta": theta, **(scaling or {})}
        return kw

    def default_layer_types(self, hf, where, layers):
        """Five local layers to one global (``sliding_window_pattern``, 6 by default), as transformers."""
        every = positive(hf, "sliding_window_pattern", where, 6, integer=True)
        return [SLIDING if (i + 1) % every else FULL for i in range(layers)]

    def hf_config(self, cfg, vocab):
        """Gemma 3's keys, RoPE by layer type (``rope_parameters`` only: transformers folds a top-level
        ``rope_scaling`` into the global layers')."""
        out = super().hf_config(cfg, vocab)
        for key in ("rope_theta", "rope_scaling"):
            out.pop(key, None)
        local = dict(cfg.rope_local or {"rope_theta": cfg.rope_theta})
        local.setdefault("rope_type", "default")
        full = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
        out["rope_parameters"] = {FULL: full, SLIDING: local}
        return out
