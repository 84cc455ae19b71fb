"""HF transformers interop: parity at every tp x pp, eval, round trip, fine-tune, generation, bad input."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from mt3d.data.corpora import stdlib_documents
from mt3d.data.tokenizer import load_tokenizer, train_bpe
from mt3d.model.blocks import BuildContext
from mt3d.model.hf import HFError, config_from_hf
from mt3d.model.loading import from_pretrained
from mt3d.model.pipeline import StackedModel, layer_specs
from mt3d.model.sharding import global_names, param_layout, split_name
from mt3d.parallel.spawn import spawn
from mt3d.parallel.state import AxisGroup

from helpers import step_records, tiny_config, train_worker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random GPT-2 (tied) and Llama (GQA, llama3 RoPE, untied) dirs with a BPE tokenizer."""
    base = tmp_path_factory.mktemp("hf")
    docs = [d for _, d in zip(range(1500), stdlib_documents())]
    tok_dir = base / "tok"
    tok = train_bpe(docs, 512, tok_dir)
    torch.manual_seed(0)
    models = {
        "gpt2": GPT2LMHeadModel(
            GPT2Config(
                n_embd=64, n_layer=4, n_head=4, vocab_size=tok.vocab_size, n_positions=128,
                bos_token_id=tok.eos_id, eos_token_id=tok.eos_id,
            )
        ),
        "llama": LlamaForCausalLM(
            LlamaConfig(
                hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=128, vocab_size=tok.vocab_size, max_position_embeddings=128,
                rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                bos_token_id=tok.eos_id, eos_token_id=tok.eos_id,
            )
        ),
    }  # fmt: skip
    out = {}
    for name, m in models.items():
        d = base / name
        m.save_pretrained(d)
        for f in tok_dir.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        out[name] = d
    return out


def sample_ids(n=24, batch=2, seed=1):
    return torch.randint(0, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def hf_model(path):
    cls = GPT2LMHeadModel if "gpt2" in str(path) else LlamaForCausalLM
    return cls.from_pretrained(path).eval()


def logits_worker(path, tp, pp, ids):
    from mt3d.model.inference import logits

    model = from_pretrained(path, tp=tp, pp=pp)
    out = logits(model, ids, model.state, model.config.hidden)
    return None if out is None else out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_logits_match_transformers_at_every_layout(hf_dirs, arch):
    ids = sample_ids()
    with torch.no_grad():
        ref = hf_model(hf_dirs[arch])(ids).logits
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        outs = [
            o
            for o in spawn(logits_worker, tp * pp, str(hf_dirs[arch]), tp, pp, ids, timeout=240)
            if o is not None
        ]
        assert len(outs) == tp  # every TP rank of the last stage holds the full logits
        for o in outs:
            err = (o - ref).abs().max().item()
            assert err <= 1e-4, f"{arch} tp={tp} pp={pp}: max |logit diff| {err}"


def test_sharding_table_matches_the_layers(hf_dirs):
    for arch in ("gpt2", "llama"):
        cfg = config_from_hf(hf_dirs[arch])
        for tp in (1, 2, 4):
            group = AxisGroup("tp", tuple(range(tp)), 0, None)
            model = StackedModel(layer_specs(cfg, BuildContext(tp=group), cfg.vocab_size))
            names = [n for n, _ in model.named_parameters()]
            assert sorted(names) == sorted(global_names(cfg))
            for name, p in model.named_parameters():
                layer, local = split_name(name)
                layout = param_layout(cfg, layer, local, cfg.vocab_size)
                marked = getattr(p, "tensor_model_parallel", False)
                assert marked == (layout.dim is not None), name
                if marked:
                    assert p.partition_dim == layout.dim and p.partition_parts == (
                        layout.parts if layout.parts and len(layout.parts) > 1 else None
                    ), name


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


def test_eval_matches_transformers_loss(hf_dirs, tmp_path):
    text = "\n\n".join(d for _, d in zip(range(40), stdlib_documents()))
    f = tmp_path / "text.txt"
    f.write_text(text)
    for arch in ("gpt2", "llama"):
        tok = load_tokenizer(hf_dirs[arch])
        ids = torch.tensor(tok.encode(text, eos=False))
        model = hf_model(hf_dirs[arch])
        for seq_len, stride in ((64, 64), (64, 16)):
            want, count = hf_window_loss(model, ids, seq_len, stride)
            out = subprocess.run(
                [sys.executable, "-m", "mt3d", "eval", "--model", str(hf_dirs[arch]), "--text", str(f),
                 "--seq-len", str(seq_len), "--stride", str(stride), "--json"],
                capture_output=True, text=True, timeout=300, cwd=ROOT,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-2000:]
            got = json.loads(out.stdout.strip().splitlines()[-1])
            assert got["tokens"] == count
            assert abs(got["loss"] - want) <= 1e-5 * want, (arch, seq_len, stride, got, want)


def eval_worker(path, tp, pp, ids):
    from mt3d.model.inference import evaluate_tokens

    model = from_pretrained(path, tp=tp, pp=pp)
    return evaluate_tokens(model, ids, model.state, 64, 32)


def test_eval_under_tp_and_pp_matches(hf_dirs):
    tok = load_tokenizer(hf_dirs["llama"])
    ids = torch.tensor(tok.encode(" ".join(d for _, d in zip(range(20), stdlib_documents())), eos=False))
    want, _ = hf_window_loss(hf_model(hf_dirs["llama"]), ids, 64, 32)
    for res in spawn(eval_worker, 4, str(hf_dirs["llama"]), 2, 2, ids, timeout=240):
        assert abs(res["loss"] - want) <= 1e-5 * want


def run_export(checkpoint, out):
    return subprocess.run(
        [sys.executable, "-m", "mt3d", "export-hf", "--checkpoint", str(checkpoint), "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip


def fine_tune_config(tmp_path, hf_dir, steps):
    raw = tiny_config(tmp_path, tp=2, pp=2, steps=steps, save_at_end=True)
    raw["mt3d"]["model"] = {"from_hf": str(hf_dir)}
    raw["mt3d"]["data"] = {"corpus": "builtin", "seq_len": 64}
    raw["optimizer"]["params"]["lr"] = 3e-3
    return raw


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_round_trip_is_bit_identical(hf_dirs, tmp_path, arch):
    raw = fine_tune_config(tmp_path / "run", hf_dirs[arch], steps=0)
    spawn(train_worker, 4, raw, timeout=300)
    out = run_export(tmp_path / "run", tmp_path / "export")
    assert out.returncode == 0, out.stderr[-3000:]
    from safetensors.torch import load_file

    a = load_file(hf_dirs[arch] / "model.safetensors")
    b = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    from mt3d.model.loading import open_source

    source = open_source(tmp_path / "run")  # the tokenizer travels inside the checkpoint
    assert Path(source.tokenizer_dir) == source.path / "tokenizer"
    assert (source.path / "tokenizer" / "tokenizer.json").read_bytes() == (
        hf_dirs[arch] / "tokenizer.json"
    ).read_bytes()
    again = run_export(tmp_path / "run", tmp_path / "export")
    assert again.returncode == 2 and "not empty" in again.stderr  # never overwrites


def test_fine_tune_from_hf_lowers_the_loss(hf_dirs, tmp_path, caplog):
    raw = fine_tune_config(tmp_path / "ft", hf_dirs["gpt2"], steps=8)
    records = step_records(spawn(train_worker, 4, raw, timeout=300)[0])
    assert records[-1]["loss"] < records[0]["loss"]
    assert run_export(tmp_path / "ft", tmp_path / "ft_hf").returncode == 0
    tok = load_tokenizer(hf_dirs["gpt2"])
    text = " ".join(d for _, d in zip(range(60), stdlib_documents()))
    ids = torch.tensor(tok.encode(text, eos=False))
    before, _ = hf_window_loss(hf_model(hf_dirs["gpt2"]), ids, 64, 64)
    with caplog.at_level(logging.WARNING):
        tuned = GPT2LMHeadModel.from_pretrained(tmp_path / "ft_hf").eval()
    assert not [
        r for r in caplog.records if "were not" in r.getMessage() or "missing" in r.getMessage().lower()
    ]
    after, _ = hf_window_loss(tuned, ids, 64, 64)
    assert after < before - 0.05, (before, after)


def generate_worker(path, tp, prompt, n):
    from mt3d.model.inference import generate

    model = from_pretrained(path, tp=tp)
    return generate(model, prompt, model.state, max_new_tokens=n)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_greedy_generation_matches_transformers_at_tp2(hf_dirs, arch):
    prompt = sample_ids(n=7, batch=1, seed=4)
    with torch.no_grad():
        want = hf_model(hf_dirs[arch]).generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    outs = spawn(generate_worker, 2, str(hf_dirs[arch]), 2, prompt, 20, timeout=240)
    for got in outs:
        assert got.tolist() == want.tolist()


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
    msg = r"2.attn.out.weight \(from transformer.h.0.attn.c_proj.weight\) has shape \(32, 64\)"
    msg += r".*expects \(64, 64\)"
    with pytest.raises(Exception, match=msg):
        from_pretrained(broken)
    del sd["transformer.h.0.attn.c_proj.weight"]
    sd["transformer.h.0.attn.c_proj.weight"] = torch.zeros(64, 64)
    save_file(sd, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="tensor 'transformer.h.1.mlp.c_fc.bias' is missing"):
        from_pretrained(broken)
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", "eval", "--model", str(bert), "--text", __file__, "--seq-len", "8"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "unsupported architecture" in out.stderr
    # a truncated safetensors file (header cut) and a truncated tensor region: one-line HFError
    whole = (hf_dirs["gpt2"] / "model.safetensors").read_bytes()
    for cut in (20, len(whole) - 100):
        (broken / "model.safetensors").write_bytes(whole[:cut])
        with pytest.raises(HFError, match="not a valid safetensors file|past the end of the file"):
            from_pretrained(broken)
    # command-line values are checked before anything is loaded
    bad_args = {
        ("--stride", "16"): "--stride 16 is longer than --seq-len 8",
        ("--seq-len", "0"): "--seq-len must be >= 1",
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
