"""The third hardening campaign (fine-tuning surfaces): a run's data set-up as a newcomer writes it
(no tokenizer named, a corpus too small for its validation split, no evaluation at all, nothing
supervised, documents longer than seq_len), each one line with exit 2 before any process group, or a
run that trains."""

import contextlib
import io
import json
import random

import numpy as np
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from mt3d.cli import main
from mt3d.data.indexed import IndexedWriter
from mt3d.data.tokenizer import train_bpe
from mt3d.parallel.spawn import spawn

from helpers import train_rc_worker

WORDS = "tensor pipeline data expert context shard rank stage layer block token batch step loss".split()


def cli(*argv):
    """``mt3d ARGV`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer, an HF Llama with it, a plain-text corpus of 40 documents preprocessed by ``mt3d
    preprocess`` (which records its tokenizer), and a masked dataset with nothing supervised (as
    mt3d made them before preprocessing refused such data)."""
    base = tmp_path_factory.mktemp("setup")
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) for _ in range(40)]
    tok = train_bpe(docs * 3, 300, base / "tok")
    (base / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    rc, _, err = cli("preprocess", "--input", base / "docs.jsonl", "--tokenizer", base / "tok",
                     "--output-prefix", base / "text")  # fmt: skip
    assert rc == 0, err
    hf = base / "hf"
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(LlamaConfig(intermediate_size=64, vocab_size=tok.vocab_size, **small)).save_pretrained(
        hf
    )
    for f in (base / "tok").iterdir():
        (hf / f.name).write_bytes(f.read_bytes())
    w = IndexedWriter(base / "unsupervised", np.uint16, with_mask=True)
    for d in docs[:10]:
        ids = tok.encode(d)
        w.add(ids, [0] * len(ids))
    w.close()
    return {"base": base, "tok": base / "tok", "hf": hf}


def config(corpus, save_dir, **data):
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "mt3d": {
            "model": {"from_hf": str(corpus["hf"])},
            "parallel": {"tensor": 1, "pipeline": 1},
            "data": {"corpus": "indexed", "prefixes": [str(corpus["base"] / "text")], "seq_len": 16, **data},
            "train": {"steps": 2, "log_interval": 1, "eval_batches": 1, "save_at_end": False,
                      "save_dir": str(save_dir), "progress": False},
        },
    }  # fmt: skip


SET_UP = {
    "a validation split too small for one sample": (
        {"split": [30, 1, 0], "seq_len": 100}, {},
        "text's validation split (split [30, 1, 0]) holds 1 documents"),
    "split [w, 0, 0] in a run that evaluates": (
        {"split": [1, 0, 0]}, {}, "gives the validation split no documents but the run evaluates"),
    "every document longer than seq_len": (
        {"packing": True, "seq_len": 4}, {}, "every one of its 40 documents is longer than seq_len 4"),
    "a train split too small for one sample": (
        {"split": [1, 30, 0], "seq_len": 100}, {"eval_batches": 0},
        "text's train split (split [1, 30, 0]) holds 1 documents"),
    "a masked dataset with nothing supervised": (
        {"prefixes": ["unsupervised"]}, {}, "unsupervised has no supervised token (its loss mask is all 0)"),
    "no tokenizer set or recorded, a model without one": (
        {"prefixes": ["unsupervised"]}, {"from_hf": "bare"},
        "mt3d.data.tokenizer is not set and none is recorded"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SET_UP))
def test_a_data_set_up_that_cannot_train_is_one_line_and_exit_2(corpus, tmp_path, monkeypatch, case):
    data, train, expect = SET_UP[case]
    raw = config(corpus, tmp_path / "run", **data)
    raw["mt3d"]["data"]["prefixes"] = [str(corpus["base"] / p) for p in data.get("prefixes", ["text"])]
    if train.pop("from_hf", None):
        (tmp_path / "bare").mkdir()
        (tmp_path / "bare" / "config.json").write_text((corpus["hf"] / "config.json").read_text())
        (tmp_path / "bare" / "model.safetensors").write_bytes(
            (corpus["hf"] / "model.safetensors").read_bytes()
        )
        raw["mt3d"]["model"]["from_hf"] = str(tmp_path / "bare")
    raw["mt3d"]["train"].update(train)
    (tmp_path / "run.json").write_text(json.dumps(raw))
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc, _, err = cli("train", "--config", tmp_path / "run.json", "--check")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and expect in lines[0], err


def test_a_run_naming_no_tokenizer_and_no_validation_split_trains(corpus, tmp_path, monkeypatch):
    """No ``data.tokenizer``: the one ``mt3d preprocess`` recorded (a text corpus), else the ``from_hf``
    model's (a dataset from before the record); split [w, 0, 0] with nothing evaluated trains."""
    from mt3d.config import load, validate

    meta = corpus["base"] / "text.meta.json"
    assert json.loads(meta.read_text())["tokenizer"] == str(corpus["tok"].resolve())
    raw = config(corpus, tmp_path / "run", split=[1, 0, 0])
    raw["mt3d"]["train"]["eval_batches"] = 0
    (tmp_path / "run.json").write_text(json.dumps(raw))
    run = load(tmp_path / "run.json", [])
    from mt3d.config import resolve_model

    model = resolve_model(run.mt3d.model)
    validate(run, 1, model)
    assert run.mt3d.data.tokenizer == str(corpus["tok"].resolve())
    saved = meta.read_text()
    try:  # a dataset without the record: the model's tokenizer
        meta.unlink()
        run = load(tmp_path / "run.json", [])
        validate(run, 1, model)
        assert run.mt3d.data.tokenizer == str(corpus["hf"])
    finally:
        meta.write_text(saved)
    rc, records = spawn(train_rc_worker, 1, raw, timeout=240)[0]
    assert rc == 0 and [r["step"] for r in records if "loss" in r] == [1, 2], records
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in records if "loss" in r)


@pytest.mark.parametrize(
    "case,fp8,layers,rc,expect",
    [
        ("all_gather without SP", {"all_gather": True}, 4, 0,
         "warning: mt3d.train.fp8.all_gather does nothing here"),
        ("exclude_first_last over 2 blocks", {"exclude_first_last": True}, 2, 2,
         "error: mt3d.train.fp8 covers no linear: exclude_first_last keeps the first and last block"),
    ],
)  # fmt: skip
def test_fp8_settings_that_do_nothing_are_said(tmp_path, monkeypatch, case, fp8, layers, rc, expect):
    from helpers import TINY_LLAMA, tiny_config

    raw = tiny_config(
        tmp_path / "run", model={**TINY_LLAMA, "layers": layers}, tp=2, fp8={"recipe": "tensorwise", **fp8}
    )
    raw["bf16"] = {"enabled": True}
    (tmp_path / "run.json").write_text(json.dumps(raw))
    monkeypatch.setenv("WORLD_SIZE", "2")
    got, _, err = cli("train", "--config", tmp_path / "run.json", "--check")
    lines = err.strip().splitlines()
    assert got == rc and len(lines) == 1 and expect in lines[0], err


def test_plan_with_a_context_degree_the_sequence_cannot_take_is_the_whole_reason_and_exit_2():
    rc, _, err = cli("plan", "--model", "llama-1b", "--gpus", "6", "--context", "3", "--seq-len", "4096")
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert (
        "--context 3 --seq-len 4096: context parallelism needs seq_len 4096 divisible by 2 x cp = 6"
        in lines[0]
    )
    # one usable degree among those pinned: a plan, whose rejections keep the rule's numbers
    rc, out, err = cli("plan", "--model", "llama-1b", "--gpus", "6", "--context", "2,3", "--seq-len", "4096",
                       "--json")  # fmt: skip
    rejected = {r["reason"] for r in json.loads(out)["rejected"] if r.get("cp") == 3}
    assert rc == 0 and "context parallelism needs seq_len 4096 divisible by 2 x cp = 6" in rejected, rejected


def test_a_set_up_error_before_process_groups_is_said_once_per_host(corpus, tmp_path, monkeypatch, capsys):
    """Under a launcher every rank checks the config and its host's files alike: the host's first rank
    says what is wrong, the others exit 2 silently; a rank's own launcher variables are its own to
    report."""
    from mt3d.train import main as train

    raw = config(corpus, tmp_path / "run", split=[30, 1, 0], seq_len=100)
    (tmp_path / "run.json").write_text(json.dumps(raw))
    said = []
    for local in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(local))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert train(["--config", str(tmp_path / "run.json")]) == 2
        said.append(capsys.readouterr().err.strip().splitlines())
    assert len(said[0]) == 1 and "validation split" in said[0][0] and said[1] == [], said
    (tmp_path / "good.json").write_text(json.dumps(config(corpus, tmp_path / "run")))
    monkeypatch.setenv("RANK", "5")  # LOCAL_RANK 1 still
    assert train(["--config", str(tmp_path / "good.json")]) == 2
    assert "RANK=5 is outside WORLD_SIZE=2" in capsys.readouterr().err
