"""Checkpoints: exact resume, reshard to any layout, crash/kill/preemption safety, NaN steps, safe loading."""

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mt3d.checkpoint.manager import complete_checkpoints, rotate
from mt3d.checkpoint.manifest import CheckpointError, describe_files, write_manifest
from mt3d.config import from_dict, resolve_model, validate
from mt3d.parallel.spawn import WorkerError, free_port, spawn

from helpers import (
    TINY_EVERY,
    TINY_GPT,
    TINY_LLAMA,
    run_all,
    step_records,
    tiny_config,
    train_rc_worker,
    train_worker,
)

ROOT = Path(__file__).resolve().parents[1]
DROPOUT_GPT = {**TINY_GPT, "hidden_dropout": 0.1, "attention_dropout": 0.1}


def run(raw, world, timeout=300):
    return spawn(train_worker, world, raw, timeout=timeout)[0]


def losses(records):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(records)]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-states-overlap"])  # overlap: grad reduce, p2p
def test_resume_is_exact(tmp_path, precision):
    """10 steps straight vs 5 + resume + 5 at tp 2 x pp 2 x dp 2, with dropout on: identical, also
    when the resumed run nests its ranks in another order (random state follows coordinates). With bf16
    master weights and moments, the overlapped gradient reduction and pipeline transfers posted ahead
    (mt3d's schedule engine at v = 1): at pp 2 x dp 2."""
    tp, world = (1, 4) if precision == "bf16-states-overlap" else (2, 8)

    def config(d, steps, **kw):
        raw = tiny_config(d, model=DROPOUT_GPT, tp=tp, pp=2, steps=steps, save_at_end=True, **kw)
        raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 8}}  # resumes mid-warm-up
        if precision != "fp32":
            raw["bf16"] = {"enabled": True}
        if precision == "bf16-states-overlap":
            overlap = {"grad_reduce": True, "p2p": True, "bucket_elements": 3000}
            raw["mt3d"]["train"].update(optimizer_states="bf16", overlap=overlap)
        return raw

    again = config(tmp_path / "b", 10, resume="auto")
    again["mt3d"]["parallel"]["order"] = "tp-pp-dp"
    straight, _, resumed = run_all(world, [config(tmp_path / "a", 10), config(tmp_path / "b", 5), again])
    straight, resumed = losses(straight), losses(resumed)[5:]  # metrics.jsonl is appended to
    assert [s for s, _, _ in resumed] == list(range(6, 11))
    assert resumed == straight[5:]  # bit-identical losses and grad norms


# every degree of every axis at least once, each axis grown and shrunk from the saved (2, 2, 2)
LAYOUTS = [(1, 1, 8), (1, 4, 2), (4, 2, 1), (2, 1, 4), (4, 1, 2), (1, 2, 4), (2, 4, 1)]


def test_reshard_to_every_layout(tmp_path):
    """A (2,2,2) GPT run checkpointed at step 3 and continued to step 6 (the reference) resumes from
    step 3 at every other layout of 8 ranks (in the same spawn) and on one process, to 1e-5."""
    src = tmp_path / "src" / "checkpoints" / "step_00000003"

    def config(tp, pp, dp):
        return tiny_config(tmp_path / f"to_{tp}{pp}{dp}", tp=tp, pp=pp, steps=6, resume=str(src),
                           micro=1 if dp == 8 else 2)  # fmt: skip

    saved = tiny_config(tmp_path / "src", tp=2, pp=2, steps=6, save_interval=3)
    reference, *got = run_all(8, [saved, *(config(*layout) for layout in LAYOUTS)])
    got.append(run(config(1, 1, 1), 1))
    reference = losses(reference)[3:]
    for layout, records in zip([*LAYOUTS, (1, 1, 1)], got, strict=True):
        assert [s for s, _, _ in losses(records)] == [4, 5, 6]
        for (_, a, ga), (_, b, gb) in zip(losses(records), reference):
            assert abs(a - b) <= 1e-5 * abs(b) and abs(ga - gb) <= 1e-5 * abs(gb), (layout, reference)
    assert (src.parent / "universal" / src.name / "manifest.json").is_file()  # converted once, reused


# the model section of a manifest written before ModelConfig had family and block options
LEGACY_MODEL_KEYS = (
    "hidden", "layers", "heads", "vocab_size", "kv_heads", "ffn", "head_dim", "max_seq_len", "position",
    "norm", "mlp", "bias", "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "hidden_dropout",
    "attention_dropout", "init_std", "name", "extra",
)  # fmt: skip


def make_legacy(checkpoint):
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["meta"]["model"] = {k: manifest["meta"]["model"][k] for k in LEGACY_MODEL_KEYS}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("model", ["llama-gqa", "every-option"])
def test_reshard_other_models(tmp_path, model):
    """GQA Llama from a checkpoint written before the family field existed; and a model with every
    block option (each kind of parameter's universal-checkpoint pattern is derived, not written)."""
    spec = TINY_LLAMA if model == "llama-gqa" else TINY_EVERY
    src = tmp_path / "src"
    ref = losses(run(tiny_config(src, model=spec, tp=2, pp=2, steps=6, save_interval=3), 4))[3:]
    step3 = src / "checkpoints" / "step_00000003"
    if model == "llama-gqa":
        make_legacy(step3)
        from mt3d.checkpoint.loading import open_source

        assert open_source(step3).cfg.family == "llama"

    def check(got):
        assert [s for s, _, _ in got] == [4, 5, 6]
        for (_, a, ga), (_, b, gb) in zip(got, ref):
            assert abs(a - b) <= 1e-5 * abs(b) and abs(ga - gb) <= 1e-5 * abs(gb), (got, ref)

    layouts = ((1, 1, 1), (4, 1, 2), (1, 4, 1)) if model == "llama-gqa" else ((1, 1, 1), (2, 1, 2))
    for tp, pp, dp in layouts:
        raw = tiny_config(tmp_path / f"to{tp}{pp}{dp}", model=spec, tp=tp, pp=pp, steps=6, resume=str(step3))
        check(losses(run(raw, tp * pp * dp)))
    if model == "llama-gqa":
        # A corrupted conversion cache (same size, one byte flipped) is detected and converted again.
        cache = src / "checkpoints" / "universal" / "step_00000003"
        victim = max((p for p in cache.rglob("*.pt")), key=lambda p: p.stat().st_size)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        check(losses(run(tiny_config(tmp_path / "again", model=spec, steps=6, resume=str(step3)), 1)))


def test_resuming_an_older_step_moves_the_abandoned_history_aside(tmp_path):
    """Resume from step 2 of a run saved at 2, 4, 6: saving step 4 again moves the old 4 and 6 to
    checkpoints/superseded/ (nothing deleted) so that `resume: auto` continues the new history."""
    d = tmp_path / "run"
    run(tiny_config(d, steps=6, save_interval=2), 1)
    ckpts = d / "checkpoints"
    old4 = json.loads((ckpts / "step_00000004" / "manifest.json").read_text())
    raw = tiny_config(d, steps=4, save_interval=2, resume=str(ckpts / "step_00000002"))
    raw["optimizer"]["params"]["lr"] *= 3  # a different history from step 3 on
    run(raw, 1)
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step_00000002", "step_00000004"]
    assert sorted(p.name for p in (ckpts / "superseded").iterdir()) == ["step_00000004-0", "step_00000006-0"]
    assert json.loads((ckpts / "superseded" / "step_00000004-0" / "manifest.json").read_text()) == old4
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    records = run(tiny_config(d, steps=5, resume="auto", save_at_end=True), 1)
    assert [r["step"] for r in step_records(records)][-1:] == [5]
    meta = json.loads((ckpts / "step_00000005" / "manifest.json").read_text())["meta"]
    assert meta["step"] == 5 and not (ckpts / "superseded" / "step_00000006-1").exists()


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    straight = losses(run(tiny_config(tmp_path / "ref", tp=2, pp=2, steps=9), 4))
    raw = tiny_config(tmp_path / "run", tp=2, pp=2, steps=9, save_interval=3)
    with pytest.raises(WorkerError, match="exited with code -9"):
        spawn(train_worker, 4, raw, timeout=120, env={"MT3D_FAULTS": "kill_in_save@6:1"})
    ckpts = tmp_path / "run" / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step_00000003"]
    assert (ckpts / "step_00000006.tmp").is_dir()  # the interrupted write, never committed
    assert (ckpts / "latest").read_text().strip() == "step_00000003"
    info = subprocess.run(
        [sys.executable, "-m", "mt3d", "checkpoint", "info", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    statuses = [json.loads(line)["status"] for line in info.stdout.splitlines()]
    assert statuses == ["complete", "incomplete"]
    raw["mt3d"]["train"]["resume"] = "auto"
    resumed = losses(run(raw, 4))[-6:]
    assert resumed == straight[3:]  # steps 4..9 as if nothing had happened
    assert [p.name for p in complete_checkpoints(ckpts)] == [
        "step_00000003",
        "step_00000006",
        "step_00000009",
    ]


def test_sigterm_saves_and_exits_with_the_documented_code(tmp_path):
    from mt3d.training.session import EXIT_PREEMPTED

    straight = losses(run(tiny_config(tmp_path / "ref", tp=2, pp=2, steps=8), 4))
    raw = tiny_config(tmp_path / "run", tp=2, pp=2, steps=8)
    results = spawn(train_rc_worker, 4, raw, timeout=120, env={"MT3D_FAULTS": "sigterm@3:2"})
    assert [rc for rc, _ in results] == [EXIT_PREEMPTED] * 4
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000003"]
    raw["mt3d"]["train"]["resume"] = "auto"
    assert losses(run(raw, 4))[-5:] == straight[3:]


def test_sigterm_through_torchrun(tmp_path):
    """A real signal to the launcher: workers checkpoint at the next step and exit 75."""
    raw = tiny_config(tmp_path / "run", tp=2, steps=400)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(raw))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = ["torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += ["-m", "mt3d.train", "--config", str(cfg)]
    proc = subprocess.Popen(
        [sys.executable, "-m", *cmd],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert "exitcode  : 75" in out or "exit code 75" in out.lower() or proc.returncode != 0, out[-2000:]
    done = complete_checkpoints(tmp_path / "run" / "checkpoints")
    assert len(done) == 1, out[-3000:]
    step = int(done[0].name.split("_")[1])
    assert 3 <= step < 400 and "stop requested (signal)" in out


def test_nan_steps_are_skipped_everywhere_and_a_streak_stops_the_run(tmp_path):
    from mt3d.training.session import EXIT_DIVERGED

    results = spawn(
        train_rc_worker,
        4,
        tiny_config(tmp_path / "one", tp=2, pp=2, steps=6),
        env={"MT3D_FAULTS": "nan_grad@3:3"},
    )
    assert [rc for rc, _ in results] == [0] * 4
    records = step_records(results[0][1])
    by_step = {r["step"]: r for r in records}
    assert by_step[3]["skipped"] == 1 and by_step[3]["bad_streak"] == 1 and by_step[3]["grad_norm"] is None
    assert by_step[4]["bad_streak"] == 0 and by_step[6]["skipped"] == 1
    assert all(r["loss"] is not None for r in records)
    raw = tiny_config(tmp_path / "streak", tp=2, pp=2, steps=20, max_bad_steps=3)
    results = spawn(train_rc_worker, 4, raw, env={"MT3D_FAULTS": "nan_grad@2-20:0"})
    assert [rc for rc, _ in results] == [EXIT_DIVERGED] * 4
    records = step_records(results[0][1])
    assert records[-1]["step"] == 4 and records[-1]["bad_streak"] == 3
    assert [p.name for p in complete_checkpoints(tmp_path / "streak" / "checkpoints")] == ["step_00000004"]


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/mt3d-pwned-marker"


def _tamper(ckpt: Path, name: str, payload: bytes) -> None:
    """Replace a file and re-sign the manifest, as an attacker with write access would."""
    (ckpt / name).write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = describe_files(ckpt, sorted(manifest["files"]))
    write_manifest(ckpt, files, manifest["meta"])


def test_malicious_pickle_is_refused(tmp_path):
    run(tiny_config(tmp_path / "run", steps=2, save_at_end=True), 1)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    target = "mp_rank_00_model_states.pt"
    import torch

    evil = tmp_path / "evil.pt"
    torch.save({"module": Evil()}, evil)
    _tamper(ckpt, target, evil.read_bytes())
    Path(MARKER).unlink(missing_ok=True)
    raw = tiny_config(tmp_path / "run", steps=4, resume="auto")
    results = spawn(train_rc_worker, 1, raw)
    assert results[0][0] == 2
    assert not Path(MARKER).exists()
    from mt3d.ds.safe import safe_torch_load

    with pytest.raises(
        CheckpointError, match=f"{target} contains a pickled object outside mt3d's allow-list"
    ):
        safe_torch_load(ckpt / target)
    _tamper(ckpt, "layer_00-model_00-model_states.pt", evil.read_bytes())  # a file export-hf reads
    out = subprocess.run(
        [sys.executable, "-m", "mt3d", "export-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "layer_00-model_00-model_states.pt contains a pickled object" in out.stderr
    assert not Path(MARKER).exists() and not (tmp_path / "hf").exists()


def test_bit_flip_and_truncation_are_detected(tmp_path):
    run(tiny_config(tmp_path / "run", tp=2, pp=2, steps=4, save_interval=2), 4)
    ckpts = tmp_path / "run" / "checkpoints"
    newest = ckpts / "step_00000004"
    victim = newest / "layer_03-model_01-model_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    raw = tiny_config(tmp_path / "run", tp=2, pp=2, steps=6, resume=str(newest))
    explicit = spawn(train_rc_worker, 4, raw)
    assert [rc for rc, _ in explicit] == [2] * 4  # an explicitly named checkpoint must verify
    from mt3d.checkpoint.reader import CheckpointReader

    with pytest.raises(CheckpointError, match="layer_03-model_01-model_states.pt is corrupted"):
        CheckpointReader(newest)
    # auto resume reports the corrupt checkpoint and continues from the previous one
    raw = tiny_config(tmp_path / "run", tp=2, pp=2, steps=6, resume="auto", save_interval=2)
    results = spawn(train_rc_worker, 4, raw)
    assert [rc for rc, _ in results] == [0] * 4
    assert [r["step"] for r in step_records(results[0][1])][-4:] == [3, 4, 5, 6]  # re-ran from step 2
    CheckpointReader(newest)  # rewritten by the resumed run: verifies again
    short = ckpts / "step_00000006" / "mp_rank_00_model_states.pt"
    short.write_bytes(short.read_bytes()[:-10])
    assert [p.name for p in complete_checkpoints(ckpts)][-1] == "step_00000004"


def test_rotation_never_deletes_the_only_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "x.pt").write_bytes(b"x" * step)
        write_manifest(d, describe_files(d, ["x.pt"]), {"step": step})
    (root / "step_00000004").mkdir()  # a save that never finished
    assert [p.name for p in rotate(root, 1)] == ["step_00000001", "step_00000002"]
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000003"]
    assert rotate(root, 1) == [] and rotate(root, 0) == []


def test_deepspeed_workarounds_are_still_needed():
    """If one of these fails, DeepSpeed changed: re-check the workaround named in the message."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine

    src = inspect.getsource(TorchCheckpointEngine.load)
    assert "weights_only=False" in src, "DeepSpeed loads safely now: mt3d.ds.safe may be simplified"
    save = inspect.getsource(DeepSpeedEngine.save_checkpoint)
    assert "_create_checkpoint_file" in save or "latest" in save, "re-check mt3d's own 'latest' handling"


def test_deepspeed_fused_adam_builder_still_breaks_on_arch_suffixes(monkeypatch):
    """mt3d defaults Adam/AdamW to torch's implementation because of this; see training/engine.py."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        FusedAdamBuilder().compute_capability_args()
    from mt3d.ds.engine import deepspeed_config

    run = from_dict(tiny_config("/tmp/x"))
    layout = validate(run, 1, resolve_model(run.mt3d.model))
    ds = deepspeed_config(run.deepspeed, layout, sequence_parallel=False, on_cpu=False)
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True


def test_nan_steps_are_skipped_without_zero_too(tmp_path):
    """fp32 without ZeRO: DeepSpeed would apply NaN gradients; mt3d's guard skips the step."""
    raw = tiny_config(tmp_path / "z0", tp=2, steps=4, zero=0)
    results = spawn(train_rc_worker, 2, raw, env={"MT3D_FAULTS": "nan_grad@2:1"})
    assert [rc for rc, _ in results] == [0, 0]
    records = step_records(results[0][1])
    assert [r["skipped"] for r in records] == [0, 1, 1, 1] and records[1]["grad_norm"] is None
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in records if r["step"] != 2)
    assert records[-1]["loss"] < records[0]["loss"] * 1.01  # the weights were not poisoned


def test_resume_refuses_another_model_and_warns_on_changed_hyperparameters(caplog):
    from mt3d.checkpoint.resume import _check_model

    def model(**change):
        return resolve_model({**TINY_GPT, "vocab_size": 512, **change})

    saved = model()
    meta = {"model": saved.to_dict(), "vocab_size": 512, "global_batch": 8, "seq_len": 32}
    _check_model(Path("step_1"), meta, model())
    for change, expect in (
        ({"vocab_size": 1024}, "vocab_size: checkpoint 512 vs config 1024"),
        ({"max_seq_len": 2 * saved.max_seq_len}, "max_seq_len: checkpoint"),  # learned positions
        ({"kv_heads": 2}, "kv_heads: checkpoint 4 vs config 2"),
    ):
        with pytest.raises(CheckpointError, match=expect):
            _check_model(Path("step_1"), meta, model(**change))
    caplog.set_level("WARNING", logger="mt3d")
    _check_model(
        Path("step_1"), meta, model(norm_eps=1e-6),
        {"global_batch": 16, "seq_len": 32},
    )  # fmt: skip
    text = caplog.text
    assert "norm_eps changed" in text and "global_batch changed: 8 -> 16" in text and "seq_len" not in text


def test_resume_warns_when_the_data_or_its_packing_changed(caplog, tmp_path):
    from mt3d.checkpoint.resume import DATA_FACTS, _check_data

    was = {"corpus": "indexed", "documents": [9], "tokens": [90], "packed": False}
    was["train_samples_per_epoch"] = [3]
    assert set(was) == {"corpus", *DATA_FACTS}
    caplog.set_level("WARNING", logger="mt3d")
    _check_data(tmp_path, {"data": was, "step": 4}, {**was})
    assert "another corpus" not in caplog.text
    _check_data(tmp_path, {"data": was, "step": 4}, {**was, "packed": True, "train_samples_per_epoch": [2]})
    assert "(packed, train_samples_per_epoch changed)" in caplog.text


def _unguarded_resume_worker(raw):
    """Resume without mt3d's reshard guard, to see what DeepSpeed itself does; (exit code, records)."""
    from mt3d.ds import universal

    universal.unsupported_reshard = lambda saved, target: None
    try:
        return train_rc_worker(raw)
    except Exception:  # DeepSpeed's own failure is the point of the exercise
        return 1, None


def test_zero3_checkpoints_export_and_refuse_what_deepspeed_reshards_wrongly(tmp_path):
    """ZeRO-3 keeps weights only in its fp32 partitions: the reader stitches them (export, eval). Every
    reshard of ZeRO-3 states is refused with the way out; the test also runs them past the guard and
    fails when DeepSpeed starts getting them right."""
    import torch

    from mt3d.checkpoint.reader import CheckpointReader
    from mt3d.ds.universal import unsupported_reshard

    z3 = tiny_config(tmp_path / "z3", steps=4, zero=3, save_interval=2)
    z2 = tiny_config(tmp_path / "z2", steps=4, zero=2, save_interval=2)
    ref = losses(run(z3, 2))
    flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
    assert flat(ref) == pytest.approx(flat(losses(run(z2, 2))), rel=1e-5)
    a = CheckpointReader(tmp_path / "z3" / "checkpoints" / "step_00000004")
    b = CheckpointReader(tmp_path / "z2" / "checkpoints" / "step_00000004")
    names = list(b._module(0))
    assert names and sorted(a._module(0)) == sorted(names)
    for name in names:  # atol: Adam turns the float noise of zero-gradient key biases into ~3e-6
        torch.testing.assert_close(a.full(name), b.full(name), rtol=1e-4, atol=1e-5, msg=name)

    src = str(tmp_path / "z3" / "checkpoints" / "step_00000002")
    z2src = str(tmp_path / "z2" / "checkpoints" / "step_00000002")
    refused = [  # (source, world, target layout)
        (src, 1, {"zero": 3}),  # another dp
        (src, 2, {"zero": 3, "tp": 2}),
        (src, 2, {"zero": 1, "pp": 2}),
        (z2src, 2, {"zero": 3}),
    ]
    for i, (source, world, target) in enumerate(refused):
        raw = tiny_config(tmp_path / f"to{i}", steps=4, resume=source, **target)
        assert spawn(train_rc_worker, world, raw)[0][0] == 2, target  # refused up front, bad-input code
        rc, records = spawn(_unguarded_resume_worker, world, raw, timeout=300)[0]
        right = rc == 0 and flat(losses(records)) == pytest.approx(flat(ref[2:]), rel=1e-5)
        assert not right, f"DeepSpeed now resumes {source} at {target}: drop it from unsupported_reshard"
    saved = {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 3}
    assert "tensor=1 and dp=2" in unsupported_reshard(saved, {**saved, "dp": 1})
    assert "stage 1 or 2" in unsupported_reshard({**saved, "zero_stage": 1}, saved)
    assert unsupported_reshard({**saved, "zero_stage": 1}, {**saved, "zero_stage": 2, "dp": 1}) is None


def test_the_reshard_cache_and_a_lying_manifest_are_not_trusted(tmp_path):
    """A pickle planted in the universal-checkpoint cache (its manifest re-signed) is refused like
    one in a step directory, and a manifest claiming another step than the engine state is refused."""
    import torch

    run(tiny_config(tmp_path / "run", steps=2, save_at_end=True), 1)
    step2 = tmp_path / "run" / "checkpoints" / "step_00000002"
    zero2 = tiny_config(tmp_path / "z2", steps=3, zero=2, resume=str(step2))
    run(zero2, 1)  # another ZeRO stage: builds checkpoints/universal/step_00000002
    cache = tmp_path / "run" / "checkpoints" / "universal" / "step_00000002"
    evil = tmp_path / "evil.pt"
    torch.save(Evil(), evil)
    _tamper(cache, "zero/1.pos/fp32.pt", evil.read_bytes())
    Path(MARKER).unlink(missing_ok=True)
    rc, _ = spawn(train_rc_worker, 1, tiny_config(tmp_path / "z2b", steps=3, zero=2, resume=str(step2)))[0]
    assert rc == 2 and not Path(MARKER).exists()
    manifest = json.loads((step2 / "manifest.json").read_text())
    manifest["meta"]["step"] = 100
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    from mt3d.checkpoint.resume import check_engine_state

    with pytest.raises(CheckpointError, match="manifest.json says step 100 but the engine state"):
        check_engine_state(step2, manifest["meta"])
    rc, _ = spawn(train_rc_worker, 1, tiny_config(tmp_path / "again", steps=3, resume=str(step2)))[0]
    assert rc == 2


def test_a_full_disk_during_save_is_named_and_keeps_the_previous_checkpoint(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        raw = tiny_config(disk / "run", steps=6, save_interval=2)
        rc, _ = spawn(train_rc_worker, 1, raw)[0]
        assert rc == 2
        done = complete_checkpoints(disk / "run" / "checkpoints")
        assert done and not list((disk / "run" / "checkpoints").glob("*.tmp"))
        from mt3d.checkpoint.manifest import read_manifest, verify_files

        newest = done[-1]
        verify_files(newest, read_manifest(newest), sorted(read_manifest(newest)["files"]))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
