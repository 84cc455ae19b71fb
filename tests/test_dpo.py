"""DPO: preference data tokenized as TRL tokenizes it (against transformers' tokenizer and chat
template), the reference log-probabilities against transformers' model, training at tp 2 x pp 2 and
cp 2 x tp 2 (SP) equal to one process, LoRA, exact resume, and bad input.

The pairs mix TRL's three formats (standard strings, conversational with an explicit prompt, implicit
prompt); completions of 1 to 5 words, so pairs per micro-batch are uneven.
"""

import json
import math
import random

import pytest
import torch
from test_sft import cli, save_hf_model, words, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from mt3d.data.indexed import IndexedDataset
from mt3d.data.tokenizer import train_bpe
from mt3d.parallel.spawn import spawn

from helpers import run_grouped, tiny_config, train_rc_worker

SEQ = 64


def records(n, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"prompt": words(rng, 1, 6), "chosen": " " + words(rng, 1, 5),
                        "rejected": " " + words(rng, 1, 5)})  # fmt: skip
            continue
        prompt = [{"role": "user", "content": words(rng, 1, 4)}]
        chosen = [{"role": "assistant", "content": words(rng, 1, 5)}]
        rejected = [{"role": "assistant", "content": words(rng, 1, 5)}]
        if i % 3 == 1:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:  # implicit prompt: the messages both lists start with
            out.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
    return out


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    """A ChatML tokenizer, 90 pairs made with ``mt3d preprocess --format preference``, and a tiny HF
    Llama (random non-zero norms) to fine-tune."""
    base = tmp_path_factory.mktemp("dpo")
    tok = train_bpe([" ".join(words(random.Random(i), 20, 30) for i in range(40))] * 4, 400, base / "tok",
                    chat=True)  # fmt: skip
    recs = records(90)
    write_jsonl(base / "pairs.jsonl", recs)
    rc, out, err = cli("preprocess", "--input", base / "pairs.jsonl", "--format", "preference", "--tokenizer",
                       base / "tok", "--output-prefix", base / "pairs")  # fmt: skip
    assert rc == 0 and "90 preference pairs" in out, err
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=tok.vocab_size, max_position_embeddings=128,
                         bos_token_id=tok.eos_id, eos_token_id=tok.eos_id)  # fmt: skip
    for seed, name in enumerate(("llama", "other")):  # the policy's start, another reference
        save_hf_model(config, seed, base / name, base / "tok")
    return {"base": base, "records": recs, "tok": tok}


def test_pairs_are_tokenized_as_trl_does_and_shown_as_pairs(dpo):
    base, hf = dpo["base"], AutoTokenizer.from_pretrained(dpo["base"] / "tok")
    ds = IndexedDataset(base / "pairs")
    assert len(ds) == 2 * len(dpo["records"])
    for p, rec in enumerate(dpo["records"]):
        if isinstance(rec["chosen"], str):  # standard: the prompt with special tokens, completion + EOS
            prompt = hf(rec["prompt"])["input_ids"]
            completions = [hf(rec[k], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
                           for k in ("chosen", "rejected")]  # fmt: skip
        else:  # conversational: the template's prompt, then what each reply adds to its rendering
            msgs = rec.get("prompt") or rec["chosen"][:1]
            head = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            prompt = hf(head, add_special_tokens=False)["input_ids"]
            completions = []
            for k in ("chosen", "rejected"):
                reply = rec[k][-1:]
                whole = hf.apply_chat_template(msgs + reply, tokenize=False)
                assert whole.startswith(head)
                completions.append(hf(whole[len(head) :], add_special_tokens=False)["input_ids"])
        for side, completion in enumerate(completions):
            ids, mask = ds.doc(2 * p + side).tolist(), ds.doc_mask(2 * p + side).tolist()
            assert ids == prompt + completion, (p, side)
            assert mask == [0] * len(prompt) + [1] * len(completion), (p, side)
    rc, out, _ = cli("data", "show", base / "pairs", "--json", "--limit", "4")
    lines = [json.loads(line) for line in out.splitlines()]
    shown = [(r["pair"], r["side"]) for r in lines]
    assert rc == 0 and shown == [(0, "chosen"), (0, "rejected"), (1, "chosen"), (1, "rejected")]
    rc, out, _ = cli("data", "show", base / "pairs", "--limit", "2")
    assert rc == 0 and "--- pair 0, rejected (document 1)" in out


def dpo_config(dpo, d, tp=1, pp=1, lora=None, train=None, zero=1, model=None, **parallel):
    train = {"objective": "dpo", "dpo": {"beta": 0.5}, **(train or {})}
    raw = tiny_config(d, tp=tp, pp=pp, steps=5, zero=zero, **train)
    raw["mt3d"]["model"] = model or {"from_hf": str(dpo["base"] / "llama")}
    prefix, tok = str(dpo["base"] / "pairs"), str(dpo["base"] / "tok")
    raw["mt3d"]["data"] = {"corpus": "indexed", "prefixes": [prefix], "tokenizer": tok, "seq_len": SEQ,
                           "split": [90, 10, 0]}  # fmt: skip
    raw["mt3d"]["parallel"].update(parallel)
    if lora:
        raw["mt3d"]["lora"] = lora
    return raw


LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
FIGURES = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
           "logps/rejected", "rewards/accuracies", "pairs")  # fmt: skip


@pytest.fixture(scope="module")
def dpo_runs(dpo, tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo-runs")
    step3 = str(d / "ref" / "checkpoints" / "step_00000003")
    moe = {"model": {"preset": "tiny-mixtral"}}
    other = {"dpo": {"beta": 0.5, "reference": "model", "reference_model": str(dpo["base"] / "other")}}
    runs = {
        "ref": (1, dpo_config(dpo, d / "ref", train={"save_interval": 3})),
        "tp2 pp2 sp": (4, dpo_config(dpo, d / "tp2pp2", tp=2, pp=2, sequence_parallel=True)),
        "zero2 dp2": (2, dpo_config(dpo, d / "zero2", zero=2)),
        "moe": (1, dpo_config(dpo, d / "moe", **moe)),
        "moe ep2": (2, dpo_config(dpo, d / "moe-ep2", expert=2, **moe)),
        "other reference": (1, dpo_config(dpo, d / "other", train=other)),
        "cp2 tp2 sp": (4, dpo_config(dpo, d / "cp2", tp=2, context=2, sequence_parallel=True)),
        "lora": (1, dpo_config(dpo, d / "lora", lora=LORA)),
        "lora tp2": (2, dpo_config(dpo, d / "lora-tp2", tp=2, lora=LORA)),
        "ipo": (1, dpo_config(dpo, d / "ipo", train={"dpo": {"beta": 0.5, "loss_type": "ipo"}})),
    }
    got = dict(zip(runs, run_grouped(list(runs.values()), timeout=900), strict=True))
    resumed = dpo_config(dpo, d / "resumed", train={"resume": step3})  # another run directory's checkpoint
    got["resumed"] = run_grouped([(1, resumed)], timeout=600)[0]
    # a reference table made for another model is refused on resume, in one line
    (d / "tampered").mkdir()
    held = torch.load(d / "ref" / "dpo_reference.pt", weights_only=True)
    torch.save(
        {**held, "identity": {**held["identity"], "model": "sha256:0"}}, d / "tampered" / "dpo_reference.pt"
    )
    tampered = dpo_config(dpo, d / "tampered", train={"resume": step3, "overwrite": False})
    got["tampered"] = spawn(train_rc_worker, 1, tampered, timeout=600)[0]
    return {"records": got, "dir": d}


def same(got, ref, what, first=1):
    ref = [r for r in ref if r["step"] >= first]
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    for a, b in zip(got, ref, strict=True):
        for key in FIGURES:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), f"{what} step {a['step']} {key}"


def test_dpo_at_every_layout_equals_one_process(dpo_runs):
    runs = dpo_runs["records"]
    ref = runs["ref"]
    # the policy starts as the reference: every margin 0, the loss ln 2; then it learns the preferences
    assert abs(ref[0]["loss"] - math.log(2)) < 1e-6 and ref[0]["rewards/margins"] == 0.0
    assert ref[-1]["loss"] < ref[0]["loss"] and ref[-1]["rewards/accuracies"] > 0.5
    assert sum(r["pairs"] for r in ref) > 0 and len({r["pairs"] for r in ref}) > 1  # uneven batches
    same(runs["tp2 pp2 sp"], ref, "tp2 pp2 sp")
    same(runs["cp2 tp2 sp"], ref, "cp2 tp2 sp")
    same(runs["zero2 dp2"], ref, "zero2 dp2")
    same(runs["moe ep2"], runs["moe"], "moe ep2")
    first = runs["moe"][0]  # DPO's ln 2 plus the router's load-balancing loss (tiny-mixtral: 0.02 x aux)
    assert abs(first["loss"] - math.log(2) - 0.02 * first["moe_aux_loss"]) < 1e-5
    assert abs(runs["other reference"][0]["loss"] - math.log(2)) > 1e-3  # another reference: margins not 0
    same(runs["lora tp2"], runs["lora"], "lora tp2")
    assert abs(runs["lora"][0]["loss"] - math.log(2)) < 1e-6 and runs["lora"][-1]["loss"] != ref[-1]["loss"]
    assert abs(runs["ipo"][0]["loss"] - 1.0) < 1e-6  # (0 - 1 / (2 beta))^2 at beta 0.5
    same(runs["resumed"], ref, "resumed from step 3", first=4)
    assert runs["tampered"][0] == 2  # the reference table of another model: refused


def hf_logps(model_dir, prefix, every=1):
    """transformers, one document at a time: {document: its supervised tokens' log-probability}."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ds = IndexedDataset(prefix)
    out = {}
    for i in range(0, len(ds), every):
        ids, mask = torch.tensor(ds.doc(i), dtype=torch.long), torch.tensor(ds.doc_mask(i))
        with torch.no_grad():
            logp = model(ids[None]).logits[0, :-1].double().log_softmax(-1)
        out[i] = (logp.gather(1, ids[1:, None])[:, 0] * mask[1:]).sum().item()
    return out


def test_reference_log_probabilities_equal_transformers(dpo, dpo_runs):
    """Each completion's log-probability under the starting model, summed over its supervised tokens,
    as transformers computes it document by document."""
    held = torch.load(dpo_runs["dir"] / "ref" / "dpo_reference.pt", weights_only=True)
    table = held["table"]
    assert math.isfinite(float(table.max())) and (table > -math.inf).sum() == 2 * len(dpo["records"])
    for i, want in hf_logps(dpo["base"] / "llama", dpo["base"] / "pairs", every=7).items():
        assert abs(table[i].item() - want) <= 1e-4 * max(1.0, abs(want)), i
    assert (dpo_runs["dir"] / "resumed" / "dpo_reference.pt").is_file()  # carried with the resumed run
    other = torch.load(dpo_runs["dir"] / "other" / "dpo_reference.pt", weights_only=True)["table"]
    for i, want in hf_logps(dpo["base"] / "other", dpo["base"] / "pairs", every=11).items():
        assert abs(other[i].item() - want) <= 1e-4 * max(1.0, abs(want)), i


def eval_worker(argv):
    import torch.distributed as dist

    rc, stdout, stderr = cli("eval", *argv)
    assert rc == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1]) if dist.get_rank() == 0 else None


def test_eval_with_a_reference_model_equals_transformers_at_every_layout(dpo, dpo_runs, tmp_path):
    """`mt3d eval --ref-model`: the policy (the one-process run's step-3 checkpoint, exported) against
    the starting model, DPO's sigmoid loss, reward accuracy and margin over every pair, as computed
    from transformers' log-probabilities; the same at tp 2 x pp 2 and cp 2."""
    step3 = dpo_runs["dir"] / "ref" / "checkpoints" / "step_00000003"
    assert cli("export-hf", "--checkpoint", step3, "--out", tmp_path / "policy")[0] == 0
    prefix, ref = dpo["base"] / "pairs", dpo["base"] / "llama"
    policy, reference = hf_logps(tmp_path / "policy", prefix), hf_logps(ref, prefix)
    n = len(dpo["records"])
    margins = [0.1 * ((policy[2 * p] - reference[2 * p]) - (policy[2 * p + 1] - reference[2 * p + 1]))
               for p in range(n)]  # fmt: skip
    loss = sum(-torch.nn.functional.logsigmoid(torch.tensor(m)).item() for m in margins) / n
    want = {
        "dpo_loss": loss,
        "reward_accuracy": sum(m > 0 for m in margins) / n,
        "reward_margin": sum(margins) / n,
    }
    assert 0 < want["reward_accuracy"] < 1 and want["dpo_loss"] != pytest.approx(math.log(2))
    argv = ["--model", str(step3), "--ref-model", str(ref), "--data", str(prefix), "--seq-len", str(SEQ),
            "--json"]  # fmt: skip
    for world, flags in ((1, []), (4, ["--tp", "2", "--pp", "2"]), (2, ["--cp", "2"])):
        got = spawn(eval_worker, world, argv + flags, timeout=300)[0]
        assert got["pairs"] == n and got["dropped_pairs"] == 0, flags
        for key, value in want.items():
            assert abs(got[key] - value) <= 1e-5 * max(1.0, abs(value)), (flags, key, got[key], value)
    rc, _, err = cli("eval", "--model", str(ref), "--ref-model", str(ref), "--text", str(prefix) + ".bin",
                     "--seq-len", "8")  # fmt: skip
    assert rc == 2 and "--ref-model scores preference pairs" in err


BAD = {
    "plain data": ({"data": "plain"}, "holds no preference pairs"),
    "beta": ({"train": {"dpo": {"beta": 0}}}, "mt3d.train.dpo.beta must be positive"),
    "loss type": ({"train": {"dpo": {"loss_type": "hinge"}}}, "loss_type must be 'sigmoid' or 'ipo'"),
    "reference": ({"train": {"dpo": {"reference": "policy"}}}, "reference must be 'precompute'"),
    "reference model missing": (
        {"train": {"dpo": {"reference": "model", "reference_model": "/nonexistent"}}},
        "mt3d.train.dpo.reference_model: not found: /nonexistent",
    ),
    "reference model of nothing": (
        {"train": {"dpo": {"reference": "model"}}, "model": {"preset": "tiny-llama"}},
        "reference 'model' needs reference_model",
    ),
    "prompt longer than seq_len": ({"data": {"seq_len": 8}}, "leave no room for a completion in seq_len 8"),
    "dpo without objective": ({"train": {"objective": "lm"}}, "mt3d.train.dpo is set but"),
    "builtin corpus": ({"data": "builtin"}, "holds no preference pairs"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_dpo_input_is_one_line_and_exit_2(dpo, tmp_path, monkeypatch, case):
    change, message = BAD[case]
    raw = dpo_config(dpo, tmp_path / "run")
    if change.get("data") == "plain":
        write_jsonl(tmp_path / "plain.jsonl", [{"text": "tensor pipeline data"}] * 4)
        assert cli("preprocess", "--input", tmp_path / "plain.jsonl", "--tokenizer", dpo["base"] / "tok",
                   "--output-prefix", tmp_path / "plain")[0] == 0  # fmt: skip
        raw["mt3d"]["data"]["prefixes"] = [str(tmp_path / "plain")]
    if change.get("data") == "builtin":
        raw["mt3d"]["data"] = {"corpus": "builtin", "seq_len": SEQ}
    if isinstance(change.get("data"), dict):
        raw["mt3d"]["data"].update(change["data"])
    if "model" in change:
        raw["mt3d"]["model"] = change["model"]
    raw["mt3d"]["train"].update(change.get("train", {}))
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(raw))
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc, _, err = cli("train", "--config", cfg, "--check")
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / "dpo_reference.pt").exists()


@pytest.mark.parametrize("record,message", [
    ({"prompt": "a", "chosen": " b"}, 'bad.jsonl:2: a preference record needs "rejected"'),
    ({"prompt": "a", "chosen": "", "rejected": " b"}, "bad.jsonl:2: the chosen completion is empty"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": " c"},
     "bad.jsonl:2: a chat record needs \"rejected\""),
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "bad.jsonl:2: chosen and rejected share no first message"),
])  # fmt: skip
def test_bad_preference_records_name_file_and_line(dpo, tmp_path, record, message):
    write_jsonl(tmp_path / "bad.jsonl", [dpo["records"][0], record])
    rc, _, err = cli("preprocess", "--input", tmp_path / "bad.jsonl", "--format", "preference", "--tokenizer",
                     dpo["base"] / "tok", "--output-prefix", tmp_path / "bad")  # fmt: skip
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad.bin").exists()  # nothing half-written


def test_per_token_log_probabilities_equal_transformers_at_every_layout(dpo, tmp_path):
    """`mt3d eval --logprobs` (what an RL trainer reads of its rollouts): every token's log-probability
    given its document's earlier tokens, as transformers computes it, at one process, tp 2 x pp 2 and
    cp 2; null for each document's first token."""
    prefix, model_dir = dpo["base"] / "pairs", dpo["base"] / "llama"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ds = IndexedDataset(prefix)
    for world, flags in ((1, []), (4, ["--tp", "2", "--pp", "2"]), (2, ["--cp", "2"])):
        out = tmp_path / f"lp{world}.jsonl"
        argv = ["--model", str(model_dir), "--data", str(prefix), "--seq-len", str(SEQ),
                "--logprobs", str(out), "--json", *flags]  # fmt: skip
        got = spawn(eval_worker, world, argv, timeout=300)[0]
        assert got["documents"] == len(ds) and got["truncated"] == 0
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["document"] for r in lines] == list(range(len(ds)))
        for r in lines[::9]:
            ids = torch.tensor(r["tokens"])
            assert r["tokens"] == ds.doc(r["document"]).tolist() and r["logprobs"][0] is None
            with torch.no_grad():
                want = model(ids[None]).logits[0, :-1].double().log_softmax(-1).gather(1, ids[1:, None])[:, 0]
            assert torch.allclose(torch.tensor(r["logprobs"][1:], dtype=torch.float64), want, atol=1e-5), (
                flags
            )
    rc, _, err = cli("eval", "--model", model_dir, "--text", str(prefix) + ".bin", "--seq-len", "8",
                     "--logprobs", tmp_path / "x.jsonl")  # fmt: skip
    assert rc == 2 and "--logprobs writes the per-token log-probabilities of --data" in err


def live_worker(path, tp, pp, ep):
    import torch.distributed as dist

    from mt3d.checkpoint.live import hf_weights
    from mt3d.checkpoint.loading import from_pretrained

    model = from_pretrained(path, tp=tp, pp=pp, ep=ep)
    got = hf_weights(model, model.config, model.state, model.vocab_size)
    assert (got is None) == (dist.get_rank() != 0)
    return got


def test_a_running_layout_gives_its_full_weights_in_hf_names(dpo, tmp_path):
    """`checkpoint.live.hf_weights` (what a rollout engine pulls): at tp 2 x pp 2, and a Mixtral at
    tp 2 x ep 2, the HF tensors the model was loaded from, bit for bit."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig

    torch.manual_seed(3)
    mixtral = MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                            vocab_size=dpo["tok"].vocab_size, max_position_embeddings=128)  # fmt: skip
    AutoModelForCausalLM.from_config(mixtral).save_pretrained(tmp_path / "mixtral")
    for path, layout in ((dpo["base"] / "llama", (2, 2, 1)), (tmp_path / "mixtral", (2, 1, 2))):
        got = spawn(live_worker, layout[0] * layout[1] * layout[2], str(path), *layout, timeout=300)[0]
        want = load_file(path / "model.safetensors")
        assert sorted(got) == sorted(want), path
        for k, v in want.items():
            assert torch.equal(got[k], v), (path, k)
