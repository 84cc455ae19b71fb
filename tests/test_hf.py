"""HF transformers interop for every family: logits at every tp x pp, eval, round trip, fine-tuning
parity, generation past the sliding window, and bad input.

The tiny models exercise what each family adds: sliding windows (8) shorter than every test
sequence, mixed local/global layers, q/k/v biases, q/k norms, head_dim != hidden / heads, Gemma's
soft-caps (small enough to bite), tied and untied heads; every bias and norm weight is randomised.
"""

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    MiniMaxM2Config,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from mt3d.checkpoint.loading import from_pretrained
from mt3d.data.corpora import stdlib_documents
from mt3d.data.tokenizer import load_tokenizer, train_bpe
from mt3d.model.families import HFError
from mt3d.model.hf import config_from_hf
from mt3d.parallel.spawn import spawn

from helpers import run_grouped, tiny_config

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = [
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "minimax_m2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen3_next",
       "qwen3_5_moe"]  # fmt: skip
WINDOWED = ["mistral", "qwen2", "gemma2", "gemma3", "gpt_oss"]
WINDOW = 8


def hf_configs(vocab, eos):
    small = dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, vocab_size=vocab,
        max_position_embeddings=128, bos_token_id=eos, eos_token_id=eos,
    )  # fmt: skip
    return {
        "gpt2": GPT2Config(
            n_embd=64, n_layer=4, n_head=4, vocab_size=vocab, n_positions=128, bos_token_id=eos,
            eos_token_id=eos,
        ),
        "llama": LlamaConfig(
            num_attention_heads=8, num_key_value_heads=4, **small,
            rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        ),
        "mistral": MistralConfig(
            num_attention_heads=8, num_key_value_heads=4, sliding_window=WINDOW, rope_theta=5000.0, **small
        ),
        "qwen2": Qwen2Config(
            num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=2, tie_word_embeddings=True, **small,
        ),
        "qwen3": Qwen3Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True, **small
        ),
        "gemma2": Gemma2Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
            query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **small,
        ),
        # Gemma 3: q/k norms, local layers at their own RoPE base, the global ones linearly scaled,
        # attention biases, one global layer in two (sliding_window_pattern 2)
        "gemma3": Gemma3TextConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
            query_pre_attn_scalar=24, sliding_window_pattern=2, attention_bias=True,
            rope_scaling={"rope_type": "linear", "factor": 4.0}, **small,
        ),
        # mixtures of experts: 4 experts, top-2 (routers sharpened in hf_dirs so tokens really choose)
        "mixtral": MixtralConfig(
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
            **{**small, "intermediate_size": 64},
        ),
        "qwen2_moe": Qwen2MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[1], **small,
        ),
        "qwen3_moe": Qwen3MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2, **small,
        ),
        # gpt-oss: attention sinks and biases, sliding/full layers, YaRN past its original 16 positions,
        # router and expert biases, the clamped SwiGLU at a limit that clamps 8-19% of the gates and
        # 12-28% of the up values
        "gpt_oss": GptOssConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=0.3,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16,
                             "rope_theta": 150000.0},
            **{**small, "intermediate_size": 64},
        ),
        # DeepSeek-V3: latent attention with a query latent, interleaved RoPE under YaRN with mscale
        # (past its original 16 positions), v_head_dim != qk; 8 experts in 4 groups, top-2 of 2 groups,
        # routed scaling, a correction bias (randomised in hf_dirs), a shared expert, one dense block
        "deepseek_v3": DeepseekV3Config(
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
            rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
                             "rope_theta": 10000.0},
            **small,
        ),
        # GLM-4.5: GQA with q/k/v biases (none on the output), q/k norms, RoPE over the first half of
        # each head, DeepSeek-V3's router (8 experts in 4 groups, top-2 of 2 groups, a correction bias,
        # routed scaling), a shared expert, one dense block
        "glm4_moe": Glm4MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
            first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **small,
        ),
        # MiniMax-M2: q/k norms over all heads (their sums of squares added over TP), RoPE over half of
        # each head, 8 experts top-2 by sigmoid scores with a correction bias (randomised in hf_dirs)
        "minimax_m2": MiniMaxM2Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5},
            **{**small, "intermediate_size": 32},
        ),
        # Qwen3-Next: Gated DeltaNet in blocks 0 and 2 (2 key heads, 4 value heads; 24 tokens, a chunk of
        # 64 is cut short), gated attention with q/k norms over a quarter-rotated head in 1 and 3, the
        # (1 + w) norms, 4 experts top-2 with a gated shared expert, block 1 dense
        "qwen3_next": Qwen3NextConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            mlp_only_layers=[1], full_attention_interval=2, **small,
        ),
        # Qwen3.5: the same hybrid with separate q/k/v, z, b and a projections, dense MLPs; Qwen3.5-MoE:
        # every block sparse with a gated shared expert
        "qwen3_5": Qwen3_5TextConfig(**QWEN35, **small),
        "qwen3_5_moe": Qwen3_5MoeTextConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, **QWEN35, **small,
        ),
    }  # fmt: skip


QWEN35 = dict(
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    layer_types=["linear_attention", "full_attention"] * 2,
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """One tiny random model per family, saved with a BPE tokenizer."""
    base = tmp_path_factory.mktemp("hf")
    docs = [d for _, d in zip(range(1500), stdlib_documents())]
    tok_dir = base / "tok"
    tok = train_bpe(docs, 512, tok_dir)
    out = {}
    for i, (name, config) in enumerate(hf_configs(tok.vocab_size, tok.eos_id).items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1 or pname.endswith("_bias"):  # biases, sinks, norm weights: non-zero, not one
                    p.add_(torch.randn_like(p) * 0.2)
                elif pname.endswith(("moe.gate.weight", "mlp.gate.weight", "shared_expert_gate.weight",
                                     "mlp.router.weight")):  # fmt: skip
                    p.mul_(30)  # routers far from uniform
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):  # choices the bias changes
                    b.add_(torch.randn_like(b) * 0.3)
        d = base / name
        model.save_pretrained(d)
        for f in tok_dir.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        out[name] = d
    return out


def hf_model(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def sample_ids(n=24, batch=2, seed=1):
    return torch.randint(0, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def logits_worker(dirs, tp, pp, ids, ep=1):
    from mt3d.model.inference import logits

    out = {}
    for name, path in dirs.items():
        model = from_pretrained(path, tp=tp, pp=pp, ep=ep, state=out.get("_state"))
        out["_state"] = model.state
        out[name] = logits(model, ids, model.state, model.config.hidden)
    out.pop("_state")
    return out


def test_logits_match_transformers_at_every_layout(hf_dirs):
    ids = sample_ids()
    with torch.no_grad():
        ref = {name: hf_model(d)(ids).logits for name, d in hf_dirs.items()}
    dirs = {name: str(d) for name, d in hf_dirs.items()}
    sparse = {name: d for name, d in dirs.items() if name in MOE}
    for tp, pp, ep in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 2)):
        names = sparse if ep > 1 else dirs  # every ep rank runs the same tokens through its experts
        per_rank = spawn(logits_worker, tp * pp * ep, names, tp, pp, ids, ep, timeout=300)
        last_stage = [r for r in per_rank if r[next(iter(names))] is not None]
        assert len(last_stage) == tp * ep  # every TP rank of the last stage holds the full logits
        for got in last_stage:
            for name in names:
                err = (got[name] - ref[name]).abs().max().item()
                assert err <= 1e-4, f"{name} tp={tp} pp={pp} ep={ep}: max |logit diff| {err}"


def test_the_language_model_of_a_vision_language_checkpoint(hf_dirs, tmp_path, caplog):
    """Vision-language checkpoints of Qwen3.5 (``Qwen3_5ForConditionalGeneration``: the text model's
    config under text_config, its tensors under model.language_model) and Gemma 3
    (``Gemma3ForConditionalGeneration``: under language_model.model, its head tied), each with a vision
    tower: mt3d reads the language model as a text model of the family, reports the vision tensors as
    unused, and its logits on text equal the vision-language model's at one process and tp 2."""
    from transformers import AutoModelForImageTextToText, Gemma3Config, Qwen3_5Config

    small = dict(hidden_size=32, intermediate_size=64)
    vlms = {  # (config class, where the unused tensors are, the vision tower's config)
        "qwen3_5": (Qwen3_5Config, "model.visual.", dict(depth=1, num_heads=2, out_hidden_size=64,
                                                          patch_size=4, num_position_embeddings=16, **small)),
        "gemma3": (Gemma3Config, "multi_modal_projector.", dict(num_hidden_layers=1, num_attention_heads=2,
                                                                 image_size=16, patch_size=4, **small)),
    }  # fmt: skip
    ids, want, dirs = sample_ids(), {}, {}
    for name, (config, tower, vision) in vlms.items():
        text = {k: v for k, v in hf_model(hf_dirs[name]).config.to_dict().items() if k != "architectures"}
        torch.manual_seed(3)
        extra = {"mm_tokens_per_image": 4} if name == "gemma3" else {}
        model = AutoModelForImageTextToText.from_config(
            config(text_config=text, vision_config=vision, **extra)
        )
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.2)
        d = dirs[name] = tmp_path / name
        model.save_pretrained(d)
        for f in (hf_dirs[name]).iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                (d / f.name).write_bytes(f.read_bytes())
        with torch.no_grad():
            want[name] = model.eval()(input_ids=ids).logits
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert config_from_hf(d).family == name
            got = logits_worker({name: str(d)}, 1, 1, ids)[name]
        assert tower in caplog.text and "ignored" in caplog.text, name
        assert (got - want[name]).abs().max() <= 1e-4, name
    for got in spawn(logits_worker, 2, {k: str(d) for k, d in dirs.items()}, 2, 1, ids, timeout=300):
        for name in dirs:
            assert (got[name] - want[name]).abs().max() <= 1e-4, name
    # a run from each exports the text model, which transformers loads silently with the VLM's logits
    run_grouped(
        [(1, fine_tune_config(tmp_path / f"run-{k}", d, 0, 1, 1, save_at_end=True)) for k, d in dirs.items()]
    )
    for name in dirs:
        assert run_export(tmp_path / f"run-{name}", tmp_path / f"text-{name}").returncode == 0
        model = loads_without_warnings(tmp_path / f"text-{name}", caplog)
        assert type(model).__name__.endswith("ForCausalLM"), type(model)
        with torch.no_grad():
            assert (model(ids).logits - want[name]).abs().max() <= 1e-4, name


@pytest.mark.parametrize("name", WINDOWED)
def test_a_window_blind_model_fails_the_parity_check(hf_dirs, name):
    """The windows are shorter than the test sequences: ignoring them changes the logits."""
    from mt3d.checkpoint.loading import build_model, load_weights, open_source
    from mt3d.model.inference import logits
    from mt3d.parallel.state import ParallelState

    ids = sample_ids()
    with torch.no_grad():
        ref = hf_model(hf_dirs[name])(ids).logits
    source = open_source(hf_dirs[name])
    assert source.cfg.attention["window"] == WINDOW < ids.shape[1]
    state = ParallelState.single()
    blind = build_model(replace(source.cfg, attention=None), source.vocab, state, skip_init=True)
    load_weights(blind, source, state.tp)
    blind.vocab_size = source.vocab
    assert (logits(blind.eval(), ids, state, source.cfg.hidden) - ref).abs().max() > 1e-3


def test_families_read_what_transformers_reads(hf_dirs):
    """Config mapping facts: family, window layout, and the HF defaults mt3d assumes for absent keys."""
    from transformers import AutoConfig

    from mt3d.model.families import get_family

    cfgs = {name: config_from_hf(d) for name, d in hf_dirs.items()}
    assert {name: c.family for name, c in cfgs.items()} == {n: n for n in FAMILIES}
    assert cfgs["mistral"].attention == {"window": WINDOW}
    assert cfgs["qwen2"].attention["layer_types"] == ["full_attention"] * 2 + ["sliding_attention"] * 2
    assert [p is None for p in cfgs["gemma2"].patterns] == [False, True, False, True]  # layer 0 is local
    assert [p is None for p in cfgs["gemma3"].patterns] == [False, True, False, True]
    assert cfgs["gemma3"].rope_local == {"rope_theta": 10000.0} and cfgs["gemma3"].rope_theta == 1e6
    assert cfgs["gemma3"].rope_scaling == {"rope_type": "linear", "factor": 4.0} and cfgs["gemma3"].qk_norm
    assert cfgs["qwen3"].head_dim * cfgs["qwen3"].heads != cfgs["qwen3"].hidden and cfgs["qwen3"].qk_norm
    mm = cfgs["minimax_m2"]
    assert mm.qk_norm == "all" and mm.rotary_fraction == 0.5 and mm.moe_spec.correction_bias
    legacy = json.loads((hf_dirs["minimax_m2"] / "config.json").read_text())
    legacy["rope_parameters"].pop("partial_rotary_factor")  # MiniMax's own configs: rotary_dim only
    kw = get_family("minimax_m2").config_kwargs({**legacy, "rotary_dim": 8}, "minimax")
    assert kw["rotary_fraction"] == 0.25
    for name in FAMILIES:
        fam = get_family(name)
        hf_default = AutoConfig.for_model(fam.model_types[0]).to_dict()
        for key, value in fam.hf_defaults.items():
            if key in hf_default:
                assert hf_default[key] == value, (name, key)
            elif key == "rope_theta":
                assert hf_default["rope_parameters"]["rope_theta"] == value, name


def hf_window_loss(model, ids, seq_len, stride):
    from mt3d.model.inference import windows

    nll, count = 0.0, 0
    for begin, end, scored in windows(ids.numel(), seq_len, stride):
        x = ids[begin:end].unsqueeze(0)
        labels = x.clone()
        labels[:, : x.shape[1] - scored] = -100
        with torch.no_grad():
            out = model(x, labels=labels)
        n = int((labels[:, 1:] != -100).sum())
        nll += out.loss.item() * n
        count += n
    return nll / count, count


def eval_text(tmp_path, docs=40):
    text = "\n\n".join(d for _, d in zip(range(docs), stdlib_documents()))
    f = tmp_path / "text.txt"
    f.write_text(text)
    return f, text


def test_eval_matches_transformers_loss(hf_dirs, tmp_path):
    """Sliding-window perplexity of every family equals transformers'; `mt3d eval` (the command, one
    family: the others take the same code path in-process) prints it."""
    from mt3d.model.inference import evaluate_tokens

    f, text = eval_text(tmp_path)
    for name in FAMILIES:
        ids = torch.tensor(load_tokenizer(hf_dirs[name]).encode(text, eos=False))
        want, count = hf_window_loss(hf_model(hf_dirs[name]), ids, 64, 16)
        model = from_pretrained(hf_dirs[name])
        got = evaluate_tokens(model, ids, model.state, 64, 16)
        assert got["tokens"] == count and abs(got["loss"] - want) <= 1e-5 * want, (name, got, want)
    # the last family again, through the command
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", "eval", "--model", str(hf_dirs[name]), "--text", str(f),
         "--seq-len", "64", "--stride", "16", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == count
    assert abs(got["loss"] - want) <= 1e-5 * want, (name, got, want)


def eval_worker(dirs, ids, tp=2, pp=2, ep=1, cp=1):
    from mt3d.model.inference import evaluate_tokens

    out, state = {}, None
    for name, path in dirs.items():
        model = from_pretrained(path, tp=tp, pp=pp, ep=ep, cp=cp, state=state)
        state = model.state
        out[name] = evaluate_tokens(model, ids[name], state, 64, 64)["loss"]
    return out


def test_eval_under_tp_and_pp_matches(hf_dirs, tmp_path):
    _, text = eval_text(tmp_path, docs=20)
    ids = {name: torch.tensor(load_tokenizer(d).encode(text, eos=False)) for name, d in hf_dirs.items()}
    want = {name: hf_window_loss(hf_model(d), ids[name], 64, 64)[0] for name, d in hf_dirs.items()}
    dirs = {name: str(d) for name, d in hf_dirs.items()}
    sparse = {name: d for name, d in dirs.items() if name in MOE}
    # windows, per-type RoPE and sinks over cp chunks (sinks' heads over the all-to-all); the 2026 families
    # at cp 2 x tp 2: partial RoPE, q/k norms over all heads, DeltaNet states chained over the cp ranks
    local = ("gemma2", "gemma3", "gpt_oss", "deepseek_v3", "glm4_moe", "minimax_m2", "qwen3_next", "qwen3_5",
             "qwen3_5_moe")  # fmt: skip
    local = {name: dirs[name] for name in local}
    runs = (
        spawn(eval_worker, 4, dirs, ids, timeout=300)
        + spawn(eval_worker, 4, sparse, ids, 1, 2, 2, timeout=300)
        + spawn(eval_worker, 4, local, ids, 2, 1, 1, 2, timeout=300)
    )
    for got in runs:
        for name in got:
            assert abs(got[name] - want[name]) <= 1e-5 * want[name], name


def run_export(checkpoint, out):
    return subprocess.run(
        [sys.executable, "-m", "mt3d", "export-hf", "--checkpoint", str(checkpoint), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def fine_tune_config(save_dir, hf_dir, steps, tp=2, pp=2, **train):
    raw = tiny_config(save_dir, tp=tp, pp=pp, steps=steps, **train)
    raw["mt3d"]["model"] = {"from_hf": str(hf_dir)}
    raw["mt3d"]["data"] = {"corpus": "builtin", "seq_len": 64}
    raw["optimizer"]["params"]["lr"] = 3e-3
    return raw


def loads_without_warnings(path, caplog):
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model = hf_model(path)
    noisy = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, noisy
    return model


@pytest.fixture(scope="module")
def round_trip_runs(hf_dirs, tmp_path_factory):
    """Every family's HF directory saved as an mt3d checkpoint at tp 2 x pp 2 (mixtures of experts:
    tp 2 x ep 2, each ep rank's experts in its own files; Mixtral with whole experts folded over
    tp x dp, tp 2 x ep 4 x expert_tensor 1, its experts loaded whole), all in one spawn."""
    base = tmp_path_factory.mktemp("round-trip")
    runs = []
    for name in FAMILIES:
        raw = fine_tune_config(base / name, hf_dirs[name], steps=0, save_at_end=True)
        if name in MOE:
            raw["mt3d"]["parallel"].update(pipeline=1, expert=2)
        if name == "mixtral":  # parallel.expert_layout: model.from_hf and export-hf at a folded layout
            raw["mt3d"]["parallel"].update(expert=4, expert_tensor=1)
        runs.append((4, raw))
    run_grouped(runs, timeout=900)
    return {name: base / name for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bit_identical(hf_dirs, round_trip_runs, tmp_path, name, caplog):
    """HF -> an mt3d checkpoint at tp 2 x pp 2 (mixtures of experts: tp 2 x ep 2, Mixtral folded) ->
    export-hf -> the same tensors, loadable silently."""
    run = round_trip_runs[name]
    out = run_export(run, tmp_path / "export")
    assert out.returncode == 0, out.stderr[-3000:]
    from safetensors.torch import load_file

    a = load_file(hf_dirs[name] / "model.safetensors")
    b = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    loads_without_warnings(tmp_path / "export", caplog)
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    original = json.loads((hf_dirs[name] / "config.json").read_text())
    for key in ("model_type", "sliding_window", "layer_types", "attn_logit_softcapping", "head_dim"):
        if key in original:
            assert exported[key] == original[key], key
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    from mt3d.checkpoint.loading import open_source

    source = open_source(run)  # the tokenizer travels inside the checkpoint
    assert Path(source.tokenizer_dir) == source.path / "tokenizer"
    again = run_export(run, tmp_path / "export")
    assert again.returncode == 2 and "not empty" in again.stderr  # never overwrites


def assert_same_training(got, ref, what):
    assert [r["step"] for r in got] == [r["step"] for r in ref] and len(ref) == 5
    for a, b in zip(got, ref):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"{what} step {a['step']} {key}: {a} vs {b}"


FINE_TUNED = ["mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe", "gpt_oss", "deepseek_v3"]


@pytest.fixture(scope="module")
def fine_tuned(hf_dirs, tmp_path_factory):
    """Each family fine-tuned for 5 steps on one process and at (2,2,2) (MoE: tp 2 x pp 2 x ep 2);
    Gemma 2 also at tp 2 x pp 2 with SP and recompute (over post-norms, soft-caps, windows; DeepSeek-V3's
    latents under SP: tests/test_moe.py), Gemma 3, gpt-oss and DeepSeek-V3 at cp 2 (RoPE per layer type
    from global positions; sinks over the all-gather and halo exchanges, eval covering the all-to-all;
    the latent gathered over cp). Runs of a
    world size share one spawn: {name: (dir of the (2,2,2) run, {what: step records})}."""
    base = tmp_path_factory.mktemp("fine-tuned")
    runs, keys = [], []
    for name in FINE_TUNED:
        d = base / name
        runs.append((1, fine_tune_config(d / "ref", hf_dirs[name], 5, 1, 1)))
        raw = fine_tune_config(d / "ft", hf_dirs[name], 5, save_at_end=True)
        if name in MOE:  # dp 2 = ep: the experts split over the data-parallel pair
            raw["mt3d"]["parallel"]["expert"] = 2
        runs.append((8, raw))
        keys += [(name, "ref"), (name, "(2,2,2)")]
        if name == "gemma2":
            raw = fine_tune_config(d / "sp", hf_dirs[name], 5, 2, 2, recompute={"interval": 1})
            raw["mt3d"]["parallel"]["sequence_parallel"] = True
            runs.append((4, raw))
            keys.append((name, "SP + recompute"))
        if name in ("gemma3", "gpt_oss", "deepseek_v3"):  # per-type RoPE; sinks and latents over cp
            raw = fine_tune_config(d / "cp", hf_dirs[name], 5, 1, 1)
            raw["mt3d"]["parallel"]["context"] = 2
            if name == "gpt_oss":
                raw["mt3d"]["parallel"]["context_exchange"] = "allgather"
            runs.append((2, raw))
            keys.append((name, "cp 2"))
    out = {name: (base / name / "ft", {}) for name in FINE_TUNED}
    for (name, what), records in zip(keys, run_grouped(runs, timeout=900), strict=True):
        out[name][1][what] = records
    return out


@pytest.mark.parametrize("name", FINE_TUNED)
def test_fine_tuning_at_tp2_pp2_dp2_matches_one_process(hf_dirs, fine_tuned, tmp_path, name, caplog):
    run_dir, records = fine_tuned[name]
    ref = records["ref"]
    assert ref[-1]["loss"] < ref[0]["loss"]
    for what, got in records.items():
        if what != "ref":
            assert_same_training(got, ref, f"{name} {what}")
    # the fine-tuned model exports, loads silently in transformers and scores better than before
    assert run_export(run_dir, tmp_path / "ft_hf").returncode == 0
    _, text = eval_text(tmp_path, docs=60)
    ids = torch.tensor(load_tokenizer(hf_dirs[name]).encode(text, eos=False))
    before, _ = hf_window_loss(hf_model(hf_dirs[name]), ids, 64, 64)
    after, _ = hf_window_loss(loads_without_warnings(tmp_path / "ft_hf", caplog), ids, 64, 64)
    assert after < before - 0.05, (before, after)


def generate_worker(dirs, prompt, n):
    from mt3d.model.inference import generate

    out, state = {}, None
    for name, path in dirs.items():
        model = from_pretrained(path, tp=2, state=state)
        state = model.state
        out[name] = generate(model, prompt, state, max_new_tokens=n)
    return out


def test_greedy_generation_matches_transformers_at_tp2(hf_dirs):
    """7 prompt tokens + 20 generated: well past the window of 8 (the Gated DeltaNet families: their
    convolution tails and states cached)."""
    prompt = sample_ids(n=7, batch=1, seed=4)
    generating = hf_dirs
    with torch.no_grad():
        want = {
            name: hf_model(d).generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
            for name, d in generating.items()
        }
    dirs = {name: str(d) for name, d in generating.items()}
    for got in spawn(generate_worker, 2, dirs, prompt, 20, timeout=300):
        for name in generating:
            assert got[name].tolist() == want[name].tolist(), name


def test_generation_with_sampling_is_seeded():
    from mt3d.model.inference import sample_next

    logits = torch.randn(3, 50)
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    a = sample_next(logits, temperature=0.8, top_k=5, top_p=0.9, generator=g())
    b = sample_next(logits, temperature=0.8, top_k=5, top_p=0.9, generator=g())
    assert torch.equal(a, b)
    top5 = logits.topk(5).indices
    assert all(int(a[i]) in top5[i].tolist() for i in range(3))
    assert torch.equal(sample_next(logits, temperature=0, top_k=0, top_p=1, generator=g()), logits.argmax(-1))


BAD_CONFIGS = [
    ("llama", {"rope_parameters": {"rope_type": "proportional", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type 'proportional' is not supported"),
    ("mistral", {"num_local_experts": 8}, "num_local_experts=8 asks for mixture-of-experts layers"),
    ("qwen3", {"num_experts": 4, "moe_intermediate_size": 32}, "asks for mixture-of-experts layers"),
    ("qwen2", {"num_attention_sinks": 4}, "num_attention_sinks=4 asks for attention sinks"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ("gemma2", {"sliding_window": -4}, "sliding_window must be a positive integer, got -4"),
    ("qwen2", {"layer_types": ["sliding_attention"] * 3},
     "layer_types must list num_hidden_layers=4 entries, got 3"),
    ("gemma2", {"layer_types": ["chunked_attention"] * 4},
     "layer_types entry 'chunked_attention' is not supported"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive number, got"),
    ("gemma2", {"final_logit_softcapping": 0}, "final_logit_softcapping must be a positive number, got"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation 'relu' is not supported"),
    ("gpt2", {"n_embd": None}, "config.json has no 'n_embd'"),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}},
     "asks for quantized (MXFP4) expert weights"),
    ("gpt_oss", {"swiglu_limit": -1}, "swiglu_limit must be a positive number"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax' asks for softmax expert scores"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method='greedy' asks for expert selection other than"),
    ("deepseek_v3", {"first_k_dense_replace": 4}, "first_k_dense_replace 4 leaves no sparse block of 4"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e4}},
     "rope_parameters.rope_type 'ntk' is not supported"),
    ("minimax_m2", {"output_router_logits": True},
     "output_router_logits=True asks for transformers' load-balancing loss for MiniMax-M2"),
    ("minimax_m2", {"qk_norm_type": "per_head"}, "qk_norm_type='per_head' asks for q/k norms per head"),
    ("minimax_m2", {"rotary_dim": 33, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "rotary_dim 33 must be even and at most head_dim 32"),
]  # fmt: skip


@pytest.mark.parametrize("family, change, message", BAD_CONFIGS)
def test_bad_hf_configs_are_refused_by_key_before_any_weight(hf_dirs, tmp_path, family, change, message):
    d = tmp_path / family
    d.mkdir()
    cfg = json.loads((hf_dirs[family] / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))  # no weights at all: the config alone is refused
    with pytest.raises(HFError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf(d)


def test_bad_hf_input(hf_dirs, tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]})
    )
    with pytest.raises(
        HFError, match="unsupported architecture 'BertForMaskedLM'; supported: GPT2LMHeadModel"
    ):
        config_from_hf(bert)
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{not json")
    with pytest.raises(HFError, match="config.json is not valid JSON"):
        config_from_hf(tmp_path / "garbled")
    from mt3d.model.config import ModelConfigError

    with pytest.raises(ModelConfigError, match="kv_heads \\(4\\) are not divisible by tp=8"):
        from_pretrained(hf_dirs["llama"], tp=8)  # refused before any weight is read
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in hf_dirs["gpt2"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    sd = load_file(broken / "model.safetensors")
    del sd["transformer.h.1.mlp.c_fc.bias"]
    sd["transformer.h.0.attn.c_proj.weight"] = sd["transformer.h.0.attn.c_proj.weight"][:, :32].contiguous()
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    msg = r"implies 2.attn.out.weight of shape \(64, 64\) but the weights hold"
    msg += r" transformer.h.0.attn.c_proj.weight \(32, 64\)"
    with pytest.raises(Exception, match=msg):
        from_pretrained(broken)
    del sd["transformer.h.0.attn.c_proj.weight"]
    sd["transformer.h.0.attn.c_proj.weight"] = torch.zeros(64, 64)
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="tensor 'transformer.h.1.mlp.c_fc.bias' is missing"):
        from_pretrained(broken)
    yarn = tmp_path / "yarn"
    yarn.mkdir()
    cfg = json.loads((hf_dirs["llama"] / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "proportional", "factor": 2.0, "rope_theta": 1e4}
    (yarn / "config.json").write_text(json.dumps(cfg))
    for model, expect in (
        (bert, "unsupported architecture"),
        (yarn, "rope_type 'proportional' is not supported"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "mt3d", "eval", "--model", str(model), "--text", __file__,
             "--seq-len", "8"],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )  # fmt: skip
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and expect in out.stderr, out.stderr
    # a truncated safetensors file (header cut) and a truncated tensor region: one-line HFError
    whole = (hf_dirs["gpt2"] / "model.safetensors").read_bytes()
    for cut in (20, len(whole) - 100):
        (broken / "model.safetensors").write_bytes(whole[:cut])
        with pytest.raises(HFError, match="not a valid safetensors file|past the end of the file"):
            from_pretrained(broken)
    # command-line values are checked before anything is loaded
    bad_args = {
        ("--stride", "16"): "--stride 16 is longer than --seq-len 8",
        ("--seq-len", "0"): "argument --seq-len: must be >= 1, got 0",
        ("--seq-len", "4096", "--stride", "8"): "exceeds the model's max_seq_len 128",
    }
    for extra, expect in bad_args.items():
        out = subprocess.run(
            [sys.executable, "-m", "mt3d", "eval", "--model", str(hf_dirs["gpt2"]), "--text", __file__,
             "--seq-len", "8", *extra],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )  # fmt: skip
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and expect in out.stderr, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", "generate", "--model", str(hf_dirs["gpt2"]), "--prompt", "x",
         "--top-p", "0"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 2 and "0 < --top-p <= 1" in out.stderr


def _retype(path, tensors, dtype):
    """Rewrite the header's dtype of ``tensors`` (or all, None); the tensor bytes stay as they are."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    for name, e in header.items():
        if name != "__metadata__" and (tensors is None or name in tensors) and e["dtype"] == "F32":
            e["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])


@pytest.mark.parametrize("tensors, dtype", [(["transformer.h.0.ln_1.bias"], "F16"), (None, "BF16")])
def test_a_safetensors_header_with_the_wrong_dtype_is_refused(hf_dirs, tmp_path, tensors, dtype):
    d = tmp_path / "m"
    d.mkdir()
    for f in hf_dirs["gpt2"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    _retype(d / "model.safetensors", tensors, dtype)
    with pytest.raises(HFError, match=f"is declared {dtype} .* but spans .* bytes: the header is wrong"):
        from_pretrained(d)
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", "eval", "--model", str(d), "--text", __file__, "--seq-len", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "the header is wrong" in out.stderr
