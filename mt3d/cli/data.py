"""The data commands: ``mt3d preprocess`` (text or jsonl to indexed token files) and
``train-tokenizer``."""

from __future__ import annotations

import argparse
import json
import sys

from ..inputs import (
    positive_int,
)
from .common import writable_output

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
    )
    for line in stats.skipped_lines[:20]:
        print(f"skipped: {line}", file=sys.stderr)
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
