"""The ``mt3d`` command (also ``python -m mt3d``): one sub-command per task, each with --help."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from .errors import EXIT_BAD_INPUT, UserError
from .inputs import (
    OneLineParser,
    byte_size,
    choices_list,
    non_negative_int,
    nonnegative_float,
    positive_float,
    positive_int,
    positive_ints,
    read_text,
    world_size,
)


class UsageError(UserError):
    """Bad command-line usage: reported as one line, exit code 2."""


KNOWN_ERRORS = (UserError, FileNotFoundError, NotADirectoryError, PermissionError)


def writable_output(path: str | None, flag: str, directory: bool = False) -> None:
    """Refuse an output a command could not write, before any work: ``path`` (a file, or with
    ``directory`` a directory) must be creatable in a writable place."""
    if path is None:
        return
    from pathlib import Path

    from .config import writable_dir

    if directory:
        writable_dir(Path(path), flag)
    else:
        writable_dir(Path(path).parent, f"{flag} {path}: its directory")


# --- topo ----------------------------------------------------------------------------------
TOPO_EXAMPLES = """examples:
  mt3d topo --world-size 16 --gpus-per-node 8 --tp 2 --pp 2
  mt3d topo --world-size 2240 --gpus-per-node 8 --tp 8 --pp 35 --model mtnlg-530b --json
  mt3d topo --hostfile launch/hostfile.example --tp 2 --pp 2
  mt3d topo --world-size 8 --tp 2 --islands '0,2;1,3;4,6;5,7'
  mt3d topo --world-size 64 --gpus-per-node 8 --tp 2 --cp 2 --ep 2 --pp 2
  nvidia-smi topo -m > topo.txt; mt3d topo --world-size 8 --tp 2 --nvidia-smi-topo topo.txt
"""


def _add_topo(sub) -> None:
    p = sub.add_parser(
        "topo",
        help="show the rank mapping, every group, and which groups cross hosts",
        description="Show how ranks map to (tp, dp, pp) coordinates and hosts, every process group, "
        "and how many groups cross host boundaries.",
        epilog=TOPO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world-size", type=world_size, help="total ranks (default: the hostfile's slots)")
    p.add_argument(
        "--gpus-per-node", type=positive_int, help="ranks per host for uniform hosts (default: one host)"
    )
    p.add_argument("--hostfile", help="DeepSpeed hostfile ('host slots=N' per line); hosts may be uneven")
    from .parallel.axes import AXES, DEFAULT_ORDER

    for axis in AXES:
        if axis.key:  # one flag per configured axis: --tp, --cp, --ep, --pp
            p.add_argument(f"--{axis.name}", type=positive_int, default=1,
                           help=f"{axis.key} degree: splits {axis.splits} (default 1)")  # fmt: skip
    p.add_argument(
        "--order", default=DEFAULT_ORDER, help=f"axis nesting, innermost first (default {DEFAULT_ORDER})"
    )
    p.add_argument("--islands", help="NVLink islands as local ranks, e.g. '0,1;2,3;4,5;6,7'")
    p.add_argument(
        "--nvidia-smi-topo", metavar="FILE", help="file with 'nvidia-smi topo -m' output to find islands"
    )
    p.add_argument(
        "--allow-crossing", action="store_true", help="warn instead of failing when TP must cross hosts"
    )
    p.add_argument("--model", help="preset name, for the cross-host traffic estimate (e.g. gpt3-1.3b)")
    p.add_argument(
        "--seq-len", type=positive_int, help="sequence length for the estimate (default: the model's)"
    )
    p.add_argument(
        "--micro-batch", type=positive_int, default=1, help="micro-batch size for the estimate (default 1)"
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        help="micro-batches per step for the estimate (default 1)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (groups, crossings, bytes) instead of tables",
    )
    p.set_defaults(func=cmd_topo)


def cmd_topo(args: argparse.Namespace) -> int:
    """``mt3d topo``."""
    from pathlib import Path

    from .parallel import hosts as H
    from .parallel import report as R
    from .parallel import topology as T
    from .planner.traffic import TrafficModel
    from .presets import get_preset

    hosts = H.read_hostfile(args.hostfile) if args.hostfile else None
    world = (
        args.world_size if args.world_size is not None else (sum(h.slots for h in hosts) if hosts else None)
    )
    if world is None:
        raise UsageError("give --world-size or --hostfile")
    islands = None
    if args.islands and args.nvidia_smi_topo:
        raise UsageError("give --islands or --nvidia-smi-topo, not both")
    if args.islands:
        islands = H.parse_islands(args.islands)
    elif args.nvidia_smi_topo:
        path = Path(args.nvidia_smi_topo)
        if not path.is_file():
            raise FileNotFoundError(f"nvidia-smi topo file not found: {path}")
        islands = H.parse_nvidia_smi_topo(read_text(path, "nvidia-smi topo output"))
    from .parallel.axes import degree_keys

    topo = T.place(
        world,
        gpus_per_node=args.gpus_per_node,
        hosts=hosts,
        order=args.order,
        islands=islands,
        allow_crossing=args.allow_crossing,
        **{name: getattr(args, name) for name in degree_keys().values()},
    )
    traffic = None
    if args.model:
        cfg = get_preset(args.model)
        cfg.check_parallel(args.tp, args.pp)
        traffic = TrafficModel(
            layers=cfg.layers,
            hidden=cfg.hidden,
            seq_len=args.seq_len or cfg.max_seq_len,
            micro_batch=args.micro_batch,
            micro_batches=args.grad_accum,
            params=cfg.num_params(),
        )
    if args.json:  # streamed: the per-rank listing never sits in memory
        R.write_report_json(topo, traffic, sys.stdout)
    else:
        print(R.format_report(topo, traffic))
    return 0


# --- plot ----------------------------------------------------------------------------------
def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="write a PNG of a run's loss and throughput curves",
        description="Plot train/eval loss and tokens/s (and MFU) from RUN_DIR/metrics.jsonl.",
        epilog="example:\n  mt3d plot runs/cpu_demo_3d            # writes runs/cpu_demo_3d/curves.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="training run directory (the config's mt3d.train.save_dir)")
    p.add_argument("--out", help="output PNG (default RUN_DIR/curves.png)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """``mt3d plot``."""
    from .training.plot import plot_run

    try:
        writable_output(args.out, "--out")
        print(plot_run(args.run_dir, args.out))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0


def _add_summary(sub) -> None:
    p = sub.add_parser(
        "summary",
        help="headline figures of a training run (losses, throughput, checkpoints, W&B runs)",
        description="Summarise RUN_DIR: first/last train loss, eval loss (vs the entropy floor of the "
        "synthetic corpus when known), tokens/s, complete checkpoints and W&B run directories.",
        epilog="example:\n  mt3d summary runs/cpu_demo_3d --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="training run directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_summary)


def cmd_summary(args: argparse.Namespace) -> int:
    """``mt3d summary``."""
    from .training.plot import summarize

    s = summarize(args.run_dir)
    if args.json:
        print(json.dumps(s))
        return 0
    fmt = lambda v: "n/a" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    print(
        f"run {s['run_dir']}: {s['steps']} steps, train loss {fmt(s['first_loss'])} -> {fmt(s['last_loss'])}"
    )
    line = f"eval loss {fmt(s['last_eval_loss'])} (best {fmt(s['best_eval_loss'])})"
    if s["entropy_floor"] is not None and s["last_eval_loss"] is not None:
        gap = s["last_eval_loss"] - s["entropy_floor"]
        line += (
            f"; entropy floor {s['entropy_floor']:.4f}, gap {gap:.4f} nats ({gap / s['entropy_floor']:+.1%})"
        )
    print(line)
    print(f"throughput {fmt(s['tokens_per_s'])} tokens/s at the last logged step")
    print(f"checkpoints: {', '.join(s['checkpoints']) or 'none'}")
    print(f"W&B runs: {', '.join(s['wandb_runs']) or 'none'}")
    return 0


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
    from .data.preprocess import preprocess

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
    from .data.preprocess import Stats, check_inputs, read_documents
    from .data.tokenizer import train_bpe

    writable_output(args.out, "--out", directory=True)
    docs = read_documents(
        check_inputs(args.input), jsonl_key=args.jsonl_key, on_bad_line="skip", stats=Stats()
    )
    tok = train_bpe(docs, args.vocab_size, args.out)
    print(f"wrote {args.out}: {tok.vocab_size} tokens")
    return 0


# --- models: eval, generate, export-hf ------------------------------------------------------------
def _add_model_args(p) -> None:
    p.add_argument(
        "--model", required=True, help="HF model directory, mt3d checkpoint dir, or run dir (newest)"
    )
    p.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel ranks (launch tp*pp processes)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def _load(args, pp: int = 1):
    import torch

    from .model.loading import from_pretrained

    device = None
    if torch.cuda.is_available():
        import os

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    cp, ep = getattr(args, "cp", 1), getattr(args, "ep", 1)
    return from_pretrained(
        args.model, tp=args.tp, pp=pp, cp=cp, ep=ep, dtype=getattr(torch, args.dtype), device=device
    ), device


def _tokenizer_for(model, vocab: int):
    """The model's tokenizer, refused when it has ids the model's ``vocab`` does not."""
    from .data.tokenizer import load_tokenizer

    if not model.tokenizer_dir:
        raise UsageError(
            "the model has no tokenizer (an HF dir needs tokenizer.json; a checkpoint records its own)"
        )
    tok = load_tokenizer(model.tokenizer_dir)
    if tok.vocab_size > vocab:
        raise UsageError(
            f"the tokenizer in {model.tokenizer_dir} has {tok.vocab_size} ids but the model's vocabulary "
            f"only {vocab}: it is not this model's tokenizer"
        )
    return tok


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="loss and perplexity of an HF dir or mt3d checkpoint on a text file",
        description="Token-weighted loss / perplexity over a text file with non-overlapping windows "
        "(stride = seq-len) or sliding windows (smaller stride: each token scored once, with context).",
        epilog="examples:\n  mt3d eval --model runs/x --text wiki.txt --seq-len 512 --stride 256 --json\n"
        "  torchrun --nproc_per_node 4 -m mt3d eval --model hf/llama --text wiki.txt --seq-len 1024 \\\n"
        "      --tp 2 --pp 2\n"
        "  torchrun --nproc_per_node 4 -m mt3d eval --model hf/llama --text book.txt --seq-len 32768 --cp 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(p)
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    p.add_argument(
        "--cp",
        type=positive_int,
        default=1,
        help="context-parallel ranks: each window cut over them (long documents)",
    )
    p.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="expert-parallel ranks (mixtures of experts): each holds experts / ep of every sparse layer",
    )
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument("--seq-len", type=positive_int, required=True, help="window length in tokens")
    p.add_argument("--stride", type=positive_int, help="window step (default seq-len: non-overlapping)")
    p.add_argument("--json", action="store_true", help='one line: {"loss", "perplexity", "tokens"}')
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """``mt3d eval``."""

    import torch

    from .model.inference import evaluate_tokens
    from .model.loading import open_source

    stride = args.stride or args.seq_len
    _positive(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, seq_len=args.seq_len, stride=stride)
    if stride > args.seq_len:
        raise UsageError(
            f"--stride {stride} is longer than --seq-len {args.seq_len} (tokens would be skipped)"
        )
    cfg = open_source(args.model, verify=False).cfg  # config only: refuse before any weight is read
    text = read_text(args.text)
    if cfg.position_limit is not None and args.seq_len > cfg.position_limit:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.position_limit}")
    model, device = _load(args, args.pp)
    tok = _tokenizer_for(model, model.vocab_size)
    ids = torch.tensor(tok.encode(text, eos=False), dtype=torch.long, device=device)
    if ids.numel() < 2:
        raise UsageError(f"{args.text} has fewer than 2 tokens")
    res = evaluate_tokens(model, ids, model.state, args.seq_len, stride)
    if model.state.global_rank == 0:
        if args.json:
            print(json.dumps(res))
        else:
            print(f"loss {res['loss']:.4f}  perplexity {res['perplexity']:.3f}  tokens {res['tokens']}")
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="text generation (greedy or sampled) with a KV cache, any tp",
        description="Continue a prompt. Greedy by default; --temperature > 0 samples (with --top-k, "
        "--top-p, --seed). Under a launcher with --tp T, every rank holds 1/T of the model.",
        epilog="examples:\n  mt3d generate --model hf/gpt2 --prompt 'Return the' --max-new-tokens 20\n"
        "  torchrun --nproc_per_node 2 -m mt3d generate --model runs/x --prompt 'Hello' --tp 2 \\\n"
        "      --temperature 0.8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", action="store_true", help='one line: {"text", "ids"}')
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """``mt3d generate``."""
    import torch

    from .model.inference import generate

    _positive(tp=args.tp, max_new_tokens=args.max_new_tokens)
    import math

    finite = math.isfinite(args.temperature)
    if not finite or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError(
            f"need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1; got {args.temperature}, "
            f"{args.top_k}, {args.top_p}"
        )
    from .model.loading import open_source

    source = open_source(args.model, verify=False)  # config and tokenizer: check before any weight is read
    tok = _tokenizer_for(source, source.vocab)
    ids = tok.encode(args.prompt, eos=False)
    if not ids:
        raise UsageError("the prompt is empty")
    limit = source.cfg.position_limit
    if limit is not None and len(ids) > limit:
        raise UsageError(f"the prompt is {len(ids)} tokens, longer than the model's {limit} positions")
    model, device = _load(args)
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    out = generate(
        model,
        prompt,
        model.state,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=tok.eos_id,
    )
    if model.state.global_rank == 0:
        new = out.shape[1] - len(ids)
        if limit is not None and out.shape[1] >= limit and new < args.max_new_tokens:
            print(f"note: generation stopped at the model's {limit} positions after {new} of "
                  f"{args.max_new_tokens} new tokens", file=sys.stderr)  # fmt: skip
        ids = out[0].tolist()
        text = tok.decode(ids)
        print(json.dumps({"text": text, "ids": ids}) if args.json else text)
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export-hf",
        help="write an HF transformers directory from an mt3d checkpoint of any layout",
        description="Gather the shards of a checkpoint (any tp x pp) into config.json + model.safetensors "
        "(sharded with an index above --max-shard-size) + the tokenizer. The checkpoint is verified first.",
        epilog="example:\n  mt3d export-hf --checkpoint runs/x/checkpoints/step_00001000 --out hf/x",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint dir (step_XXXXXXXX) or run dir (its newest)"
    )
    p.add_argument("--out", required=True, help="new (or empty) output directory")
    p.add_argument(
        "--max-shard-size", type=byte_size, default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)"
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``mt3d export-hf``."""
    from .model.export import export_hf

    writable_output(args.out, "--out", directory=True)
    print(export_hf(args.checkpoint, args.out, max_shard_size=args.max_shard_size))
    return 0


def _add_checkpoint(sub) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect checkpoints: layout, step, model, size and validity",
        description="'mt3d checkpoint info DIR' describes one checkpoint (step_XXXXXXXX) or every checkpoint "
        "of a run: complete (manifest present, every file's size and sha256 match), incomplete (no "
        "manifest: interrupted while saving) or corrupt (names the file).",
        epilog="examples:\n  mt3d checkpoint info runs/x\n"
        "  mt3d checkpoint info runs/x/checkpoints/step_00000500 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    info = csub.add_parser("info", help="describe checkpoints")
    info.add_argument("path", help="checkpoint dir, run dir or checkpoints dir")
    info.add_argument("--fast", action="store_true", help="check sizes only, skip hashing")
    info.add_argument("--json", action="store_true", help="one JSON object per checkpoint, one per line")
    p.set_defaults(func=cmd_checkpoint)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``mt3d checkpoint info``."""
    from .checkpoint.info import describe, format_rows

    rows = describe(args.path, verify=not args.fast)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_rows(rows))
    return 0 if all(r["status"].startswith("complete") for r in rows[-1:]) else 1


# --- plan ----------------------------------------------------------------------------------
PLAN_EXAMPLES = """examples:
  mt3d plan --model gpt3-1.3b --gpus 8 --gpus-per-node 8 --gpu h100
  mt3d plan --model mtnlg-530b --gpus 2240 --gpu a100-80gb --global-batch 1920 --seq-len 2048
  mt3d plan --model ds_configs/megatron_8.3b_tp8.json --gpus 64 --gpus-per-node 8 --gpu h200 --json
  mt3d plan --model hf/llama --gpus 16 --gpus-per-node 8 --gpu h100 --write-config ds_configs/my_llama.json
"""


# `mt3d plan` flags that override a field of the GPU preset (planner.hardware.Device): flag -> (field, help)
DEVICE_FLAGS = {
    "--peak-tflops": ("peak_tflops", "the device's dense peak, TFLOP/s"),
    "--memory-gb": ("memory_gb", "the device's memory, GB"),
    "--gemm-tflops": ("gemm_tflops", "the device's GEMM ceiling, TFLOP/s (largest achievable matmul rate)"),
    "--gemm-tflops-fp8": ("gemm_tflops_fp8", "the device's FP8 GEMM ceiling, TFLOP/s (bench gemm --fp8)"),
    "--nvlink-gbps": ("intra_gbps", "GB/s per GPU inside a node (NVLink bus bandwidth)"),
    "--network-gbps": ("inter_gbps", "GB/s per node across nodes (all its NICs; shared by its GPUs)"),
    "--pcie-gbps": ("pcie_gbps", "GB/s per GPU between GPU and CPU memory (offload)"),
    "--nvme-gbps": ("nvme_gbps", "GB/s of a node's NVMe drives together (ZeRO-Infinity)"),
    "--host-memory-gb": ("host_memory_gb", "CPU memory per node, GB (offload)"),
    "--nvme-gb": ("nvme_gb", "NVMe capacity per node, GB (ZeRO-Infinity; 0 = none)"),
}


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="rank (tp, pp, dp, micro-batch, ZeRO, recompute, SP) layouts by predicted memory and time",
        description="Enumerate every layout of a model on a cluster, reject impossible ones with a reason, "
        "predict memory per GPU (ZeRO model states, Korthikanti activations, 1F1B in-flight micro-batches) "
        "and step time (compute from GEMM shapes against the device's GEMM ceiling, or at --efficiency of "
        "peak; TP/PP/DP communication, offload, pipeline bubble) for the "
        "rest, and rank them by step time.",
        epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="preset name, run config JSON, or HF model directory")
    p.add_argument("--gpus", type=world_size, required=True, help="total GPUs")
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu", default="h100", help="a100-80gb, h100, h200 or cpu")
    p.add_argument(
        "--global-batch", type=positive_int, help="sequences per step (default: the config's, else 512)"
    )
    p.add_argument(
        "--seq-len",
        type=positive_int,
        help="tokens per sequence (default: the config's, else the model's max)",
    )
    p.add_argument("--vocab", type=positive_int, help="vocabulary size when the model does not fix it")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument(
        "--efficiency",
        type=positive_float,
        default=None,
        help="time compute at this fraction of peak instead of the GEMM shape model (the default; 0.5 "
        "on devices without a GEMM calibration)",
    )
    p.add_argument(
        "--virtual-stages",
        type=positive_ints,
        default=(1, 2, 4),
        help="interleaved-schedule chunks per pipeline rank to try (default 1,2,4)",
    )
    p.add_argument(
        "--context",
        type=positive_ints,
        default=None,
        help="context-parallel degrees to try (default: every divisor of --gpus the sequence allows; 1: off)",
    )
    _add_plan_stack(p)
    p.add_argument("--explain", action="store_true", help="print the time and memory components of the best "
                   "layout")  # fmt: skip
    for flag, (_, helptext) in DEVICE_FLAGS.items():
        p.add_argument(flag, type=nonnegative_float if flag == "--nvme-gb" else positive_float, help=helptext)
    p.add_argument("--top", type=positive_int, default=10, help="rows to show")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (feasible and rejected layouts) instead"
    )
    p.add_argument("--write-config", metavar="PATH", help="write the best layout as a ds_configs-style JSON")
    p.set_defaults(func=cmd_plan)


def _add_plan_stack(p) -> None:
    """``mt3d plan``'s flags for another stack's choices: pinned degrees and batch split (each takes
    one value or a list to try) and how that stack runs (``planner.search.Stack``)."""
    from .planner.choices import (
        ATTENTION_KERNELS,
        DEFAULT_OVERLAP,
        GRAD_DTYPES,
        OPTIMIZER_STATES,
        OVERLAPS,
        RECOMPUTE,
    )
    from .planner.offload import OFFLOAD_OPTIONS

    p.add_argument("--tensor", type=positive_ints, default=None, help="tensor-parallel degrees to try")
    p.add_argument("--pipeline", type=positive_ints, default=None, help="pipeline degrees to try")
    p.add_argument("--data", type=positive_ints, default=None, help="data-parallel degrees to try")
    p.add_argument(
        "--expert", type=positive_ints, default=None, help="expert-parallel degrees to try (MoE models)"
    )
    p.add_argument("--micro-batch", type=positive_ints, default=(1, 2, 4, 8, 16), help="micro-batches to try")
    p.add_argument("--zero", type=choices_list((0, 1, 2, 3), "--zero"), default=(0, 1, 2, 3),
                   help="ZeRO stages to try (0-3)")  # fmt: skip
    p.add_argument("--offload", type=choices_list(OFFLOAD_OPTIONS, "--offload"), default=None,
                   help="offload tiers to try (none, opt-cpu, opt-nvme, cpu, nvme)")  # fmt: skip
    p.add_argument("--recompute", type=choices_list(RECOMPUTE, "--recompute"), default=RECOMPUTE,
                   help="recompute modes to try (none, full: whole blocks, selective: attention core and "
                   "activations)")  # fmt: skip
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="flash",
                   help="the attention kernel of the stack planned for (materialized: scores kept, as "
                   "Megatron-LM 2021)")  # fmt: skip
    p.add_argument(
        "--pp-scatter-gather",
        action="store_true",
        help="stage-boundary transfers split over the TP ranks (PTD-P's scatter/gather)",
    )
    p.add_argument("--other-stack", action="store_true",
                   help="plan for a stack other than mt3d: skip the rules of mt3d's DeepSpeed engine (ZeRO "
                   "stage with a pipeline or cp, MoE)")  # fmt: skip
    p.add_argument(
        "--gemm-fraction",
        type=positive_float,
        default=None,
        help="share of the GEMM ceiling a training step's GEMMs reach (default: the calibration)",
    )
    p.add_argument("--optimizer-states", choices=OPTIMIZER_STATES, default="fp32",
                   help="optimizer-state dtype of 16-bit training: fp32 master and moments (12 B/param), "
                   "bf16-moments (8), bf16 master and moments (6)")  # fmt: skip
    p.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="param",
                   help="gradients of 16-bit training in the weights' dtype (param: DeepSpeed's default), or "
                   "fp32 (mt3d: data_types.grad_accum_dtype fp32, DeepSpeed's BF16 optimizer at bf16 "
                   "ZeRO-1; Megatron-Core's default fp32 gradient buffer)")  # fmt: skip
    p.add_argument("--overlap", type=choices_list(OVERLAPS + ("none",), "--overlap"), default=DEFAULT_OVERLAP,
                   help="transfers the stack overlaps with compute (mt3d: tp always, the list adds to it; "
                   "--other-stack: the list, none for nothing): tp (each column-parallel linear's backward "
                   "transfers behind its GEMMs), dp "
                   "(gradient reduction during the last backward: mt3d.train.overlap.grad_reduce), pp "
                   "(pipeline transfers posted ahead: mt3d.train.overlap.p2p), tp-comm (--other-stack: "
                   "every TP transfer of an SP layout behind the GEMM beside it, Megatron-Core's "
                   "--tp-comm-overlap; without SP tp's)")  # fmt: skip
    p.add_argument("--fp8", choices=("tensorwise", "rowwise"), default=None,
                   help="the blocks' linears in FP8 with this recipe (train.fp8; bf16 only)")  # fmt: skip
    p.add_argument(
        "--activation-model",
        choices=("mt3d", "korthikanti"),
        default="mt3d",
        help="activation memory of mt3d's blocks, or Korthikanti et al.'s Table 2 (Megatron)",
    )


def plan_inputs(args, cfg, defaults: dict | None = None) -> dict:
    """``planner.search.plan``'s keyword arguments from parsed ``mt3d plan`` flags (``defaults``: those
    of a run config given as the model): the one translation, used by the command and the benchmarks."""
    from .planner.hardware import get_device
    from .planner.search import Cluster, Stack

    defaults = defaults or {}
    overrides = {
        field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _) in DEVICE_FLAGS.items()
    }
    if overrides["inter_gbps"] is not None:  # the flag is per node, the device field per GPU
        overrides["inter_gbps"] /= args.gpus_per_node

    def given(value, fallback):
        return value if value is not None else fallback

    pins = {ax: getattr(args, flag) for ax, flag in PLAN_PINS.items() if getattr(args, flag)}
    return dict(
        cluster=Cluster(args.gpus, args.gpus_per_node, get_device(args.gpu, **overrides)),
        global_batch=given(args.global_batch, defaults.get("global_batch") or 512),
        seq_len=given(args.seq_len, defaults.get("seq_len") or cfg.max_seq_len),
        vocab=given(args.vocab, cfg.vocab_size or defaults.get("vocab")),
        precision=args.precision,
        efficiency=args.efficiency,
        virtual_stages=args.virtual_stages,
        context=args.context,
        micro_batches=args.micro_batch,
        zero_stages=args.zero,
        **({"offloads": args.offload} if args.offload else {}),
        pins=pins,
        stack=Stack(
            args.recompute,
            args.attention_kernel,
            args.pp_scatter_gather,
            args.activation_model,
            args.optimizer_states,
            args.grad_dtype,
            args.gemm_fraction,
            not args.other_stack,
            planned_overlap(args.overlap, args.other_stack),
            args.fp8,
        ),  # fmt: skip
    )


def planned_overlap(given: tuple[str, ...], other_stack: bool) -> tuple[str, ...]:
    """``--overlap``'s transfers as the planner counts them: mt3d's layers always overlap tp (whatever
    the list says); another stack overlaps what the list names (``none``: nothing)."""
    chosen = tuple(x for x in given if x != "none")
    if "tp-comm" in chosen and not other_stack:
        raise UserError("--overlap tp-comm states another stack's TP overlap (Megatron-Core's "
                        "--tp-comm-overlap), which mt3d does not run: add --other-stack")  # fmt: skip
    return chosen if other_stack or "tp" in chosen else ("tp", *chosen)


PLAN_PINS = {"tp": "tensor", "pp": "pipeline", "dp": "data", "ep": "expert"}
"""Axis -> the ``mt3d plan`` flag (attribute) that pins its degrees."""


def _plan_model(spec: str):
    """(ModelConfig, mt3d model section, config-file defaults) from a preset, config JSON or HF dir."""
    from pathlib import Path

    from .config import load, resolve_model

    path = Path(spec)
    if path.is_file():
        run = load(path)
        d = run.mt3d.data
        return (
            resolve_model(run.mt3d.model),
            run.mt3d.model,
            {
                "global_batch": run.deepspeed.batch_keys()["train_batch_size"],
                "seq_len": d.seq_len,
                "vocab": d.vocab_size if d.corpus != "indexed" else None,
            },
        )
    if path.is_dir():
        return resolve_model({"from_hf": str(path)}), {"from_hf": str(path)}, {}
    return resolve_model({"preset": spec}), {"preset": spec}, {}


def cmd_plan(args: argparse.Namespace) -> int:
    """``mt3d plan``."""
    from .planner.search import explain, explain_infeasible, format_plan, plan, write_config

    writable_output(args.write_config, "--write-config")
    cfg, section, defaults = _plan_model(args.model)
    inputs = plan_inputs(args, cfg, defaults)
    result = plan(cfg, inputs.pop("cluster"), **inputs)
    if args.write_config:
        write_config(result, args.write_config, section)
    if args.json:
        slim = {
            **result,
            "feasible": [{k: v for k, v in r.items() if k != "memory"} for r in result["feasible"]],
        }
        print(json.dumps(slim))
    else:
        print(format_plan(result, args.top))
        if args.explain and result["feasible"]:
            print("\n" + explain(result["feasible"][0]))
        if args.write_config:
            print(f"wrote {args.write_config}")
    if not result["feasible"]:
        if not args.json:
            print(explain_infeasible(result), file=sys.stderr)
        return 1
    return 0


def _add_train(sub) -> None:
    from . import train

    p = sub.add_parser(
        "train",
        help="train from one JSON config (the same as python -m mt3d.train; run it under a launcher)",
        description=train.DESCRIPTION,
        epilog=train.EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_arguments(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """``mt3d train``: ``mt3d.train.run`` (it reports its own errors and exit codes)."""
    from .train import run

    return run(args)


COMMANDS: list[Callable] = [
    _add_train,
    _add_plan,
    _add_checkpoint,
    _add_topo,
    _add_plot,
    _add_summary,
    _add_preprocess,
    _add_train_tokenizer,
    _add_eval,
    _add_generate,
    _add_export,
]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (sub-commands registered by COMMANDS)."""
    parser = OneLineParser(
        prog="mt3d",
        description="3D-parallel (tensor x pipeline x ZeRO data) LLM training on DeepSpeed.",
        epilog="Run 'mt3d <command> --help' for a command's options and examples.",
    )
    # `deepspeed --module mt3d train ...` puts the launcher's --local_rank before the sub-command
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run, and turn known bad-input errors into one line + exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    import warnings

    # Layout notes are part of every report; no need to repeat them as Python warnings.
    warnings.filterwarnings("ignore", message="mt3d topology")
    try:
        return int(args.func(args) or 0)
    except KNOWN_ERRORS as e:
        print(f"mt3d {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `mt3d topo ... | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
