"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``; Kimi K2 has the same block):
multi-head latent attention (``mt3d.model.mla``) and DeepSeek's MoE.

The MoE: sigmoid expert scores; experts chosen by score plus ``e_score_correction_bias`` (selection
only) among each token's ``topk_group`` best of ``n_group`` groups; weights the chosen scores,
renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``; ``n_shared_experts`` shared
experts as one ungated MLP of n_shared x moe_intermediate_size; the first ``first_k_dense_replace``
blocks dense (``intermediate_size``). The correction bias is loaded, saved and trained by aux-loss-free
balancing when ``model.moe.bias_update_rate`` is set (transformers does not train it).

Tensors are stored one per expert (``mlp.experts.{j}.gate_proj`` ...), as transformers 5 saves them.
Multi-token-prediction layers (``model.layers.{num_hidden_layers}...`` in DeepSeek's own checkpoints)
are not built: they are reported as unused tensors and skipped, as transformers skips them.
"""

from __future__ import annotations

from .base import HFError, get, positive, register
from .keys import COMMON, LLAMA_LIKE, read, refused
from .moe import MOE_KEYS, MoEFamily, _without_moe_refusals

_ATTN = {
    "norm1": ("input_layernorm",),
    "norm2": ("post_attention_layernorm",),
    "attn.q": ("self_attn.q_proj",),
    "attn.q_a": ("self_attn.q_a_proj",),
    "attn.q_a_norm": ("self_attn.q_a_layernorm",),
    "attn.q_b": ("self_attn.q_b_proj",),
    "attn.kv_a": ("self_attn.kv_a_proj_with_mqa",),
    "attn.kv_a_norm": ("self_attn.kv_a_layernorm",),
    "attn.kv_b": ("self_attn.kv_b_proj",),
    "attn.out": ("self_attn.o_proj",),
    "mlp.up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}


@register
class DeepseekV3(MoEFamily):
    """DeepSeek-V3 / R1 (671B), Kimi K2 (1T)."""

    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    model_types = ("deepseek_v3",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, mlp_bias=False,
        tie_embeddings=False, norm_eps=1e-6,
    )  # fmt: skip
    variable = frozenset({"bias", "qkv_bias", "tie_embeddings", "moe", "mla"})
    hf_defaults = {"max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    transformers_module = "deepseek_v3"
    mtp_format = "nextn"
    mtp_count_keys = ("num_nextn_predict_layers", "num_mtp_layers")
    experts_keys = ("n_routed_experts", "num_local_experts")
    block_modules = _ATTN
    expert_modules = {
        "mlp.router": ("mlp.gate",),
        "mlp.experts.{j}.up": ("mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj"),
        "mlp.experts.{j}.down": ("mlp.experts.{j}.down_proj",),
        "mlp.shared.up": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
        "mlp.shared.down": ("mlp.shared_experts.down_proj",),
    }
    hf_keys = {
        **_without_moe_refusals(COMMON),
        **LLAMA_LIKE,
        **MOE_KEYS,
        **dict.fromkeys(
            (
                "n_routed_experts",
                "num_local_experts",
                "moe_intermediate_size",
                "n_group",
                "topk_group",
                "kv_lora_rank",
                "qk_rope_head_dim",
                "qk_nope_head_dim",
                "v_head_dim",
                "first_k_dense_replace",
            ),
            read("int+"),
        ),  # fmt: skip
        "first_k_dense_replace": read("int0+"),
        "n_shared_experts": read("int0+"),
        "q_lora_rank": read("int+"),
        "routed_scaling_factor": read("num+"),
        "norm_topk_prob": read("bool"),
        "rope_interleave": read("bool"),
        "attention_bias": read("bool"),
        "scoring_func": refused("softmax expert scores in a DeepSeek-V3 config", None, "sigmoid"),
        "topk_method": refused("expert selection other than noaux_tc", None, "noaux_tc"),
        "num_nextn_predict_layers": read("int0+"),  # MTP layers: built with model.mtp, else skipped
        "num_mtp_layers": read("int0+"),
        "quantization_config": refused("quantized (FP8 block-scaled) weights; dequantize to bf16 first"),
    }

    def moe_limits(self, spec):
        """DeepSeek's routing: sigmoid scores, a correction bias, an ungated shared expert, no biases."""
        if spec.scoring != "sigmoid" or not spec.correction_bias or spec.shared_gate or spec.router_bias:
            return "DeepSeek-V3 routes by sigmoid scores with a correction bias and ungated shared experts"
        if spec.sparse_step != 1 or spec.dense_layers != tuple(range(len(spec.dense_layers))):
            return "DeepSeek-V3's dense blocks are the first first_k_dense_replace ones"
        return None

    def limits(self, cfg):
        """Latent attention is required."""
        return "DeepSeek-V3 needs model.mla" if cfg.mla is None else super().limits(cfg)

    def config_kwargs(self, hf, where):
        """Llama's reading; head_dim is qk_nope + qk_rope (transformers' head_dim is the rotary part)."""
        hf = dict(hf)
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            positive(hf, key, where, {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                      "v_head_dim": 128}[key], integer=True)  # fmt: skip
        hf["head_dim"] = get(hf, "qk_nope_head_dim", 128) + get(hf, "qk_rope_head_dim", 64)
        return super().config_kwargs(hf, where)

    def options_from_hf(self, hf, where, layers):
        """attention_bias, the latent attention's sizes and DeepSeek's MoE."""
        bias = bool(get(hf, "attention_bias", False))
        mla = dict(
            kv_lora_rank=get(hf, "kv_lora_rank", 512), qk_rope_head_dim=get(hf, "qk_rope_head_dim", 64),
            qk_nope_head_dim=get(hf, "qk_nope_head_dim", 128), v_head_dim=get(hf, "v_head_dim", 128),
            q_lora_rank=positive(hf, "q_lora_rank", where, None, integer=True),
            rope_interleave=bool(get(hf, "rope_interleave", True)),
        )  # fmt: skip
        moe = deepseek_moe_from_hf(self, hf, where, layers, ffn=2048, dense=3, groups=(8, 4), scaling=2.5)
        return dict(bias=bias, qkv_bias=bias, mla=mla, moe=moe)

    def options_to_hf(self, cfg):
        """DeepSeek's keys for the latent attention and the MoE."""
        mla = cfg.mla_spec
        return dict(
            attention_bias=cfg.bias, kv_lora_rank=mla.kv_lora_rank, q_lora_rank=mla.q_lora_rank,
            qk_rope_head_dim=mla.qk_rope_head_dim, qk_nope_head_dim=mla.qk_nope_head_dim,
            v_head_dim=mla.v_head_dim, rope_interleave=mla.rope_interleave, **deepseek_moe_to_hf(self, cfg),
        )  # fmt: skip

    def hf_config(self, cfg, vocab):
        """head_dim is the rotary part, as transformers writes it."""
        return {**super().hf_config(cfg, vocab), "head_dim": cfg.mla_spec.qk_rope_head_dim}


def deepseek_moe_from_hf(family, hf: dict, where: str, layers: int, *, ffn: int, dense: int,
                         groups: tuple[int, int], scaling: float) -> dict:  # fmt: skip
    """model.moe from DeepSeek-V3's MoE keys (read by ``family``; the defaults are its config class's):
    sigmoid scores, the correction bias, group-limited routing, the routed scaling, ungated shared
    experts as one MLP of n_shared x moe_intermediate_size, the first first_k_dense_replace blocks dense."""
    ffn = positive(hf, "moe_intermediate_size", where, ffn, integer=True)
    dense = get(hf, "first_k_dense_replace", dense)
    if dense >= layers:
        raise HFError(f"{where}: first_k_dense_replace {dense} leaves no sparse block of {layers}")
    routing = dict(
        scoring="sigmoid", n_group=get(hf, "n_group", groups[0]), topk_group=get(hf, "topk_group", groups[1]),
        routed_scaling=float(get(hf, "routed_scaling_factor", scaling)), correction_bias=True,
        norm_topk_prob=bool(get(hf, "norm_topk_prob", True)),
    )  # fmt: skip
    shared = dict(shared_ffn=ffn * get(hf, "n_shared_experts", 1), shared_gate=False)
    return family.read_moe(hf, where, ffn, dense_layers=list(range(dense)), **shared, **routing)


def deepseek_moe_to_hf(family, cfg) -> dict:
    """DeepSeek-V3's MoE keys for ``cfg`` (written by ``family``)."""
    spec = cfg.moe_spec
    if not spec.shared_ffn or spec.shared_ffn % spec.expert_ffn:
        raise HFError(
            f"{family.architecture} configs hold shared experts as a multiple of moe_intermediate_size"
        )
    return dict(
        **family.write_moe(cfg), moe_intermediate_size=spec.expert_ffn,
        n_shared_experts=spec.shared_ffn // spec.expert_ffn, n_group=spec.n_group, topk_group=spec.topk_group,
        routed_scaling_factor=spec.routed_scaling, norm_topk_prob=spec.norm_topk_prob,
        first_k_dense_replace=len(spec.dense_layers),
    )  # fmt: skip
