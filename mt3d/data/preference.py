"""Preference pairs for DPO (``mt3d preprocess --format preference``): TRL's preference formats, tokenized
as TRL tokenizes them, stored as two documents per pair.

Records (one JSON object per line, as TRL's datasets):

* standard: ``{"prompt": str, "chosen": str, "rejected": str}``. The prompt's ids are the tokenizer's
  encoding of the prompt with its own special tokens (a BOS where the tokenizer adds one); a
  completion's are its encoding without special tokens, then the EOS id.
* conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``. The prompt
  is the chat template's rendering of the prompt messages with the generation prompt; a completion is
  what the rendering of the prompt and its messages adds after that (the template closes the turn).
* implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``: the prompt is the messages both
  lists start with (TRL's ``extract_prompt``), the completions the rest.

Storage: pair p is documents 2p (chosen) and 2p + 1 (rejected) of the indexed dataset, each its prompt
then completion, with the loss mask on the completion (``mt3d.data.sft``'s convention: the tokens the
log-probability of a completion sums over). ``P.meta.json`` says ``"format": "preference"``, counts
the pairs and records the longest prompt (``longest_prompt``: a run whose ``seq_len`` it fills is
refused before any work).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .sft import ChatRenderer, SFTDataError, _messages, json_records, unicode_text

FORMAT = "preference"


def pair_records(path: Path, stats, on_bad_bytes: str = "fail") -> Iterator[dict]:
    """Checked preference records of one jsonl file: {"prompt", "chosen", "rejected", "chat", "where"},
    prompt and completions strings (standard) or message lists (conversational, the prompt extracted
    where implicit); anything else is one line naming the file and line."""
    for where, rec in json_records(path, stats, on_bad_bytes):
        for key in ("chosen", "rejected"):
            if key not in rec:
                raise SFTDataError(
                    f'{where}a preference record needs "{key}" (TRL\'s formats: prompt, chosen and rejected '
                    "strings or message lists, or chosen and rejected message lists)"
                )
        chat = isinstance(rec["chosen"], list)
        if chat:
            chosen, rejected = _messages(rec, where, "chosen"), _messages(rec, where, "rejected")
            if "prompt" in rec:
                prompt = _messages(rec, where, "prompt")
            else:  # implicit: the messages both start with
                n = 0
                while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                    n += 1
                if n == 0:
                    raise SFTDataError(f"{where}chosen and rejected share no first message, so the prompt "
                                       'cannot be extracted: give "prompt" explicitly')  # fmt: skip
                prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        else:
            for key in ("prompt", "chosen", "rejected"):
                if not isinstance(rec.get(key), str):
                    got = "missing" if key not in rec else f"a {type(rec[key]).__name__}"
                    raise SFTDataError(f"{where}{key!r} must be a string ({got}) like the others, or every "
                                       "field a message list")  # fmt: skip
            keys = ("prompt", "chosen", "rejected")
            prompt, chosen, rejected = (unicode_text(rec[k], f"{where}{k!r}") for k in keys)
        yield {"prompt": prompt, "chosen": chosen, "rejected": rejected, "chat": chat, "where": where}


def tokenize_pair(tok, renderer: ChatRenderer | None, rec: dict) -> tuple[list, int]:
    """([(ids, mask) of the chosen document, (ids, mask) of the rejected one], the prompt's tokens)
    (module docstring)."""
    if rec["chat"]:
        if renderer is None:
            raise SFTDataError(
                f"{rec['where']}conversational pairs are rendered with a chat template and the tokenizer has "
                "none: give --chat-template FILE"
            )
        head = renderer.render(rec["prompt"], add_generation_prompt=True, where=rec["where"])
        prompt = tok.backend.encode(head, add_special_tokens=False).ids
    else:
        prompt = tok.backend.encode(rec["prompt"], add_special_tokens=True).ids
    out = []
    for key in ("chosen", "rejected"):
        if rec["chat"]:
            whole = renderer.render(rec["prompt"] + rec[key], where=rec["where"])
            if not whole.startswith(head):
                raise SFTDataError(f"{rec['where']}the chat template renders the prompt differently once the "
                                   f"{key} reply follows, so the completion cannot be cut off it: use a "
                                   "--chat-template that renders every turn the same way")  # fmt: skip
            completion = tok.backend.encode(whole[len(head) :], add_special_tokens=False).ids
        else:
            completion = tok.encode(rec[key], eos=True) if rec[key] else []
        if not completion:
            raise SFTDataError(
                f"{rec['where']}the {key} completion is empty: a pair compares two completions (drop the "
                "record or fill it)"
            )
        ids = list(prompt) + list(completion)
        mask = [0] * len(prompt) + [1] * len(completion)
        mask[0] = 0  # a document's first token has nothing to be predicted from
        out.append((ids, mask))
    return out, len(prompt)


def pair_data_conflict(prefixes, seq_len: int | None = None) -> str | None:
    """Why these dataset prefixes cannot feed DPO (None: they can): one dataset, made by
    ``mt3d preprocess --format preference``, whose longest prompt leaves room in ``seq_len``."""
    from .indexed import read_meta

    if len(prefixes) != 1:
        return (
            f"train.objective 'dpo' reads one preference dataset, got {len(prefixes)} prefixes "
            "(preprocess the pairs into one)"
        )
    meta = read_meta(prefixes[0])
    if meta.get("format") != FORMAT:
        return (
            f"{prefixes[0]} holds no preference pairs (train.objective 'dpo' reads datasets made by "
            "mt3d preprocess --format preference)"
        )
    longest = meta.get("longest_prompt", 0)
    if seq_len is not None and longest >= seq_len:
        return (
            f"{prefixes[0]} has prompts of up to {longest} tokens, which leave no room for a completion in "
            f"seq_len {seq_len}: raise the sequence length or drop those pairs"
        )
    return None
