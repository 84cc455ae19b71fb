"""A small chat corpus made from mt3d's own source, so fine-tuning runs on a machine with no downloads.

Each conversation asks about mt3d's modules, classes and functions and answers with the first
paragraph of their docstrings, read with ``ast`` (nothing is imported): one to three question and
answer turns, sometimes after a system prompt, in the ``{"messages": [{"role", "content"}]}`` jsonl
that ``mt3d preprocess --format chat`` reads. The questions and the number of turns vary, so the
supervised share of a conversation varies too. Deterministic for a seed::

    python -m mt3d.data.chat_corpus runs/chat.jsonl
    python -m mt3d.data.chat_corpus --preference runs/prefs.jsonl   # DPO pairs (TRL's format)

The preference pairs ask each question once: chosen, its own docstring; rejected, another's.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

SYSTEM = "You are mt3d's assistant. Answer questions about mt3d's code in one paragraph."
QUESTIONS = {
    "module": ("What is {name} for?", "What does the module {name} do?", "Explain {name}."),
    "class": ("What is the class {name} in {where}?", "What does {where}.{name} represent?"),
    "function": ("What does {name} in {where} do?", "Explain {where}.{name}.", "What is {name} for?"),
}


def _first_paragraph(doc: str | None) -> str | None:
    if not doc:
        return None
    text = " ".join(doc.strip().split("\n\n")[0].split())
    return text if len(text) >= 20 else None


def project_facts(root: Path | None = None) -> list[tuple[str, str, str, str]]:
    """(kind, name, where, answer) for every documented module and public class and function of
    the package at ``root`` (default: mt3d's), in path order."""
    root = root or Path(__file__).resolve().parents[1]
    out = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("mt3d", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        answer = _first_paragraph(ast.get_docstring(tree))
        if answer:
            out.append(("module", module, module, answer))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                answer = _first_paragraph(ast.get_docstring(node))
                if answer:
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    out.append((kind, node.name, module, answer))
    return out


def project_conversations(seed: int = 0, root: Path | None = None) -> list[dict]:
    """Conversations over ``project_facts``: each fact answered once, in turns of one to three."""
    rng = random.Random(seed)
    facts = project_facts(root)
    rng.shuffle(facts)
    out, i = [], 0
    while i < len(facts):
        turns = rng.choice((1, 1, 2, 3))
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for kind, name, where, answer in facts[i : i + turns]:
            question = rng.choice(QUESTIONS[kind]).format(name=name, where=where)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
        i += turns
    return out


def project_preferences(seed: int = 0, root: Path | None = None) -> list[dict]:
    """Preference pairs over ``project_facts`` (conversational, explicit prompt): each question once,
    its own answer chosen and another fact's rejected."""
    rng = random.Random(seed)
    facts = project_facts(root)
    out = []
    for i, (kind, name, where, answer) in enumerate(facts):
        other = facts[(i + rng.randrange(1, len(facts))) % len(facts)][3]
        prompt = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        prompt.append({"role": "user", "content": rng.choice(QUESTIONS[kind]).format(name=name, where=where)})
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": other}]})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """Write the corpus (or, after --preference, the pairs) to the jsonl file named on the command line."""
    args = sys.argv[1:] if argv is None else argv
    pairs = args[:1] == ["--preference"]
    args = args[1:] if pairs else args
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m mt3d.data.chat_corpus [--preference] OUT.jsonl", file=sys.stderr)
        return 2
    out = Path(args[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    records = project_preferences() if pairs else project_conversations()
    out.write_text("".join(json.dumps(c) + "\n" for c in records), encoding="utf-8")
    print(f"{out}: {len(records)} {'preference pairs' if pairs else 'conversations'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
