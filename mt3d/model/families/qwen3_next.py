"""The Gated DeltaNet hybrids: Qwen3-Next (``Qwen3NextForCausalLM``, model_type ``qwen3_next``) and
Qwen3.5 (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, model_types ``qwen3_5_text`` /
``qwen3_5_moe_text``): Gated DeltaNet in three of four blocks (``linear_attention``,
``mt3d.model.gdn``), gated attention in the fourth (q_proj holds each head's query, then its sigmoid
output gate; q/k RMSNorms; RoPE over a quarter of each head), every norm but the DeltaNet's gated one
scaling by (1 + weight); Qwen3-Next and Qwen3.5-MoE with Qwen2-MoE's experts and a sigmoid-gated shared
expert, Qwen3.5 with a dense MLP.

The DeltaNet tensors map one to one: Qwen3-Next's ``linear_attn.in_proj_qkvz`` and ``in_proj_ba`` in
transformers' per-key-head layouts (``GdnSpec.fused``), Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a``; both with ``conv1d``, ``A_log``, ``dt_bias``, ``norm`` and ``out_proj``.
Which blocks are which: ``layer_types`` (written on export), or ``full_attention_interval`` (default 4).
Qwen3.5's vision-language checkpoints (model_types ``qwen3_5`` / ``qwen3_5_moe``) are read as their language
model (``hf.read_hf_config`` takes ``text_config``, ``hf.HFReader`` the ``model.language_model`` tensors).
"""

from __future__ import annotations

from typing import ClassVar

from .base import HFError, Piece, get, positive, register
from .keys import COMMON, LLAMA_LIKE, inert, read
from .llama import LLAMA_BLOCK, LlamaLike
from .moe import _QWEN_MOE_KEYS, MOE_KEYS, MoEFamily, Qwen2Moe, QwenMoE, _without_moe_refusals

_COMMON_GDN = {
    "attn.conv": "linear_attn.conv1d.weight",
    "attn.A_log": "linear_attn.A_log",
    "attn.dt_bias": "linear_attn.dt_bias",
    "attn.norm.weight": "linear_attn.norm.weight",
    "attn.out.weight": "linear_attn.out_proj.weight",
}
GDN_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim")  # fmt: skip
_SPEC_KEYS = ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel")
_HYBRID_KEYS = {
    **_without_moe_refusals(COMMON), **LLAMA_LIKE, "attention_bias": read("bool"),
    "partial_rotary_factor": read("num+"), "layer_types": read("strs"),
    "full_attention_interval": read("int+"),
    **{k: read("int+") for k in GDN_KEYS},
    "mtp_num_hidden_layers": read("int0+"),  # MTP layers: built with model.mtp, else skipped
    "mtp_use_dedicated_embeddings": read("bool"),  # refused with model.mtp (``mtp_count``)
}  # fmt: skip
_VISION = inert("the vision tower's (vision_config): not built")


class GatedDeltaNetFamily(LlamaLike):
    """What the hybrids share: the DeltaNet keys and tensors, gated attention, (1 + w) norms."""

    gdn_tensors: ClassVar[dict[str, str]] = {}
    mtp_format = "qwen"
    mtp_count_keys = ("mtp_num_hidden_layers",)

    def mtp_count(self, hf):
        """The MTP layers held; refused where they have embeddings of their own (mt3d's share the model's)."""
        if hf.get("mtp_use_dedicated_embeddings"):
            raise HFError("config.json: mtp_use_dedicated_embeddings is true; mt3d's MTP layers share the "
                          "model's embedding: drop model.mtp")  # fmt: skip
        return super().mtp_count(hf)

    """A DeltaNet block's mt3d parameters -> their HF tensors under model.layers.{i}."""
    fused: ClassVar[bool] = True
    """``GdnSpec.fused``: the family's projection layout."""
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, mlp_bias=False,
        qk_norm=True, norm_unit_offset=True, attn_output_gate=True, tie_embeddings=False, norm_eps=1e-6,
    )  # fmt: skip
    variable = frozenset({"tie_embeddings", "moe", "linear_attention", "rotary_fraction", "bias", "qkv_bias"})
    hf_defaults = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "head_dim": 256}  # fmt: skip
    partial_rotary = True
    block_modules = LLAMA_BLOCK

    def limits(self, cfg):
        """Gated DeltaNet layers in the family's layout are required (its format has them)."""
        spec = cfg.gdn_spec
        if spec is None:
            return f"{self.architecture} needs model.linear_attention (its Gated DeltaNet layers)"
        if spec.fused != self.fused:
            return f"model.linear_attention.fused must be {self.fused} ({self.architecture}'s projections)"
        return super().limits(cfg)

    def gdn_from_hf(self, hf: dict, where: str) -> dict:
        """model.linear_attention and the attention biases from the config."""
        spec = {
            ours: positive(hf, theirs, where, None, integer=True)
            for ours, theirs in zip(_SPEC_KEYS, GDN_KEYS)
        }
        missing = [k for o, k in zip(_SPEC_KEYS, GDN_KEYS) if spec[o] is None and o != "conv_kernel"]
        if missing:
            raise HFError(f"{where}: config.json has no {missing[0]!r}")
        spec["conv_kernel"], spec["fused"] = spec["conv_kernel"] or 4, self.fused
        kinds = get(hf, "layer_types", None)
        if kinds is not None:
            spec["layer_types"] = list(kinds)
        else:
            spec["full_every"] = positive(hf, "full_attention_interval", where, 4, integer=True)
        bias = bool(get(hf, "attention_bias", False))
        return dict(linear_attention=spec, bias=bias, qkv_bias=bias)

    def gdn_to_hf(self, cfg) -> dict:
        """The DeltaNet keys with every block's type, and the attention biases."""
        spec = cfg.gdn_spec
        kinds = ["linear_attention" if spec.linear(i) else "full_attention" for i in range(cfg.layers)]
        keys = {theirs: getattr(spec, ours) for ours, theirs in zip(_SPEC_KEYS, GDN_KEYS)}
        return dict(**keys, layer_types=kinds, attention_bias=cfg.bias)

    def options_from_hf(self, hf, where, layers):
        """The DeltaNet shape and which blocks have it, attention biases."""
        return self.gdn_from_hf(hf, where)

    def options_to_hf(self, cfg):
        """The DeltaNet keys and attention biases."""
        return self.gdn_to_hf(cfg)

    def pieces(self, cfg, role, block, local):
        """A DeltaNet block's tensors by ``gdn_tensors``; the rest as the base family's."""
        if role == "block" and cfg.is_linear(block) and local in self.gdn_tensors:
            return [Piece(f"model.layers.{block}.{self.gdn_tensors[local]}")]
        return super().pieces(cfg, role, block, local)


@register
class Qwen3Next(GatedDeltaNetFamily, QwenMoE):
    """Qwen3-Next-80B-A3B."""

    name = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    model_types = ("qwen3_next",)
    transformers_module = "qwen3_next"
    one_window = False
    expert_modules = Qwen2Moe.expert_modules
    gdn_tensors = {**_COMMON_GDN, "attn.in_qkvz.weight": "linear_attn.in_proj_qkvz.weight",
                   "attn.in_ba.weight": "linear_attn.in_proj_ba.weight"}  # fmt: skip
    hf_keys = {**_HYBRID_KEYS, **_QWEN_MOE_KEYS, "shared_expert_intermediate_size": read("int0+")}

    def options_from_hf(self, hf, where, layers):
        """The DeltaNet layers, attention biases, Qwen2-MoE's experts."""
        shared = get(hf, "shared_expert_intermediate_size", 512)
        moe = self.qwen_moe(hf, where, layers, shared_ffn=shared, shared_gate=True)
        return dict(**self.gdn_from_hf(hf, where), moe=moe)

    def options_to_hf(self, cfg):
        """The DeltaNet keys, attention biases, the experts."""
        return dict(**self.gdn_to_hf(cfg), **self.write_qwen_moe(cfg),
                    shared_expert_intermediate_size=cfg.moe_spec.shared_ffn)  # fmt: skip


_QWEN35_GDN = {
    **_COMMON_GDN,
    **{f"attn.in_{p}.weight": f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")},
}
_QWEN35_VISION = {
    k: _VISION
    for k in ("depth", "num_heads", "in_channels", "patch_size", "spatial_merge_size", "temporal_patch_size",
              "out_hidden_size", "num_position_embeddings", "vision_config", "text_config", "image_token_id",
              "video_token_id")
}  # fmt: skip


@register
class Qwen35(GatedDeltaNetFamily):
    """Qwen3.5 (dense; the text model)."""

    name = "qwen3_5"
    architecture = "Qwen3_5ForCausalLM"
    model_types = ("qwen3_5_text",)
    transformers_module = "qwen3_5"
    fused = False
    gdn_tensors = _QWEN35_GDN
    variable = GatedDeltaNetFamily.variable - {"moe"}
    hf_keys = {**_HYBRID_KEYS, **_QWEN35_VISION}


@register
class Qwen35Moe(GatedDeltaNetFamily, MoEFamily):
    """Qwen3.5-MoE (the text model): every block sparse, renormalised top-k, a gated shared expert."""

    name = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForCausalLM"
    model_types = ("qwen3_5_moe_text",)
    transformers_module = "qwen3_5_moe"
    fused = False
    one_window = False
    gdn_tensors = _QWEN35_GDN
    expert_modules = Qwen2Moe.expert_modules
    hf_keys = {
        **_HYBRID_KEYS, **_QWEN35_VISION, **MOE_KEYS, "num_experts": read("int+"),
        "moe_intermediate_size": read("int+"), "shared_expert_intermediate_size": read("int0+"),
    }  # fmt: skip

    def moe_limits(self, spec):
        """Every block sparse, renormalised top-k, a gated shared expert."""
        if spec.sparse_step != 1 or spec.dense_layers or not spec.norm_topk_prob or not spec.shared_gate:
            return "Qwen3.5-MoE has every block sparse, renormalised top-k weights and a gated shared expert"
        return None

    def options_from_hf(self, hf, where, layers):
        """The DeltaNet layers, attention biases, the experts."""
        ffn = positive(hf, "moe_intermediate_size", where, 512, integer=True)
        shared = get(hf, "shared_expert_intermediate_size", 512)
        moe = self.read_moe(hf, where, ffn, norm_topk_prob=True, shared_ffn=shared, shared_gate=True)
        return dict(**self.gdn_from_hf(hf, where), moe=moe)

    def options_to_hf(self, cfg):
        """The DeltaNet keys, attention biases, the experts."""
        spec = cfg.moe_spec
        return dict(**self.gdn_to_hf(cfg), **self.write_moe(cfg), moe_intermediate_size=spec.expert_ffn,
                    shared_expert_intermediate_size=spec.shared_ffn)  # fmt: skip

    def hf_config(self, cfg, vocab):
        """intermediate_size is not a key of Qwen3.5-MoE's config."""
        out = super().hf_config(cfg, vocab)
        out.pop("intermediate_size", None)
        return out
