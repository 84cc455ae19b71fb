"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``, model_type ``glm4_moe``): grouped-query attention with
biases on q/k/v (``attention_bias``; none on the output), optional per-head q/k RMSNorms
(``use_qk_norm``) and RoPE over the first half of each head (``partial_rotary_factor`` 0.5:
``ModelConfig.rotary_fraction``), with DeepSeek-V3's MoE: sigmoid expert scores, a correction bias
for selection, group-limited routing (``n_group`` / ``topk_group``), renormalised weights times
``routed_scaling_factor``, ``n_shared_experts`` ungated shared experts and the first
``first_k_dense_replace`` blocks dense.

Tensors are stored one per expert (``mlp.experts.{j}.gate_proj`` ...), as transformers 5 saves them.
Multi-token-prediction layers (``model.layers.{num_hidden_layers}...``, ``num_nextn_predict_layers``)
are not built: reported as unused tensors and skipped, as transformers skips them.
"""

from __future__ import annotations

from .base import get, register
from .deepseek_v3 import DeepseekV3, deepseek_moe_from_hf, deepseek_moe_to_hf
from .keys import COMMON, LLAMA_LIKE, read
from .llama import LLAMA_BLOCK
from .moe import MOE_KEYS, MoEFamily, _without_moe_refusals


@register
class Glm4Moe(MoEFamily):
    """GLM-4.5 (355B, 32B active), GLM-4.5-Air (106B, 12B active), GLM-4.6."""

    name = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    model_types = ("glm4_moe",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, mlp_bias=False, tie_embeddings=False,
        norm_eps=1e-5,
    )  # fmt: skip
    variable = frozenset({"qkv_bias", "qk_norm", "rotary_fraction", "tie_embeddings", "moe"})
    hf_defaults = {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    transformers_module = "glm4_moe"
    mtp_format = "nextn"
    mtp_count_keys = ("num_nextn_predict_layers", "num_mtp_layers")
    experts_keys = ("n_routed_experts", "num_local_experts")
    block_modules = LLAMA_BLOCK
    expert_modules = DeepseekV3.expert_modules
    hf_keys = {
        **_without_moe_refusals(COMMON),
        **LLAMA_LIKE,
        **MOE_KEYS,
        **{k: v for k, v in DeepseekV3.hf_keys.items() if k in (
            "n_routed_experts", "num_local_experts", "moe_intermediate_size", "n_group", "topk_group",
            "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob",
            "attention_bias", "num_nextn_predict_layers", "num_mtp_layers", "quantization_config")},
        "use_qk_norm": read("bool"),
        "partial_rotary_factor": read("num+"),
    }  # fmt: skip
    partial_rotary = True
    moe_limits = DeepseekV3.moe_limits

    def options_from_hf(self, hf, where, layers):
        """q/k/v biases, q/k norms and DeepSeek-V3's MoE (GLM's defaults: no groups, no scaling)."""
        moe = deepseek_moe_from_hf(self, hf, where, layers, ffn=1408, dense=1, groups=(1, 1), scaling=1.0)
        qkv_bias, qk_norm = bool(get(hf, "attention_bias", False)), bool(get(hf, "use_qk_norm", False))
        return dict(qkv_bias=qkv_bias, qk_norm=qk_norm, moe=moe)

    def options_to_hf(self, cfg):
        """GLM's keys for the attention and DeepSeek-V3's for the MoE."""
        return dict(
            attention_bias=bool(cfg.qkv_bias), use_qk_norm=cfg.qk_norm, **deepseek_moe_to_hf(self, cfg)
        )
