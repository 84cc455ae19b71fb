"""Fine-tuning data: chat and prompt/completion tokens and loss masks against transformers, packed
evaluation against transformers run one document at a time, packed training at every layout against
one process, and bad input.

The conversations are random: one to three turns, replies of 1 to 10 words, a system turn in some,
so supervised tokens per micro-batch are uneven; they pack 1 to 5 to a 96-token sample.
"""

import contextlib
import io
import json
import math
import random

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
)

from mt3d.cli import main
from mt3d.data.indexed import IndexedDataset
from mt3d.data.tokenizer import CHATML, train_bpe
from mt3d.parallel.spawn import spawn

from helpers import TINY_LLAMA, run_all, tiny_config

WORDS = (
    "tensor pipeline data expert context shard rank stage layer block token batch step loss grad "
    "norm weight bias head query key value window document mask chat reply model train eval save"
).split()
SEQ = 96
WINDOW = 4


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": words(rng, 2, 5)}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 2, 2, 3))):
            messages += [{"role": "user", "content": words(rng, 1, 4)},
                         {"role": "assistant", "content": words(rng, 1, 10)}]  # fmt: skip
        out.append({"messages": messages})
    return out


def write_jsonl(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def cli(*argv):
    """``mt3d ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def hf_configs(vocab, eos):
    small = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, vocab_size=vocab,
                 max_position_embeddings=128, bos_token_id=eos, eos_token_id=eos)  # fmt: skip
    return {
        "llama": LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **small),
        "mistral": MistralConfig(
            num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW, **small
        ),
        "gemma2": Gemma2Config(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            **small,
        ),  # fmt: skip
        "gpt2": GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=vocab,
            n_positions=128,
            bos_token_id=eos,
            eos_token_id=eos,
        ),  # fmt: skip
    }


def save_hf_model(config, seed, out, tok_dir):
    """A random HF model of ``config`` (seed ``seed``; every bias and norm weight randomised, not zero
    or one) saved at ``out`` with the tokenizer files of ``tok_dir``; returns ``out``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    for f in tok_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A ChatML tokenizer, chat and prompt/completion datasets made with ``mt3d preprocess``, and one
    tiny HF model per attention kind (global RoPE, sliding window, local/global pattern with soft-caps,
    learned positions) with random non-zero biases and norms."""
    base = tmp_path_factory.mktemp("sft")
    texts = [" ".join(WORDS)] * 20 + [c["messages"][-1]["content"] for c in conversations(200, seed=9)]
    tok = train_bpe(texts, 512, base / "tok", chat=True)
    convs = conversations(240)
    write_jsonl(
        base / "chat.jsonl", convs[:120] + [{"messages": [{"role": "user", "content": "hi"}]}] + convs[120:]
    )
    assert cli("preprocess", "--input", base / "chat.jsonl", "--format", "chat", "--tokenizer", base / "tok",
               "--output-prefix", base / "chat")[0] == 0  # fmt: skip
    rng = random.Random(3)
    pairs = [{"prompt": words(rng, 1, 5), "completion": " " + words(rng, 1, 5)} for _ in range(20)]
    write_jsonl(base / "pc.jsonl", pairs)
    assert cli("preprocess", "--input", base / "pc.jsonl", "--format", "prompt-completion", "--tokenizer",
               base / "tok", "--output-prefix", base / "pc")[0] == 0  # fmt: skip
    models = {}
    for i, (name, config) in enumerate(hf_configs(tok.vocab_size, tok.eos_id).items()):
        models[name] = save_hf_model(config, i, base / name, base / "tok")
    return {"base": base, "convs": convs, "pairs": pairs, "models": models, "tok": tok}


def test_tokens_and_masks_are_the_templates_and_cover_exactly_the_replies(sft):
    base, hf = sft["base"], AutoTokenizer.from_pretrained(sft["base"] / "tok")
    assert hf.chat_template == CHATML
    ds = IndexedDataset(base / "chat")
    assert len(ds) == len(sft["convs"])  # the conversation without a reply was skipped
    meta = json.loads((base / "chat.meta.json").read_text())
    assert meta["skipped_without_reply"] == 1 and meta["format"] == "chat", meta
    for i, conv in enumerate(sft["convs"]):
        messages = conv["messages"]
        want = hf.apply_chat_template(messages, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert ds.doc(i).tolist() == want, i
        # the mask independently: tokens whose characters lie in an assistant reply or its <|im_end|>
        text = hf.apply_chat_template(messages, tokenize=False)
        spans, at = [], 0
        for m in messages:
            turn = f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            assert text.startswith(turn, at)
            if m["role"] == "assistant":
                start = at + len(f"<|im_start|>{m['role']}\n")
                spans.append((start, at + len(turn) - 1))  # the newline after <|im_end|> is not a target
            at += len(turn)
        offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        expected = [int(any(a <= s < b for a, b in spans)) for s, _ in offsets]
        assert ds.doc_mask(i).tolist() == expected, i
    pc = IndexedDataset(base / "pc")
    for i, pair in enumerate(sft["pairs"]):
        p = hf(pair["prompt"], add_special_tokens=False)["input_ids"]
        c = hf(pair["completion"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        assert pc.doc(i).tolist() == p + c and pc.doc_mask(i).tolist() == [0] * len(p) + [1] * len(c)
    rc, out, _ = cli("data", "show", base / "chat", "--json", "--limit", "2")
    shown = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and len(shown) == 2
    assert shown[1] == {"tokens": ds.doc(1).tolist(), "loss_mask": ds.doc_mask(1).tolist()}


def test_generate_chat_replies_as_transformers_does_on_the_template(sft):
    """``mt3d generate --chat --system``: the prompt is apply_chat_template's with the generation prompt,
    and the greedy reply (cut at its end of turn) is transformers' generate's."""
    path = sft["models"]["llama"]
    hf_tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a sample?"}]
    prompt = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :]
    want = out.tolist()
    want = want[: want.index(hf_tok.eos_token_id)] if hf_tok.eos_token_id in want else want
    rc, text, err = cli("generate", "--model", path, "--chat", "--system", "Be brief.", "--prompt",
                        "What is a sample?", "--max-new-tokens", 10, "--json")  # fmt: skip
    assert rc == 0, err
    assert json.loads(text)["ids"] == want and want


def test_the_shipped_chat_corpus_preprocesses(sft, tmp_path):
    from mt3d.data.chat_corpus import main as write_corpus

    assert write_corpus([str(tmp_path / "c.jsonl")]) == 0
    rc, out, err = cli("preprocess", "--input", tmp_path / "c.jsonl", "--format", "chat", "--tokenizer",
                       sft["base"] / "tok", "--output-prefix", tmp_path / "c")  # fmt: skip
    assert rc == 0, err
    ds = IndexedDataset(tmp_path / "c")
    supervised = sum(int(ds.doc_mask(i).sum()) for i in range(len(ds)))
    assert len(ds) > 300 and 0.3 < supervised / ds.num_tokens < 0.9


# A template whose generation prompt ends inside a token ("assistant: " + "reply": the reply's first word
# is " tensor"), as plain text and with transformers' assistant-mask tags; <|im_end|> closes replies.
STRADDLE = ("{% for m in messages %}{% if m.role == 'assistant' %}assistant: {{ m.content }}<|im_end|>\n"
            "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
TAGGED = ("{% for m in messages %}{% if m.role == 'assistant' %}assistant: {% generation %}{{ m.content }}"
          "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip


def test_a_reply_is_every_token_holding_its_characters_as_transformers_assistant_mask(sft, tmp_path):
    """The reply's first token straddles the generation prompt (" tensor" begins with the prompt's
    space): it is supervised, as in transformers' assistant mask of the same template with
    ``{% generation %}`` tags, which mt3d reads too (also dating turns with ``strftime_now``)."""
    hf = AutoTokenizer.from_pretrained(sft["base"] / "tok")
    convs = sft["convs"][:40]
    write_jsonl(tmp_path / "in.jsonl", convs)
    dated = TAGGED.replace("{% for", "{{ strftime_now('%d %B %Y') }}\n{% for", 1)
    for name, template in {"straddle": STRADDLE, "tagged": TAGGED, "dated": dated}.items():
        (tmp_path / f"{name}.jinja").write_text(template)
        rc, _, err = cli("preprocess", "--input", tmp_path / "in.jsonl", "--format", "chat", "--tokenizer",
                         sft["base"] / "tok", "--chat-template", tmp_path / f"{name}.jinja",
                         "--output-prefix", tmp_path / name)  # fmt: skip
        assert rc == 0 and "warning" not in err, err
        ds = IndexedDataset(tmp_path / name)
        for i, conv in enumerate(convs):
            out = hf.apply_chat_template(conv["messages"], chat_template=dated if name == "dated" else TAGGED,
                                         tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)  # fmt: skip
            want = list(out["assistant_masks"])
            want[0] = 0  # a document's first token is never a target
            assert ds.doc(i).tolist() == list(out["input_ids"]), (name, i)
            assert ds.doc_mask(i).tolist() == want, (name, i)
            if name == "straddle":  # the token holding the prompt's last character and the reply's first
                text = hf.apply_chat_template(conv["messages"], chat_template=STRADDLE, tokenize=False)
                offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
                first = text.index("assistant: ") + len("assistant: ")
                t = next(t for t, (a, b) in enumerate(offsets) if a < first < b)
                assert ds.doc_mask(i)[t] == 1, (i, text[offsets[t][0] : offsets[t][1]])


def test_templates_that_close_no_reply_or_ignore_the_generation_prompt_warn_once(sft, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", sft["convs"][:20])
    templates = {
        "no close": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}",
        "generation prompt": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                             "{% endfor %}",
    }  # fmt: skip
    for key, template in templates.items():
        (tmp_path / "t.jinja").write_text(template)
        rc, _, err = cli("preprocess", "--input", tmp_path / "in.jsonl", "--format", "chat", "--tokenizer",
                         sft["base"] / "tok", "--chat-template", tmp_path / "t.jinja",
                         "--output-prefix", tmp_path / "out")  # fmt: skip
        warnings = [line for line in err.splitlines() if line.startswith("warning:")]
        assert rc == 0 and len(warnings) == 1, err
        assert {"no close": "puts nothing after an assistant reply",
                "generation prompt": "ignores add_generation_prompt"}[key] in warnings[0]  # fmt: skip


def reference_nll(model_dir, prefix, seq_len):
    """transformers, one document at a time (its first seq_len tokens): summed loss and count of the
    supervised targets, and the documents truncated."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ds = IndexedDataset(prefix)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(ds)):
            ids = torch.from_numpy(ds.doc(i)[:seq_len].astype(np.int64))[None]
            mask = torch.from_numpy(ds.doc_mask(i)[:seq_len].astype(bool))
            logits = model(ids).logits[0, :-1].double()
            targets = mask[1:]
            nll += torch.nn.functional.cross_entropy(
                logits[targets], ids[0, 1:][targets], reduction="sum"
            ).item()
            count += int(targets.sum())
    return nll, count, int((ds.doc_lengths() > seq_len).sum())


def eval_worker(models, prefix, flags):
    import torch.distributed as dist

    out = {}
    for name, path in models.items():
        rc, stdout, stderr = cli(
            "eval", "--model", path, "--data", prefix, "--seq-len", SEQ, "--json", *flags
        )
        assert rc == 0, stderr
        if dist.get_rank() == 0:  # the last line (DeepSpeed's pipeline module prints its layers)
            out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_packed_eval_equals_transformers_one_document_at_a_time(sft, tp, pp, cp):
    models = {k: str(v) for k, v in sft["models"].items()}
    prefix = str(sft["base"] / "chat")
    flags = ["--tp", tp, "--pp", pp, "--cp", cp]
    got = spawn(eval_worker, tp * pp * cp, models, prefix, [str(f) for f in flags], timeout=300)[0]
    for name, path in models.items():
        nll, count, truncated = reference_nll(path, prefix, SEQ)
        res = got[name]
        assert res["tokens"] == count and res["documents"] == len(sft["convs"])
        assert res["truncated"] == truncated > 0  # a few conversations are longer than SEQ
        assert abs(res["loss"] - nll / count) <= 1e-5 * nll / count, (name, res["loss"], nll / count)
        assert 0.5 < res["packing_efficiency"] <= 1.0


def test_packed_eval_of_a_gated_deltanet_model_equals_transformers(sft):
    """Qwen3-Next (Gated DeltaNet in blocks 0 and 2) and Qwen3.5-MoE (separate DeltaNet projections, every
    block sparse): packed evaluation, where the convolution and the state restart at every document
    (96-token sequences of short conversations, past one 64-token chunk), equals transformers one
    document at a time, at one process, tp 2 x pp 2 and tp 2 x cp 2 (the chunks' states chained over the
    cp ranks)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3NextConfig

    tok = sft["tok"]
    shared = dict(
        hidden_size=32, num_hidden_layers=4, intermediate_size=64, vocab_size=tok.vocab_size,
        max_position_embeddings=128, bos_token_id=tok.eos_id, eos_token_id=tok.eos_id, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32,
    )  # fmt: skip
    kinds = ["linear_attention", "full_attention"] * 2
    configs = {"q": Qwen3NextConfig(full_attention_interval=2, **shared),
               "m": Qwen3_5MoeTextConfig(layer_types=kinds, **shared)}  # fmt: skip
    paths = {
        k: str(save_hf_model(c, 11, sft["base"] / f"gdn-{k}", sft["base"] / "tok"))
        for k, c in configs.items()
    }
    prefix = str(sft["base"] / "chat")
    want = {k: reference_nll(p, prefix, SEQ)[:2] for k, p in paths.items()}
    for tp, pp, cp in ((1, 1, 1), (2, 2, 1), (2, 1, 2)):
        flags = [str(f) for f in ("--tp", tp, "--pp", pp, "--cp", cp)]
        got = spawn(eval_worker, tp * pp * cp, paths, prefix, flags, timeout=300)[0]
        for k, (nll, count) in want.items():
            res = got[k]
            assert res["tokens"] == count and res["documents"] == len(sft["convs"])
            assert abs(res["loss"] - nll / count) <= 1e-5 * nll / count, (
                k,
                tp,
                pp,
                cp,
                res["loss"],
                nll / count,
            )


# --- training --------------------------------------------------------------------------------------


def sft_config(sft, d, model=None, tp=1, pp=1, micro=2, train=None, **parallel):
    raw = tiny_config(d, model=model or TINY_LLAMA, tp=tp, pp=pp, micro=micro, **(train or {}))
    base = sft["base"]
    raw["mt3d"]["data"] = {"corpus": "indexed", "prefixes": [str(base / "chat")],
                           "tokenizer": str(base / "tok"), "seq_len": SEQ, "split": [90, 10, 0]}  # fmt: skip
    raw["mt3d"]["parallel"].update(parallel)
    return raw


MOE = {"preset": "tiny-qwen2-moe"}
QWEN3_NEXT_MTP = {"preset": "tiny-qwen3-next", "mtp": {"layers": 1}}
"""Gated DeltaNet, gated attention, experts and multi-token prediction over packed, prompt-masked
conversations (each depth's inputs and targets inside its document)."""


def compare(got, ref, what, first=1):
    ref = [r for r in ref if r["step"] >= first]
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    for a, b in zip(got, ref, strict=True):
        assert a["supervised_tokens"] == b["supervised_tokens"], what
        for key in ("loss", "grad_norm"):
            assert math.isfinite(a[key])
            rel = abs(a[key] - b[key]) / abs(b[key])
            assert rel <= 1e-5, f"{what} step {a['step']} {key}: {a[key]} vs {b[key]} ({rel:.1e})"


@pytest.fixture(scope="module")
def sft_reference(sft, tmp_path_factory):
    """One process, 5 steps: the dense Llama with the global batch in one micro-batch (the layouts run
    2 samples per micro-batch: a mean of micro-batch means would not give its loss; a checkpoint at
    step 3 kept) and the MoE with 2 per micro-batch, as at ep 2 (its load-balancing loss is a
    micro-batch's, by design, as Megatron's and transformers')."""
    d = tmp_path_factory.mktemp("sft-ref")
    dense = sft_config(sft, d / "llama", micro=8, train={"save_interval": 3})
    moe = sft_config(sft, d / "moe", model=MOE)
    # plain text (the replies as documents), document-masked
    write_jsonl(d / "plain.jsonl", [{"text": c["messages"][-1]["content"]} for c in sft["convs"]])
    assert cli("preprocess", "--input", d / "plain.jsonl", "--tokenizer", sft["base"] / "tok",
               "--output-prefix", d / "plain")[0] == 0  # fmt: skip
    plain = sft_config(sft, d / "plain")
    plain["mt3d"]["data"].update(prefixes=[str(d / "plain")], document_mask=True)
    hybrid = sft_config(sft, d / "qwen3-next", model=QWEN3_NEXT_MTP)
    records = run_all(1, [dense, moe, plain, hybrid])
    step3 = d / "llama" / "checkpoints" / "step_00000003"
    return {"llama": records[0], "moe": records[1], "plain": records[2], "qwen3_next": records[3],
            "step3": str(step3)}  # fmt: skip


def test_packed_training_is_normalised_over_the_global_batch(sft_reference):
    for steps in (
        sft_reference["llama"],
        sft_reference["moe"],
        sft_reference["plain"],
        sft_reference["qwen3_next"],
    ):
        assert len(steps) == 5 and steps[-1]["loss"] < steps[0]["loss"]
        supervised = [r["supervised_tokens"] for r in steps]
        assert len(set(supervised)) > 1 and all(0.5 < r["packing_efficiency"] <= 1 for r in steps)
    # plain text trains on every real position but each document's last (its next token is another's)
    for r in sft_reference["plain"]:
        assert r["supervised_tokens"] <= r["packing_efficiency"] * 8 * SEQ - 8  # >= 1 document per sample


# name: (ranks, [(parallel keys, model, train keys, first step compared)], reference)
CASES = {
    "(2,2,2) SP, selective recompute": (8, [
        (dict(tp=2, pp=2, sequence_parallel=True), None, {"recompute": {"granularity": "selective"}}, 1),
    ], "llama"),
    "cp 2 x pp 2 all-gather, all-to-all, and resharded from one process": (4, [
        (dict(pp=2, context=2, context_exchange="allgather"), None, {}, 1),
        (dict(pp=2, context=2, context_exchange="alltoall"), None, {}, 1),
        (dict(tp=2, context=2, sequence_parallel=True), None, {"resume": "{step3}"}, 4),
    ], "llama"),
    "interleaved, resumed mid-epoch": (2, [
        (dict(pp=2, virtual_stages=2), None, {"save_interval": 3}, 1),
        (dict(pp=2, virtual_stages=2), None, {"resume": "{run0}/checkpoints/step_00000003"}, 4),
    ], "llama"),
    "MoE ep 2": (2, [(dict(expert=2), MOE, {}, 1)], "moe"),
    "Qwen3-Next with MTP, tp 2 x cp 2 and tp 2 x pp 2 with SP": (4, [
        (dict(tp=2, context=2, sequence_parallel=True), QWEN3_NEXT_MTP, {}, 1),
        (dict(tp=2, pp=2, sequence_parallel=True), QWEN3_NEXT_MTP, {}, 1),
    ], "qwen3_next"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_packed_training_matches_one_process(sft, sft_reference, tmp_path, case):
    ranks, runs, ref = CASES[case]
    raws = []
    for i, (parallel, model, train, _) in enumerate(runs):
        fill = {"step3": sft_reference["step3"], "run0": tmp_path / "run0"}
        train = {k: v.format(**fill) if isinstance(v, str) else v for k, v in train.items()}
        raws.append(sft_config(sft, tmp_path / f"run{i}", model=model, train=train, **parallel))
    got = run_all(ranks, raws)
    for records, (parallel, _, train, first) in zip(got, runs, strict=True):
        compare(records, sft_reference[ref], f"{case}: {parallel} {train}", first)
        if str(train.get("resume", "")).startswith("{run0}"):  # resumes the case's own run: exactly
            key = [(r["loss"], r["grad_norm"], r["supervised_tokens"]) for r in records]
            assert key == [(r["loss"], r["grad_norm"], r["supervised_tokens"]) for r in got[0][first - 1 :]]


# --- bad input ---------------------------------------------------------------------------------------

OK = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD = {
    "jsonl without messages": ("chat", {"text": "hi"}, "tok", 'a chat record needs "messages"'),
    "unknown role": ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "tok",
                     "message 0 has role 'robot'; roles are system, user, assistant, tool"),
    "content not a string": ("chat", {"messages": [{"role": "user", "content": ["x"]}]}, "tok",
                             "message 0 (user) has list content; content must be a string"),
    "prompt without completion": ("prompt-completion", {"prompt": "x"}, "tok",
                                  "'completion' must be a string (missing)"),
    "no conversation with a reply": ("chat", {"messages": [{"role": "user", "content": "x"}]}, "tok",
                                     "no chat records to keep in the inputs (1 had no assistant reply)"),
    "tokenizer without a chat template": ("chat", OK, "plain", "has no chat template"),
    "tokenizer asking for its own code": ("chat", OK, "custom", "asks for custom tokenizer code"),
    "invalid UTF-8": ("chat", OK, "tok", "in.jsonl:1: not UTF-8 text (byte 0xff at column 45)"),
    "a message that is a string": ("chat", {"messages": ["hi", OK["messages"][1]]}, "tok",
                                   'message 0 is a str, not an object {"role": ..., "content": ...}'),
    "a lone surrogate": ("chat", {"messages": [{"role": "user", "content": "a \ud800"}, OK["messages"][1]]},
                         "tok", "message 0 (user) holds a lone surrogate '\\ud800' at character 2"),
    "a lone surrogate in a completion": ("prompt-completion", {"prompt": "a", "completion": "\udfff"}, "tok",
                                         "'completion' holds a lone surrogate"),
    "a template over the sandbox's range": ("chat", OK, "tok", "failed on a conversation: OverflowError",
                                            "{% for i in range(10**8) %}x{% endfor %}"),
    "an empty template": ("chat", OK, "tok", "t.jinja is empty", " \n"),
    "a template rendering nothing": ("chat", OK, "tok", "renders nothing for this conversation", "{{ '' }}"),
    "a template marking no reply": ("chat", OK, "tok", "none of the 1 chat records has a supervised token",
                                    "{% for m in messages %}{{ m.content }}{% generation %}"
                                    "{% endgeneration %}{% endfor %}"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_fine_tuning_data_is_one_line_and_exit_2(sft, tmp_path, case):
    fmt, record, tok, expect, *template = BAD[case]
    base = sft["base"]
    if tok == "plain" and not (base / "plain").is_dir():
        train_bpe(WORDS * 10, 300, base / "plain")
    if tok == "custom" and not (base / "custom").is_dir():
        (base / "custom").mkdir()
        for f in (base / "tok").iterdir():
            (base / "custom" / f.name).write_bytes(f.read_bytes())
        config = json.loads((base / "custom" / "tokenizer_config.json").read_text())
        config["auto_map"] = {"AutoTokenizer": ["tok.MyTokenizer", None]}
        (base / "custom" / "tokenizer_config.json").write_text(json.dumps(config))
    write_jsonl(tmp_path / "in.jsonl", [record])
    if case == "invalid UTF-8":
        (tmp_path / "in.jsonl").write_bytes((tmp_path / "in.jsonl").read_bytes().replace(b"hi", b"h\xff"))
    argv = ["--input", tmp_path / "in.jsonl", "--format", fmt, "--tokenizer", base / tok]
    if template:
        (tmp_path / "t.jinja").write_text(template[0])
        argv += ["--chat-template", tmp_path / "t.jinja"]
    rc, _, err = cli("preprocess", *argv, "--output-prefix", tmp_path / "out")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and expect in lines[0], err
    assert not (tmp_path / "out.bin").exists()


def test_documents_all_longer_than_seq_len_are_refused_before_any_work(sft, tmp_path, monkeypatch):
    chat = sft["base"] / "chat"
    rc, _, err = cli("eval", "--model", sft["models"]["llama"], "--data", chat, "--seq-len", 16)
    assert rc == 2 and f"every one of its {len(sft['convs'])} documents is longer than seq_len 16" in err, err
    config = tmp_path / "run.json"
    config.write_text(json.dumps(sft_config(sft, tmp_path / "run")))
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc, _, err = cli("train", "--config", config, "--set", "mt3d.data.seq_len=16", "--check")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "documents is longer than seq_len 16" in lines[0], err
    assert "raise mt3d.data.seq_len" in lines[0]


PATTERNS = {"causal": None, "sliding": (4, 1, 1), "strided": (4, 3, 1), "dilated": (3, 1, 2)}


@pytest.mark.parametrize("pattern", list(PATTERNS.values()), ids=list(PATTERNS))
def test_document_attention_is_each_document_alone_for_every_pattern_and_chunk(pattern):
    """Whole sequences and context-parallel pieces (a chunk's queries over the keys before them, or
    over a halo), forward and backward, against each document run alone; padding gives zeros."""
    from mt3d.model.attention import LocalPattern, attend, reference_attention

    local = LocalPattern(*pattern) if pattern else None
    lengths = [5, 11, 1, 9, 6]
    docs = torch.tensor([sum(([i] * n for i, n in enumerate(lengths)), []) + [-1] * 4])
    n = docs.shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 8, generator=g, requires_grad=True) for _ in range(2))
    rep = lambda t: t.repeat_interleave(2, dim=1)  # noqa: E731 - GQA for the reference
    ref, at = [], 0
    for length in lengths:
        sl = slice(at, at + length)
        ref.append(reference_attention(q[:, :, sl], rep(k[:, :, sl]), rep(v[:, :, sl]), local, scale=0.3))
        at += length
    ref = torch.cat(ref + [torch.zeros(1, 4, 4, 8)], dim=2)
    got = attend(q, k, v, pattern=local, scale=0.3, documents=docs)
    assert torch.allclose(got, ref, atol=1e-6)
    dy = torch.randn_like(ref)
    grads = [torch.autograd.grad(x.mul(dy).sum(), (q, k, v)) for x in (got, ref)]
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    # (chunk start, size, first key): keys from 0 (all-gather) or from its documents' start (a halo)
    for q0, c, k0 in ((8, 4, 0), (8, 8, 0), (16, 12, 0), (16, 12, 10), (20, 4, 17), (24, 12, 17)):
        ks = slice(k0, q0 + c)
        piece = attend(q[:, :, q0 : q0 + c], k[:, :, ks], v[:, :, ks], pattern=local, scale=0.3, q_start=q0,
                       k_start=k0, n=n, documents=docs)  # fmt: skip
        assert torch.allclose(piece, ref[:, :, q0 : q0 + c], atol=1e-6), (q0, c, k0)
