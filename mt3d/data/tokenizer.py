"""Tokenizers: load an HF tokenizer directory, or train a byte-level BPE and save it as one.

The training and preprocessing paths use the ``tokenizers`` library directly (fast, picklable,
no torch); the saved directory is a regular HF tokenizer that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..errors import UserError
from ..inputs import read_json

EOS = "<|endoftext|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, the chat template of ``train_bpe(..., chat=True)`` tokenizers (each turn between
``<|im_start|>role`` and ``<|im_end|>``, which is also their end-of-text token, as in Qwen's
instruction-tuned models)."""


class TokenizerError(UserError):
    """A tokenizer directory that cannot be used; the message names the file."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the end-of-document id, loaded from an HF directory."""

    def __init__(self, backend, eos_id: int, path: str | None = None) -> None:
        self.backend = backend
        self.eos_id = eos_id
        self.path = path

    @property
    def vocab_size(self) -> int:
        """Number of ids (including added special tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, eos: bool = True) -> list[int]:
        """Ids of one document, with EOS appended by default."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ids + [self.eos_id] if eos else ids

    def encode_batch(self, texts: list[str], eos: bool = True) -> list[list[int]]:
        """Ids of several documents (parallel inside the Rust library)."""
        out = [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return [ids + [self.eos_id] for ids in out] if eos else out

    def decode(self, ids) -> str:
        """Text of a list of ids."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def __getstate__(self):
        return {"json": self.backend.to_str(), "eos_id": self.eos_id, "path": self.path}

    def __setstate__(self, state):
        from tokenizers import Tokenizer as Backend

        self.backend = Backend.from_str(state["json"])
        self.eos_id, self.path = state["eos_id"], state["path"]


def _special(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)


def copy_tokenizer(src: str | Path, dst: str | Path) -> int:
    """Copy the tokenizer files of HF directory ``src`` into ``dst``; returns how many."""
    import shutil

    n = 0
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            Path(dst).mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, Path(dst) / name)
            n += 1
    return n


def refuse_custom_code(d: Path) -> None:
    """Refuse a tokenizer directory that asks for Python code of its own (``auto_map`` in
    ``tokenizer_config.json``, the way transformers finds custom classes): mt3d never runs code that
    comes with a model or a checkpoint, and never offers to."""
    f = d / "tokenizer_config.json"
    if f.is_file():
        config = read_json(f, "tokenizer config")
        if config.get("auto_map"):
            raise TokenizerError(
                f"{f} asks for custom tokenizer code (auto_map {config['auto_map']!r}); mt3d never runs code "
                "from a model or checkpoint directory: save the tokenizer as a plain tokenizer.json "
                "(PreTrainedTokenizerFast) without auto_map"
            )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load an HF tokenizer directory (``tokenizer.json`` + config; other formats via transformers)."""
    d = Path(path)
    if not d.is_dir():
        raise TokenizerError(f"tokenizer directory not found: {d}")
    refuse_custom_code(d)
    from tokenizers import Tokenizer as Backend

    tj = d / "tokenizer.json"
    if tj.is_file():
        try:
            backend = Backend.from_file(str(tj))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise TokenizerError(
                f"{tj} is not a valid tokenizer file ({' '.join(str(e).split())[:200]})"
            ) from None
    else:
        try:
            from transformers import AutoTokenizer

            backend = AutoTokenizer.from_pretrained(
                str(d), local_files_only=True, trust_remote_code=False
            ).backend_tokenizer
        except Exception as e:
            raise TokenizerError(f"{d}: no tokenizer.json and transformers could not load it ({e})") from None
    eos = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = d / name
        if f.is_file():
            eos = eos or _special(read_json(f, "tokenizer config").get("eos_token"))
    eos = eos or EOS
    eos_id = backend.token_to_id(eos)
    if eos_id is None:
        raise TokenizerError(f"{d}: end-of-text token {eos!r} is not in the vocabulary")
    return Tokenizer(backend, eos_id, str(d))


def save_hf(backend, out_dir: str | Path, model_max_length: int = 2048, chat: bool = False) -> Tokenizer:
    """Save a ``tokenizers.Tokenizer`` as an HF tokenizer directory (EOS also serves as BOS/PAD);
    ``chat``: with the ChatML template, ``<|im_end|>`` its end-of-text token (``CHATML``)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=TURN_END if chat else EOS,
        bos_token=EOS,
        pad_token=EOS,
        model_max_length=model_max_length,
        **({"additional_special_tokens": [TURN_START, TURN_END]} if chat else {}),
    )
    if chat:
        fast.chat_template = CHATML
    fast.save_pretrained(str(out))
    return load_tokenizer(out)


def train_bpe(texts: Iterable[str], vocab_size: int, out_dir: str | Path, chat: bool = False) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` and save it as an HF tokenizer directory (``chat``: with the
    ChatML turn tokens and template, ``CHATML``)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(f"byte-level BPE needs vocab_size > 256, got {vocab_size}")
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, TURN_START, TURN_END] if chat else [EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return save_hf(tok, out_dir, chat=chat)


def word_level(words: list[str], out_dir: str | Path) -> Tokenizer:
    """A whitespace word-level tokenizer over ``words`` (+ EOS), saved as an HF directory."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(words)}
    vocab[EOS] = len(vocab)
    tok = Backend(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([EOS])
    return save_hf(tok, out_dir)
