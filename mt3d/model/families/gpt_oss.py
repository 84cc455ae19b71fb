"""gpt-oss (``GptOssForCausalLM``, model_type ``gpt_oss``): OpenAI's open-weight MoE models.

Llama's tensor names with: q/k/v/o biases, a learned attention sink per query head
(``self_attn.sinks``, ``ModelConfig.attn_sinks``), sliding (128) and full layers alternating, YaRN
RoPE (``truncate`` false), and every MLP a mixture of experts whose router has a bias and whose
experts have biases and gpt-oss's clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``: ``MoESpec``).
The routing is mt3d's softmax top-k with renormalised weights (softmax over the k largest logits, as
transformers computes it, is the renormalised full softmax).

The experts are stored as transformers holds them, stacked per layer: ``mlp.experts.gate_up_proj``
[E, h, 2f] with gate and up columns interleaved (gate at even columns), ``gate_up_proj_bias`` [E, 2f],
``down_proj`` [E, f, h], ``down_proj_bias`` [E, h]. Each mt3d expert reads its matrix of the stack,
every other column (``Piece.index``, ``Piece.step``). The hub's MXFP4-quantized checkpoints
(``quantization_config``) are refused: dequantize them to bf16 with transformers first.
"""

from __future__ import annotations

import re

from .base import HFError, Piece, attention_from_hf, get, positive, register
from .keys import COMMON, LLAMA_LIKE, WINDOWED, read, refused
from .llama import LLAMA_BLOCK
from .moe import MOE_KEYS, MoEFamily, _without_moe_refusals

FULL, SLIDING = "full_attention", "sliding_attention"
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(up|down)\.(weight|bias)$")


@register
class GptOss(MoEFamily):
    """gpt-oss-20b and gpt-oss-120b."""

    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    model_types = ("gpt_oss",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=True, qkv_bias=True, mlp_bias=False,
        attn_sinks=True, tie_embeddings=False, norm_eps=1e-5,
    )  # fmt: skip
    variable = frozenset({"attention", "bias", "qkv_bias", "tie_embeddings", "moe"})
    hf_defaults = {
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": 128,
    }
    transformers_module = "gpt_oss"
    one_window = False  # layer_types marks the local layers
    experts_keys = ("num_local_experts", "num_experts")
    block_modules = {**LLAMA_BLOCK, "attn": ("self_attn",)}  # attn.sinks -> self_attn.sinks
    expert_modules = {"mlp.router": ("mlp.router",)}
    hf_keys = {
        **_without_moe_refusals(COMMON),
        **LLAMA_LIKE,
        **WINDOWED,
        **MOE_KEYS,
        "num_local_experts": read("int+"),
        "num_experts": read("int+"),
        "attention_bias": read("bool"),
        "swiglu_alpha": read("num+"),
        "swiglu_limit": read("num+"),
        "quantization_config": refused(
            "quantized (MXFP4) expert weights; dequantize to bf16 with transformers and save again"
        ),
    }

    def moe_limits(self, spec):
        """Every layer sparse, renormalised top-k, router and expert biases, the clamped SwiGLU."""
        if (spec.shared_ffn or spec.sparse_step != 1 or spec.dense_layers or not spec.norm_topk_prob
                or not (spec.router_bias and spec.expert_bias) or spec.swiglu_limit is None):  # fmt: skip
            return ("gpt-oss has every layer sparse, renormalised top-k weights, router and expert biases, "
                    "the clamped SwiGLU (swiglu_limit) and no shared expert")  # fmt: skip
        return None

    def options_from_hf(self, hf, where, layers):
        """attention_bias, the layer types (sliding first, alternating, by default) and the experts."""
        bias = bool(get(hf, "attention_bias", True))
        window = positive(hf, "sliding_window", where, 128, integer=True)
        if hf.get("layer_types") is None:
            hf = {**hf, "layer_types": [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]}
        glu = dict(
            swiglu_alpha=float(get(hf, "swiglu_alpha", 1.702)),
            swiglu_limit=float(get(hf, "swiglu_limit", 7.0)),
        )
        moe = self.read_moe(
            hf, where, hf["intermediate_size"], norm_topk_prob=True, router_bias=True, expert_bias=True, **glu
        )
        return dict(bias=bias, qkv_bias=bias, attention=attention_from_hf(hf, where, layers, window), moe=moe)

    def config_kwargs(self, hf, where):
        """Llama's reading; rope_parameters default to gpt-oss's YaRN (theta 150000, x32 over 4096)."""
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
            hf = {**hf, "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                            "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 4096,
                                            "rope_theta": get(hf, "rope_theta", 150000.0)}}  # fmt: skip
        return super().config_kwargs(hf, where)

    def options_to_hf(self, cfg):
        """attention_bias, the window and layer types, the experts."""
        from .base import attention_to_hf

        spec = cfg.moe_spec
        window, types = attention_to_hf(cfg)
        if window is None:
            raise HFError("gpt-oss configs need sliding_window; this model has no local layer")
        return dict(attention_bias=cfg.bias, sliding_window=window, layer_types=types, **self.write_moe(cfg),
                    swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit)  # fmt: skip

    def hf_config(self, cfg, vocab):
        """intermediate_size is the experts' inner size."""
        return {**super().hf_config(cfg, vocab), "intermediate_size": cfg.moe_spec.expert_ffn}

    def pieces(self, cfg, role, block, local):
        """Expert j's tensors are matrix j of the layer's stacks, gate and up de-interleaved."""
        m = _EXPERT.match(local) if role == "block" else None
        if m is None:
            return super().pieces(cfg, role, block, local)
        j, proj, leaf = int(m.group(1)), m.group(2), m.group(3)
        name = f"model.layers.{block}.mlp.experts.{'gate_up_proj' if proj == 'up' else 'down_proj'}"
        name += "_bias" if leaf == "bias" else ""
        transpose = leaf == "weight"  # stored [in, out]
        if proj == "down":
            return [Piece(name, transpose, index=j)]
        f = cfg.moe_spec.expert_ffn
        return [Piece(name, transpose, start=0, size=f, index=j, step=2),
                Piece(name, transpose, start=1, size=f, index=j, step=2)]  # fmt: skip

    def in_memory(self, cfg, state):
        """The files hold transformers' in-memory layout already."""
        return state
