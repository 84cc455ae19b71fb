"""Named model sizes. ``get_preset(name)`` returns a fresh ModelConfig.

Sizes follow the published configurations: GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020,
Table 2.1), Megatron-LM 8.3B (Shoeybi et al. 2019), MT-NLG 530B (Smith et al. 2022), Llama 2
(Touvron et al. 2023), and the released HF configs of Mistral 7B v0.1, Qwen2.5-7B, Qwen3-8B,
Gemma 2 9B, Gemma 3 27B, Mixtral 8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B and Qwen3-Next-80B-A3B. Each names its
``family``, whose block options fill the keys it does not give.
``tiny`` is the CPU demo model; ``tiny-<family>`` are CPU variants of each family.
"""

from __future__ import annotations

import difflib

from .model.config import ModelConfig, ModelConfigError

_GPT = dict(family="gpt2")
_LLAMA = dict(family="llama", norm_eps=1e-5, rope_theta=10000.0)
# the CPU variants of the newer families: windows shorter than the test sequences
_TINY = dict(hidden=64, layers=4, heads=4, kv_heads=2, ffn=128, max_seq_len=128)
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _deepseek_v3(heads: int, factor: float, beta_fast: float, moe: dict, **sizes) -> dict:
    """DeepSeek-V3's shapes (the published latent attention, top-8 routing with one shared expert,
    YaRN) with what tells DeepSeek-V3 and Kimi K2 apart: heads, sizes, RoPE scaling and expert groups."""
    return dict(
        family="deepseek_v3", hidden=7168, layers=61, heads=heads, kv_heads=heads, ffn=18432, **sizes,
        rope_scaling={"rope_type": "yarn", "factor": factor, "beta_fast": beta_fast, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        mla=dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 q_lora_rank=1536, rope_interleave=True),
        moe=dict(top_k=8, expert_ffn=2048, shared_ffn=2048, shared_gate=False, scoring="sigmoid",
                 correction_bias=True, **moe),
    )  # fmt: skip


PRESETS: dict[str, dict] = {
    "tiny": dict(hidden=64, layers=4, heads=4, max_seq_len=128, **_GPT),
    "tiny-llama": dict(hidden=64, layers=4, heads=4, kv_heads=2, ffn=128, max_seq_len=128, **_LLAMA),
    "tiny-mistral": dict(family="mistral", attention={"window": 16}, **_TINY),
    "tiny-qwen2": dict(
        family="qwen2", attention={"window": 16, "layer_types": [_FULL, _FULL, _SLIDING, _SLIDING]}, **_TINY
    ),
    "tiny-qwen3": dict(family="qwen3", head_dim=32, **_TINY),
    "tiny-gemma2": dict(
        family="gemma2",
        head_dim=32,
        query_pre_attn_scalar=24,
        attention={"window": 16, "global_every": 2},
        **_TINY,
    ),
    "tiny-gemma3": dict(
        family="gemma3",
        head_dim=32,
        query_pre_attn_scalar=24,
        attention={"window": 16, "global_every": 2},
        rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rope_local={"rope_theta": 10_000.0},
        **_TINY,
    ),
    # mixture-of-experts CPU variants: 4 experts, top-2, a load-balancing loss
    "tiny-gpt-oss": dict(
        family="gpt_oss", rope_theta=150000.0,
        attention={"window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2},
        moe=dict(experts=4, top_k=2, expert_ffn=64, norm_topk_prob=True, router_bias=True, expert_bias=True,
                 swiglu_limit=7.0, swiglu_alpha=1.702),
        **{**_TINY, "head_dim": 16},
    ),
    "tiny-deepseek-v3": dict(
        family="deepseek_v3", hidden=64, layers=4, heads=4, kv_heads=4, ffn=128, max_seq_len=128,
        mla=dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=32,
                 rope_interleave=True),
        moe=dict(experts=8, top_k=2, expert_ffn=32, shared_ffn=32, shared_gate=False, scoring="sigmoid",
                 n_group=4, topk_group=2, routed_scaling=2.5, correction_bias=True, dense_layers=[0],
                 bias_update_rate=1e-3),
    ),
    "tiny-mixtral": dict(
        family="mixtral", moe=dict(experts=4, top_k=2, expert_ffn=64, aux_loss_coef=0.02), **_TINY
    ),
    "tiny-qwen2-moe": dict(
        family="qwen2_moe",
        moe=dict(experts=4, top_k=2, expert_ffn=32, shared_ffn=64, dense_layers=[1], norm_topk_prob=False,
                 aux_loss_coef=0.02),
        **_TINY,
    ),
    "tiny-glm4-moe": dict(
        family="glm4_moe", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=128, max_seq_len=128,
        rotary_fraction=0.5, qkv_bias=True, qk_norm=True, bias=False, tie_embeddings=False,
        moe=dict(experts=8, top_k=2, expert_ffn=32, shared_ffn=32, shared_gate=False, scoring="sigmoid",
                 correction_bias=True, n_group=4, topk_group=2, routed_scaling=2.5, norm_topk_prob=True,
                 dense_layers=[0], aux_loss_coef=0.02),
    ),
    "tiny-minimax-m2": dict(
        family="minimax_m2", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=128, max_seq_len=128,
        rotary_fraction=0.5, qk_norm="all", bias=False, tie_embeddings=False, norm_eps=1e-6,
        moe=dict(experts=8, top_k=2, expert_ffn=32, scoring="sigmoid", correction_bias=True,
                 norm_topk_prob=True, bias_update_rate=1e-3),
    ),
    # Qwen3-Next's blocks at CPU size: Gated DeltaNet in blocks 0 and 2 (sequences past one 64-token
    # chunk), gated attention in 1 and 3, a gated shared expert, block 1 dense
    "tiny-qwen3-next": dict(
        family="qwen3_next", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128, max_seq_len=256,
        rotary_fraction=0.25, linear_attention=dict(key_heads=2, value_heads=4, key_head_dim=16,
                                                    value_head_dim=16, full_every=2),
        moe=dict(experts=4, top_k=2, expert_ffn=32, shared_ffn=64, dense_layers=[1], norm_topk_prob=True,
                 aux_loss_coef=0.02),
    ),
    # Qwen3.5 and Qwen3.5-MoE's blocks at CPU size (Qwen3-Next's with separate DeltaNet projections;
    # every block of the MoE sparse)
    "tiny-qwen3.5": dict(
        family="qwen3_5", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128, max_seq_len=256,
        rotary_fraction=0.25, linear_attention=dict(key_heads=2, value_heads=4, key_head_dim=16,
                                                    value_head_dim=16, full_every=2, fused=False),
    ),
    "tiny-qwen3.5-moe": dict(
        family="qwen3_5_moe", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128, max_seq_len=256,
        rotary_fraction=0.25, linear_attention=dict(key_heads=2, value_heads=4, key_head_dim=16,
                                                    value_head_dim=16, full_every=2, fused=False),
        moe=dict(experts=4, top_k=2, expert_ffn=32, shared_ffn=64, norm_topk_prob=True, aux_loss_coef=0.02),
    ),
    "tiny-qwen3-moe": dict(
        family="qwen3_moe", head_dim=32, moe=dict(experts=4, top_k=2, expert_ffn=32, norm_topk_prob=True,
                                                 aux_loss_coef=0.02), **_TINY,
    ),
    "gpt2-small": dict(hidden=768, layers=12, heads=12, vocab_size=50257, max_seq_len=1024, **_GPT),
    "gpt2-medium": dict(hidden=1024, layers=24, heads=16, vocab_size=50257, max_seq_len=1024, **_GPT),
    "gpt2-large": dict(hidden=1280, layers=36, heads=20, vocab_size=50257, max_seq_len=1024, **_GPT),
    "gpt2-xl": dict(hidden=1600, layers=48, heads=25, vocab_size=50257, max_seq_len=1024, **_GPT),
    "gpt3-1.3b": dict(hidden=2048, layers=24, heads=16, vocab_size=50257, max_seq_len=2048, **_GPT),
    "megatron-8.3b": dict(hidden=3072, layers=72, heads=32, vocab_size=50257, max_seq_len=1024, **_GPT),
    "gpt3-175b": dict(hidden=12288, layers=96, heads=96, vocab_size=50257, max_seq_len=2048, **_GPT),
    "mtnlg-530b": dict(hidden=20480, layers=105, heads=128, vocab_size=50257, max_seq_len=2048, **_GPT),
    "llama-1b": dict(
        hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab_size=32000, max_seq_len=2048, **_LLAMA
    ),
    "llama-7b": dict(
        hidden=4096, layers=32, heads=32, ffn=11008, vocab_size=32000, max_seq_len=4096, **_LLAMA
    ),
    "llama-13b": dict(
        hidden=5120, layers=40, heads=40, ffn=13824, vocab_size=32000, max_seq_len=4096, **_LLAMA
    ),
    "llama-70b": dict(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab_size=32000, max_seq_len=4096, **_LLAMA
    ),
    # Mistral 7B v0.1 (Jiang et al. 2023): 4096-token sliding window on every layer
    "mistral-7b": dict(
        family="mistral", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab_size=32000,
        max_seq_len=32768, norm_eps=1e-5, attention={"window": 4096},
    ),
    # Qwen2.5-7B (Qwen team 2024): q/k/v biases, no sliding window in the released config
    "qwen2.5-7b": dict(
        family="qwen2", hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab_size=152064,
        max_seq_len=32768, rope_theta=1e6,
    ),
    # Qwen3-8B (Qwen team 2025): q/k RMSNorm, head_dim 128
    "qwen3-8b": dict(
        family="qwen3", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288,
        vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
    ),
    # Gemma 2 9B (Gemma team 2024): local (4096) and global layers alternate, soft-capping 50 / 30
    "gemma2-9b": dict(
        family="gemma2", hidden=3584, layers=42, heads=16, kv_heads=8, head_dim=256, ffn=14336,
        vocab_size=256000, max_seq_len=8192, query_pre_attn_scalar=256,
        attention={"window": 4096, "global_every": 2},
    ),
    # Gemma 3 27B, the language model (Gemma team 2025): five local layers (1024) to one global, the
    # global layers' RoPE at base 1e6 scaled x8, the local ones' at 1e4
    "gemma3-27b": dict(
        family="gemma3", hidden=5376, layers=62, heads=32, kv_heads=16, head_dim=128, ffn=21504,
        vocab_size=262208, max_seq_len=131072, query_pre_attn_scalar=168,
        attention={"window": 1024, "global_every": 6}, rope_theta=1_000_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local={"rope_theta": 10_000.0},
    ),
    # Mixtral 8x7B (Jiang et al. 2024): 8 experts, top-2, every layer sparse
    "mixtral-8x7b": dict(
        family="mixtral", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab_size=32000,
        max_seq_len=32768, norm_eps=1e-5, rope_theta=1e6,
        moe=dict(experts=8, top_k=2, expert_ffn=14336, aux_loss_coef=0.02),
    ),
    # gpt-oss (OpenAI 2025): 32 / 128 experts, top-4, biases and attention sinks, 128-token windows on
    # every other layer, YaRN x32 over 4096 positions
    **{name: dict(
        family="gpt_oss", hidden=2880, layers=layers, heads=64, kv_heads=8, head_dim=64, ffn=2880,
        vocab_size=201088, max_seq_len=131072, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 4096},
        attention={"window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)},
        moe=dict(experts=experts, top_k=4, expert_ffn=2880, norm_topk_prob=True, router_bias=True,
                 expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702),
    ) for name, layers, experts in (("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128))},
    # DeepSeek-V3 (DeepSeek-AI 2024; R1 is the same model): latent attention, 256 experts in 8 groups,
    # top-8 from 4 groups, one shared expert, 3 dense blocks; without its multi-token-prediction layer
    "deepseek-v3": _deepseek_v3(
        heads=128, vocab_size=129280, max_seq_len=163840, rope_theta=10000.0, factor=40.0, beta_fast=32.0,
        moe=dict(experts=256, n_group=8, topk_group=4, routed_scaling=2.5, dense_layers=[0, 1, 2]),
    ),
    # Kimi K2 (Moonshot AI 2025): DeepSeek-V3's block with 384 experts, 64 heads, one dense block
    "kimi-k2": _deepseek_v3(
        heads=64, vocab_size=163840, max_seq_len=131072, rope_theta=50000.0, factor=32.0, beta_fast=1.0,
        moe=dict(experts=384, n_group=1, topk_group=1, routed_scaling=2.827, dense_layers=[0]),
    ),
    # GLM-4.5 and GLM-4.5-Air (Zhipu AI 2025): GQA with q/k/v biases, RoPE over half of each head,
    # DeepSeek-V3's router without groups, one shared expert; without the multi-token-prediction layer
    "glm-4.5": dict(
        family="glm4_moe", hidden=5120, layers=92, heads=96, kv_heads=8, head_dim=128, ffn=12288,
        vocab_size=151552, max_seq_len=131072, rope_theta=1e6, rotary_fraction=0.5, qkv_bias=True,
        qk_norm=True, bias=False, tie_embeddings=False, norm_eps=1e-5,
        moe=dict(experts=160, top_k=8, expert_ffn=1536, shared_ffn=1536, shared_gate=False,
                 scoring="sigmoid", correction_bias=True, routed_scaling=2.5, norm_topk_prob=True,
                 dense_layers=[0, 1, 2]),
    ),
    "glm-4.5-air": dict(
        family="glm4_moe", hidden=4096, layers=46, heads=96, kv_heads=8, head_dim=128, ffn=10944,
        vocab_size=151552, max_seq_len=131072, rope_theta=1e6, rotary_fraction=0.5, qkv_bias=True,
        bias=False, tie_embeddings=False, norm_eps=1e-5,
        moe=dict(experts=128, top_k=8, expert_ffn=1408, shared_ffn=1408, shared_gate=False,
                 scoring="sigmoid", correction_bias=True, routed_scaling=1.0, norm_topk_prob=True,
                 dense_layers=[0]),
    ),
    # MiniMax-M2 (MiniMax 2025): 256 experts, top-8, sigmoid routing with a correction bias, q/k norms
    # over all heads, RoPE over half of each head; without the multi-token-prediction modules
    "minimax-m2": dict(
        family="minimax_m2", hidden=3072, layers=62, heads=48, kv_heads=8, head_dim=128, ffn=1536,
        vocab_size=200064, max_seq_len=196608, rope_theta=5e6, rotary_fraction=0.5, qk_norm="all",
        bias=False, tie_embeddings=False, norm_eps=1e-6,
        moe=dict(experts=256, top_k=8, expert_ffn=1536, scoring="sigmoid", correction_bias=True,
                 norm_topk_prob=True),
    ),
    # Qwen3-30B-A3B and Qwen3-235B-A22B (Qwen team 2025): 128 experts, top-8, renormalised
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, ffn=6144,
        vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
        moe=dict(experts=128, top_k=8, expert_ffn=768, norm_topk_prob=True, aux_loss_coef=0.001),
    ),
    # Qwen3-Next-80B-A3B (Qwen team 2025): Gated DeltaNet in 3 of 4 blocks, 512 experts top-10 with a
    # gated shared expert
    "qwen3-next-80b-a3b": dict(
        family="qwen3_next", hidden=2048, layers=48, heads=16, kv_heads=2, head_dim=256, ffn=5120,
        vocab_size=151936, max_seq_len=262144, rope_theta=1e7, rotary_fraction=0.25,
        linear_attention=dict(key_heads=16, value_heads=32, key_head_dim=128, value_head_dim=128,
                              full_every=4),
        moe=dict(experts=512, top_k=10, expert_ffn=512, shared_ffn=512, norm_topk_prob=True,
                 aux_loss_coef=0.001),
    ),
    "qwen3-235b-a22b": dict(
        family="qwen3_moe", hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128, ffn=12288,
        vocab_size=151936, max_seq_len=40960, rope_theta=1e6,
        moe=dict(experts=128, top_k=8, expert_ffn=1536, norm_topk_prob=True, aux_loss_coef=0.001),
    ),
}  # fmt: skip


def preset_names() -> list[str]:
    """All preset names."""
    return list(PRESETS)


def get_preset(name: str) -> ModelConfig:
    """A new ModelConfig for the named preset (unknown names suggest the closest ones)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelConfigError(f"unknown model preset {name!r}{hint} (known: {', '.join(PRESETS)})")
    return ModelConfig.from_dict({"name": name, **PRESETS[name]})
