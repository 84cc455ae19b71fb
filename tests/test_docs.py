"""Every command the README and docs/ show still works as written: each one's arguments are parsed
by the command's own parser (a renamed or removed flag fails here), and the cheap ones are run."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands():
    """(page, command line) of every shell line in a ```bash block (continuations joined)."""
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.split(" #")[0].strip()
                if line and not line.startswith("#"):
                    yield page.name, line


def mt3d_argv(line: str) -> tuple[str, list[str]] | None:
    """('mt3d' or 'bench', the arguments after the program) of a line that runs mt3d, else None."""
    words = [w for w in shlex.split(line) if not re.match(r"^[A-Z_]+=", w)]  # leading VAR=value
    for i, w in enumerate(words):
        if w == "mt3d" or (w in ("-m", "--module") and words[i + 1] in ("mt3d", "mt3d.train", "mt3d.bench")):
            prog = "mt3d" if w == "mt3d" else words[i + 1]
            rest = words[i + 1 :] if w == "mt3d" else words[i + 2 :]
            if prog == "mt3d.train":
                return "mt3d", ["train", *rest]
            return ("bench" if prog == "mt3d.bench" else "mt3d"), rest
    return None


CASES = [(page, line) for page, line in commands() if mt3d_argv(line)]


def test_the_pages_show_the_commands():
    pages = {page for page, _ in CASES}
    assert len(CASES) > 40 and {"README.md", "training.md", "planner.md", "hf.md"} <= pages


@pytest.mark.parametrize("page, line", CASES, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CASES)])
def test_every_documented_command_parses(page, line):
    prog, argv = mt3d_argv(line)
    if prog == "bench":
        from mt3d.bench.__main__ import build_parser
    else:
        from mt3d.cli import build_parser
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{page}: `{line}` no longer parses (exit {e.code})")


CHEAP = [
    (p, line)
    for p, line in CASES
    if mt3d_argv(line)[1][:1] in (["topo"], ["plan"]) and "--write-config" not in line
]


@pytest.mark.parametrize("page, line", CHEAP, ids=[f"{p}:{i}" for i, (p, _) in enumerate(CHEAP)])
def test_the_cheap_documented_commands_run(page, line, monkeypatch, capsys):
    from mt3d.cli import main

    monkeypatch.chdir(ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for word in shlex.split(line):
        if re.match(r"^[A-Z_]+=", word):
            monkeypatch.setenv(*word.split("=", 1))
    assert main(mt3d_argv(line)[1]) == 0, capsys.readouterr().err
