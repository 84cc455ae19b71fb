"""``mt3d preprocess``: text / jsonl files -> an indexed token dataset (P.bin + P.idx).

Input is streamed (a corpus larger than RAM works): documents are read one at a time, tokenized in
batches (in this process, or in ``workers`` processes with a bounded number of batches in flight),
and appended to ``P.bin.tmp`` / ``P.idx.tmp``, which are renamed into place only when everything
succeeded. No torch import: the command runs in a small memory budget.
"""

from __future__ import annotations

import codecs
import collections
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UserError
from .indexed import DTYPES, IndexedWriter, dtype_for_vocab, read_meta  # noqa: F401 - read here too
from .tokenizer import Tokenizer, load_tokenizer


class PreprocessError(UserError):
    """Bad input to preprocessing; the message names the file (and line)."""


@dataclass
class Stats:
    """What a preprocessing run did."""

    documents: int = 0
    tokens: int = 0
    bytes_in: int = 0
    skipped_lines: list[str] = field(default_factory=list)
    replaced_bytes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    supervised: int = 0
    """Tokens marked as targets (chat and prompt/completion data)."""
    skipped_no_reply: int = 0
    """Conversations without an assistant reply (nothing to learn from), skipped."""
    warnings: list[str] = field(default_factory=list)
    """What the command warns of (a chat template's quirks), each once."""
    pairs: int = 0
    """Preference pairs (two documents each)."""
    longest_prompt: int = 0
    """The longest prompt of the preference pairs, in tokens."""

    def summary(self) -> dict:
        """JSON-able summary with throughput."""
        s = max(self.seconds, 1e-9)
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "mb": self.bytes_in / 1e6,
            "seconds": self.seconds,
            "mb_per_s": self.bytes_in / 1e6 / s,
            "tokens_per_s": self.tokens / s,
            "skipped_lines": len(self.skipped_lines),
            "replaced_bytes": sum(self.replaced_bytes.values()),
            "supervised_tokens": self.supervised,
            "skipped_without_reply": self.skipped_no_reply,
            **({"pairs": self.pairs, "longest_prompt": self.longest_prompt} if self.pairs else {}),
        }


BINARY_FRACTION = 0.01
"""A file whose first MB has more than this fraction of bytes that are not UTF-8 text (invalid
sequences, NULs) is refused as binary unless ``on_bad_bytes="replace"``."""
_SAMPLE = 1 << 20


def check_text(path: Path, on_bad_bytes: str) -> None:
    """Refuse a mostly-binary file (``BINARY_FRACTION`` of its first MB) before reading it all."""
    with open(path, "rb") as f:
        sample = f.read(_SAMPLE)
    text = sample.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") + text.count("\x00") - sample.decode("utf-8", "ignore").count("\ufffd")
    if on_bad_bytes == "fail" and bad > BINARY_FRACTION * max(len(sample), 1):
        raise PreprocessError(
            f"{path} does not look like text: {bad} of its first {len(sample)} bytes are invalid UTF-8 or "
            f"NUL (more than {BINARY_FRACTION:.0%}); pass --on-bad-bytes replace to keep it anyway"
        )


class _CountingDecoder:
    """UTF-8 decoding that replaces invalid bytes with U+FFFD and counts them per file."""

    def __init__(self, stats: Stats, path: Path) -> None:
        self.stats, self.key = stats, str(path)
        self.name = f"mt3d-count-{id(self)}"
        codecs.register_error(self.name, self._handle)

    def _handle(self, err: UnicodeDecodeError):
        self.stats.replaced_bytes[self.key] = self.stats.replaced_bytes.get(self.key, 0) + (
            err.end - err.start
        )
        return "\ufffd", err.end


def check_inputs(paths: list[str]) -> list[Path]:
    """Every input exists, is a .txt or .jsonl file, and is not empty."""
    if not paths:
        raise PreprocessError("no input files given (--input FILE ...)")
    out = []
    for p in map(Path, paths):
        if not p.is_file():
            raise PreprocessError(f"input not found: {p}")
        if p.suffix not in (".txt", ".jsonl"):
            raise PreprocessError(f"{p}: unsupported input type {p.suffix!r} (use .txt or .jsonl)")
        if p.stat().st_size == 0:
            raise PreprocessError(f"{p} is empty")
        out.append(p)
    return out


def read_documents(
    paths: list[Path],
    *,
    txt_mode: str = "blocks",
    jsonl_key: str = "text",
    on_bad_line: str = "fail",
    on_bad_bytes: str = "fail",
    stats: Stats,
) -> Iterator[str]:
    """Documents of every input, in order: .txt as one document per file or per blank-line-separated
    block; .jsonl as one document per line (``jsonl_key``). Invalid UTF-8 becomes U+FFFD and is
    counted per file (``stats.replaced_bytes``); mostly-binary files are refused (``check_text``)."""
    for path in paths:
        check_text(path, on_bad_bytes)
        stats.bytes_in += path.stat().st_size
        errors = _CountingDecoder(stats, path).name
        if path.suffix == ".txt" and txt_mode == "file":
            text = path.read_bytes().decode("utf-8", errors=errors)
            if text.strip():
                yield text
            continue
        with open(path, encoding="utf-8", errors=errors) as f:
            if path.suffix == ".txt":
                block: list[str] = []
                for line in f:
                    if line.strip():
                        block.append(line)
                    elif block:
                        yield "".join(block).rstrip("\n")
                        block = []
                if block:
                    yield "".join(block).rstrip("\n")
                continue
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    text = obj[jsonl_key]
                    if not isinstance(text, str):
                        raise TypeError(f"'{jsonl_key}' is {type(text).__name__}, not a string")
                    text.encode("utf-8")  # a lone surrogate ("\ud800" unpaired) is not Unicode text
                except (json.JSONDecodeError, KeyError, TypeError, UnicodeEncodeError) as e:
                    why = f"missing key '{jsonl_key}'" if isinstance(e, KeyError) else str(e).split(":")[0]
                    if isinstance(e, UnicodeEncodeError):
                        why = f"'{jsonl_key}' holds a lone surrogate {e.object[e.start]!a}: not Unicode"
                    msg = f"{path}:{lineno}: invalid jsonl line ({why})"
                    if on_bad_line == "fail":
                        raise PreprocessError(msg + "; fix it or pass --on-bad-line skip") from None
                    stats.skipped_lines.append(msg)
                    continue
                if text:
                    yield text


def _batches(docs: Iterator[str], size: int, max_chars: int) -> Iterator[list[str]]:
    """Batches of at most ``size`` documents and (unless one document is longer) ``max_chars``.

    The character bound is what keeps memory flat: the tokenizer's per-token bookkeeping costs
    about 100 bytes per token while a batch is encoded, so 1024 long documents would need GBs.
    """
    batch: list[str] = []
    chars = 0
    for d in docs:
        if batch and chars + len(d) > max_chars:
            yield batch
            batch, chars = [], 0
        batch.append(d)
        chars += len(d)
        if len(batch) == size:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tok: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tok


def _encode(batch: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, dtype=np.uint32) for ids in _WORKER_TOKENIZER.encode_batch(batch)]


def _encoded_batches(
    batches: Iterator[list[str]], tok: Tokenizer, workers: int
) -> Iterator[list[np.ndarray]]:
    if workers <= 1:
        # One encoding thread: the Rust tokenizer releases the GIL, so reading and parsing the
        # next batch here overlaps with encoding the current one (a bounded window of 2 batches).
        from concurrent.futures import ThreadPoolExecutor

        def encode(b: list[str]) -> list[np.ndarray]:
            return [np.asarray(ids, dtype=np.uint32) for ids in tok.encode_batch(b)]

        with ThreadPoolExecutor(1) as pool:
            pending: collections.deque = collections.deque()
            for b in batches:
                pending.append(pool.submit(encode, b))
                if len(pending) >= 2:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        return
    import multiprocessing as mp

    # Workers tokenize single-threaded; the parallelism is the processes.
    os.environ["RAYON_NUM_THREADS"] = "1"
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tok,)) as pool:
        pending: collections.deque = collections.deque()
        for b in batches:  # at most 2 batches per worker in flight: memory stays bounded
            pending.append(pool.apply_async(_encode, (b,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def preprocess(
    inputs: list[str],
    tokenizer_dir: str,
    output_prefix: str,
    *,
    workers: int = 1,
    txt_mode: str = "blocks",
    jsonl_key: str = "text",
    on_bad_line: str = "fail",
    on_bad_bytes: str = "fail",
    dtype: str = "auto",
    batch_docs: int = 1024,
    batch_chars: int = 1 << 20,
    progress: bool = True,
    fmt: str = "text",
    template_file: str | None = None,
) -> Stats:
    """Tokenize ``inputs`` into ``output_prefix``.bin/.idx; returns what was done. ``fmt`` chat or
    prompt-completion: jsonl records (``mt3d.data.sft``) stored with their loss mask (``P.mask``)."""
    if txt_mode not in ("blocks", "file"):
        raise PreprocessError(f"--txt-mode must be blocks or file, got {txt_mode!r}")
    if on_bad_line not in ("fail", "skip"):
        raise PreprocessError(f"--on-bad-line must be fail or skip, got {on_bad_line!r}")
    if on_bad_bytes not in ("fail", "replace"):
        raise PreprocessError(f"--on-bad-bytes must be fail or replace, got {on_bad_bytes!r}")
    paths = check_inputs(inputs)
    tok = load_tokenizer(tokenizer_dir)
    if dtype == "auto":
        np_dtype = dtype_for_vocab(tok.vocab_size)
    else:
        by_name = {np.dtype(t).name: t for t in DTYPES.values()}
        if dtype not in by_name:
            raise PreprocessError(f"--dtype must be auto, uint8, uint16 or uint32, got {dtype!r}")
        np_dtype = by_name[dtype]
        if tok.vocab_size - 1 > np.iinfo(np_dtype).max:
            raise PreprocessError(
                f"the tokenizer has {tok.vocab_size} ids but {dtype} holds at most "
                f"{np.iinfo(np_dtype).max + 1}; use --dtype uint32 or auto"
            )
    stats = Stats()
    t0 = time.perf_counter()
    if fmt != "text":
        _preprocess_sft(paths, tok, tokenizer_dir, output_prefix, np_dtype, fmt, template_file, stats,
                        on_bad_bytes)  # fmt: skip
        stats.seconds = time.perf_counter() - t0
        write_meta(output_prefix, fmt, tokenizer_dir, stats)
        return stats
    docs = read_documents(
        paths, txt_mode=txt_mode, jsonl_key=jsonl_key, on_bad_line=on_bad_line, on_bad_bytes=on_bad_bytes,
        stats=stats,
    )  # fmt: skip
    writer = IndexedWriter(output_prefix, np_dtype)
    bar = None
    if progress and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(unit="doc", desc="preprocess", dynamic_ncols=True)
    try:
        for encoded in _encoded_batches(_batches(docs, batch_docs, batch_chars), tok, workers):
            for ids in encoded:
                writer.add(ids)
                stats.tokens += ids.size
            stats.documents += len(encoded)
            if bar is not None:
                bar.update(len(encoded))
        if stats.documents == 0:
            raise PreprocessError("no documents found in the inputs (all empty or skipped)")
        writer.close()
    except BaseException:
        writer.abort()  # never leave a half-written pair behind
        raise
    finally:
        if bar is not None:
            bar.close()
    stats.seconds = time.perf_counter() - t0
    write_meta(output_prefix, fmt, tokenizer_dir, stats)
    return stats


def write_meta(prefix: str | Path, fmt: str, tokenizer_dir: str | Path, stats: Stats) -> None:
    """``P.meta.json``: what the dataset is, the tokenizer that made it (``mt3d data show`` reads it to
    print the documents' text) and its counts (documents, tokens, supervised tokens, records skipped)."""
    import json

    counts = {k: v for k, v in stats.summary().items() if isinstance(v, int)}
    meta = {"format": fmt, "tokenizer": str(Path(tokenizer_dir).resolve()), **counts}
    Path(f"{prefix}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def _has_template(tokenizer_dir, template_file) -> bool:
    """Whether a chat template is at hand (preference pairs need one only when conversational)."""
    from .sft import SFTDataError, chat_template

    try:
        chat_template(tokenizer_dir, template_file)
    except SFTDataError:
        return False
    return True


def _preprocess_sft(paths, tok, tokenizer_dir, output_prefix, np_dtype, fmt, template_file, stats,
                    on_bad_bytes: str = "fail") -> None:  # fmt: skip
    """Chat, prompt/completion or preference jsonl into ``output_prefix``.bin/.idx/.mask
    (``mt3d.data.sft``, ``mt3d.data.preference``)."""
    from .preference import FORMAT, pair_records, tokenize_pair
    from .sft import (
        FORMATS,
        ChatRenderer,
        chat_template,
        conversation,
        prompt_completion,
        records,
        special_tokens,
    )

    if fmt not in (*FORMATS, FORMAT):
        raise PreprocessError(f"--format must be one of {', '.join((*FORMATS, FORMAT))}, got {fmt!r}")
    bad = [p for p in paths if p.suffix != ".jsonl"]
    if bad:
        raise PreprocessError(f"{bad[0]}: --format {fmt} reads .jsonl records, one per line")
    renderer = (
        ChatRenderer(chat_template(tokenizer_dir, template_file), special_tokens(tokenizer_dir))
        if fmt == "chat" or fmt == FORMAT and (template_file or _has_template(tokenizer_dir, None))
        else None
    )
    writer = IndexedWriter(output_prefix, np_dtype, with_mask=True)
    try:
        for path in paths:
            stats.bytes_in += path.stat().st_size
            if fmt == FORMAT:  # two documents per pair: chosen, rejected
                for rec in pair_records(path, stats, on_bad_bytes):
                    docs, prompt = tokenize_pair(tok, renderer, rec)
                    stats.longest_prompt = max(stats.longest_prompt, prompt)
                    for ids, mask in docs:
                        writer.add(ids, mask)
                        stats.documents, stats.tokens, stats.supervised = (
                            stats.documents + 1,
                            stats.tokens + len(ids),
                            stats.supervised + sum(mask),
                        )
                    stats.pairs += 1
                continue
            for rec in records(path, fmt, stats, on_bad_bytes):
                if renderer is not None:
                    ids, mask = conversation(tok, renderer, rec["messages"], rec["where"])
                else:
                    ids, mask = prompt_completion(tok, rec["prompt"], rec["completion"])
                writer.add(ids, mask)
                stats.documents += 1
                stats.tokens += len(ids)
                stats.supervised += sum(mask)
        if stats.documents == 0:
            raise PreprocessError(
                f"no {fmt} records to keep in the inputs ({stats.skipped_no_reply} had no assistant reply)"
            )
        if stats.supervised == 0:
            raise PreprocessError(
                f"none of the {stats.documents} {fmt} records has a supervised token, so there is nothing "
                "to train on: the chat template marks no reply"
            )
        writer.close()
        if renderer is not None:
            stats.warnings.extend(renderer.notes.values())
    except BaseException:
        writer.abort()
        raise
