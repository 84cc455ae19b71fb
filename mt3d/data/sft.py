"""Supervised fine-tuning data: chat conversations and prompt/completion pairs as tokens with a loss mask.

Conventions (docs/data.md):

* A conversation's tokens are exactly its chat template's rendering, tokenized without added special
  tokens (what ``transformers``' ``apply_chat_template(messages, tokenize=True)`` gives).
* ``mask[t] = 1`` iff token t is a supervised target, predicted from the tokens before it in its own
  document (so never a document's first token). In a chat, each assistant reply and the end-of-turn
  tokens that close it are supervised; system and user turns, role headers and the whitespace after
  an end of turn are not. In a prompt/completion pair, the completion and its end token.
* A reply is a span of characters, and every token holding any of its characters is supervised
  (transformers' assistant mask): a token that straddles the generation prompt's end and the reply's
  start (``assistant: `` then ``Sure``: the token `` Sure``) is the reply's.

A reply's span is read off the template itself: its ``{% generation %}`` blocks when it has them
(transformers' assistant-mask tags), else the rendering of the messages before it with the generation
prompt ends where the reply starts, and the rendering that includes it ends after its end-of-turn
tokens. A template for which those renderings are not prefixes of the whole conversation's (one that
rewrites earlier turns) is refused by name; one that ignores ``add_generation_prompt`` (the role header
is then supervised) or closes no reply (nothing teaches the model to stop) is warned of once. Templates
are rendered in jinja2's sandbox, as transformers renders them; a tokenizer that asks for code of its
own is refused before that.
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
        return _nonempty(read_text(Path(template_file), "chat template"), template_file)
    d = Path(tokenizer_dir)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return _nonempty(read_text(jinja, "chat template"), jinja)
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


def _nonempty(template: str, path) -> str:
    if not template.strip():
        raise SFTDataError(f"the chat template {path} is empty: give one that renders the messages")
    return template


class ChatRenderer:
    """A chat template compiled once, rendered as transformers renders it: sandboxed jinja2 with
    trimmed blocks and loop controls, the tokenizer's special tokens as variables, transformers'
    ``tojson`` (no HTML escaping), ``strftime_now`` and ``{% generation %}`` blocks (its assistant-mask
    tags: ``render`` returns the character spans they filled)."""

    def __init__(self, template: str, special: dict[str, str | None]) -> None:
        from jinja2 import TemplateError, nodes
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise SFTDataError(f"the chat template refused the conversation: {message}")

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), loopcontrols]
        )
        env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(template)
        except TemplateError as e:
            raise SFTDataError(f"the chat template does not compile: {e}") from None
        self.env, self.special = env, special
        self.tagged = any(
            getattr(b.call.node, "name", None) == "_track"
            for b in env.parse(template).find_all(nodes.CallBlock)
        )
        """Whether the template marks replies with ``{% generation %}`` (transformers' assistant mask)."""
        self.notes: dict[str, str] = {}
        """Warnings about the template, each once per renderer (``note``)."""

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "") -> str:
        """The template's text for ``messages``."""
        return self.render_spans(messages, add_generation_prompt, where)[0]

    def render_spans(self, messages: list[dict], add_generation_prompt: bool = False,
                     where: str = "") -> tuple[str, list[tuple[int, int]]]:  # fmt: skip
        """The template's text for ``messages`` and the character spans its ``{% generation %}``
        blocks filled. A template that fails in any way (an error of its own, a range over the
        sandbox's limit, a recursion) is one line naming the record."""
        chunks: list[str] = []
        spans: list[tuple[int, int]] = []
        self.env.mt3d_tracking = (chunks, spans)
        try:
            for chunk in self.template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special
            ):
                chunks.append(chunk)
        except SFTDataError as e:
            raise SFTDataError(f"{where}{e}") from None
        except Exception as e:  # the template is the user's code: whatever it raises is bad input
            raise SFTDataError(
                f"{where}the chat template failed on a conversation: {type(e).__name__}: {e}"
            ) from None
        finally:
            self.env.mt3d_tracking = None
        return "".join(chunks), spans

    def note(self, key: str, message: str) -> None:
        """Keep a warning about the template, once."""
        self.notes.setdefault(key, message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter: plain ``json.dumps`` (jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """transformers' ``strftime_now``: templates date their system turns with it (Llama 3.x)."""
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _generation_tag():
    """The jinja extension of ``{% generation %}...{% endgeneration %}``: the body renders as itself,
    and while a ``ChatRenderer`` renders, the span of output it fills is recorded. The output before
    the block has been yielded by then (the renderer collects chunks), which gives its start."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(mt3d_tracking=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller):
            out = caller()
            if self.environment.mt3d_tracking is not None:
                chunks, spans = self.environment.mt3d_tracking
                start = sum(map(len, chunks))
                spans.append((start, start + len(out)))
            return out

    return Generation


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
    text, tagged = renderer.render_spans(messages, where=where)
    if not text.strip():
        raise SFTDataError(f"{where}the chat template renders nothing for this conversation: give a "
                           "--chat-template that renders the messages")  # fmt: skip
    spans = tagged if renderer.tagged else _reply_spans(renderer, messages, text, where)
    enc = tok.backend.encode(text, add_special_tokens=False)
    mask = overlap_mask(enc.offsets, spans)
    if mask:
        mask[0] = 0  # a document's first token has nothing to be predicted from
    return list(enc.ids), mask


def _reply_spans(
    renderer: ChatRenderer, messages: list[dict], text: str, where: str
) -> list[tuple[int, int]]:
    """The character span of every assistant reply and the end-of-turn text that closes it, read off
    the template (module docstring); notes a template that ignores the generation prompt or closes
    no reply."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = renderer.render(messages[:i], add_generation_prompt=True, where=where)
        upto = renderer.render(messages[: i + 1], where=where)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise SFTDataError(
                f"{where}the chat template renders earlier turns differently once later ones follow (its "
                "rendering is not prefix-stable), so the assistant replies cannot be located: use a "
                "--chat-template that renders every turn the same way"
            )
        end = len(upto.rstrip())
        if i and "generation prompt" not in renderer.notes:
            if before == renderer.render(messages[:i], where=where):
                renderer.note("generation prompt", "the chat template ignores add_generation_prompt, so "
                              "each reply's role header is supervised with it: use a template that renders "
                              "the assistant's header when add_generation_prompt is true")  # fmt: skip
        if m["content"].strip() and upto[len(before) : end].endswith(m["content"].rstrip()):
            renderer.note("no close", "the chat template puts nothing after an assistant reply (no "
                          "end-of-turn text), so no supervised token teaches the model to end its turn: "
                          "use a template that closes each reply (an end-of-turn or EOS token)")  # fmt: skip
        spans.append((len(before), end))
    return spans


def overlap_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token whose characters ``offsets[t] = (start, end)`` meet a span: a token that
    straddles a reply's first character (``assistant:`` + `` hello``) is the reply's too, as
    transformers' assistant mask has it. Offsets and spans are in order: one pass."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = int(end > spans[k][0])
    return mask


def prompt_completion(tok, prompt: str, completion: str) -> tuple[list, list]:
    """(token ids, loss mask) of a prompt/completion pair: the completion and its end token supervised."""
    p = tok.encode(prompt, eos=False)
    c = tok.encode(completion, eos=True)
    mask = [0] * len(p) + [1] * len(c)
    if mask:
        mask[0] = 0
    return p + c, mask


def json_records(path: Path, stats, on_bad_bytes: str = "fail") -> Iterator[tuple[str, dict]]:
    """``(where, record)`` of every JSON object of one jsonl file (``where``: "file:line: "); blank lines
    skipped; a line that is no JSON object is one line naming the file and line. Invalid UTF-8 is
    refused by line, or with ``on_bad_bytes`` "replace" becomes U+FFFD and is counted
    (``stats.replaced_bytes``)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}:{n}: "
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if on_bad_bytes != "replace":
                    at = f"byte 0x{raw[e.start]:02x} at column {e.start + 1}"
                    raise SFTDataError(f"{where}not UTF-8 text ({at}): fix the file or pass --on-bad-bytes "
                                       "replace") from None  # fmt: skip
                line = raw.decode("utf-8", errors="replace")
                stats.replaced_bytes[str(path)] = stats.replaced_bytes.get(str(path), 0) + line.count(
                    "\ufffd"
                )
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SFTDataError(f"{where}not a JSON object ({e.msg})") from None
            if not isinstance(rec, dict):
                raise SFTDataError(f"{where}not a JSON object")
            yield where, rec


def records(path: Path, fmt: str, stats, on_bad_bytes: str = "fail") -> Iterator[dict]:
    """The checked records of one jsonl file (``json_records``): ``messages`` (chat) or ``prompt`` and
    ``completion``; anything else is one line naming the file and line. Conversations without an
    assistant reply are skipped and counted (``stats.skipped_no_reply``)."""
    for where, rec in json_records(path, stats, on_bad_bytes):
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
            prompt, completion = (unicode_text(rec[k], f"{where}{k!r}") for k in ("prompt", "completion"))
            yield {"prompt": prompt, "completion": completion, "where": where}


def _messages(rec: dict, where: str, key: str = "messages") -> list[dict]:
    messages = rec.get(key)
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(f'{where}a chat record needs "{key}": [{{"role": ..., "content": ...}}, ...]')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SFTDataError(f'{where}message {i} is a {type(m).__name__}, not an object {{"role": ..., '
                               '"content": ...}')  # fmt: skip
        if m.get("role") not in ROLES:
            raise SFTDataError(f"{where}message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            kind = type(m.get("content")).__name__
            raise SFTDataError(
                f"{where}message {i} ({m['role']}) has {kind} content; content must be a string"
            )
        out.append(
            {"role": m["role"], "content": unicode_text(m["content"], f"{where}message {i} ({m['role']})")}
        )
    return out


def unicode_text(text: str, what: str) -> str:
    """``text`` when it is valid Unicode; a lone surrogate (JSON's ``"\\ud800"`` without its pair),
    which no tokenizer takes, is one line naming ``what`` and where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SFTDataError(
            f"{what} holds a lone surrogate {text[e.start]!a} at character {e.start}, which is not valid "
            "Unicode: fix the escape in the record (or drop the record)"
        ) from None
    return text
