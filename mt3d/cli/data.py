"""The data commands: ``mt3d preprocess`` (text or jsonl to indexed token files) and
``train-tokenizer``."""

from __future__ import annotations

import argparse
import json
import sys

from ..inputs import (
    positive_int,
)
from .common import UsageError, writable_output

# --- data --------------------------------------------------------------------------------
PREPROCESS_EXAMPLES = """examples:
  mt3d preprocess --input data/a.jsonl data/b.jsonl --tokenizer data/tok --output-prefix data/c --workers 2
  mt3d preprocess --input book.txt --tokenizer data/tok --output-prefix data/book --txt-mode file
  mt3d preprocess --input scraped.jsonl --jsonl-key content --on-bad-line skip --tokenizer data/tok \\
      --output-prefix data/scraped
"""


def _add_preprocess(sub) -> None:
    p = sub.add_parser(
        "preprocess",
        help="tokenize .txt/.jsonl files into an indexed token dataset (P.bin + P.idx)",
        description="Stream text into P.bin (token ids, smallest dtype that fits) and P.idx (document "
        "offsets). Output appears only when complete; EOS is appended to every document.",
        epilog=PREPROCESS_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", nargs="+", required=True, help=".txt and/or .jsonl files")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer directory (see 'mt3d train-tokenizer')")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument(
        "--workers",
        type=positive_int,
        default=1,
        help="tokenizer processes (default 1: in-process, multi-threaded)",
    )
    p.add_argument(
        "--txt-mode",
        default="blocks",
        choices=["blocks", "file"],
        help="document per blank-line block or per file",
    )
    p.add_argument("--jsonl-key", default="text", help="key holding the text in .jsonl lines (default text)")
    p.add_argument(
        "--on-bad-line",
        default="fail",
        choices=["fail", "skip"],
        help="invalid jsonl lines: stop or skip+report",
    )
    p.add_argument(
        "--on-bad-bytes",
        default="fail",
        choices=["fail", "replace"],
        help="files whose first MB is more than 1%% invalid UTF-8 or NUL: refuse them (default) or keep "
        "them with U+FFFD for the bad bytes; replaced bytes are counted and reported either way",
    )
    p.add_argument(
        "--dtype", default="auto", help="token dtype: auto (smallest that fits), uint8, uint16, uint32"
    )
    p.add_argument("--format", default="text", choices=["text", "chat", "prompt-completion", "preference"],
                   help="text (default), chat (.jsonl with messages: [{role, content}], rendered with the "
                   "tokenizer's chat template), prompt-completion (.jsonl with prompt and completion) or "
                   "preference (.jsonl with prompt, chosen and rejected, TRL's formats: two documents per "
                   "pair); all but text store a loss mask beside the tokens (docs/data.md)")  # fmt: skip
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template to use instead of the tokenizer's own")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_preprocess)


def cmd_preprocess(args: argparse.Namespace) -> int:
    """``mt3d preprocess``."""
    from ..data.preprocess import preprocess

    writable_output(args.output_prefix, "--output-prefix")
    stats = preprocess(
        args.input,
        args.tokenizer,
        args.output_prefix,
        workers=args.workers,
        txt_mode=args.txt_mode,
        jsonl_key=args.jsonl_key,
        on_bad_line=args.on_bad_line,
        on_bad_bytes=args.on_bad_bytes,
        dtype=args.dtype,
        fmt=args.format,
        template_file=args.chat_template,
    )
    for line in stats.skipped_lines[:20]:
        print(f"skipped: {line}", file=sys.stderr)
    for line in stats.warnings:
        print(f"warning: {line}", file=sys.stderr)
    for path, n in stats.replaced_bytes.items():
        print(f"warning: {path}: {n} invalid UTF-8 byte(s) replaced with U+FFFD", file=sys.stderr)
    s = stats.summary()
    if args.json:
        print(json.dumps(s))
    else:
        print(
            f"wrote {args.output_prefix}.bin/.idx: {s['documents']} documents, {s['tokens']} tokens, "
            f"{s['mb']:.1f} MB in {s['seconds']:.1f} s ({s['mb_per_s']:.2f} MB/s, "
            f"{s['tokens_per_s']:.0f} tokens/s), "
            f"{s['skipped_lines']} bad lines skipped"
            + (
                f"; {s['supervised_tokens']} supervised tokens, {s['skipped_without_reply']} conversations "
                "without an assistant reply skipped"
                if args.format != "text"
                else ""
            )
            + (f"; {s['pairs']} preference pairs" if args.format == "preference" else "")
        )
    return 0


def _add_train_tokenizer(sub) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE on local text and save it as an HF tokenizer directory",
        description="Train a byte-level BPE (the 'tokenizers' library) on .txt/.jsonl files; the output "
        "directory loads with transformers.AutoTokenizer.from_pretrained.",
        epilog="example:\n  mt3d train-tokenizer --input data/*.jsonl --vocab-size 32000 --out data/tok",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--input", nargs="+", required=True, help=".txt and/or .jsonl files")
    p.add_argument("--vocab-size", type=positive_int, default=32000)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--jsonl-key", default="text")
    p.set_defaults(func=cmd_train_tokenizer)


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    """``mt3d train-tokenizer``."""
    from ..data.preprocess import Stats, check_inputs, read_documents
    from ..data.tokenizer import train_bpe

    writable_output(args.out, "--out", directory=True)
    docs = read_documents(
        check_inputs(args.input), jsonl_key=args.jsonl_key, on_bad_line="skip", stats=Stats()
    )
    tok = train_bpe(docs, args.vocab_size, args.out)
    print(f"wrote {args.out}: {tok.vocab_size} tokens")
    return 0


def _add_data(sub) -> None:
    p = sub.add_parser(
        "data",
        help="look at a preprocessed dataset: each document with what will be trained on",
        description="'mt3d data show PREFIX' prints each document of PREFIX.bin/.idx with its supervised "
        "tokens marked (the loss mask of chat, prompt/completion and preference data; plain text: all of "
        "it), preference pairs as their chosen and rejected documents; --json prints one line per document "
        '{"tokens": [...], "loss_mask": [...]} (preference data: with "pair" and "side").',
        epilog="examples:\n  mt3d data show runs/chat --limit 3\n  mt3d data show runs/chat --json | head -1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dsub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    show = dsub.add_parser("show", help="print documents and their loss masks")
    show.add_argument("prefix", help="the dataset prefix P (P.bin, P.idx)")
    show.add_argument("--json", action="store_true", help="one JSON line per document: tokens and loss_mask")
    show.add_argument("--limit", type=positive_int, default=None, help="the first N documents only")
    show.add_argument("--tokenizer", default=None, help="tokenizer to print text with (default: the one "
                      "that made the dataset, from P.meta.json)")  # fmt: skip
    p.set_defaults(func=cmd_data)


def cmd_data(args: argparse.Namespace) -> int:
    """``mt3d data show``."""
    from ..data.indexed import IndexedDataset, read_meta
    from ..data.tokenizer import load_tokenizer

    ds = IndexedDataset(args.prefix)
    n = ds.num_docs if args.limit is None else min(args.limit, ds.num_docs)
    tok = None
    if not args.json:
        where = args.tokenizer or read_meta(args.prefix).get("tokenizer")
        if where is None:
            raise UsageError(
                f"{args.prefix} does not name its tokenizer: give --tokenizer DIR (or use --json)"
            )
        tok = load_tokenizer(where)
    color = sys.stdout.isatty()
    pairs = read_meta(args.prefix).get("format") == "preference"  # documents 2p, 2p + 1: pair p
    for i in range(n):
        ids, mask = ds.doc(i).tolist(), ds.doc_mask(i).tolist()
        side = ("chosen", "rejected")[i % 2] if pairs else None
        if args.json:
            print(json.dumps({"tokens": ids, "loss_mask": mask, **({"pair": i // 2, "side": side} if pairs
                                                                     else {})}))  # fmt: skip
            continue
        what = f"pair {i // 2}, {side} (document {i})" if pairs else f"document {i}"
        print(f"--- {what}: {len(ids)} tokens, {sum(mask)} supervised")
        print(_marked(tok, ids, mask, color))
    return 0


def _marked(tok, ids: list[int], mask: list[int], color: bool) -> str:
    """A document's text with its supervised runs marked (green on a terminal, else ⟦...⟧)."""
    out, run, on = [], [], None
    for i, m in zip(ids, mask, strict=True):
        if m != on and run:
            out.append(_run(tok.decode(run), on, color))
            run = []
        on = m
        run.append(i)
    if run:
        out.append(_run(tok.decode(run), on, color))
    return "".join(out)


def _run(text: str, supervised: bool, color: bool) -> str:
    if not supervised:
        return text
    return f"\033[32m{text}\033[0m" if color else f"⟦{text}⟧"
