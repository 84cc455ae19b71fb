"""Named model sizes. ``get_preset(name)`` returns a fresh ModelConfig.

Sizes follow the published configurations: GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020,
Table 2.1), Megatron-LM 8.3B (Shoeybi et al. 2019), MT-NLG 530B (Smith et al. 2022), Llama 2
(Touvron et al. 2023). ``tiny`` is the CPU demo model.
"""

from __future__ import annotations

import difflib

from .model.config import ModelConfig, ModelConfigError

_GPT = dict(position="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
_LLAMA = dict(
    position="rope",
    norm="rmsnorm",
    mlp="swiglu",
    bias=False,
    tie_embeddings=False,
    norm_eps=1e-5,
    rope_theta=10000.0,
)

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden=64, layers=4, heads=4, max_seq_len=128, **_GPT),
    "tiny-llama": dict(hidden=64, layers=4, heads=4, kv_heads=2, ffn=128, max_seq_len=128, **_LLAMA),
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
}


def preset_names() -> list[str]:
    """All preset names."""
    return list(PRESETS)


def get_preset(name: str) -> ModelConfig:
    """A new ModelConfig for the named preset (unknown names suggest the closest ones)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelConfigError(f"unknown model preset {name!r}{hint} (known: {', '.join(PRESETS)})")
    return ModelConfig(name=name, **PRESETS[name])
