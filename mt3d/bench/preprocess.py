"""``preprocess``: ``mt3d preprocess`` throughput with 1 and 2 workers vs raw ``tokenizers`` batch encoding.

The input is the built-in English corpus (standard-library documentation) repeated to ``--mb``
megabytes of jsonl; the tokenizer is the built-in corpus' byte-level BPE. The raw figure is
``Tokenizer.encode_batch`` over all documents already in memory (the library's own parallelism),
the ceiling for any preprocessing pipeline; the ratio is preprocess MB/s over raw MB/s (target
>= 0.8).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from .common import emit, table


def run(args) -> dict:
    """Entry from ``python -m mt3d.bench preprocess``."""
    from ..data.corpora import builtin_corpus, stdlib_documents
    from ..data.preprocess import preprocess
    from ..data.tokenizer import load_tokenizer

    corpus = builtin_corpus()
    tok = load_tokenizer(corpus.tokenizer_dir)
    docs = list(stdlib_documents())
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.jsonl"
        lines = [json.dumps({"text": d}) + "\n" for d in docs]
        size, all_docs = 0, []
        with open(src, "w") as f:
            while size < args.mb * 1e6:
                for line, d in zip(lines, docs):
                    f.write(line)
                    size += len(line)
                    all_docs.append(d)
        mb = src.stat().st_size / 1e6
        t0 = time.perf_counter()
        tokens = sum(len(e.ids) for e in tok.backend.encode_batch(all_docs, add_special_tokens=False))
        raw_s = time.perf_counter() - t0
        rows = [
            {
                "pipeline": "raw encode_batch",
                "mb_per_s": mb / raw_s,
                "tokens_per_s": tokens / raw_s,
                "ratio": 1.0,
            }
        ]
        del all_docs
        for workers in (1, 2):
            stats = preprocess([str(src)], str(corpus.tokenizer_dir), f"{tmp}/out{workers}", workers=workers)
            s = stats.summary()
            rows.append(
                {
                    "pipeline": f"mt3d preprocess, {workers} worker(s)",
                    "mb_per_s": s["mb_per_s"],
                    "tokens_per_s": s["tokens_per_s"],
                    "ratio": s["mb_per_s"] / rows[0]["mb_per_s"],
                }
            )
    print(f"preprocessing throughput on {mb:.0f} MB of jsonl (target ratio >= 0.8 of raw encode_batch)")
    print(table(rows, ["pipeline", "mb_per_s", "tokens_per_s", "ratio"]))
    return emit("preprocess", {"mb": mb, "rows": rows})


def markdown(r: dict) -> tuple[list[str], list[list]]:
    """Headers and rows of this benchmark's table in the README."""
    from .report import _f

    rows = [[x["pipeline"], _f(x["mb_per_s"]), _f(x["tokens_per_s"]), _f(x["ratio"])] for x in r["rows"]]
    return ["pipeline", "MB/s", "tokens/s", "vs raw"], rows
