"""Supervised fine-tuning data: chat conversations and prompt/completion pairs as tokens with a loss mask.

Conventions (docs/data.md):

* A conversation's tokens are exactly its chat template's rendering, tokenized without added special
  tokens (what ``transformers``' ``apply_chat_template(messages, tokenize=True)`` gives).
* ``mask[t] = 1`` iff token t is a supervised target, predicted from the tokens before it in its own
  document (so never a document's first token). In a chat, each assistant reply and the end-of-turn
  tokens that close it are supervised; system and user turns, role headers and the whitespace after
  an end of turn are not. In a prompt/completion pair, the completion and its end token.

A reply's span is read off the template itself: the rendering of the messages before it with the
generation prompt ends where the reply starts, and the rendering that includes it ends after its
end-of-turn tokens. A template for which those renderings are not prefixes of the whole conversation's
(one that rewrites earlier turns) is refused by name. Templates are rendered in jinja2's sandbox, as
transformers renders them; a tokenizer that asks for code of its own is refused before that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import UserError
from ..inputs import read_json, read_text

ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("text", "chat", "prompt-completion")


class SFTDataError(UserError):
    """A chat or prompt/completion record, or a chat template, that cannot be used; names file and line."""


def chat_template(tokenizer_dir: str | Path, template_file: str | Path | None = None) -> str:
    """The chat template: ``template_file`` when given, else the tokenizer's own
    (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``)."""
    if template_file is not None:
        return read_text(Path(template_file), "chat template")
    d = Path(tokenizer_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return read_text(jinja, "chat template")
    config = d / "tokenizer_config.json"
    found = read_json(config, "tokenizer config").get("chat_template") if config.is_file() else None
    if isinstance(found, list):  # named templates: the default one
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    if not isinstance(found, str) or not found.strip():
        raise SFTDataError(
            f"{d} has no chat template (chat_template.jinja or tokenizer_config.json's chat_template): "
            "give one with --chat-template FILE"
        )
    return found


class ChatRenderer:
    """A chat template compiled once, rendered as transformers renders it (sandboxed jinja2 with
    trimmed blocks, the tokenizer's special tokens as variables)."""

    def __init__(self, template: str, special: dict[str, str | None]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise SFTDataError(f"the chat template refused the conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(template)
        except TemplateError as e:
            raise SFTDataError(f"the chat template does not compile: {e}") from None
        self.special = special

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``."""
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special)  # fmt: skip
        except TemplateError as e:
            raise SFTDataError(f"the chat template failed on a conversation: {e}") from None


def special_tokens(tokenizer_dir: str | Path) -> dict[str, str | None]:
    """The special tokens a template may name (``bos_token``, ``eos_token``, ...), from the tokenizer's
    config files."""
    out: dict[str, str | None] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = Path(tokenizer_dir) / name
        if f.is_file():
            for key, value in read_json(f, "tokenizer config").items():
                if key.endswith("_token") and key not in out:
                    out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def conversation(tok, renderer: ChatRenderer, messages: list[dict], where: str = "") -> tuple[list, list]:
    """(token ids, loss mask) of one conversation (module docstring)."""
    text = renderer.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = renderer.render(messages[:i], add_generation_prompt=True)
        upto = renderer.render(messages[: i + 1])
        if not (text.startswith(upto) and upto.startswith(before)):
            raise SFTDataError(
                f"{where}the chat template renders earlier turns differently once later ones follow (its "
                "rendering is not prefix-stable), so the assistant replies cannot be located: use a "
                "--chat-template that renders every turn the same way"
            )
        spans.append((len(before), len(upto.rstrip())))
    enc = tok.backend.encode(text, add_special_tokens=False)
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc.offsets]
    if mask:
        mask[0] = 0  # a document's first token has nothing to be predicted from
    return list(enc.ids), mask


def prompt_completion(tok, prompt: str, completion: str) -> tuple[list, list]:
    """(token ids, loss mask) of a prompt/completion pair: the completion and its end token supervised."""
    p = tok.encode(prompt, eos=False)
    c = tok.encode(completion, eos=True)
    mask = [0] * len(p) + [1] * len(c)
    if mask:
        mask[0] = 0
    return p + c, mask


def records(path: Path, fmt: str, stats) -> Iterator[dict]:
    """The checked records of one jsonl file: ``messages`` (chat) or ``prompt`` and ``completion``;
    anything else is one line naming the file and line. Conversations without an assistant reply are
    skipped and counted (``stats.skipped_no_reply``)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}: "
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SFTDataError(f"{where}not a JSON object ({e.msg})") from None
            if not isinstance(rec, dict):
                raise SFTDataError(f"{where}not a JSON object")
            if fmt == "chat":
                messages = _messages(rec, where)
                if not any(m["role"] == "assistant" for m in messages):
                    stats.skipped_no_reply += 1
                    continue
                yield {"messages": messages, "where": where}
            else:
                for key in ("prompt", "completion"):
                    if not isinstance(rec.get(key), str):
                        got = "missing" if key not in rec else f"a {type(rec[key]).__name__}"
                        raise SFTDataError(f"{where}{key!r} must be a string ({got}); prompt-completion "
                                           'records are {"prompt": "...", "completion": "..."}')  # fmt: skip
                yield {"prompt": rec["prompt"], "completion": rec["completion"], "where": where}


def _messages(rec: dict, where: str) -> list[dict]:
    messages = rec.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(f'{where}a chat record needs "messages": [{{"role": ..., "content": ...}}, ...]')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise SFTDataError(f"{where}message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            kind = type(m.get("content")).__name__
            raise SFTDataError(
                f"{where}message {i} ({m['role']}) has {kind} content; content must be a string"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out
