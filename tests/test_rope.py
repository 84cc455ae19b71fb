"""RoPE scalings against transformers: YaRN (with DeepSeek's mscale ratio and custom betas) and
longrope (short factors within the pretraining length, long ones past it), on a tiny Llama; each one
changes the logits (the scaling bites at these lengths)."""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from mt3d.checkpoint.loading import from_pretrained
from mt3d.data.tokenizer import train_bpe
from mt3d.model.inference import logits

OLD = 16  # the pretraining length the scalings extend; test sequences of 12 and 40 tokens
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": OLD,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                 "long_factor": [2.0 + 0.3 * i for i in range(8)], "original_max_position_embeddings": OLD},
}  # fmt: skip


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_bpe(["the quick brown fox jumps over the lazy dog"] * 50, 300, d)
    return d


def llama(path, tok_dir, rope):
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=300, max_position_embeddings=64,
                      rope_parameters={**rope, "rope_theta": 10000.0})  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in tok_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_scalings_match_transformers(tmp_path, tok_dir, name):
    d = llama(tmp_path / name, tok_dir, SCALINGS[name])
    plain = from_pretrained(llama(tmp_path / "plain", tok_dir, {"rope_type": "default"}))
    ref, model = AutoModelForCausalLM.from_pretrained(d).eval(), from_pretrained(d)
    assert model.config.rope_scaling["rope_type"] == SCALINGS[name]["rope_type"]
    for n in (12, 40):
        ids = torch.randint(0, 300, (2, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            want = ref(ids).logits
            got = logits(model, ids, model.state, model.config.hidden)[..., :300]
            unscaled = logits(plain, ids, plain.state, plain.config.hidden)[..., :300]
        assert (got - want).abs().max().item() < 1e-4, (name, n)
        assert (unscaled - want).abs().max().item() > 1e-3, (name, n)
