"""Bad input from the fault campaign: each one line on stderr naming the key, file or flag, exit 2,
before anything expensive (no process group, no weights)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mt3d.data.tokenizer import train_bpe

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "ds_configs" / "cpu_demo_3d.json")
W8 = {"WORLD_SIZE": "8"}  # the demo config's layout needs 8 ranks


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny GPT-2 HF directory with 8 positions, broken copies of it, and broken run files."""
    from transformers import GPT2Config, GPT2LMHeadModel

    base = tmp_path_factory.mktemp("bad")
    tok = train_bpe(["the quick brown fox jumps over the lazy dog"] * 40, 300, base / "hf")
    GPT2LMHeadModel(
        GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=tok.vocab_size)
    ).save_pretrained(base / "hf")
    cfg = json.loads((base / "hf" / "config.json").read_text())
    for name, text in (
        ("garbled", "{not json"),
        ("no_embd", json.dumps({k: v for k, v in cfg.items() if k != "n_embd"})),
    ):
        (base / name).mkdir()
        (base / name / "config.json").write_text(text)
    (base / "binary.txt").write_bytes(bytes(range(256)) * 4)
    run = base / "run"
    run.mkdir()
    (run / "run.json").write_text('{"config": ')
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    garbage = base / "garbage"
    garbage.mkdir()
    (garbage / "metrics.jsonl").write_text("\x00\x01 not json\n" + '{"step": 1, "loss": 2.0}\n')
    (base / "a-file").write_text("x")
    return base


def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def train(*sets, check=True):
    """``mt3d train`` of the demo config with ``--set`` overrides."""
    argv = ["train", "--config", DEMO]
    for x in sets:
        argv += ["--set", x]
    return argv + (["--check"] if check else [])


def ev(model, text="{base}/binary.txt"):
    """``mt3d eval`` of ``model`` on ``text``."""
    return ["eval", "--model", model, "--text", text, "--seq-len", "4"]


LAUNCHED = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "{port}",
}
ONE = ("mt3d.parallel.tensor=1", "mt3d.parallel.pipeline=1", "mt3d.train.save_dir={base}/busy")
CASES = [
    ("fp16=true", train("fp16=true"), W8, "'fp16' must be a JSON object"),
    ("bf16=yes", train("bf16=yes"), W8, "'bf16' must be a JSON object"),
    ("bf16.enabled=yes", train("bf16.enabled=yes"), W8, "'bf16.enabled' must be true or false"),
    ("optimizer=adam", train("optimizer=adam"), W8, "'optimizer' must be a JSON object"),
    ("offload as a string", train("zero_optimization.offload_optimizer=cpu"), W8,
     "zero_optimization.offload_optimizer must be a JSON object"),
    ("WORLD_SIZE=abc", train(), {"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ("save_dir not writable", train("mt3d.train.save_dir=/proc/mt3d-run"), W8,
     "mt3d.train.save_dir /proc/mt3d-run is not writable"),
    ("save_dir is a file", train("mt3d.train.save_dir={base}/a-file"), W8, "a-file exists and is not a directory"),
    ("HF config.json invalid", ev("{base}/garbled"), {}, "config.json is not valid JSON"),
    ("HF config.json without n_embd", ev("{base}/no_embd"), {}, "config.json has no 'n_embd'"),
    ("binary text to eval", ev("{base}/hf"), {}, "binary.txt is not UTF-8 text (invalid byte 0x80 at offset 128)"),
    ("prompt past the positions", ["generate", "--model", "{base}/hf", "--prompt", "the quick brown fox " * 4], {},
     "exceed the model's 8 positions: shorten the prompt"),
    ("corrupt run.json", ["summary", "{base}/run"], {}, "run.json:1:12: invalid JSON"),
    ("garbage metrics.jsonl", ["plot", "{base}/garbage"], {}, "metrics.jsonl:1: not a JSON record"),
    ("export --max-shard-size lots", ["export-hf", "--checkpoint", "{base}/run", "--out", "{base}/x",
     "--max-shard-size", "lots"], {}, "argument --max-shard-size: expected a size like 5GB"),
    ("plan --top -3", ["plan", "--model", "tiny", "--gpus", "8", "--top", "-3"], {}, "argument --top: must be >= 1"),
    ("plan --gpus 1e12", ["plan", "--model", "tiny", "--gpus", "1000000000000"], {},
     "argument --gpus: 1000000000000 exceeds mt3d's limit of 1048576 ranks"),
    ("topo --world-size 0", ["topo", "--world-size", "0"], {}, "argument --world-size: must be >= 1, got 0"),
    ("busy MASTER_PORT", train(*ONE, check=False), LAUNCHED, "MASTER_PORT {port} on 127.0.0.1 is already in use"),
]  # fmt: skip


@pytest.mark.parametrize("argv, env, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_code_2(files, argv, env, expect):
    port = busy_port()
    fill = {"base": files, "port": port.getsockname()[1]}
    argv = [a.format(**fill) for a in argv]
    env = {k: v.format(**fill) for k, v in env.items()}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "mt3d", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT,
            env={**os.environ, **env},
        )  # fmt: skip
    finally:
        port.close()
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and expect.format(**fill) in lines[0], out.stderr[-2000:]


def test_a_damaged_checkpoint_is_reported_not_skipped_silently(tmp_path, caplog):
    from mt3d.checkpoint.manager import complete_checkpoints
    from mt3d.checkpoint.manifest import describe_files, write_manifest

    for step in (1, 2):
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / "weights.pt").write_bytes(b"x" * 100)
        write_manifest(d, describe_files(d, ["weights.pt"]), {"step": step})
    (tmp_path / "step_00000003").mkdir()  # an interrupted save: no manifest, no report
    (tmp_path / "step_00000002" / "weights.pt").write_bytes(b"x" * 50)
    with caplog.at_level("ERROR", logger="mt3d"):
        assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000001"]
    assert len(caplog.records) == 1 and "skipping damaged checkpoint step_00000002" in caplog.text
