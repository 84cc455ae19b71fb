"""Every key of an HF config that transformers' modeling code reads is honoured, inert or refused by
name (mt3d.model.families.keys), and HF directories that would make mt3d compute something else than
transformers (or read files outside them, or run their code) are refused in one line."""

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig

from mt3d.checkpoint.loading import from_pretrained, open_source
from mt3d.data.tokenizer import TokenizerError, load_tokenizer, train_bpe
from mt3d.model.families import HFError, families
from mt3d.model.hf import config_from_hf
from mt3d.model.inference import logits

TRANSFORMERS = Path(__import__("transformers").__file__).parent / "models"


def _read_keys(module: str) -> set[str]:
    src = (TRANSFORMERS / module / f"modeling_{module}.py").read_text()
    keys = set(re.findall(r"\bconfig\.([A-Za-z_][A-Za-z0-9_]*)", src))
    keys |= set(re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"']([A-Za-z_0-9]+)[\"']", src))
    return keys


@pytest.mark.parametrize("family", [f for f in families() if f.transformers_module], ids=lambda f: f.name)
def test_the_key_table_covers_what_transformers_reads(family):
    missing = sorted(_read_keys(family.transformers_module) - set(family.hf_keys))
    assert not missing, f"{family.name}: transformers' modeling code reads {missing}: add them to hf_keys"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_bpe(["the quick brown fox jumps over the lazy dog"] * 50, 300, d)
    return d


def _save(model, d, tok_dir):
    model.save_pretrained(d)
    for f in Path(tok_dir).iterdir():
        shutil.copy(f, d / f.name)
    return d


def _gpt2(tmp_path, tok_dir, name="gpt2", **kw):
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=300, n_positions=32, **kw)
    return _save(AutoModelForCausalLM.from_config(cfg), tmp_path / name, tok_dir)


def _edit(d, **changes):
    f = d / "config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))
    return d


def test_a_mistral_config_with_layer_types_is_read_as_transformers_reads_it(tmp_path, tok_dir):
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=300, max_position_embeddings=64,
                        sliding_window=4)  # fmt: skip
    d = _save(AutoModelForCausalLM.from_config(cfg), tmp_path / "mistral", tok_dir)
    _edit(d, layer_types=["sliding_attention", "full_attention"] * 2)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(d).eval()
        assert type(ref).__name__ == "MinistralForCausalLM"
        want = ref(ids).logits
        model = from_pretrained(d)
        assert model.config.family == "ministral"
        got = logits(model, ids, model.state, model.config.hidden)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"scale_attn_weights": False}, "scale_attn_weights=False asks for attention scores without"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True asks for"),
        ({"n_embd": "32"}, "n_embd must be a positive integer, got '32'"),
        ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon must be a positive number"),
        ({"vocab_size": "300"}, "vocab_size must be a positive integer"),
        ({"architectures": 7}, "architectures must be a list of strings, got 7"),
        ({"embd_pdrop": 0.3, "resid_pdrop": 0.1}, "embd_pdrop 0.3 differs from resid_pdrop 0.1"),
        ({"vocab_size": 10**9}, "config.json implies .* of shape \\(1000000000, 32\\)"),
        ({"n_embd": 64}, "config.json implies"),
        ({"dtype": "float16"}, None),  # the weights are F32: nothing ambiguous
    ],
)
def test_gpt2_configs_that_would_compute_something_else_are_refused_by_name(
    tmp_path, tok_dir, changes, match
):
    d = _edit(_gpt2(tmp_path, tok_dir), **changes)
    if match is None:
        open_source(d)
        return
    with pytest.raises(HFError, match=match) as info:
        open_source(d)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "rope,match",
    [
        ({"rope_type": "linear"}, "needs factor as a positive number, got None"),
        ({"rope_type": "linear", "factor": 0}, "needs factor as a positive number, got 0"),
        ({"rope_type": "dynamic", "factor": "2"}, "needs factor"),
        ({"rope_type": "default", "rope_theta": "1e4"}, "rope_theta must be a positive number"),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "high_freq_factor must be larger",
        ),  # fmt: skip
    ],
)
def test_rope_parameters_without_their_numbers_are_refused(tmp_path, tok_dir, rope, match):
    torch.manual_seed(0)
    cfg = MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=300, max_position_embeddings=64)  # fmt: skip
    d = _save(AutoModelForCausalLM.from_config(cfg), tmp_path / "m", tok_dir)
    _edit(d, rope_parameters={"rope_theta": 10000.0, **rope})
    with pytest.raises(HFError, match=match):
        config_from_hf(d)
    _edit(d, rope_parameters=None, rope_scaling=None, max_window_layers="8")  # not read by Mistral: ignored
    config_from_hf(d)


def test_weights_the_config_does_not_describe(tmp_path, tok_dir, caplog):
    from safetensors.torch import load_file, save_file

    d = _gpt2(tmp_path, tok_dir, "tied")
    sd = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in sd  # transformers stores a tied head once
    sd["lm_head.weight"] = sd["transformer.wte.weight"] + 0.01  # a trained head in a tied config
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="ties the output layer to the embedding .* set tie_word_embeddings"):
        open_source(d)
    sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()  # the same head: nothing to refuse
    extra = {k.replace(".h.1.", ".h.2."): v.clone() for k, v in sd.items() if ".h.1." in k}  # a third layer
    save_file({**sd, **extra}, d / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="mt3d"):
        open_source(d)
    assert (
        "12 stored tensor(s) are not part of the model" in caplog.text and "transformer.h.2." in caplog.text
    )
    half = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    save_file(half, d / "model.safetensors", metadata={"format": "pt"})
    _edit(d, dtype="float16")
    with pytest.raises(HFError, match="says float16 but the weights are stored as BF16"):
        open_source(d)


def test_files_outside_a_directory_and_custom_code_are_refused(tmp_path, tok_dir):
    from mt3d.checkpoint.manifest import CheckpointError, read_manifest

    d = _gpt2(tmp_path, tok_dir, "sharded")
    (tmp_path / "secret").mkdir()
    shutil.copy(d / "model.safetensors", tmp_path / "secret" / "other.safetensors")
    index = {"metadata": {}, "weight_map": {"transformer.wte.weight": "../secret/other.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFError, match="leads outside"):
        open_source(d)
    (d / "link.safetensors").symlink_to(tmp_path / "secret" / "other.safetensors")
    index["weight_map"] = {"transformer.wte.weight": "link.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFError, match="leads outside"):
        open_source(d)
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps(
        {"format": "mt3d-checkpoint-1", "meta": {}, "files": {"../../x": {"size": 1, "sha256": "0"}}}
    ))  # fmt: skip
    with pytest.raises(CheckpointError, match="leads outside"):
        read_manifest(ckpt)
    tok = tmp_path / "custom_tok"
    shutil.copytree(tok_dir, tok)
    _edit_json = json.loads((tok / "tokenizer_config.json").read_text())
    _edit_json["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (tok / "tokenizer_config.json").write_text(json.dumps(_edit_json))
    with pytest.raises(TokenizerError, match="custom tokenizer code .* never runs code"):
        load_tokenizer(tok)
