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


def readme_block(title: str) -> list[str]:
    """The shell lines of the first ```bash block after the README heading that starts with ``title``."""
    text = (ROOT / "README.md").read_text().split(f"\n## {title}", 1)[1]
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_fine_tuning_path_prepares_its_data_and_config(tmp_path):
    """The README's fine-tuning commands as written, on a fresh directory, up to the training: a tiny
    chat Llama, the chat corpus, its preprocessing and ``data show``, and the preference pairs and
    theirs; then ``ds_configs/sft_llama.json``, ``dpo_llama.json`` (from the chat Llama in place of the
    SFT run's export) and ``lora_llama.json`` pass ``train --check`` at the world their deepspeed lines
    launch (4), reading what they made."""
    import os
    import subprocess
    import sys

    for d in ("launch", "ds_configs"):
        (tmp_path / d).symlink_to(ROOT / d)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    lines = readme_block("Fine-tuning")
    train = next(i for i, line in enumerate(lines) if line.startswith("deepspeed"))
    pairs = [line for line in lines[train:] if "preference" in line and line.split()[0] in ("python", "mt3d")]
    assert len(pairs) == 2  # the demo's preference pairs and their preprocessing
    for line in lines[:train] + pairs:
        out = subprocess.run(
            line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"`{line}`: {out.stderr[-2000:]}"
        if line.startswith("mt3d data show"):
            assert "⟦" in out.stdout  # data show marks what is trained on
    trainings = [line for line in lines if line.startswith("deepspeed")]
    assert len(trainings) == 3  # the full fine-tune, DPO after it and the LoRA one
    for line in trainings:
        world = re.search(r"--num_gpus (\d+)", line).group(1)
        after_sft = ["--set", "mt3d.model.from_hf=hf/tiny-llama-chat"] if "dpo" in line else []
        out = subprocess.run(
            [sys.executable, "-m", "mt3d", *mt3d_argv(line)[1], *after_sft, "--check"], cwd=tmp_path,
            env={**env, "WORLD_SIZE": world}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        ok = f"config OK: world {world} = tp 2 x pp 2"
        assert out.returncode == 0 and ok in out.stdout, out.stdout + out.stderr[-2000:]
