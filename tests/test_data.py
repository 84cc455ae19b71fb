"""Data path: preprocessing round trips, bad input, sample index, splits, blending, DP order, corpora."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mt3d.data.corpora import MarkovGrammar, builtin_corpus, stdlib_documents, synthetic_corpus
from mt3d.data.indexed import IndexedDataError, IndexedDataset, IndexedWriter
from mt3d.data.loader import StepBatches, micro_batch_ids
from mt3d.data.preprocess import PreprocessError, preprocess
from mt3d.data.samples import BlendedSamples, PackedSamples, split_documents
from mt3d.data.tokenizer import load_tokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    docs = [d for _, d in zip(range(400), stdlib_documents())]
    out = tmp_path_factory.mktemp("tok") / "bpe"
    train_bpe(docs, 400, out)
    return out


@pytest.fixture(scope="module")
def texts():
    docs = [d for _, d in zip(range(300), stdlib_documents())]
    # no blank (or whitespace-only) lines inside, so .txt blocks are exactly these documents
    return ["\n".join(line for line in d.splitlines() if line.strip()) for d in docs]


def write_inputs(tmp, texts):
    txt = tmp / "a.txt"
    txt.write_text("\n\n".join(texts[:150]) + "\n")
    jl = tmp / "b.jsonl"
    jl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[150:])))
    return txt, jl


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_round_trip(tmp_path, tok_dir, texts, workers):
    txt, jl = write_inputs(tmp_path, texts)
    stats = preprocess(
        [str(txt), str(jl)], str(tok_dir), str(tmp_path / "out"), workers=workers, batch_docs=16
    )
    tok = load_tokenizer(tok_dir)
    ds = IndexedDataset(tmp_path / "out")
    assert ds.num_docs == len(texts) == stats.documents
    assert ds.dtype == np.uint16 and ds.max_id < tok.vocab_size
    for i, text in enumerate(texts):
        assert ds.doc(i).tolist() == tok.encode(text) and ds.doc(i)[-1] == tok.eos_id
    assert ds.num_tokens == stats.tokens
    one = preprocess([str(txt)], str(tok_dir), str(tmp_path / "file"), txt_mode="file")
    assert one.documents == 1
    assert IndexedDataset(tmp_path / "file").doc(0).tolist() == tok.encode(txt.read_text())
    # the tokenizer directory is a regular HF tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf(texts[0], add_special_tokens=False)["input_ids"] + [tok.eos_id] == tok.encode(texts[0])


def test_preprocess_bad_input(tmp_path, tok_dir, texts):
    txt, jl = write_inputs(tmp_path, texts)
    out = str(tmp_path / "o")
    with pytest.raises(PreprocessError, match="input not found"):
        preprocess([str(tmp_path / "nope.txt")], str(tok_dir), out)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(PreprocessError, match="empty.txt is empty"):
        preprocess([str(empty)], str(tok_dir), out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "broken\n{"other": 1}\n{"text": "also fine"}\n')
    with pytest.raises(PreprocessError, match="bad.jsonl:2: invalid jsonl line"):
        preprocess([str(txt), str(bad)], str(tok_dir), out)
    assert not list(tmp_path.glob("o.*")), "a failed run leaves nothing behind"
    stats = preprocess([str(bad)], str(tok_dir), out, on_bad_line="skip")
    assert stats.documents == 2 and [s.split(": ")[0] for s in stats.skipped_lines] == [
        f"{bad}:2",
        f"{bad}:3",
    ]
    assert "missing key 'text'" in stats.skipped_lines[1]
    with pytest.raises(PreprocessError, match="holds at most 256; use --dtype uint32"):
        preprocess([str(txt)], str(tok_dir), out, dtype="uint8")


def test_failed_run_keeps_the_previous_output(tmp_path, tok_dir, texts):
    txt, _ = write_inputs(tmp_path, texts)
    preprocess([str(txt)], str(tok_dir), str(tmp_path / "p"))
    before = {n: (tmp_path / n).read_bytes() for n in ("p.bin", "p.idx", "p.meta.json")}
    bad = tmp_path / "x.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(PreprocessError):
        preprocess([str(txt), str(bad)], str(tok_dir), str(tmp_path / "p"))
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert IndexedDataset(tmp_path / "p").num_docs == 150
    assert sorted(p.name for p in tmp_path.glob("p.*")) == ["p.bin", "p.idx", "p.meta.json"]


def test_corrupt_and_mismatched_files_are_detected(tmp_path):
    for name, docs in (("a", [[1, 2, 3], [4, 5]]), ("b", [[9, 9, 9], [9, 9]])):
        w = IndexedWriter(tmp_path / name, np.uint16)
        for d in docs:
            w.add(d)
        w.close()
    (tmp_path / "c.bin").write_bytes((tmp_path / "b.bin").read_bytes())
    (tmp_path / "c.idx").write_bytes((tmp_path / "a.idx").read_bytes())
    with pytest.raises(IndexedDataError, match="c.bin does not belong to .*c.idx"):
        IndexedDataset(tmp_path / "c")
    (tmp_path / "a.bin").write_bytes((tmp_path / "a.bin").read_bytes()[:-2])
    with pytest.raises(IndexedDataError, match="a.bin is truncated: 8 bytes, index expects 10"):
        IndexedDataset(tmp_path / "a")
    (tmp_path / "d.idx").write_bytes(b"garbage" * 10)
    (tmp_path / "d.bin").write_bytes(b"")
    with pytest.raises(IndexedDataError, match="bad magic"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(IndexedDataError, match="does not fit in uint8"):
        IndexedWriter(tmp_path / "e", np.uint8).add([300])
    cmd = ["preprocess", "--input", str(tmp_path / "none.txt"), "--tokenizer", "x", "--output-prefix", "z"]
    out = subprocess.run([sys.executable, "-m", "mt3d", *cmd], capture_output=True, text=True, timeout=60)
    assert (
        out.returncode == 2
        and out.stderr.strip() == f"mt3d preprocess: error: input not found: {tmp_path}/none.txt"
    )


@pytest.fixture(scope="module")
def corpus():
    return synthetic_corpus(256, seed=3, tokens=60_000)


def test_packed_samples_follow_the_shuffled_document_stream(tmp_path, corpus):
    ds = IndexedDataset(corpus.prefix)
    docs = np.arange(ds.num_docs)
    s = PackedSamples(ds, docs, seq_len=32, seed=7, cache_dir=tmp_path)
    order_docs, _, _, shuffle = s._epoch(0)
    stream = np.concatenate([ds.doc(int(d)) for d in order_docs])
    for i in range(0, len(s), 37):
        j = int(shuffle[i])
        assert np.array_equal(s[i], stream[j * 32 : j * 32 + 33])
    assert len(s) == (ds.num_tokens - 1) // 32
    assert not np.array_equal(s[len(s)], s[0])  # epoch 1 is a different order
    # the index is cached on disk and identical when rebuilt elsewhere
    assert len(list(tmp_path.glob("samples-*-e0.npz"))) == 1
    again = PackedSamples(ds, docs, seq_len=32, seed=7, cache_dir=tmp_path / "other")
    assert all(np.array_equal(again[i], s[i]) for i in range(0, 2 * len(s), 53))


def _digest_worker(prefix, n):
    ds = IndexedDataset(prefix)
    s = PackedSamples(ds, np.arange(ds.num_docs), seq_len=16, seed=11)
    return hashlib.sha256(np.stack([s[i] for i in range(n)]).tobytes()).hexdigest()


def test_sample_order_is_the_same_in_every_process(corpus):
    from mt3d.parallel.spawn import spawn

    digests = spawn(_digest_worker, 2, str(corpus.prefix), 500)
    assert digests[0] == digests[1] == _digest_worker(str(corpus.prefix), 500)


def test_splits_are_disjoint_and_complete():
    parts = split_documents(1000, [98, 1, 1])
    assert [len(p) for p in parts] == [980, 10, 10]
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    tiny = split_documents(5, [98, 1, 1])
    assert all(len(p) >= 1 for p in tiny) and sum(len(p) for p in tiny) == 5


class Counting:
    def __init__(self, k, seq_len=4):
        self.k, self.seq_len = k, seq_len

    def __getitem__(self, i):
        return np.array([self.k, i])

    def __len__(self):
        return 10**6


def test_blending_matches_the_weights():
    weights = [0.7, 0.2, 0.1]
    blend = BlendedSamples([Counting(k) for k in range(3)], weights)
    for n in (100, 10_000, 70_000):
        counts = np.bincount([blend.source_of(i)[0] for i in range(n)], minlength=3)
        assert np.all(np.abs(counts / n - weights) <= 0.01), (n, counts)
    # every source's samples are used in order, each once
    seen = [blend[i] for i in range(5000)]
    for k in range(3):
        idx = [int(s[1]) for s in seen if s[0] == k]
        assert idx == list(range(len(idx)))
    fresh = BlendedSamples([Counting(k) for k in range(3)], weights)
    assert [blend.source_of(i) for i in range(100)] == [fresh.source_of(i) for i in range(100)]


class SmallBlocks(BlendedSamples):
    BLOCK = 256


def test_blending_keeps_few_blocks_and_resumes_far_from_cached_boundaries(tmp_path):
    weights = [0.5, 0.3, 0.15, 0.05]
    ref = SmallBlocks([Counting(k) for k in range(4)], weights)  # no cache: replays from 0
    first = [ref.source_of(i) for i in range(0, 200 * 256, 97)]
    assert len(ref._blocks) <= ref.KEEP_BLOCKS  # memory stays bounded however far it goes
    cached = SmallBlocks([Counting(k) for k in range(4)], weights, tmp_path)
    far = 150 * 256 + 17
    assert cached.source_of(far) == ref.source_of(far)
    saved = np.load(next(tmp_path.glob("blend-*.npy")))
    assert len(saved) == 152 and (saved[-1] == ref._counts[151]).all()
    resumed = SmallBlocks([Counting(k) for k in range(4)], weights, tmp_path)  # a restarted run
    assert len(resumed._counts) == 152  # boundaries come from disk, not from a replay
    assert resumed.source_of(far) == ref.source_of(far)
    assert [resumed.source_of(i) for i in range(0, 200 * 256, 97)] == first


def test_dp_ranks_read_disjoint_samples_covering_each_batch():
    gb, mb = 24, 2
    for dp in (1, 2, 3, 6):
        ga = gb // (mb * dp)
        for step in (0, 5):
            ids = [
                i
                for r in range(dp)
                for m in range(ga)
                for i in micro_batch_ids(step, m, global_batch=gb, micro_batch=mb, grad_accum=ga, dp_rank=r)
            ]
            assert sorted(ids) == list(range(step * gb, (step + 1) * gb))


def test_resumed_iterator_continues_exactly(corpus):
    ds = IndexedDataset(corpus.prefix)
    s = PackedSamples(ds, np.arange(ds.num_docs), seq_len=16, seed=1)
    kw = dict(global_batch=8, micro_batch=2, grad_accum=2, dp_rank=1)
    full = StepBatches(s, **kw)
    for _ in range(3 * 2):
        next(full)
    resumed = StepBatches(s, start_step=3, **kw)
    for _ in range(4):
        a, b = next(full), next(resumed)
        assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b))


def test_synthetic_grammar_entropy_is_exact():
    g = MarkovGrammar.random(64, seed=5)
    pi = g.stationary()
    assert abs(pi.sum() - 1) < 1e-12
    nxt = np.zeros_like(pi)
    np.add.at(nxt, g.successors, pi[:, None] * g.probs)
    assert np.abs(nxt - pi).max() < 1e-12
    # empirical conditional entropy of a long sample approaches the computed rate
    stream = np.concatenate(list(g.sample(400_000, seed=1, chains=64)))
    pairs = np.bincount(stream[:-1] * 64 + stream[1:], minlength=64 * 64).reshape(64, 64).astype(float)
    cond = pairs / pairs.sum(1, keepdims=True)
    h = -(pairs / pairs.sum() * np.log(np.where(cond > 0, cond, 1))).sum()
    assert abs(h - g.entropy_rate()) / g.entropy_rate() < 0.01


def test_builtin_corpus_is_deterministic_english(tmp_path):
    a = builtin_corpus(512, cache_dir=str(tmp_path / "a"))
    b = builtin_corpus(512, cache_dir=str(tmp_path / "b"))
    assert (a.prefix.with_suffix(".bin")).read_bytes() == (b.prefix.with_suffix(".bin")).read_bytes()
    tok = load_tokenizer(a.tokenizer_dir)
    ds = IndexedDataset(a.prefix)
    text = tok.decode(ds.read(0, 5000))
    assert a.info["documents"] > 1000 and text.count(" the ") > 20
    assert builtin_corpus(512, cache_dir=str(tmp_path / "a")).info == a.info  # cached


def _big_jsonl(path: Path, words: list[str], mbytes: int) -> None:
    rng = np.random.default_rng(0)
    vocab = np.array(words)
    with open(path, "w") as f:
        written = 0
        while written < mbytes * 1_000_000:
            line = json.dumps({"text": " ".join(vocab[rng.integers(0, len(vocab), 2000)])}) + "\n"
            f.write(line * 50)
            written += len(line) * 50


def test_corpus_larger_than_the_memory_cap_preprocesses(tmp_path, corpus):
    """300 MB of jsonl through `mt3d preprocess` with a 200 MB address-space limit."""
    words = [w for w in json.loads((corpus.tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]]
    words = [w for w in words if w.isalpha()]
    src = tmp_path / "big.jsonl"
    _big_jsonl(src, words, 300)
    assert src.stat().st_size > 300e6
    limit = 200 * 2**20

    def cap():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    # RLIMIT_AS counts address space, not memory: each extra glibc malloc arena reserves 64 MB it
    # may never touch, so one arena keeps the cap about what the process really uses.
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", RAYON_NUM_THREADS="1", MALLOC_ARENA_MAX="1")
    cmd = ["preprocess", "--input", str(src), "--tokenizer", str(corpus.tokenizer_dir)]
    cmd += ["--output-prefix", str(tmp_path / "big"), "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", *cmd],
        capture_output=True,
        text=True,
        timeout=900,
        preexec_fn=cap,
        env=env,
        cwd=ROOT,
    )
    src.unlink()
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads(out.stdout)
    ds = IndexedDataset(tmp_path / "big")
    assert ds.num_tokens == stats["tokens"] > 36_000_000
    assert ds.doc(ds.num_docs - 1)[-1] == load_tokenizer(corpus.tokenizer_dir).eos_id


def _capped_training_worker(prefix, save_dir, headroom_mb):
    """Build an engine, cap the address space at what is mapped now + headroom, then open the big
    corpus and train on it: opening or reading it must fit in the headroom."""
    import resource

    from mt3d.bench.common import bench_run_config, build_engine
    from mt3d.data.loader import StepBatches

    raw = bench_run_config(
        model=dict(preset="tiny", max_seq_len=512), seq_len=512, micro=1, global_batch=2, zero=0
    )
    raw["mt3d"]["train"]["save_dir"] = save_dir
    _, layout, _, engine, data, _ = build_engine(raw)

    def step(samples, k):
        it = StepBatches(samples, global_batch=2, micro_batch=1, grad_accum=layout.grad_accum, dp_rank=0,
                         start_step=k)  # fmt: skip
        return float(engine.train_batch(data_iter=it))

    losses = [step(data.train, 0)]  # warm-up: the engine's first-step allocations happen before the cap
    vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    limit = (vm + headroom_mb * 1024) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    ds = IndexedDataset(prefix)
    big = PackedSamples(ds, np.arange(ds.num_docs), seq_len=512, seed=1)
    losses += [step(big, 0), step(big, 1), step(big, 600_000)]  # the last is in epoch 1
    return losses, vm


def test_training_reads_a_corpus_larger_than_its_memory_headroom(tmp_path, corpus):
    """A 600 MB token file trains with 200 MB of address space left: nothing maps or loads it."""
    from mt3d.parallel.spawn import spawn

    rng = np.random.default_rng(0)
    w = IndexedWriter(tmp_path / "big", np.uint16)
    for _ in range(300):  # 300 documents of 1M tokens
        w.add(rng.integers(0, 255, 1_000_000, dtype=np.uint16))
    w.close()
    assert (tmp_path / "big.bin").stat().st_size == 600_000_000
    env = {"MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1"}
    losses, vm_kb = spawn(
        _capped_training_worker, 1, str(tmp_path / "big"), str(tmp_path / "run"), 200, env=env, timeout=600
    )[0]
    assert len(losses) == 4 and all(np.isfinite(losses))


def _idx_offsets(path):
    from mt3d.data.indexed import _HEADER

    data = bytearray(path.read_bytes())
    return data, _HEADER.size


def test_corrupt_offsets_and_out_of_vocabulary_ids_are_caught_with_the_file_named(tmp_path):
    w = IndexedWriter(tmp_path / "a", np.uint16)
    for d in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
        w.add(d)
    w.close()
    good = (tmp_path / "a.idx").read_bytes()
    data, head = _idx_offsets(tmp_path / "a.idx")
    offs = np.frombuffer(bytes(data[head:]), dtype=np.uint64).copy()  # [0, 3, 5, 9]
    offs[1], offs[2] = offs[2], offs[1]  # two offsets swapped: a document of negative length
    (tmp_path / "a.idx").write_bytes(bytes(data[:head]) + offs.tobytes())
    with pytest.raises(IndexedDataError, match="a.idx: document 1 ends before it starts"):
        IndexedDataset(tmp_path / "a")
    offs = np.frombuffer(good[head:], dtype=np.uint64).copy()
    offs[-1] = 12  # past the .bin (9 tokens)
    (tmp_path / "a.idx").write_bytes(good[:head] + offs.tobytes())
    with pytest.raises(IndexedDataError, match="offsets run from 0 to 12, expected 0 to the 9 tokens"):
        IndexedDataset(tmp_path / "a")
    (tmp_path / "a.idx").write_bytes(good)
    ds = IndexedDataset(tmp_path / "a", check_tag=False)
    ds.vocab_limit = 8
    assert ds.read(0, 5).tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(
        IndexedDataError, match="token id 8 at token offset 7 is outside the tokenizer's 8-id"
    ):
        ds.read(3, 9)


def test_binary_input_is_refused_and_replaced_bytes_are_counted(tmp_path):
    tok = tmp_path / "tok"
    train_bpe(["hello world, plain text"] * 50, 300, tok)
    rng = np.random.default_rng(0)
    (tmp_path / "random.txt").write_bytes(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    (tmp_path / "mostly.txt").write_bytes(b"good text line\n\n" * 1000 + b"\xff\xfe bad \x80 bytes\n")

    def pre(*extra):
        cmd = [sys.executable, "-m", "mt3d", "preprocess", "--tokenizer", str(tok), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    out = pre("--input", str(tmp_path / "random.txt"), "--output-prefix", str(tmp_path / "r"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "random.txt does not look like text" in out.stderr and "--on-bad-bytes replace" in out.stderr
    assert not (tmp_path / "r.bin").exists()
    out = pre("--input", str(tmp_path / "mostly.txt"), "--output-prefix", str(tmp_path / "m"), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["replaced_bytes"] == 3
    assert "mostly.txt: 3 invalid UTF-8 byte(s) replaced" in out.stderr
    out = pre("--input", str(tmp_path / "random.txt"), "--output-prefix", str(tmp_path / "r"),
              "--on-bad-bytes", "replace", "--json")  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)["replaced_bytes"] > 10_000
