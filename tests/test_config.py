"""Run configs: overrides, typed parsing, and every bad config refused before process groups exist."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mt3d.config import ConfigError, apply_overrides, from_dict, load, resolve_model, validate

from helpers import TINY_LLAMA, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def check(raw, world):
    run = from_dict(raw)
    return validate(run, world, resolve_model(run.mt3d.model))


def test_overrides_reach_deepspeed_and_mt3d_keys(tmp_path):
    raw = tiny_config(tmp_path)
    raw["bf16"] = {"enabled": True}
    out = apply_overrides(
        raw,
        [
            "bf16.enabled=false",
            "mt3d.train.steps=10",
            "mt3d.parallel.sequence_parallel=true",
            "zero_optimization.offload_optimizer.device=cpu",
            "mt3d.train.run_name=demo run",
            "mt3d.parallel.stage_layers=[1, 3]",
        ],
    )
    assert out["bf16"]["enabled"] is False and raw["bf16"]["enabled"] is True  # input untouched
    assert out["mt3d"]["train"]["steps"] == 10
    assert out["mt3d"]["parallel"]["sequence_parallel"] is True
    assert out["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert out["mt3d"]["train"]["run_name"] == "demo run"
    run = from_dict(out)
    assert run.mt3d.parallel.stage_layers == [1, 3] and run.ds["bf16"] == {"enabled": False}
    with pytest.raises(ConfigError, match="not an object"):
        apply_overrides(raw, ["mt3d.train.steps.x=1"])
    with pytest.raises(ConfigError, match="key.path=value"):
        apply_overrides(raw, ["mt3d.train.steps"])


def test_file_loading_and_batch_derivation(tmp_path):
    f = tmp_path / "c.json"
    raw = tiny_config(tmp_path, tp=2, pp=2)
    del raw["train_micro_batch_size_per_gpu"]
    raw["gradient_accumulation_steps"] = 2
    f.write_text(json.dumps(raw))
    run = load(f, ["mt3d.train.steps=3"])
    layout = validate(run, 8, resolve_model(run.mt3d.model))
    assert (layout.tp, layout.pp, layout.dp) == (2, 2, 2)
    assert (layout.micro_batch, layout.grad_accum, layout.global_batch) == (2, 2, 8)
    assert run.ds["train_micro_batch_size_per_gpu"] == 2 and run.mt3d.train.steps == 3
    assert isinstance(from_dict({"mt3d": {"model": "gpt2-small"}}).mt3d.model, dict)


BAD = {
    "world not divisible": (lambda r: r, 6, "not divisible by tensor\\*pipeline"),
    "heads vs tp": (
        lambda r: r["mt3d"]["parallel"].update(tensor=8),
        16,
        "heads \\(4\\) are not divisible by tp=8",
    ),
    "kv heads vs tp": (
        lambda r: (
            r["mt3d"].update(model=dict(TINY_LLAMA, heads=8, kv_heads=2)),
            r["mt3d"]["parallel"].update(tensor=4),
        ),
        8,
        "kv_heads \\(2\\) are not divisible by tp=4",
    ),
    "layers < stages": (
        lambda r: r["mt3d"]["parallel"].update(pipeline=8, tensor=1),
        8,
        "4 layers cannot fill 8",
    ),
    "zero-2 with pp": (
        lambda r: r["zero_optimization"].update(stage=2),
        4,
        "ZeRO stage 2 cannot be used with pipeline",
    ),
    "zero-0 with pp": (lambda r: r["zero_optimization"].update(stage=0), 4, "stage to 1"),
    "batch mismatch": (lambda r: r.update(gradient_accumulation_steps=3), 4, "!= micro-batch 2 x"),
    "batch indivisible": (lambda r: r.update(train_batch_size=10), 8, "not divisible by micro-batch\\*dp"),
    "unknown key": (lambda r: r["mt3d"]["train"].update(stpes=3), 4, "did you mean 'steps'"),
    "unknown section": (lambda r: r["mt3d"].update(trian={}), 4, "did you mean 'train'"),
    "wrong type": (lambda r: r["mt3d"]["train"].update(steps="ten"), 4, "'mt3d.train.steps' must be int"),
    "bad preset": (lambda r: r["mt3d"].update(model={"preset": "gpt2-smal"}), 4, "did you mean gpt2-small"),
    "bad model key": (lambda r: r["mt3d"]["model"].update(hiden=3), 4, "unknown model keys \\['hiden'\\]"),
    "missing data": (
        lambda r: r["mt3d"]["data"].update(corpus="indexed", prefixes=["/nonexistent/x"]),
        4,
        "/nonexistent/x.bin not found",
    ),
    "missing resume": (
        lambda r: r["mt3d"]["train"].update(resume="/nonexistent/ckpt"),
        4,
        "checkpoint not found",
    ),
    "seq too long": (lambda r: r["mt3d"]["data"].update(seq_len=512), 4, "exceeds the model's max_seq_len"),
    "stage layers": (lambda r: r["mt3d"]["parallel"].update(stage_layers=[1, 1]), 4, "adding up to 4"),
    "zero heads": (lambda r: r["mt3d"]["model"].update(heads=0), 4, "model.heads must be a positive integer"),
    "rank order": (lambda r: r["mt3d"]["parallel"].update(order="tp-pp"), 4, "permutation of tp-dp-pp"),
    "islands": (lambda r: r["mt3d"]["parallel"].update(islands="0,1;x"), 4, "islands must look like"),
    "missing hostfile": (
        lambda r: r["mt3d"]["parallel"].update(hostfile="/nonexistent/hosts"),
        4,
        "hostfile not found",
    ),
    "hostfile vs world": (
        lambda r: r["mt3d"]["parallel"].update(hostfile=str(ROOT / "launch/hostfile.example")),
        8,
        "hosts provide 32 slots but world size is 8",
    ),
    "max bad steps": (lambda r: r["mt3d"]["train"].update(max_bad_steps=0), 4, "max_bad_steps must be >= 1"),
    "eval batches": (
        lambda r: r["mt3d"]["train"].update(eval_batches=0, eval_interval=2),
        4,
        "eval_interval > 0 needs eval_batches >= 1",
    ),
    "data split": (
        lambda r: r["mt3d"]["data"].update(split=[1.0, 0.0, 0.0]),
        4,
        "gives the validation split no documents but the run evaluates",
    ),
    "blend weights": (lambda r: r["mt3d"]["data"].update(weights=[-1.0]), 4, "weights must be non-negative"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_are_refused_with_one_line(tmp_path, case):
    change, world, match = BAD[case]
    raw = tiny_config(tmp_path, tp=2, pp=2)
    change(raw)
    with pytest.raises(ConfigError, match=match) as info:
        check(raw, world)
    assert "\n" not in str(info.value)


def run_train(args, world=8, timeout=120):
    env = dict(os.environ, WORLD_SIZE=str(world))
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "mt3d.train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_train_command_rejects_bad_input_before_process_groups(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(tiny_config(tmp_path, tp=2, pp=2)))
    # WORLD_SIZE=6 with no rendezvous address: reaching process-group creation would hang or crash
    out = run_train(["--config", str(f)], world=6)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "mt3d train: error: world size 6 is not divisible by tensor*pipeline = 2*2; "
        "launch a multiple of 4 processes or change mt3d.parallel"
    ]
    out = run_train(["--config", str(f), "--set", "zero_optimization.stage=3"])
    assert out.returncode == 2 and "ZeRO stage 3" in out.stderr
    out = run_train(["--config", str(tmp_path / "missing.json")])
    assert out.returncode == 2 and "config file not found" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,\n "mt3d": {,}}')
    out = run_train(["--config", str(bad)])
    assert out.returncode == 2 and "bad.json:2:" in out.stderr and "invalid JSON" in out.stderr
    ok = run_train(["--config", str(f), "--check"])
    assert ok.returncode == 0 and "tp 2 x pp 2 x dp 2" in ok.stdout


CONFIG_WORLDS = {
    "cpu_demo_3d.json": [8],
    "gpt3_1.3b_8gpu.json": [8, 64],
    "megatron_8.3b_tp8.json": [8, 512],
    "mtnlg_530b_tp8_pp35.json": [2240, 4480],
}
# templates that name the user's own preprocessed data are checked with the builtin corpus instead
USER_DATA = {"megatron_8.3b_tp8.json"}
# fine-tuning templates start from an HF directory the README makes first: checked there, by
# tests/test_docs.py::test_the_readme_fine_tuning_path_prepares_its_data_and_config
FROM_HF = {"sft_llama.json", "lora_llama.json", "dpo_llama.json"}


@pytest.mark.parametrize("name", sorted(CONFIG_WORLDS))
def test_shipped_configs_validate(name):
    path = ROOT / "ds_configs" / name
    for world in CONFIG_WORLDS[name]:
        run = load(path, ["mt3d.data.corpus=builtin"] if name in USER_DATA else [])
        layout = validate(run, world, resolve_model(run.mt3d.model))
        assert layout.world == world


def test_every_shipped_config_is_checked():
    assert sorted(p.name for p in (ROOT / "ds_configs").glob("*.json")) == sorted({*CONFIG_WORLDS, *FROM_HF})


def test_preset_overrides_rederive_dependent_sizes():
    cfg = resolve_model({"preset": "tiny", "hidden": 512, "heads": 8})
    assert (cfg.ffn, cfg.head_dim, cfg.kv_heads) == (2048, 64, 8)
    llama = resolve_model({"preset": "llama-7b", "hidden": 2048, "heads": 16, "ffn": 5504})
    assert (llama.ffn, llama.head_dim, llama.name) == (5504, 128, "llama-7b")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention": {"window": 0}}, "model.attention.window must be a positive integer, got 0"),
        (
            {"attention": {"window": 4, "layer_types": ["sliding_attention"]}},
            "model.attention.layer_types must list 4 layers",
        ),
        ({"attn_softcap": 0}, "model.attn_softcap must be a positive number or null, got 0"),
        ({"logit_softcap": -30.0}, "model.logit_softcap must be a positive number or null, got -30.0"),
        ({"family": "falcon"}, "unknown model family 'falcon'"),
        ({"family": "gpt2", "kv_heads": 2}, "family 'gpt2' (GPT2LMHeadModel): needs heads * head_dim"),
        ({"family": "llama", "qk_norm": True}, "model.qk_norm=True cannot be expressed by family 'llama'"),
        ({"mlp": "reglu"}, "model.mlp must be one of ('gelu', 'swiglu', 'geglu')"),
        ({"attention": {"window": 8, "stride": 16}}, "model.attention.stride 16 is larger than the window 8"),
        (
            {"attention": {"window": 100, "dilation": 2}},
            "model.attention: dilation 2 x window 100 exceeds max_seq_len 128",
        ),
        ({"attention": {"window": 8, "dilation": 0}}, "model.attention.dilation must be a positive integer"),
        (
            {"family": "gemma2", "attention": {"window": 8, "stride": 4}},
            "model.attention stride/dilation cannot be expressed by family 'gemma2'",
        ),
    ],
)
def test_bad_model_options_are_refused_by_key(change, message):
    with pytest.raises(ConfigError, match=re.escape(f"mt3d.model: {message}")):
        resolve_model({"preset": "tiny", **change})


def test_a_bad_window_stops_the_train_command_in_one_line(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps(tiny_config(tmp_path)))
    out = run_train(["--config", str(f), "--set", 'mt3d.model.attention={"window": -1}', "--check"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "mt3d train: error: mt3d.model: model.attention.window must be a positive integer, got -1"
    ]


def test_presets_of_every_family_and_their_published_sizes():
    sizes = {"mistral-7b": 7.24, "qwen2.5-7b": 7.62, "qwen3-8b": 8.19, "gemma2-9b": 9.24, "gemma3-27b": 27.01}
    for name, billions in sizes.items():
        cfg = resolve_model({"preset": name})
        assert cfg.family == name.split("-")[0].replace("2.5", "2")
        assert abs(cfg.num_params() / 1e9 - billions) < 0.01, name
    for family in ("mistral", "qwen2", "qwen3", "gemma2", "gemma3"):
        assert resolve_model({"preset": f"tiny-{family}"}).family == family
    # Gemma 3 27B: the count transformers' model of the published config has, and its layer pattern
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    g3 = resolve_model({"preset": "gemma3-27b"})
    hf = Gemma3TextConfig(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, head_dim=128,
                          num_attention_heads=32, num_key_value_heads=16, query_pre_attn_scalar=168,
                          sliding_window=1024, vocab_size=262208, max_position_embeddings=131072)  # fmt: skip
    with torch.device("meta"):
        assert g3.num_params() == sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert ["full_attention" if p is None else "sliding_attention" for p in g3.patterns] == hf.layer_types
    # the 2025 families: transformers' models of the published configs (DeepSeek-V3 without its MTP
    # layer; the correction biases are buffers there, parameters here), the active counts as published,
    # without the input embedding (3.6B, 5.1B, 37B)
    from transformers import DeepseekV3Config, GptOssConfig

    published = {
        "gpt-oss-20b": (GptOssConfig(num_hidden_layers=24, num_local_experts=32), 3.6),
        "gpt-oss-120b": (GptOssConfig(), 5.1),
        "deepseek-v3": (DeepseekV3Config(num_mtp_layers=0), 37.0),
    }
    for name, (hf, active) in published.items():
        cfg = resolve_model({"preset": name})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        held = sum(p.numel() for p in model.parameters())
        held += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert cfg.num_params() == held, name
        assert abs((cfg.active_params() - cfg.embedding_params()) / 1e9 - active) / active < 0.02, name
    # GLM-4.5 and -Air: transformers' models of the published configs (without the MTP layer); their
    # active counts as published count neither the input embedding nor the output layer (32B, 12B)
    from transformers import Glm4MoeConfig

    rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
    glm = dict(
        vocab_size=151552, num_key_value_heads=8, head_dim=128, attention_bias=True, rope_parameters=rope
    )
    for name, hf, active in (
        ("glm-4.5", Glm4MoeConfig(hidden_size=5120, num_hidden_layers=92, num_attention_heads=96,
                                  intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
                                  first_k_dense_replace=3, use_qk_norm=True, routed_scaling_factor=2.5,
                                  **glm), 32.0),
        ("glm-4.5-air", Glm4MoeConfig(hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
                                      intermediate_size=10944, moe_intermediate_size=1408,
                                      n_routed_experts=128, first_k_dense_replace=1, **glm), 12.0),
    ):  # fmt: skip
        cfg = resolve_model({"preset": name})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf)
        held = sum(p.numel() for p in model.parameters())
        held += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert cfg.num_params() == held and cfg.family == "glm4_moe", name
        assert abs((cfg.active_params() - 2 * cfg.embedding_params()) / 1e9 - active) / active < 0.02, name
    # MiniMax-M2: transformers' model of the published config (rotary_dim 64 of 128), 10B active without
    # the embedding and the output layer
    from transformers import MiniMaxM2Config

    hf = MiniMaxM2Config(rotary_dim=64)  # the published config.json's legacy key
    cfg = resolve_model({"preset": "minimax-m2"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    held = sum(p.numel() for p in model.parameters())
    held += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert cfg.num_params() == held and cfg.family == "minimax_m2" and cfg.rotary_dim == 64
    assert abs((cfg.active_params() - 2 * cfg.embedding_params()) / 1e9 - 10.0) / 10.0 < 0.02
    # Qwen3-Next-80B-A3B: transformers' model of the published config; 3.25B active without the embedding
    # and the output layer (published: "3B activated")
    from transformers import Qwen3NextConfig

    hf = Qwen3NextConfig(vocab_size=151936, num_experts=512, num_experts_per_tok=10, intermediate_size=5120,
                         max_position_embeddings=262144)  # fmt: skip
    cfg = resolve_model({"preset": "qwen3-next-80b-a3b"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters()) and cfg.family == "qwen3_next"
    assert abs((cfg.active_params() - 2 * cfg.embedding_params()) / 1e9 - 3.25) < 0.01
    kimi = resolve_model({"preset": "kimi-k2"})
    assert abs(kimi.num_params() / 1e12 - 1.03) < 0.01 and abs(kimi.active_params() / 1e9 - 32.9) < 0.1
    # a preset's family is a default: overrides it cannot express make the model 'custom'
    assert resolve_model({"preset": "tiny", "kv_heads": 2}).family == "custom"
    # any preset trains with a pattern (its family becomes 'custom' when HF cannot express it)
    pattern = {"window": 1024, "stride": 256, "global_every": 4}
    gpt = resolve_model({"preset": "gpt3-1.3b", "attention": pattern})
    assert gpt.family == "custom" and [p is None for p in gpt.patterns[:4]] == [False, False, False, True]
    # local layers count their window, not the sequence, in FLOPs
    gemma = resolve_model({"preset": "gemma2-9b"})
    assert gemma.attended_keys(8192) == (4096 + 8192) / 2
    assert gemma.flops_per_token(8192) < resolve_model(
        {"preset": "gemma2-9b", "attention": None}
    ).flops_per_token(8192)
