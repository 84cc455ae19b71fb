"""Training features: sequence parallelism, recompute, ZeRO-2/3, precisions, launchers, outputs."""

import copy
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mt3d.checkpoint.manager import complete_checkpoints
from mt3d.config import ConfigError, fp16_supported, from_dict, resolve_model, validate
from mt3d.model.blocks import BuildContext, TransformerBlock
from mt3d.model.config import ModelConfig
from mt3d.model.pipeline import LossFn, StackedModel, default_stage_blocks, layer_specs, stage_bounds
from mt3d.parallel.spawn import free_port, spawn
from mt3d.parallel.state import AxisGroup

from helpers import TINY_GPT, TINY_LLAMA, step_records, tiny_config, train_rc_worker, train_worker

ROOT = Path(__file__).resolve().parents[1]


def train(tmp_path, name, world, **kw):
    raw = tiny_config(tmp_path / name, **kw)
    return step_records(spawn(train_worker, world, raw, timeout=300)[0])


def assert_same(got, ref, rtol=1e-5, keys=("loss", "grad_norm")):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        for k in keys:
            assert abs(a[k] - b[k]) <= rtol * abs(b[k]), f"step {a['step']} {k}: {a[k]} vs {b[k]}"


@pytest.fixture(scope="module")
def reference(reference_runs):
    """Single-process fp32 runs of both architectures (shared: tests/conftest.py)."""
    return reference_runs


def test_sequence_parallel_inside_the_pipeline(tmp_path, reference):
    got = train(tmp_path, "sp", 4, model=TINY_GPT, tp=2, pp=2)  # warm path without SP first
    assert_same(got, reference["gpt"])
    raw_sp = dict(TINY_GPT)
    got = step_records(
        spawn(
            train_worker,
            8,
            _with(
                tiny_config(tmp_path / "sp2", model=raw_sp, tp=2, pp=2), "parallel", sequence_parallel=True
            ),
            timeout=300,
        )[0]
    )
    assert_same(got, reference["gpt"])
    got = step_records(
        spawn(
            train_worker,
            2,
            _with(tiny_config(tmp_path / "sp3", model=TINY_LLAMA, tp=2), "parallel", sequence_parallel=True),
            timeout=300,
        )[0]
    )
    assert_same(got, reference["llama"])


def _with(raw, section, **values):
    raw["mt3d"][section].update(values)
    return raw


def test_recompute_on_every_stage_gives_the_same_training(tmp_path, reference):
    raw = tiny_config(tmp_path / "rc", model=TINY_GPT, tp=2, pp=2, recompute={"interval": 1})
    assert_same(step_records(spawn(train_worker, 4, raw, timeout=300)[0]), reference["gpt"])
    raw = tiny_config(
        tmp_path / "rcp",
        model=TINY_LLAMA,
        tp=2,
        pp=2,
        recompute={"interval": 2, "partition_activations": True},
    )
    assert_same(step_records(spawn(train_worker, 8, raw, timeout=300)[0]), reference["llama"])


def test_recompute_reruns_blocks_in_backward():
    cfg = ModelConfig(**{k: v for k, v in TINY_GPT.items() if k != "preset"}, vocab_size=100)
    calls = {"n": 0}
    for interval, expected in ((0, 4), (1, 8), (3, 8)):
        ctx = BuildContext(tp=AxisGroup.alone("tp"))
        model = StackedModel(
            layer_specs(cfg, ctx, 100), loss_fn=LossFn(ctx.tp, 100), recompute_interval=interval
        )
        for m in model.modules():
            if isinstance(m, TransformerBlock):
                m.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
        calls["n"] = 0
        ids = torch.randint(0, 100, (2, 16))
        model(ids, ids).backward()
        assert calls["n"] == expected, (interval, calls["n"])


def test_stage_partitioning():
    assert default_stage_blocks(105, 35) == [3] * 35
    assert default_stage_blocks(10, 4) == [2, 3, 3, 2]  # the remainder goes to middle stages first
    assert default_stage_blocks(7, 2) == [3, 4]
    assert stage_bounds([2, 3]) == [0, 4, 9]  # embedding+positions on stage 0, norm+head on the last


@pytest.mark.parametrize("zero,world", [(0, 2), (0, 4), (2, 4), (3, 4)])
def test_other_zero_stages_at_pipeline_1(tmp_path, reference, zero, world):
    got = train(tmp_path, f"z{zero}", world, model=TINY_GPT, tp=2, zero=zero)
    assert_same(got, reference["gpt"])


def test_bf16(tmp_path, reference):
    raw = tiny_config(tmp_path / "bf16", model=TINY_GPT, tp=2, pp=2, steps=8)
    raw["bf16"] = {"enabled": True}
    got = step_records(spawn(train_worker, 8, raw, timeout=300)[0])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got)
    assert got[-1]["loss"] < got[0]["loss"]
    assert abs(got[0]["loss"] - reference["gpt"][0]["loss"]) < 2e-2 * reference["gpt"][0]["loss"]


def fp16_worker(raw):
    return train_worker(raw)


@pytest.mark.skipif(
    not fp16_supported(), reason="fp16 needs a GPU or a CPU with oneDNN fp16 (checked on GPU runs)"
)
def test_fp16_skips_overflow_steps(tmp_path):
    raw = tiny_config(tmp_path / "fp16", model=TINY_GPT, steps=12)
    raw["fp16"] = {"enabled": True, "initial_scale_power": 26, "hysteresis": 1, "loss_scale_window": 1000}
    got = step_records(spawn(fp16_worker, 1, raw, timeout=300)[0])
    # 2^26 overflows at first: those steps are skipped (and counted) while the scale halves each time
    assert 1 <= got[-1]["skipped"] < len(got)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got)


def test_fp16_is_refused_where_unsupported(tmp_path):
    raw = tiny_config(tmp_path / "x")
    raw["fp16"] = {"enabled": True}
    run = from_dict(raw)
    if fp16_supported():
        validate(run, 1, resolve_model(run.mt3d.model))
    else:
        with pytest.raises(ConfigError, match="fp16 is not supported on this device"):
            validate(run, 1, resolve_model(run.mt3d.model))


def wandb_history_keys(run_dir: Path) -> dict:
    """Keys logged to an offline W&B run and how often (reads the .wandb record log)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    keys: dict = {}
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                for item in rec.history.item:
                    k = item.key or "/".join(item.nested_key)
                    keys[k] = keys.get(k, 0) + 1
    return keys


def launcher_env():
    """The environment of a launcher started from a test (no rank variables of the test's own)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_deepspeed_launcher_run_writes_metrics_checkpoint_and_wandb(tmp_path):
    raw = tiny_config(
        tmp_path / "run", tp=2, pp=2, steps=12, save_interval=6, save_at_end=True, eval_batches=1
    )
    raw["wandb"] = {"enabled": True, "project": "mt3d-test"}
    raw["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(raw))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            "4",
            "--master_port",
            str(free_port()),
            "--module",
            "mt3d.train",
            "--config",
            str(cfg),
            "--set",
            "mt3d.train.eval_interval=6",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=launcher_env(),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # a quiet terminal: DeepSpeed's set-up lines and its scheduler warning (once per rank) are not on it
    terminal = out.stdout + out.stderr
    assert "Attempting to get learning rate" not in terminal and "Using topology" not in terminal
    run = tmp_path / "run"
    assert "Using topology" in (run / "logs" / "rank0.log").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "skipped"} <= set(
            r
        )
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert [r["step"] for r in evals] == [6, 12]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000006", "step_00000012"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000012"
    keys = wandb_history_keys(run)
    # mt3d logs every figure itself; DeepSpeed's own monitor is off (metrics.WandbSink)
    assert (
        keys.get("mt3d/loss") == 12 and keys.get("mt3d/lr") == 12 and "Train/Samples/train_loss" not in keys
    )
    assert keys.get("mt3d/eval_loss") == 2
    assert "step" in out.stdout and "eval loss" in out.stdout


def test_two_simulated_nodes_match_one_node(tmp_path):
    """torchrun --nnodes 2 on loopback (2 ranks each) trains like one 4-rank run."""
    single = train(tmp_path, "one", 4, tp=2, pp=2)
    raw = tiny_config(tmp_path / "two", tp=2, pp=2)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(raw))
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "mt3d.train",
                "--config",
                str(cfg),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=launcher_env(),
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    two = [r for r in two if "loss" in r]
    assert [r["loss"] for r in two] == [r["loss"] for r in single]
    assert [r["grad_norm"] for r in two] == [r["grad_norm"] for r in single]
    info = json.loads((tmp_path / "two" / "run.json").read_text())
    assert info["layout"]["world"] == 4


def test_sigterm_under_the_deepspeed_launcher_with_wandb_saves(tmp_path):
    """SIGTERM to the runner alone: it exits at once while the workers train on (DeepSpeed 0.19.8
    forwards signals only for multi-node runs; README says so, and this notices if that changes).
    SIGTERM to the whole process group: the launcher also kills W&B's helper, yet every worker
    saves its preemption checkpoint and exits 75."""
    import signal

    raw = tiny_config(tmp_path / "run", tp=2, pp=2, steps=400, save_at_end=False)
    raw["wandb"] = {"enabled": True, "project": "mt3d-test"}
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(raw))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port",
           str(free_port()), "--module", "mt3d.train", "--config", str(cfg)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launcher_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    try:
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # the runner's own PID
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGTERM
        time.sleep(2)
        os.killpg(proc.pid, 0)  # the launcher and its workers are still there
        steps_before = metrics.read_text().count("\n")
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as a scheduler or Ctrl-C does
        while time.time() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = proc.stdout.read()
    done = complete_checkpoints(tmp_path / "run" / "checkpoints")
    assert len(done) == 1, out[-3000:]
    assert int(done[0].name.split("_")[1]) >= steps_before >= 3
    log = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("rank*.log"))
    assert "Traceback" not in log


def test_accelerate_launch_trains_like_the_other_launchers(tmp_path):
    """launch/accelerate_ds.yaml starts the demo layout (tp 2 x pp 2 x dp 2 on 8 CPU ranks) with the
    losses and gradient norms of the same config under mt3d's spawn harness (torchrun's environment)."""
    raw = tiny_config(tmp_path / "acc", tp=2, pp=2, steps=3, global_batch=16)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(raw))
    cmd = ["accelerate", "launch", "--config_file", str(ROOT / "launch" / "accelerate_ds.yaml"),
           "--main_process_port", str(free_port()), "-m", "mt3d.train", "--config", str(cfg)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    got = [json.loads(line) for line in (tmp_path / "acc" / "metrics.jsonl").read_text().splitlines()]
    raw["mt3d"]["train"]["save_dir"] = str(tmp_path / "spawn")
    want = step_records(spawn(train_worker, 8, raw, timeout=300)[0])
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(got)] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in want
    ]


OVERLAP = {"grad_reduce": True, "bucket_elements": 3000}  # several buckets per stage of the tiny model


@pytest.mark.parametrize(
    "world,parallel,train_keys",
    [
        (8, dict(tensor=2, pipeline=2, sequence_parallel=True),
         {"recompute": {"granularity": "selective"}, "overlap": OVERLAP}),
        (8, dict(tensor=2, pipeline=2, sequence_parallel=True), {"recompute": {"gathered_sp_inputs": True}}),
        (4, dict(tensor=2, pipeline=2, virtual_stages=2, sequence_parallel=True),
         {"recompute": {"granularity": "selective"}, "overlap": {"p2p": True}}),
        (4, dict(pipeline=2, virtual_stages=2), {"overlap": {**OVERLAP, "p2p": True}}),
    ],
    ids=["selective-overlap-2-2-2-sp", "gathered-sp-inputs-2-2-2", "selective-p2p-2-2-1-v2-sp",
         "overlap-1-2-2-v2"],
)  # fmt: skip
def test_selective_recompute_sp_inputs_and_overlap_train_like_one_process(
    tmp_path, reference, world, parallel, train_keys
):
    """Selective recompute (attention core and MLP activation again in the backward), both ways of
    keeping a column-parallel linear's SP input (its 1/tp shard, the default, or all of it), and the
    data-parallel gradient reduction overlapped with the last micro-batch's backward (ZeRO-1, with
    and without virtual stages) and pipeline transfers posted ahead (at (2, 2, 1) x 2 virtual stages
    with SP, and at (1, 2, 2) x 2) give the single-process losses and grad norms."""
    raw = tiny_config(tmp_path / "run", model=TINY_LLAMA, **train_keys)
    raw["mt3d"]["parallel"].update(parallel)
    assert_same(step_records(spawn(train_worker, world, raw, timeout=300)[0]), reference["llama"])


@pytest.mark.parametrize(
    "world,zero,precision,ep",
    [(2, 0, "fp32", 1), (4, 1, "bf16", 1), (4, 1, "fp32", 2), (4, 1, "fp32", 4)],
    ids=["zero0-fp32-dp2", "bf16-optimizer-pp2-dp2", "ep2-dp2-zero1", "folded-tp2-ep4-etp1-zero1"],
)
def test_overlapped_grad_reduce_is_deepspeeds_reduction_to_the_bit(tmp_path, world, zero, precision, ep):
    """At dp 2 the overlapped reduction sums and scales as DeepSpeed's own (plain DP's all-reduce; the
    BF16 optimizer's fp32 gradients, which DeepSpeed picks for bf16 with fp32 gradient accumulation,
    with its immediate updates; under expert parallelism ZeRO-1's dense gradients over dp x cp and
    experts' over the dp / ep ranks holding them; folded, tp 2 x dp 2 with whole experts at ep 4, the
    dense ones over dp and the experts' over edp 1): the same losses and norms, bit for bit. At pp 2
    the second run also posts its pipeline transfers ahead (mt3d's schedule engine at v 1, a commit
    after each pass) against DeepSpeed's own 1F1B engine."""
    runs = []
    for overlap in (False, True):
        keys = {**OVERLAP, "grad_reduce": overlap, "p2p": overlap and world > 2 and ep == 1}
        model = TINY_LLAMA if ep == 1 else {"preset": "tiny-mixtral"}
        folded = ep * 2 > world  # ep over tp x dp
        pp = 1 if folded else world // 2 // ep
        raw = tiny_config(tmp_path / f"o{overlap}", model=model, zero=zero, tp=2 if folded else 1, pp=pp,
                          overlap=keys)  # fmt: skip
        raw["mt3d"]["parallel"].update(expert=ep, **({"expert_tensor": 1} if folded else {}))
        if precision == "bf16":
            raw["bf16"] = {"enabled": True}
            raw["data_types"] = {"grad_accum_dtype": "fp32"}
        records = step_records(spawn(train_worker, world, raw, timeout=300)[0])
        runs.append([(r["loss"], r["grad_norm"]) for r in records])
    if ep == 1 or ep * 2 > world:  # folded: dense gradients over dp 2, the experts' over edp 1
        assert runs[0] == runs[1]
    else:  # dense gradients summed over 4 ranks: an all-reduce's order, not ZeRO's reduce to each owner
        assert runs[0] != runs[1] and torch.allclose(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-6)


def test_selective_recompute_keeps_less_for_the_backward():
    """What one block keeps for its backward (saved tensors, parameters and input excluded): selective
    recompute drops the MLP activation's output and the attention core's internals (by at least the
    half of the MLP's inner activations the planner counts), and the recompute gives the same gradients."""
    from mt3d.planner.costs import mt3d_layer_bytes

    cfg = resolve_model({"preset": "tiny-llama"})

    def run(selective):
        torch.manual_seed(0)
        block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), selective=selective), 0)
        x = torch.randn(2, 64, cfg.hidden, requires_grad=True)
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x)
        y.square().sum().backward()
        skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
        grads = [x.grad, *(p.grad for p in block.parameters())]
        return sum(v for k, v in kept.items() if k not in skip), grads

    (full, g_full), (sel, g_sel) = run(False), run(True)
    predicted = mt3d_layer_bytes(cfg, 64, 2, 1, False, False, 4) - mt3d_layer_bytes(
        cfg, 64, 2, 1, False, False, 4, selective=True
    )
    assert full - sel >= predicted > 0, (full, sel, predicted)
    for a, b in zip(g_full, g_sel, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "recompute,match",
    [
        ({"granularity": "some"}, "granularity must be full or selective, got 'some'"),
        ({"granularity": "selective", "interval": 1}, "selective recomputes parts of every block"),
    ],
)
def test_bad_recompute_settings_are_one_line(tmp_path, recompute, match):
    run = from_dict(tiny_config(tmp_path, model=TINY_LLAMA, recompute=recompute))
    with pytest.raises(ConfigError, match=match) as info:
        validate(run, 1, resolve_model(run.mt3d.model))
    assert "\n" not in str(info.value)


def test_bf16_optimizer_states_hold_half_the_bytes_the_planner_says_and_train(tmp_path):
    """mt3d.train.optimizer_states 'bf16' (dp 2): DeepSpeed keeps master weights and moments in bf16,
    6 bytes per parameter / dp at ZeRO-1 as the planner sizes them (12 with fp32 states; ZeRO-3's
    moments 4), and the runs train like the fp32-state one (bf16 rounding of the update apart).
    DeepSpeed's BF16 optimizer runs at ZeRO-0 (mt3d's model is a PipelineModule) and, with fp32
    gradient accumulation (the planner's --grad-dtype fp32), at ZeRO-1: 12 bytes / dp of states beside
    a whole gradient buffer in the accumulation dtype, and the bf16 gradients left allocated unless the
    overlapped reduction folds each in as it is produced, as the planner sizes them."""
    from mt3d.planner.costs import Layout, Precision, bf16_optimizer_gradient_bytes, runs_bf16_optimizer

    from helpers import optimizer_states_worker

    runs = {  # (optimizer states, ZeRO stage, gradient dtype, overlapped reduction)
        ("fp32", 1, "param", False), ("bf16", 1, "param", False), ("bf16", 3, "param", False),
        ("fp32", 0, "param", False), ("fp32", 1, "fp32", False), ("fp32", 1, "fp32", True),
    }  # fmt: skip
    got = {}
    for states, zero, grads, overlap in sorted(runs):
        keys = {**OVERLAP, "grad_reduce": overlap}
        raw = tiny_config(tmp_path / f"{states}{zero}{grads}{overlap}", model=TINY_LLAMA, zero=zero,
                          optimizer_states=states, overlap=keys)  # fmt: skip
        raw["bf16"] = {"enabled": True}
        if grads == "fp32":
            raw["data_types"] = {"grad_accum_dtype": "fp32"}
        got[states, zero, grads, overlap] = spawn(optimizer_states_worker, 2, raw, timeout=300)
    for (states, zero, grads, overlap), ranks in got.items():
        prec = Precision.of("bf16", zero, states, grads)
        bf16_optimizer = runs_bf16_optimizer(Layout(1, 1, 2, 2, 2, zero, False, False), prec, True)
        for r in ranks:
            held = r["moment_bytes"] + (r["master_bytes"] if zero < 3 else prec.master * r["params"] / 2)
            assert held == pytest.approx((prec.master + prec.optim) * r["params"] / 2, rel=0.01), (states, r)
            zero_optimizer = "DeepSpeedZeroOptimizer" + ("_Stage3" if zero == 3 else "")
            assert r["optimizer"] == ("BF16_Optimizer" if bf16_optimizer else zero_optimizer), r
            if bf16_optimizer:
                planned = bf16_optimizer_gradient_bytes(prec, overlap) * r["params"]
                assert r["grad_buffer_bytes"] + r["lp_grad_bytes"] == pytest.approx(planned, rel=0.01), r
                assert (r["lp_grad_bytes"] > 0) != overlap, r
        assert ranks[0]["dtypes"] == ["torch.float32" if states == "fp32" else "torch.bfloat16"]
    fp32 = got["fp32", 1, "param", False][0]["losses"]
    for key in runs - {("fp32", 1, "param", False)}:
        other = got[key][0]["losses"]
        assert other[-1] < other[0]  # (ZeRO-3's regular engine reports rank 0's loss, not the dp mean)
        assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(fp32, other)), (key, fp32, other)


@pytest.mark.parametrize(
    "change,world,match",
    [
        (
            {"zero": 2},
            2,
            "ZeRO-2's reduction overlaps the backward already when zero_optimization.overlap_comm",
        ),
        ({"offload": True}, 2, "not supported with optimizer offload"),
        ({"fp16": True}, 2, "not supported with fp16"),
        ({"ep": 2, "zero": 0}, 2, "not supported with expert parallelism without ZeRO"),
        ({"bucket_elements": 0}, 1, "bucket_elements must be >= 1, got 0"),
        ({"states": "bf16"}, 1, "optimizer_states 'bf16' needs bf16 training"),
        ({"states": "bf16-moments"}, 1, "'bf16-moments' .* is not something DeepSpeed runs"),
        ({"states": "bf16", "bf16": True, "zero": 0}, 1, "'bf16' needs ZeRO 1-3"),
        ({"ds_master": True, "bf16": True}, 1, "are set by mt3d.train.optimizer_states 'bf16'"),
        ({"p2p": True}, 2, "overlap.p2p overlaps pipeline transfers: it needs pipeline >= 2"),
        (
            {"grad_accum": "fp32", "bf16": True, "zero": 0},
            1,
            "grad_accum_dtype fp32 beside bf16 weights needs ZeRO",
        ),
        ({"grad_accum": "FP32", "bf16": True}, 1, "'FP32' is not a dtype DeepSpeed knows"),
        (
            {"moe": True, "pp": 2},
            2,
            "grad_reduce is not supported with a mixture-of-experts model at pipeline 2",
        ),
        (
            {"p2p": True, "pp": 2, "batch": 6},
            2,
            r"needs micro-batches per step \(3 = gradient_accumulation_steps",
        ),
    ],
    ids=[
        "zero2",
        "offload",
        "fp16",
        "ep-zero0",
        "bucket",
        "states-fp32-run",
        "states-moments",
        "states-zero0",
        "states-by-hand",
        "p2p-pp1",
        "fp32-grads-zero0",
        "grads-dtype-spelling",
        "moe-pp2",
        "p2p-micro-batches",
    ],
)
def test_overlap_and_optimizer_state_settings_it_cannot_run_are_one_line(tmp_path, change, world, match):
    reduce = not {"states", "ds_master", "p2p", "grad_accum"} & set(change)
    overlap = {"grad_reduce": reduce, "p2p": change.get("p2p", False),
               "bucket_elements": change.get("bucket_elements", 100)}  # fmt: skip
    raw = tiny_config(tmp_path, model=TINY_LLAMA, zero=change.get("zero", 1), overlap=overlap,
                      pp=change.get("pp", 1), optimizer_states=change.get("states", "fp32"),
                      global_batch=change.get("batch", 8))  # fmt: skip
    if change.get("bf16"):
        raw["bf16"] = {"enabled": True}
    if change.get("ds_master"):
        raw["bf16"]["bf16_master_weights_and_grads"] = True
    if change.get("offload"):
        raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if change.get("grad_accum"):
        raw["data_types"] = {"grad_accum_dtype": change["grad_accum"]}
    if change.get("fp16"):
        raw["fp16"] = {"enabled": True}
    if change.get("ep") or change.get("moe"):
        raw["mt3d"]["model"] = {"preset": "tiny-mixtral"}
        raw["mt3d"]["parallel"]["expert"] = 2 if change.get("ep") else 1
    run = from_dict(raw)
    with pytest.raises(ConfigError, match=match) as info:
        validate(run, world, resolve_model(run.mt3d.model))
    assert "\n" not in str(info.value)


def released_logits_worker(virtual_stages: int, deepspeeds: bool = False) -> dict:
    """Two steps at pp 2 (a tiny GPT, 4 micro-batches) recording, as each backward of the loss's chunk
    starts, whether the forward's output (the logits) is still held; ``deepspeeds`` (v 1): with
    DeepSpeed's own forward pass back in the instance's instruction table."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    from mt3d.bench.common import bench_run_config, build_engine, train_step
    from mt3d.ds.engine import keep_loss_outputs
    from mt3d.ds.instructions import wrap_instructions

    raw = bench_run_config(model=TINY_GPT, pp=2, global_batch=8, micro=2, seq_len=32, vocab=128)
    raw["mt3d"]["parallel"]["virtual_stages"] = virtual_stages
    _, layout, rt, engine, data, _ = build_engine(raw)
    if deepspeeds:
        keep_loss_outputs(engine)
    held = []

    def wrap(kind, backward):
        def record(self, buffer_id, **chunk):  # the interleaved engine's passes name their chunk
            loss_chunk = chunk.get("chunk", virtual_stages - 1) == virtual_stages - 1
            if self.stage_id == self.num_stages - 1 and loss_chunk:
                held.append(self.pipe_buffers["outputs"][buffer_id] is not None)
            return backward(self, buffer_id, **chunk)

        return record if kind is ds_schedule.BackwardPass else backward

    wrap_instructions(engine, wrap)
    losses = [train_step(engine, layout, rt, data, 2, k) for k in range(2)]
    module = engine.module  # Mt3dPipeline.train skips what is in its mode already, restores the rest
    module.eval()
    next(m for m in module.modules() if m is not module).train()
    module.train()
    restored = all(m.training for m in module.modules())
    module.eval()
    return {"stage": rt.state.pp.rank, "held": held, "losses": losses, "restored": restored,
            "evaluating": not any(m.training for m in module.modules())}  # fmt: skip


@pytest.mark.parametrize("virtual_stages", [1, 2])
def test_the_last_stage_releases_its_logits_once_the_loss_holds_them(virtual_stages):
    """DeepSpeed's pipeline engine keeps every forward's output until its backward frees it, but the
    last stage's backward returns early: the logits of its last two micro-batches stay alive (537 MB
    of a 2.1 GB peak at 4096 tokens x 16384 vocabulary, docs/benchmarks.md). mt3d drops them once the
    loss is computed (ds.engine.release_loss_outputs; mt3d's schedule engine likewise, which held them
    until the backward had run): no backward of the loss's chunk starts with them held, while with
    DeepSpeed's own forward pass every one does (this fails when upstream frees them itself), with
    the same losses. Also: DeepSpeed's engine puts the module in training mode at every
    ``train_batch``, which ``Mt3dPipeline.train`` skips when every module is there already; a module
    left in another mode is still switched."""
    import inspect

    from deepspeed.runtime.pipe.engine import PipelineEngine

    backward = inspect.getsource(PipelineEngine._exec_backward_pass)
    assert "if self.is_last_stage():\n            super().backward(self.loss)\n            return" in backward
    assert "self.module.train()" in inspect.getsource(PipelineEngine.train_batch)
    variants = (False, True) if virtual_stages == 1 else (False,)
    runs = [spawn(released_logits_worker, 2, virtual_stages, ds, timeout=300) for ds in variants]
    for ranks, held in zip(runs, variants, strict=True):
        first, last = sorted(ranks, key=lambda r: r["stage"])
        assert first["held"] == [] and last["held"] == [held] * 8, (first, last)
        assert all(r["restored"] and r["evaluating"] for r in ranks)
    assert all([r["losses"] for r in run] == [r["losses"] for r in runs[0]] for run in runs)


def alone_worker(raw, lean):
    """Rank 0's step records of ``raw`` at one data rank, with mt3d's reduction skip or DeepSpeed's own
    reduction (``lean`` False), and how many times DeepSpeed asked for a bucket's reduction."""
    import mt3d.ds.engine as door

    calls = []
    if lean:
        door._no_reduction = lambda *a, **k: calls.append(1)
        norm = door._grad_norm
        door._grad_norm = lambda *a: calls.append(0) or norm(*a)
    else:
        door.alone_in_zero = lambda *a, **k: False
    rc, records = train_rc_worker(raw)
    assert rc == 0
    return [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(records or [])], calls


@pytest.mark.parametrize("pp", [1, 2])
def test_one_data_rank_skips_deepspeeds_reduction_with_the_same_step(tmp_path, pp):
    """ZeRO-1 at dp 1 (the regular engine, and the pipeline engine at pp 2): DeepSpeed still asks to
    reduce each bucket of gradients and for the gradient norm through the methods
    ``mt3d.ds.engine.skip_reduction`` replaces (the upstream watch), and the run's losses and gradient
    norms are bit for bit DeepSpeed's own (non-finite steps: tests/test_checkpoint.py's NaN test runs
    at dp 1)."""
    from mt3d.ds.engine import alone_in_zero, deepspeed_config

    raw = tiny_config(tmp_path / "a", pp=pp, steps=3)
    run = from_dict(copy.deepcopy(raw))
    layout = validate(run, pp, resolve_model(run.mt3d.model))
    assert alone_in_zero(layout)
    config = deepspeed_config(run.deepspeed, layout, sequence_parallel=False, on_cpu=True)
    assert config["zero_optimization"]["contiguous_gradients"] is False
    lean = spawn(alone_worker, pp, raw, True, timeout=300)[0]
    stock = spawn(alone_worker, pp, tiny_config(tmp_path / "b", pp=pp, steps=3), False, timeout=300)[0]
    assert lean[1].count(1) >= 3 and lean[1].count(0) >= 3, lean  # a bucket and a norm per step at least
    assert lean[0] == stock[0], (lean, stock)
