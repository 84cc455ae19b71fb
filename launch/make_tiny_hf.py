"""Make a tiny randomly initialised HF model of any family, with a BPE tokenizer, to try fine-tuning
on a machine with no hub access: `python launch/make_tiny_hf.py --family qwen2 --out hf/tiny-qwen2`.

The tokenizer is trained on the builtin corpus (English documentation of the Python standard
library), so `"corpus": "builtin"` fine-tuning reads it with the model's own tokenizer. Each family
gets its characteristic features at toy size: sliding windows shorter than the demo's sequences,
Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma 2's soft-caps and alternating local/global layers.
``--chat`` gives the tokenizer ChatML's turn tokens and template (``mt3d.data.tokenizer.CHATML``), for
``mt3d preprocess --format chat`` and ``mt3d generate --chat``.
"""

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from mt3d.data.corpora import stdlib_documents
from mt3d.data.tokenizer import train_bpe

SMALL = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, max_position_embeddings=512)
FAMILIES = {
    "gpt2": dict(n_embd=128, n_layer=4, n_head=4, n_positions=512),
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, **SMALL),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=32, **SMALL),
    "qwen2": dict(
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=32,
        max_window_layers=2, **SMALL,
    ),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, **SMALL),
    "gemma2": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=32,
        query_pre_attn_scalar=64, **SMALL,
    ),
}  # fmt: skip


def main() -> None:
    """Parse arguments, train the tokenizer, save model + tokenizer."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--out", required=True, help="new directory")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="ChatML turn tokens and chat template")
    args = p.parse_args()
    out = Path(args.out)
    texts = [d for _, d in zip(range(3000), stdlib_documents())]
    tok = train_bpe(texts, args.vocab_size, out, chat=args.chat)
    config = AutoConfig.for_model(
        args.family, vocab_size=tok.vocab_size, bos_token_id=tok.eos_id, eos_token_id=tok.eos_id,
        **FAMILIES[args.family],
    )  # fmt: skip
    torch.manual_seed(args.seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
