"""Faults and bad input from the second hardening campaign: a save_dir is owned by one run at a time,
NVMe swap indexes are checked against the manifest, a full disk while a file is closed is one line,
resumes notice another tokenizer or corpus, and the campaign's weak inputs are one line each."""

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mt3d.checkpoint.manifest import CheckpointError
from mt3d.parallel.spawn import WorkerError, spawn

from helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "ds_configs" / "cpu_demo_3d.json")


def _claim_worker(save_dir, overwrite):
    import torch.distributed as dist

    from mt3d.checkpoint.manager import claim_save_dir

    claim_save_dir(save_dir, dist.get_rank(), overwrite)
    return sorted(p.name for p in Path(save_dir).iterdir())


def test_one_run_owns_a_save_dir_and_overwrite_keeps_the_old_one(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with open(tmp_path / "run" / ".mt3d-run.lock", "a") as held:  # another run is going on
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(WorkerError, match="is in use by another run"):
            spawn(_claim_worker, 2, str(run), False, timeout=60)
    names = spawn(_claim_worker, 2, str(run), True, timeout=60)[0]
    assert names == [".mt3d-run.lock", "replaced"]  # the old run moved aside, not deleted
    assert (run / "replaced" / "0" / "checkpoints" / "step_00000002").is_dir()
    assert (run / "replaced" / "0" / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_fresh_run_in_a_used_save_dir_is_refused(tmp_path):
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    raw = tiny_config(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    run = from_dict(raw)
    with pytest.raises(ConfigError, match="holds another run \\(metrics.jsonl\\): continue it with"):
        validate(run, 1, resolve_model(run.mt3d.model))

    def with_train(key, value):
        return from_dict({**raw, "mt3d": {**raw["mt3d"], "train": {**raw["mt3d"]["train"], key: value}}})

    validate(with_train("overwrite", True), 1, resolve_model(run.mt3d.model))
    # resume auto finds no checkpoint to continue: it would start afresh into the old metrics
    with pytest.raises(ConfigError, match="but no complete checkpoint to resume"):
        validate(with_train("resume", "auto"), 1, resolve_model(run.mt3d.model))


def test_an_nvme_index_is_checked_against_the_manifest(tmp_path):
    from mt3d.ds.nvme import read_index

    ckpt = tmp_path / "step_00000001"
    swap = "offloaded_tensors/rank00/7.tensor.swp"
    (ckpt / "offloaded_tensors" / "rank00").mkdir(parents=True)
    for name in (swap, swap.replace("7.", "exp_avg-7."), swap.replace("7.", "exp_avg_sq-7.")):
        (ckpt / name).write_bytes(b"\0" * 400)
    files = {n: {} for n in (swap, swap.replace("7.", "exp_avg-7."), swap.replace("7.", "exp_avg_sq-7."))}

    def index(**group):
        (ckpt / "i.json").write_text(json.dumps({"sub_groups": [{"numel": 100, "state_index": 0, **group}]}))
        return read_index(ckpt, "i.json", files)

    assert index(swap=swap)[0]["numel"] == 100
    with pytest.raises(CheckpointError, match="lists '../../../../secret/secret.bin', which the .* manifest"):
        index(swap="../../../../secret/secret.bin")
    with pytest.raises(CheckpointError, match="holds 1000 fp32 elements but it has 400 bytes"):
        index(swap=swap, numel=1000)
    with pytest.raises(CheckpointError, match="not an mt3d NVMe swap index"):
        index(swap=swap, numel="100")


def test_resuming_with_another_tokenizer_is_refused(tmp_path):
    from mt3d.checkpoint.resume import _check_data

    ckpt, mine = tmp_path / "step_00000003", tmp_path / "tok"
    (ckpt / "tokenizer").mkdir(parents=True)
    mine.mkdir()
    (ckpt / "tokenizer" / "tokenizer.json").write_text('{"model": "a"}')
    (mine / "tokenizer.json").write_text('{"model": "a"}')
    _check_data(ckpt, {"step": 3}, {"tokenizer_dir": str(mine)})
    (mine / "tokenizer.json").write_text('{"model": "b"}')
    with pytest.raises(CheckpointError, match="trained with another tokenizer .* mt3d.data.tokenizer="):
        _check_data(ckpt, {"step": 3}, {"tokenizer_dir": str(mine)})


def test_rotation_removes_what_was_derived_from_a_checkpoint(tmp_path):
    from mt3d.checkpoint.manager import rotate
    from mt3d.checkpoint.manifest import describe_files, write_manifest

    for step in (1, 2):
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / "w.pt").write_bytes(b"x")
        write_manifest(d, describe_files(d, ["w.pt"]), {"step": step})
        for kind in ("universal", "converted"):
            (tmp_path / kind / d.name).mkdir(parents=True)
    assert [p.name for p in rotate(tmp_path, 1)] == ["step_00000001"]
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == ["step_00000002"]
    assert sorted(p.name for p in (tmp_path / "universal").iterdir()) == ["step_00000002"]


def test_a_full_disk_while_a_checkpoint_is_written_is_one_line_and_wandb_stays_quiet(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        raw = tiny_config(disk / "run", steps=4, save_interval=2)
        raw["wandb"] = {"enabled": True, "project": "mt3d-test"}
        raw["mt3d"]["data"]["cache_dir"] = str(tmp_path / "cache")
        cfg = tmp_path / "c.json"
        cfg.write_text(json.dumps(raw))
        env = {**os.environ, "MT3D_FAULTS": "fill_disk@4:0", "WANDB_MODE": "offline"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        out = subprocess.run([sys.executable, "-m", "mt3d.train", "--config", str(cfg)], capture_output=True,
                             text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
        assert out.returncode == 2, out.stderr[-3000:]
        lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith("[mt3d] ")]  # logs
        assert len(lines) == 1 and "saving step_00000004 failed: no space left on" in lines[0], out.stderr[
            -3000:
        ]
        assert "Traceback" not in out.stderr and "W&B" not in out.stderr and "wandb" not in out.stderr.lower()
        ckpts = disk / "run" / "checkpoints"
        assert [p.name for p in ckpts.iterdir() if p.name.startswith("step_")] == ["step_00000002"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def _main(argv, env=None, monkeypatch=None):
    from mt3d.cli import main

    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return main(argv)


def _train(*sets, check=True):
    argv = ["train", "--config", DEMO, "--set", "mt3d.parallel.tensor=1", "--set", "mt3d.parallel.pipeline=1"]
    for s in sets:
        argv += ["--set", s]
    return argv + (["--check"] if check else [])


CASES = [
    ("zero stage true", _train("zero_optimization.stage=true"), {}, "zero_optimization.stage must be 0, 1, 2 or 3, got true"),
    ("global_every > layers", _train('mt3d.model={"preset": "tiny", "attention": {"window": 4, "global_every": 9}}'), {},
     "global_every 9 is larger than the 4 layers"),
    ("stray WORLD_SIZE", _train(check=False), {"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
    ("RANK outside", _train(check=False), {"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 is outside WORLD_SIZE=2"),
    ("MASTER_PORT abc", _train(check=False), {"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not a TCP port"),
    ("MASTER_PORT 99999", _train(check=False), {"MASTER_PORT": "99999"}, "MASTER_PORT='99999' is not a TCP port"),
    ("accelerate zero stage", _train(), {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
     "the accelerate config sets zero_stage: 3 but the run config has zero_optimization.stage 1"),
    ("accelerate offload", _train(), {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
     "sets offload_optimizer_device: cpu but the run config has zero_optimization.offload_optimizer.device none"),
    ("plan --efficiency 1e-300", ["plan", "--model", "llama-7b", "--gpus", "8", "--efficiency", "1e-300"], {},
     "--efficiency is a fraction of peak in [0.01, 1]"),
    ("plan --gemm-tflops > peak", ["plan", "--model", "llama-7b", "--gpus", "8", "--gemm-tflops", "5000"], {},
     "--gemm-tflops 5000 exceeds the device's dense peak 989"),
    ("plan --write-config read-only", ["plan", "--model", "llama-7b", "--gpus", "8", "--write-config", "/proc/x.json"],
     {}, "--write-config /proc/x.json: its directory /proc is not writable"),
    ("plan seq past a learned table", ["plan", "--model", "gpt2-small", "--gpus", "8", "--seq-len", "2048",
                                       "--context", "2"], {}, "--seq-len 2048 exceeds the model's 1024 learned"),
    ("plan --data 3", ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--data", "3"], {},
     "--data 3 does not divide --gpus 8"),
    ("plan --write-config bad vocab", ["plan", "--model", "tiny", "--gpus", "8", "--vocab", "100", "--write-config",
                                       "{tmp}/w.json"], {}, "mt3d train would refuse the best layout's config: "
                                       "mt3d.data.vocab_size must be > 256"),
    ("topo --ep on a dense model", ["topo", "--world-size", "8", "--ep", "2", "--model", "gpt3-1.3b"], {},
     "--model gpt3-1.3b: a model without experts cannot use expert parallelism"),
    ("topo --ep above the experts", ["topo", "--world-size", "16", "--ep", "16", "--model", "tiny-mixtral"], {},
     "model.moe.experts = 4 is not divisible by parallel.expert 16"),
    ("resume auto over superseded only", _train("mt3d.train.resume=auto"), {"{superseded}": "1"},
     "holds another run (checkpoints and metrics.jsonl) but no complete checkpoint to resume"),
    ("topo island past the host", ["topo", "--world-size", "8", "--tp", "2", "--islands", "0,9"], {},
     "islands name local rank 9, but no host has more than 8 ranks"),
    ("topo binary hostfile", ["topo", "--hostfile", "{bin}", "--tp", "2"], {}, "is not UTF-8 text"),
    ("topo binary nvidia-smi", ["topo", "--world-size", "8", "--nvidia-smi-topo", "{bin}"], {}, "is not UTF-8 text"),
]  # fmt: skip


@pytest.mark.parametrize("argv, env, expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_weak_inputs_are_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch, argv, env, expect):
    env = dict(env)
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)) * 4)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    argv = [a.replace("{bin}", str(binary)).replace("{tmp}", str(tmp_path)) for a in argv]
    argv = [a if not a.startswith("mt3d.train.save_dir") else a for a in argv]
    if argv[0] == "train":
        argv += ["--set", f"mt3d.train.save_dir={tmp_path / 'run'}"]
    if env.pop("{superseded}", None):  # an abandoned history: metrics and superseded checkpoints only
        (tmp_path / "run" / "checkpoints" / "superseded" / "step_00000004-0").mkdir(parents=True)
        (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    assert _main(argv, env, monkeypatch) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


def test_an_infeasible_plan_names_the_batch_when_the_batch_is_the_blocker(capsys):
    from mt3d.cli import main

    argv = ["plan", "--model", "llama-7b", "--gpus", "1048576", "--gpus-per-node", "8"]
    assert main([*argv, "--context", "1"]) == 1  # infeasible without context parallelism
    out = capsys.readouterr().out
    assert "the global batch 512 cannot be split over the data parallelism" in out and "(dp >= 4096)" in out
    assert "try context parallelism (--context)" in out
    assert main(argv) == 0  # cp takes the GPUs dp cannot use
    best = capsys.readouterr().out.split("share\n", 1)[1].split()
    assert int(best[1]) > 1, best[:6]  # the cp column of the best row


def test_plans_honour_pins_write_runnable_configs_and_name_the_binding_rule(tmp_path, capsys, monkeypatch):
    """--data pins dp; a written config passes ``mt3d train --check`` on the planned cluster (cp 2 and
    the plan's vocabulary included); the infeasibility headline names the binding rule, not a size; no
    explained component is negative."""
    from mt3d.cli import main

    base = ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--json"]
    assert main([*base, "--data", "2"]) == 0
    rows = json.loads(capsys.readouterr().out)["feasible"]
    assert rows and {r["dp"] for r in rows} == {2}
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--gpus", "8", "--vocab", "1000", "--context", "2", "--seq-len", "64",
            "--write-config", str(out)]  # fmt: skip
    assert main(argv) == 0
    written = json.loads(out.read_text())
    assert written["mt3d"]["data"]["vocab_size"] == 1000 and written["mt3d"]["parallel"]["context"] == 2
    written["mt3d"]["train"]["save_dir"] = str(tmp_path / "run")
    out.write_text(json.dumps(written))
    capsys.readouterr()
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["train", "--config", str(out), "--check"]) == 0
    monkeypatch.delenv("WORLD_SIZE")
    argv = ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--offload", "opt-cpu", "--host-memory-gb", "1"]
    assert main([*argv, "--zero", "1,2"]) == 1
    headline = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("no feasible"))
    assert "overflow an offload tier: offload needs" in headline and "CPU memory" in headline, headline
    argv = ["plan", "--model", "gpt2-small", "--gpus", "8", "--other-stack", "--overlap", "tp-comm,dp,pp",
            "--tensor", "2", "--zero", "3", "--recompute", "full", "--micro-batch", "1", "--explain"]  # fmt: skip
    assert main(argv) == 0
    explained = capsys.readouterr().out.split("time:", 1)[-1]
    assert " -" not in explained.replace(" - ", ""), explained


def test_generation_past_the_position_limit_is_refused(tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    from mt3d.cli import main
    from mt3d.data.tokenizer import train_bpe

    tok = train_bpe(["the quick brown fox jumps over the lazy dog"] * 40, 300, tmp_path / "hf")
    GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=8, vocab_size=tok.vocab_size,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "hf")  # fmt: skip
    capsys.readouterr()
    argv = ["generate", "--model", str(tmp_path / "hf"), "--prompt", "the quick"]
    assert main([*argv, "--max-new-tokens", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceed the model's 8 positions: use --max-new-tokens <=" in err[0], err
    room = int(err[0].rsplit("<= ", 1)[1].split()[0])
    assert main([*argv, "--max-new-tokens", str(room)]) == 0
    assert main(["generate", "--model", str(tmp_path / "hf"), "--prompt", "the", "--temperature", "nan"]) == 2


def test_checkpoint_info_shows_every_axis_of_the_layout():
    """``mt3d checkpoint info`` names cp, ep and virtual stages where a checkpoint's layout has them."""
    from mt3d.checkpoint.info import format_rows

    row = {"tag": "step_00000003", "status": "complete", "bytes": 1e9, "step": 3, "model": "tiny-mixtral",
           "params": 2e6, "precision": "fp32",
           "layout": {"tp": 1, "cp": 2, "ep": 2, "dp": 2, "pp": 2, "virtual_stages": 2, "zero_stage": 1}}  # fmt: skip
    line = format_rows([row])
    assert "tp 1 cp 2 ep 2 dp 2 pp 2 v 2 zero 1" in line, line
