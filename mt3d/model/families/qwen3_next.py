"""Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``): Gated DeltaNet in three of four
blocks (``linear_attention``, ``mt3d.model.gdn``), gated attention in the fourth (q_proj holds each
head's query, then its sigmoid output gate; q/k RMSNorms; RoPE over a quarter of each head), every norm
but the DeltaNet's gated one scaling by (1 + weight), and Qwen2-MoE's experts with a sigmoid-gated
shared expert.

The DeltaNet tensors map one to one (``linear_attn.in_proj_qkvz``, ``in_proj_ba``, ``conv1d``,
``A_log``, ``dt_bias``, ``norm``, ``out_proj``); in transformers' per-key-head layouts, which is what
lets tensor parallelism split them by rows (``mt3d.model.gdn``). Which blocks are which: ``layer_types``
(written on export), or ``full_attention_interval`` (default 4).
"""

from __future__ import annotations

from .base import HFError, Piece, get, positive, register
from .keys import COMMON, LLAMA_LIKE, inert, read
from .llama import LLAMA_BLOCK
from .moe import _QWEN_MOE_KEYS, MoEFamily, Qwen2Moe, QwenMoE, _without_moe_refusals

GDN_TENSORS = {
    "attn.in_qkvz.weight": "linear_attn.in_proj_qkvz.weight",
    "attn.in_ba.weight": "linear_attn.in_proj_ba.weight",
    "attn.conv": "linear_attn.conv1d.weight",
    "attn.A_log": "linear_attn.A_log",
    "attn.dt_bias": "linear_attn.dt_bias",
    "attn.norm.weight": "linear_attn.norm.weight",
    "attn.out.weight": "linear_attn.out_proj.weight",
}
"""A Gated DeltaNet block's mt3d parameters -> their HF tensors under model.layers.{i}."""
GDN_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")  # fmt: skip
_SPEC_KEYS = ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel")


@register
class Qwen3Next(QwenMoE):
    """Qwen3-Next-80B-A3B."""

    name = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    model_types = ("qwen3_next",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, mlp_bias=False,
        qk_norm=True, norm_unit_offset=True, attn_output_gate=True, tie_embeddings=False, norm_eps=1e-6,
    )  # fmt: skip
    variable = frozenset({"tie_embeddings", "moe", "linear_attention", "rotary_fraction", "bias", "qkv_bias"})
    hf_defaults = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "head_dim": 256}  # fmt: skip
    transformers_module = "qwen3_next"
    partial_rotary = True
    one_window = False
    expert_modules = Qwen2Moe.expert_modules
    block_modules = LLAMA_BLOCK
    hf_keys = {
        **_without_moe_refusals(COMMON), **LLAMA_LIKE, **_QWEN_MOE_KEYS,
        "shared_expert_intermediate_size": read("int0+"), "attention_bias": read("bool"),
        "partial_rotary_factor": read("num+"), "layer_types": read("strs"),
        "full_attention_interval": read("int+"),
        **{k: read("int+") for k in GDN_KEYS},
        "mtp_num_hidden_layers": inert("multi-token-prediction layers: not built (their tensors skipped)"),
        "mtp_use_dedicated_embeddings": inert("multi-token-prediction layers: not built"),
    }  # fmt: skip

    def limits(self, cfg):
        """A router and Gated DeltaNet layers are required (the format has both)."""
        if cfg.linear_attention is None:
            return "Qwen3-Next needs model.linear_attention (its Gated DeltaNet layers)"
        return super().limits(cfg)

    def options_from_hf(self, hf, where, layers):
        """The DeltaNet shape and which blocks have it, attention biases, the experts."""
        spec = {
            ours: positive(hf, theirs, where, None, integer=True)
            for ours, theirs in zip(_SPEC_KEYS, GDN_KEYS)
        }
        missing = [
            theirs
            for ours, theirs in zip(_SPEC_KEYS, GDN_KEYS)
            if spec[ours] is None and ours != "conv_kernel"
        ]
        if missing:
            raise HFError(f"{where}: config.json has no {missing[0]!r}")
        spec["conv_kernel"] = spec["conv_kernel"] or 4
        kinds = get(hf, "layer_types", None)
        if kinds is not None:
            spec["layer_types"] = list(kinds)
        else:
            spec["full_every"] = positive(hf, "full_attention_interval", where, 4, integer=True)
        bias = bool(get(hf, "attention_bias", False))
        shared = get(hf, "shared_expert_intermediate_size", 512)
        return dict(linear_attention=spec, bias=bias, qkv_bias=bias,
                    moe=self.qwen_moe(hf, where, layers, shared_ffn=shared, shared_gate=True))  # fmt: skip

    def options_to_hf(self, cfg):
        """The DeltaNet keys with every block's type, attention biases, the experts."""
        spec = cfg.gdn_spec
        kinds = ["linear_attention" if spec.linear(i) else "full_attention" for i in range(cfg.layers)]
        return dict(
            **{theirs: getattr(spec, ours) for ours, theirs in zip(_SPEC_KEYS, GDN_KEYS)}, layer_types=kinds,
            attention_bias=cfg.bias, **self.write_qwen_moe(cfg),
            shared_expert_intermediate_size=cfg.moe_spec.shared_ffn,
        )  # fmt: skip

    def pieces(self, cfg, role, block, local):
        """A DeltaNet block's tensors by ``GDN_TENSORS``; the rest as Qwen2-MoE's."""
        if role == "block" and cfg.is_linear(block) and local in GDN_TENSORS:
            return [Piece(f"model.layers.{block}.{GDN_TENSORS[local]}")]
        return MoEFamily.pieces(self, cfg, role, block, local)
