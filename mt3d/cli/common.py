"""What every command shares: its usage error, the errors reported as one line, output checks, and
the model arguments of eval, generate and export-hf."""

from __future__ import annotations

from ..errors import UserError
from ..inputs import (
    positive_int,
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

    from ..config import writable_dir

    if directory:
        writable_dir(Path(path), flag)
    else:
        writable_dir(Path(path).parent, f"{flag} {path}: its directory")


# --- models: eval, generate, export-hf ------------------------------------------------------------
def _add_model_args(p) -> None:
    p.add_argument(
        "--model", required=True, help="HF model directory, mt3d checkpoint dir, or run dir (newest)"
    )
    p.add_argument(
        "--tp", type=positive_int, default=1, help="tensor-parallel ranks (launch tp*pp processes)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--adapter", metavar="DIR", help="a PEFT LoRA adapter directory, merged into the model's weights"
    )


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")


def _load(args, pp: int = 1):
    import torch

    from ..checkpoint.loading import from_pretrained

    device = None
    if torch.cuda.is_available():
        import os

        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    cp, ep = getattr(args, "cp", 1), getattr(args, "ep", 1)
    return from_pretrained(
        args.model,
        tp=args.tp,
        pp=pp,
        cp=cp,
        ep=ep,
        dtype=getattr(torch, args.dtype),
        device=device,
        adapter=args.adapter,
    ), device


def _tokenizer_for(model, vocab: int):
    """The model's tokenizer, refused when it has ids the model's ``vocab`` does not."""
    from ..data.tokenizer import load_tokenizer

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
