"""``packing``: packed fine-tuning data measured beside its theory, in three parts.

* **attention**: the attention operation alone (forward + backward, fp32 on CPU) on one sequence of
  ``--tokens`` tokens holding ``--documents`` documents of uneven lengths, each case in a fresh
  process: mt3d's document masking (``mt3d.model.documents``: each document's keys only), full causal
  attention over the whole sequence, and the naive way (SDPA with a dense block-diagonal causal mask,
  s x s). Theory: the masked work is sum(L_i^2) / n^2 of the causal work; memory must not grow with s^2.
* **efficiency**: real tokens over token positions of the shipped chat corpus
  (``mt3d.data.chat_corpus``, tokenized with a ChatML BPE trained on it) at several ``seq_len``,
  packed (first-fit) and one conversation per padded sample.
* **throughput**: a tiny Llama fine-tuned on that corpus, packed and padded, in supervised tokens per
  second (the real trainer, one process): theory, the ratio of the two efficiencies, the step cost
  being fixed by the static shapes less the attention and loss work padding skips.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .attention import _isolated, _measure, _setup
from .common import emit, table


def document_lengths(tokens: int, documents: int, seed: int = 0) -> list[int]:
    """``documents`` uneven lengths (from a quarter to twice the mean) summing to ``tokens``."""
    import numpy as np

    w = np.random.default_rng(seed).uniform(0.25, 2.0, documents)
    lengths = np.maximum(1, np.floor(w / w.sum() * tokens)).astype(int)
    lengths[-1] += tokens - lengths.sum()
    return lengths.tolist()


def attention_case(kind: str, lengths: list[int], heads: int, head_dim: int, reps: int) -> dict:
    """One attention variant (``documents``, ``causal`` or ``dense-mask``), forward + backward."""
    torch, cuda, device, dtype = _setup()
    from ..model.attention import attend

    n = sum(lengths)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g, device=device, dtype=dtype) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_()
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
    scale = head_dim**-0.5
    if kind == "dense-mask":
        same = docs[:, None] == docs[None, :]
        mask = same & torch.ones(n, n, dtype=torch.bool, device=device).tril()

        def run():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        documents = docs[None] if kind == "documents" else None

        def run():
            return attend(q, k, v, pattern=None, scale=scale, documents=documents)

    def step():
        run().sum().backward()
        q.grad = k.grad = v.grad = None

    return _measure(torch, cuda, step, reps)


def run_attention(args) -> list[dict]:
    """The three variants on one packed sequence."""
    lengths = document_lengths(args.tokens, args.documents)
    n = sum(lengths)
    theory = sum(x * x for x in lengths) / (n * n)
    rows = []
    for kind in ("causal", "documents", "dense-mask"):
        r = _isolated(attention_case, kind, lengths, args.heads, args.head_dim, args.reps)
        rows.append({"attention": kind, "ms": r["seconds"] * 1e3, "peak_mb": r["peak_bytes"] / 2**20, **r})
    causal = rows[0]
    for r in rows:
        r["time_vs_causal"] = r["seconds"] / causal["seconds"]
        r["mem_vs_causal"] = r["peak_bytes"] / max(causal["peak_bytes"], 1)
        r["theory_work_vs_causal"] = 1.0 if r["attention"] == "causal" else theory
    print(f"{n} tokens in {len(lengths)} documents ({min(lengths)} to {max(lengths)} tokens), {args.heads} "
          f"heads x {args.head_dim}; masked work / causal work = sum(L^2)/n^2 = {theory:.4f}")  # fmt: skip
    columns = ["attention", "ms", "peak_mb", "time_vs_causal", "mem_vs_causal", "theory_work_vs_causal"]
    print(table(rows, columns))
    return rows


def chat_dataset(work: Path, vocab: int) -> tuple[Path, Path]:
    """(tokenizer dir, dataset prefix) of the shipped chat corpus, made in ``work``."""
    from ..data.chat_corpus import project_conversations
    from ..data.preprocess import preprocess
    from ..data.tokenizer import train_bpe

    convs = project_conversations()
    (work / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    texts = [m["content"] for c in convs for m in c["messages"]]
    train_bpe(texts, vocab, work / "tok", chat=True)
    preprocess([str(work / "chat.jsonl")], str(work / "tok"), str(work / "chat"), fmt="chat", progress=False)
    return work / "tok", work / "chat"


def run_efficiency(prefix: Path, seq_lens: tuple[int, ...]) -> list[dict]:
    """Packing efficiency at each seq_len, packed and padded."""
    import numpy as np

    from ..data.indexed import IndexedDataset
    from ..data.packing import PackedDocuments

    ds = IndexedDataset(prefix)
    lengths = ds.doc_lengths()
    print(f"shipped chat corpus: {len(ds)} conversations, {int(lengths.sum())} tokens "
          f"(median {int(np.median(lengths))}, longest {int(lengths.max())})")  # fmt: skip
    rows = []
    for seq_len in seq_lens:
        row = {"seq_len": seq_len}
        for pack in (True, False):
            p = PackedDocuments(ds, np.arange(len(ds)), seq_len, seed=0, pack=pack)
            name = "packed" if pack else "padded"
            row.update({f"{name}_samples": len(p), f"{name}_efficiency": p.efficiency})
            row["truncated"] = p.truncated
        row["samples_ratio"] = row["padded_samples"] / row["packed_samples"]
        rows.append(row)
    print(table(rows, ["seq_len", "packed_samples", "packed_efficiency", "padded_samples",
                       "padded_efficiency", "samples_ratio", "truncated"]))  # fmt: skip
    return rows


def throughput_worker(raw: dict) -> list[dict]:
    """Train ``raw`` on this one rank; its step records."""
    from ..config import from_dict, resolve_model, validate
    from ..training.metrics import read_metrics
    from ..training.session import run_training

    run = from_dict(raw)
    cfg = resolve_model(run.mt3d.model)
    if run_training(run, validate(run, 1, cfg), cfg) != 0:
        raise RuntimeError("training failed")
    return [r for r in read_metrics(Path(run.mt3d.train.save_dir) / "metrics.jsonl") if "loss" in r]


def run_throughput(args, tok: Path, prefix: Path, work: Path) -> list[dict]:
    """Supervised tokens/s of the packed and the padded path (the first step, warm-up, left out)."""
    from ..parallel.spawn import spawn
    from .common import bench_run_config

    rows = []
    for pack in (True, False):
        raw = bench_run_config(model={"preset": "tiny-llama", "hidden": args.hidden, "ffn": 2 * args.hidden},
                               global_batch=8, micro=4, seq_len=args.seq_len,
                               save_dir=str(work / f"run-{pack}"))  # fmt: skip
        raw["mt3d"]["data"] = {"corpus": "indexed", "prefixes": [str(prefix)], "tokenizer": str(tok),
                               "seq_len": args.seq_len, "packing": pack, "split": [98, 2, 0]}  # fmt: skip
        raw["mt3d"]["train"].update(steps=args.steps, log_interval=1)
        steps = spawn(throughput_worker, 1, raw, timeout=3600)[0][1:]
        seconds = sum(r["step_time_s"] for r in steps)
        supervised = sum(r["supervised_tokens"] for r in steps)
        n = len(steps)
        rows.append({"path": "packed" if pack else "padded", "steps": n, "step_s": seconds / n,
                     "supervised_per_step": supervised / n, "supervised_tok_s": supervised / seconds,
                     "efficiency": sum(r["packing_efficiency"] for r in steps) / n})  # fmt: skip
    packed, padded = rows
    packed["vs_padded"] = packed["supervised_tok_s"] / padded["supervised_tok_s"]
    packed["theory"] = packed["efficiency"] / padded["efficiency"]
    print(f"tiny Llama (hidden {args.hidden}), seq_len {args.seq_len}, 8 samples per step, one process")
    print(table(rows, ["path", "steps", "step_s", "efficiency", "supervised_per_step", "supervised_tok_s",
                       "vs_padded", "theory"]))  # fmt: skip
    return rows


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench packing``."""
    out = {}
    if args.part in ("attention", "all"):
        out["attention"] = run_attention(args)
    if args.part in ("efficiency", "throughput", "all"):
        with tempfile.TemporaryDirectory(prefix="mt3d-bench-packing-") as d:
            tok, prefix = chat_dataset(Path(d), args.vocab)
            if args.part in ("efficiency", "all"):
                out["efficiency"] = run_efficiency(prefix, args.seq_lens)
            if args.part in ("throughput", "all"):
                out["throughput"] = run_throughput(args, tok, prefix, Path(d))
    return emit("packing", out)
