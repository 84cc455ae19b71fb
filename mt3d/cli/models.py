"""The commands that run a trained model: ``mt3d eval``, ``generate`` and ``export-hf``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..inputs import (
    byte_size,
    non_negative_int,
    positive_int,
    read_text,
)
from .common import UsageError, _add_model_args, _load, _positive, _tokenizer_for, writable_output


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="loss and perplexity of an HF dir or mt3d checkpoint on a text file or a preprocessed dataset",
        description="Token-weighted loss / perplexity over a text file with non-overlapping windows "
        "(stride = seq-len) or sliding windows (smaller stride: each token scored once, with context); "
        "or over a preprocessed dataset's supervised tokens (--data: its documents packed into seq-len "
        "samples with document masking, each scored as if run alone).",
        epilog="examples:\n  mt3d eval --model runs/x --text wiki.txt --seq-len 512 --stride 256 --json\n"
        "  mt3d eval --model runs/sft --data runs/chat --seq-len 512 --json\n"
        "  mt3d eval --model runs/dpo --ref-model hf/sft --data runs/prefs --seq-len 512 --json\n"
        "  mt3d eval --model runs/dpo --data runs/rollouts --seq-len 2048 --logprobs runs/logprobs.jsonl\n"
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
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="UTF-8 text file")
    source.add_argument("--data", metavar="PREFIX", help="indexed dataset (mt3d preprocess), e.g. chat data")
    p.add_argument("--seq-len", type=positive_int, required=True, help="window (--data: sample) length")
    p.add_argument("--stride", type=positive_int, help="window step (default seq-len: non-overlapping)")
    p.add_argument(
        "--ref-model",
        metavar="REF",
        help="with --data of preference pairs: DPO's reference (an HF dir or mt3d checkpoint); prints the "
        "DPO loss, reward accuracy and margin",
    )
    p.add_argument("--dpo-beta", type=float, default=0.1, help="DPO's beta with --ref-model (default 0.1)")
    p.add_argument(
        "--logprobs",
        metavar="OUT.jsonl",
        help="with --data: write every document's per-token log-probabilities, one line each "
        '{"document", "tokens", "logprobs"} (null: not scored)',
    )
    p.add_argument("--json", action="store_true", help='one line: {"loss", "perplexity", "tokens", ...}')
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """``mt3d eval``."""

    import torch

    from ..checkpoint.loading import open_source
    from ..model.inference import evaluate_tokens

    stride = args.stride or args.seq_len
    _positive(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, seq_len=args.seq_len, stride=stride)
    if stride > args.seq_len:
        raise UsageError(
            f"--stride {stride} is longer than --seq-len {args.seq_len} (tokens would be skipped)"
        )
    source = open_source(args.model, verify=False, adapter=args.adapter)  # refuse before any weight is read
    cfg = source.cfg
    if cfg.position_limit is not None and args.seq_len > cfg.position_limit:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's max_seq_len {cfg.position_limit}")
    if args.logprobs is not None and (args.data is None or args.ref_model is not None):
        raise UsageError("--logprobs writes the per-token log-probabilities of --data PREFIX's documents "
                         "(not with --text or --ref-model)")  # fmt: skip
    if args.logprobs is not None:
        writable_output(args.logprobs, "--logprobs")
    if args.ref_model is not None and args.data is None:
        raise UsageError("--ref-model scores preference pairs: give --data PREFIX (mt3d preprocess --format "
                         "preference)")  # fmt: skip
    if args.data is not None:
        return _eval_data(args, source)
    text = read_text(args.text)
    model, device = _load(args, args.pp)
    tok = _tokenizer_for(model, model.vocab_size)
    ids = torch.tensor(tok.encode(text, eos=False), dtype=torch.long, device=device)
    if ids.numel() < 2:
        raise UsageError(f"{args.text} has fewer than 2 tokens")
    return _print_eval(args, model, evaluate_tokens(model, ids, model.state, args.seq_len, stride))


def _eval_data(args: argparse.Namespace, source) -> int:
    """``mt3d eval --data``: the dataset checked against the model before any weight is read."""
    from ..data.indexed import IndexedDataset
    from ..data.packing import PackedDocuments
    from ..model.inference import evaluate_documents

    if args.stride is not None:
        raise UsageError("--stride applies to --text; --data scores every document whole")
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        raise UsageError(f"--seq-len {args.seq_len} must be a multiple of 2 x --cp = {2 * args.cp}")
    data = IndexedDataset(args.data)
    if len(data) == 0:
        raise UsageError(f"{args.data} holds no documents")
    if data.max_id >= source.vocab:
        raise UsageError(f"{args.data} holds token ids up to {data.max_id}, outside the model's "
                         f"{source.vocab}-token vocabulary: was it made with another tokenizer?")  # fmt: skip
    if args.ref_model is not None:
        return _eval_pairs(args, source, data)
    if args.logprobs is not None:
        return _logprobs(args, data)
    packed = PackedDocuments(data, range(len(data)), args.seq_len, seed=0)  # all too long: refused here
    model, _ = _load(args, args.pp)
    data.vocab_limit = model.vocab_size
    return _print_eval(args, model, evaluate_documents(model, packed, model.state))


def _eval_pairs(args: argparse.Namespace, source, data) -> int:
    """``mt3d eval --ref-model``: DPO's sigmoid loss, reward accuracy and margin of the policy against
    the reference over every pair of a preference dataset (each completion's log-probability as
    training sums it), both models checked before any weight is read."""
    import math

    import torch.nn.functional as F

    from ..checkpoint.loading import from_pretrained, open_source
    from ..data.packing import PackedDocuments
    from ..data.preference import pair_data_conflict
    from ..model.inference import document_logps

    why = pair_data_conflict([args.data], args.seq_len)
    if why:
        raise UsageError(why.replace("train.objective 'dpo' reads", "--ref-model scores"))
    if not (args.dpo_beta > 0 and math.isfinite(args.dpo_beta)):
        raise UsageError(f"--dpo-beta must be a positive number, got {args.dpo_beta}")
    ref = open_source(args.ref_model, verify=False)
    if ref.vocab != source.vocab:
        raise UsageError(f"--ref-model {args.ref_model} has a {ref.vocab}-token vocabulary, the model "
                         f"{source.vocab}: the log-probabilities would not compare")  # fmt: skip
    packed = PackedDocuments(data, range(len(data) // 2), args.seq_len, seed=0, pairs=True)
    model, device = _load(args, args.pp)
    data.vocab_limit = model.vocab_size
    policy = document_logps(model, packed, model.state)
    state, dtype = model.state, next(model.parameters()).dtype
    del model
    reference = from_pretrained(args.ref_model, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, state=state,
                                dtype=dtype, device=device)  # fmt: skip
    margin = policy - document_logps(reference, packed, state)
    pairs = packed.doc_ids  # the pairs that fit in --seq-len
    chosen, rejected = args.dpo_beta * margin[2 * pairs], args.dpo_beta * margin[2 * pairs + 1]
    res = {
        "dpo_loss": float(-F.logsigmoid(chosen - rejected).mean()),
        "pairs": int(pairs.size),
        "reward_accuracy": float((chosen > rejected).double().mean()),
        "reward_margin": float((chosen - rejected).mean()),
        "dropped_pairs": packed.dropped_pairs,
    }
    if state.global_rank == 0:
        print(json.dumps(res) if args.json else "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else
                                                         f"{k} {v}" for k, v in res.items()))  # fmt: skip
    return 0


def _logprobs(args: argparse.Namespace, data) -> int:
    """``mt3d eval --logprobs``: every document's per-token log-probabilities at the launcher's layout
    (what an RL trainer's policy-gradient step reads of its rollouts), written by rank 0."""
    import math

    from ..data.packing import PackedDocuments
    from ..model.inference import token_logps

    packed = PackedDocuments(data, range(len(data)), args.seq_len, seed=0, sources=True)
    model, _ = _load(args, args.pp)
    data.vocab_limit = model.vocab_size
    lp = token_logps(model, packed, model.state).cpu().tolist()
    if model.state.global_rank == 0:
        tmp = Path(args.logprobs + ".tmp")
        with open(tmp, "w") as f:
            for i in range(len(data)):
                lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
                values = [None if math.isnan(v) else v for v in lp[lo:hi]]
                line = {"document": i, "tokens": data.doc(i).tolist(), "logprobs": values}
                f.write(json.dumps(line) + "\n")
        tmp.replace(args.logprobs)
        res = {"documents": len(data), "tokens": int(data.num_tokens), "truncated": packed.truncated,
               "out": args.logprobs}  # fmt: skip
        print(json.dumps(res) if args.json else f"wrote {args.logprobs}: {len(data)} documents, "
              f"{data.num_tokens} tokens ({packed.truncated} truncated at --seq-len)")  # fmt: skip
    return 0


def _print_eval(args: argparse.Namespace, model, res: dict) -> int:
    if model.state.global_rank == 0:
        if args.json:
            print(json.dumps(res))
        else:
            more = ("documents", "truncated", "packing_efficiency")
            extra = "".join(f"  {k} {res[k]}" for k in more if k in res)
            line = f"loss {res['loss']:.4f}  perplexity {res['perplexity']:.3f}  tokens {res['tokens']}"
            print(line + extra)
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="text generation (greedy or sampled) with a KV cache, any tp",
        description="Continue a prompt. Greedy by default; --temperature > 0 samples (with --top-k, "
        "--top-p, --seed). Under a launcher with --tp T, every rank holds 1/T of the model.",
        epilog="examples:\n  mt3d generate --model hf/gpt2 --prompt 'Return the' --max-new-tokens 20\n"
        "  torchrun --nproc_per_node 2 -m mt3d generate --model runs/x --prompt 'Hello' --tp 2 \\\n"
        "      --temperature 0.8\n"
        "  mt3d generate --model hf/sft --chat --prompt 'What is mt3d.data.packing for?'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user turn, rendered with the tokenizer's chat template and its generation "
        "prompt; prints the assistant's reply",
    )
    p.add_argument("--system", help="with --chat: a system turn before the prompt")
    p.add_argument("--chat-template", metavar="FILE", help="with --chat: a jinja template to use")
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

    from ..model.inference import generate

    _positive(tp=args.tp, max_new_tokens=args.max_new_tokens)
    if (args.system or args.chat_template) and not args.chat:
        raise UsageError("--system and --chat-template need --chat")
    import math

    finite = math.isfinite(args.temperature)
    if not finite or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise UsageError(
            f"need --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1; got {args.temperature}, "
            f"{args.top_k}, {args.top_p}"
        )
    from ..checkpoint.loading import open_source

    source = open_source(args.model, verify=False, adapter=args.adapter)  # checked before any weight is read
    tok = _tokenizer_for(source, source.vocab)
    ids = _chat_prompt(args, tok) if args.chat else tok.encode(args.prompt, eos=False)
    if not ids:
        raise UsageError("the prompt is empty")
    limit = source.cfg.position_limit
    if limit is not None and len(ids) + args.max_new_tokens > limit:
        room = f"use --max-new-tokens <= {limit - len(ids)}" if len(ids) < limit else "shorten the prompt"
        raise UsageError(f"the prompt's {len(ids)} tokens + --max-new-tokens {args.max_new_tokens} exceed "
                         f"the model's {limit} positions: {room}")  # fmt: skip
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
        ids = out[0].tolist()
        if args.chat:  # the reply alone, up to its end of turn
            ids = ids[prompt.shape[1] :]
            ids = ids[: ids.index(tok.eos_id)] if tok.eos_id in ids else ids
        text = tok.decode(ids)
        print(json.dumps({"text": text, "ids": ids}) if args.json else text)
    return 0


def _chat_prompt(args: argparse.Namespace, tok) -> list[int]:
    """``--chat``: the ids of the system and user turns and the generation prompt, rendered as
    ``mt3d preprocess --format chat`` renders training conversations (``mt3d.data.sft``)."""
    from ..data.sft import ChatRenderer, chat_template, special_tokens

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    renderer = ChatRenderer(chat_template(tok.path, args.chat_template), special_tokens(tok.path))
    return list(tok.backend.encode(renderer.render(messages, add_generation_prompt=True),
                                   add_special_tokens=False).ids)  # fmt: skip


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export-hf",
        help="write an HF transformers directory from an mt3d checkpoint of any layout",
        description="Gather the shards of a checkpoint (any tp x pp) into config.json + model.safetensors "
        "(sharded with an index above --max-shard-size) + the tokenizer. The checkpoint is verified first.",
        epilog="examples:\n  mt3d export-hf --checkpoint runs/x/checkpoints/step_00001000 --out hf/x\n"
        "  mt3d export-hf --checkpoint runs/lora --out adapters/lora --adapter-only",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint", required=True, help="checkpoint dir (step_XXXXXXXX) or run dir (its newest)"
    )
    p.add_argument("--out", required=True, help="new (or empty) output directory")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run's adapters as a PEFT directory (adapter_config.json, adapter_model.safetensors); "
        "without it a LoRA run is exported merged into its base",
    )
    p.add_argument(
        "--max-shard-size", type=byte_size, default="5GB", help="largest safetensors file (e.g. 5GB, 500MB)"
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    """``mt3d export-hf``."""
    from ..checkpoint.export import export_hf

    writable_output(args.out, "--out", directory=True)
    print(
        export_hf(
            args.checkpoint, args.out, max_shard_size=args.max_shard_size, adapter_only=args.adapter_only
        )
    )
    return 0
