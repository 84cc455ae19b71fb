"""Planner: closed forms, the MT-NLG plan, impossible requests, the command and its JSON."""

import dataclasses
import json
import re
import subprocess
import sys
from itertools import product

import pytest

from mt3d.config import ConfigError, fp16_supported, load, resolve_model, validate
from mt3d.errors import UserError
from mt3d.planner.costs import (
    Layout,
    Precision,
    in_flight_blocks,
    korthikanti_layer_bytes,
    korthikanti_working_bytes,
    logit_bytes,
    memory_bytes,
    model_state_bytes,
    stage_params,
    step_time,
)
from mt3d.planner.hardware import get_device
from mt3d.planner.output import format_plan, interleaving_note, write_config
from mt3d.planner.search import Cluster, plan
from mt3d.presets import get_preset


def test_zero_paper_worked_example():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64-way data parallelism
    bf16 = [Precision.of("bf16", z) for z in range(4)]
    got = [round(model_state_bytes(7.5e9, 64, z, bf16[z]) / 1e9, 1) for z in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_korthikanti_activation_table():
    # GPT-3 175B layer, s 2048, b 1, h 12288, a 96, t 8: Korthikanti et al. 2022, Table 2 terms
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a, 1, False, False) == sbh * (34 + 5 * a * s / h)  # 114 sbh
    assert korthikanti_layer_bytes(s, b, h, a, t, False, False) == pytest.approx(23 * sbh)  # 10 + 3 + 10
    assert korthikanti_layer_bytes(s, b, h, a, t, True, False) == pytest.approx(114 / 8 * sbh)
    assert korthikanti_layer_bytes(s, b, h, a, t, False, True) == 2 * sbh
    assert korthikanti_layer_bytes(s, b, h, a, t, True, True) == 2 * sbh / t


def test_first_stage_holds_p_micro_batches_in_flight():
    cfg = get_preset("gpt3-175b")
    prec = Precision.of("bf16", 1)
    megatron = dict(activation_model="korthikanti", attention_kernel="materialized")
    one = memory_bytes(cfg, 50257, 2048, Layout(8, 1, 1, 1, 8, 1, False, True), prec, **megatron)
    eight = memory_bytes(cfg, 50257, 2048, Layout(8, 8, 1, 1, 8, 1, False, True), prec, **megatron)
    per_layer = korthikanti_layer_bytes(2048, 1, 12288, 96, 8, True, False)
    recv = 2048 * 12288 * 2 / 8  # DeepSpeed's pipeline engine: one receive buffer of an SP boundary shard
    assert eight["activations"] == pytest.approx(12 * per_layer * 8 + recv)  # 96/8 layers x 8 in flight
    assert one["activations"] > 96 * per_layer  # one micro-batch of all 96 layers, plus the logits
    # a flash kernel keeps no scores: Korthikanti's 5 a s / h term goes (as with selective recompute)
    flash = memory_bytes(cfg, 50257, 2048, Layout(8, 8, 1, 1, 8, 1, False, True), prec,
                         activation_model="korthikanti", attention_kernel="flash")  # fmt: skip
    no_scores = korthikanti_layer_bytes(2048, 1, 12288, 96, 8, True, False, selective=True)
    assert flash["activations"] == pytest.approx(12 * no_scores * 8 + recv)
    # another stack posting its transfers still runs 1F1B at v 1: p in flight, not mt3d's 2p - 1 (and,
    # like mt3d's schedule engine, keeps no receive buffer beyond the transfers in flight)
    lay = Layout(8, 8, 1, 1, 16, 1, False, True)  # 16 micro-batches: mt3d's engine can post them
    posted = dict(megatron, overlap=("pp",))
    other = memory_bytes(cfg, 50257, 2048, lay, prec, **posted, mt3d_engine=False)["activations"]
    assert other == pytest.approx(12 * per_layer * 8)
    mt3d = memory_bytes(cfg, 50257, 2048, lay, prec, **posted)["activations"]
    assert mt3d == pytest.approx(12 * per_layer * 15)


def test_recompute_working_set_and_logits_do_not_add():
    """With full recompute a stage's peak is its checkpoints plus the larger of one block's rebuilt
    activations with their gradients and the loss's logits (beside the final norm's input and output):
    the loss's backward is over (what it kept freed, and the logits released from the pipeline engine)
    before the last block is rebuilt.
    Korthikanti's working set: the block's activations and the largest pair of gradients
    (the softmax's, with materialised scores; else the MLP's)."""
    s, b, h, a = 2048, 4, 20480, 128
    sbh = s * b * h
    scores_grads = 2 * 2 * a * s * s * b  # the softmax's output and input gradients, 16-bit
    assert korthikanti_working_bytes(s, b, h, a, 1, False, True) == sbh * (34 + 5 * a * s / h) + scores_grads
    assert korthikanti_working_bytes(s, b, h, a, 8, True, False) == pytest.approx(sbh * 34 / 8 + 16 * sbh / 8)
    cfg = get_preset("mtnlg-530b")
    prec = Precision.of("fp16", 3)
    for vocab in (51200, 51200 * 64):  # logits smaller, then larger, than the working set
        mem = memory_bytes(cfg, vocab, s, Layout(1, 1, 640, b, 1, 3, True, False), prec,
                           activation_model="korthikanti", attention_kernel="materialized")  # fmt: skip
        logits = s * b * vocab * logit_bytes(1, 2)
        working = korthikanti_working_bytes(s, b, h, a, 1, False, True)
        head = 2 * sbh * 2  # the final norm's input and output, 16-bit
        assert mem["activations"] == pytest.approx(105 * 2 * sbh + max(logits + head, working))
    # PTD-P's 530B ZeRO-3 run at 640 A100s, micro-batch 4 (Narayanan et al. 2021, Table 2) fits 80 GB
    # less the planner's 2 GB reserve; ZeRO-3's reduce bucket is fp16 (5e8 elements: 1 GB)
    assert mem["buckets"] == 1e9
    fits = memory_bytes(cfg, 51200, s, Layout(1, 1, 640, b, 1, 3, True, False), prec,
                        activation_model="korthikanti", attention_kernel="materialized")  # fmt: skip
    assert 70e9 < fits["total"] < 78e9
    # mt3d at ZeRO 0/1 releases the logits DeepSpeed's pipeline engine would keep (ds.engine): its peak
    # is another stack's; its reduce bucket is in the weights' dtype (no fp32 accumulation set)
    bf16, lay = Precision.of("bf16", 1), Layout(1, 1, 640, b, 1, 1, True, False)
    kw = dict(activation_model="korthikanti", attention_kernel="materialized")
    ours, other = (memory_bytes(cfg, 51200, s, lay, bf16, **kw, mt3d_engine=e) for e in (True, False))
    working, logits = korthikanti_working_bytes(s, b, h, a, 1, False, True), s * b * 51200
    assert ours["activations"] == other["activations"]
    assert ours["activations"] == pytest.approx(105 * 2 * sbh + max(logits * logit_bytes(1, 2), working))
    assert ours["buckets"] == other["buckets"] == 5e8 * 2


def _peak_in_flight(steps, forward, backward) -> int:
    live = peak = 0
    for step in steps:
        for op in step:
            live += isinstance(op, forward) - isinstance(op, backward)
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_in_flight_blocks_match_the_schedules_that_run(p):
    """The planner's activation count is the first stage's peak of live forwards in the schedules the
    engines execute: DeepSpeed's TrainSchedule for v = 1, ours (PTD-P) for v > 1 and for posted
    transfers."""
    from deepspeed.runtime.pipe import schedule as ds

    from mt3d.ds.interleaved import deepspeed_schedule

    for m in (p, 2 * p, 3 * p):
        steps = ds.TrainSchedule(micro_batches=m, stages=p, stage_id=0).steps()
        assert in_flight_blocks(1, p, m, 1) == _peak_in_flight(steps, ds.ForwardPass, ds.BackwardPass)
        for v in (2, 4):
            steps = deepspeed_schedule(p, v, m, 0).steps()
            peak = _peak_in_flight(steps, ds.ForwardPass, ds.BackwardPass)  # in chunks of 1/v stage
            assert in_flight_blocks(v, p, m, v) == peak
        # posted transfers run mt3d's schedule at v = 1 too: 2(p - 1) warm-up forwards + 1 (m > p)
        steps = deepspeed_schedule(p, 1, m, 0, split=True).steps()
        peak = _peak_in_flight(steps, ds.ForwardPass, ds.BackwardPass)
        assert in_flight_blocks(1, p, m, 1, schedule_engine=True) == peak == min(2 * p - 1, m)
    # interleaving holds a little more than 1F1B: p + (p - 2)/v stages' worth once m > p
    assert in_flight_blocks(4, 8, 32, 4) / 4 == pytest.approx(8 + 6 / 4 + 1 / 4)


def test_interleaving_divides_the_bubble_and_the_plan_says_so():
    cfg, vocab, seq = get_preset("gpt3-175b"), 50257, 2048
    bw = {"tp": 300.0, "pp": 25.0, "dp": 25.0}
    times = {
        v: step_time(
            cfg,
            vocab,
            seq,
            64,
            Layout(8, 8, 1, 1, 64, 1, False, True, v),
            peak_tflops=312,
            efficiency=0.5,
            bw=bw,
        )  # fmt: skip
        for v in (1, 2, 4)
    }
    assert times[2]["bubble_s"] == pytest.approx(times[1]["bubble_s"] / 2)
    assert times[4]["bubble_s"] == pytest.approx(times[1]["bubble_s"] / 4)
    assert times[4]["pp_comm_s"] == pytest.approx(4 * times[1]["pp_comm_s"])
    result = plan(  # Megatron-style: no ZeRO-3, no offload, so the pipeline is needed
        cfg, Cluster(64, 8, get_device("a100-80gb")), global_batch=64, seq_len=seq, zero_stages=(0, 1),
        offloads=("none",),
    )  # fmt: skip
    vs = {r["virtual_stages"] for r in result["feasible"] if r["pp"] > 1}
    assert vs == {1, 2, 4}
    assert all(r["virtual_stages"] == 1 for r in result["feasible"] if r["pp"] == 1)
    # 96 layers cannot give each of 64 stages x 2 chunks a layer
    assert any(r["pp"] == 64 and r.get("virtual_stages") == 2 for r in result["rejected"])
    note = interleaving_note(result["feasible"])
    # 64 micro-batches over 8 stages: 1F1B idles 7/64 of the time, v = 2 half that for 2x the p2p traffic
    assert result["feasible"][0]["virtual_stages"] > 1
    assert re.match(r"virtual stages: v = \d wins by \d+\.\d% over 1F1B", note)
    assert note in format_plan(result)


def test_a_zero_bubble_schedule_is_planned_pinned_and_written(tmp_path):
    """``mt3d plan --schedule``: every layout with pipeline >= 2 runs the schedule (zbv at its two
    chunks), the bubble is ``zero_bubble.bubble_share``'s (at equal degrees ZB-V < ZB-H1 < 1F1B) at
    1F1B's activation memory, ``--explain`` shows the simulator's replay, and the written config
    validates with the schedule in it."""
    args = ["--model", "llama-1b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100", "--pipeline",
            "4", "--global-batch", "32", "--micro-batch", "1", "--zero", "1", "--offload", "none",
            "--json"]  # fmt: skip
    rows = {}
    for schedule in ("1f1b", "zb-h1", "zbv"):
        out = run_plan(*args, "--schedule", schedule, "--write-config", str(tmp_path / f"{schedule}.json"))
        assert out.returncode == 0, out.stderr
        feasible = json.loads(out.stdout)["feasible"]
        assert {r["schedule"] for r in feasible} == {schedule}
        if schedule == "zbv":
            assert {r["virtual_stages"] for r in feasible} == {2}
        keys = ("tp", "cp", "dp", "recompute", "selective", "sequence_parallel")
        rows[schedule] = {
            (*(r[k] for k in keys), r["virtual_stages"] if schedule == "1f1b" else 1): r for r in feasible
        }
        run = load(tmp_path / f"{schedule}.json")
        layout = validate(run, 16, resolve_model(run.mt3d.model))
        assert layout.schedule == schedule == run.mt3d.parallel.schedule
    same = set(rows["1f1b"]) & set(rows["zb-h1"]) & set(rows["zbv"])
    assert same
    for key in same:
        plain, h1, v = (rows[s][key] for s in ("1f1b", "zb-h1", "zbv"))
        assert v["bubble_s"] < h1["bubble_s"] < plain["bubble_s"]
        assert h1["bubble_s"] == pytest.approx(plain["bubble_s"] / 3)
        assert v["memory_gb"] == pytest.approx(h1["memory_gb"], rel=0.01)  # p micro-batches of its blocks
    text = run_plan(*args[:-1], "--schedule", "zbv", "--explain").stdout
    assert re.search(r"schedule zbv: bubble 0\.031 x compute .*; simulated at equal passes: idle 3\.0%", text)


def test_mtnlg_530b_plan():
    result = plan(
        get_preset("mtnlg-530b"), Cluster(2240, 8, get_device("a100-80gb")), global_batch=1920, seq_len=2048
    )
    assert any(r["tp"] == 8 and r["pp"] == 35 for r in result["feasible"])
    tp16 = [r for r in result["rejected"] if r["tp"] == 16]
    assert tp16 and all("TP groups would cross nodes" in r["reason"] for r in tp16)
    best = result["feasible"][0]
    assert best["tp"] == 8 and 0.3 < best["mfu"] < 0.6
    assert {"tp", "pp", "dp", "micro_batch", "grad_accum", "zero_stage", "recompute", "sequence_parallel",
            "memory_gb", "step_time_s", "tflops_per_gpu", "mfu"} <= set(best)  # fmt: skip


def test_impossible_requests_say_why():
    with pytest.raises(UserError, match="not a whole number of 8-GPU nodes"):
        plan(get_preset("gpt2-small"), Cluster(12, 8, get_device("h100")), global_batch=96, seq_len=1024)
    a100 = get_device("a100-80gb")
    result = plan(get_preset("gpt3-175b"), Cluster(8, 8, a100), global_batch=8, seq_len=2048)
    assert result["feasible"] and all(r["offload"] != "none" for r in result["feasible"])  # ZeRO-Infinity
    small = get_device("a100-80gb", host_memory_gb=512, nvme_gb=0)
    result = plan(get_preset("gpt3-175b"), Cluster(8, 8, small), global_batch=8, seq_len=2048)
    assert result["feasible"] == []
    from mt3d.planner.output import explain_infeasible

    headline = explain_infeasible(result)  # the GPUs hold it offloaded; the hosts' 512 GB do not
    assert "the layouts that fit on the GPUs overflow an offload tier: offload needs" in headline, headline
    assert "GB of CPU memory > 512 GB per node" in headline
    with pytest.raises(UserError, match="unknown GPU type 'v99'"):
        get_device("v99")


def run_plan(*args):
    return subprocess.run(
        [sys.executable, "-m", "mt3d", "plan", *args], capture_output=True, text=True, timeout=120
    )


def test_plan_command_json_and_written_config(tmp_path):
    args = ["--model", "gpt2-small", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100"]
    out = run_plan(
        *args,
        "--global-batch",
        "64",
        "--seq-len",
        "1024",
        "--json",
        "--write-config",
        str(tmp_path / "c.json"),
    )
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["feasible"] and isinstance(res["rejected"], list)
    times = [r["step_time_s"] for r in res["feasible"]]
    assert times == sorted(times)
    run = load(tmp_path / "c.json")
    layout = validate(run, 16, resolve_model(run.mt3d.model))
    best = res["feasible"][0]
    assert (layout.tp, layout.pp, layout.micro_batch) == (best["tp"], best["pp"], best["micro_batch"])
    assert layout.virtual_stages == best["virtual_stages"]
    only = run_plan(*args, "--global-batch", "64", "--seq-len", "1024", "--json", "--virtual-stages", "1")
    assert {r["virtual_stages"] for r in json.loads(only.stdout)["feasible"]} == {1}
    assert run.ds["bf16"]["enabled"] and not run.ds["fp16"]["enabled"]
    bad = run_plan(
        "--model", "gpt3-175b", "--gpus", "8", "--gpu", "a100-80gb", "--global-batch", "8", "--nvme-gb", "0",
        "--host-memory-gb", "512",
    )  # fmt: skip
    assert bad.returncode == 1 and "no feasible layout" in bad.stderr
    for flag, value in (
        ("--global-batch", "-1"),
        ("--efficiency", "2"),
        ("--memory-gb", "0"),
        ("--virtual-stages", "1,0"),
        ("--nvme-gb", "-1"),
        ("--network-gbps", "0"),
    ):
        odd = run_plan("--model", "gpt2-small", "--gpus", "8", flag, value)
        assert odd.returncode == 2 and flag in odd.stderr, (flag, odd.stderr)
    worse = run_plan("--model", "gpt2-smol", "--gpus", "8")
    assert worse.returncode == 2 and "did you mean gpt2-small" in worse.stderr


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_written_config_carries_the_planned_precision(tmp_path, precision):
    cluster = Cluster(8, 8, get_device("h100"))
    model = get_preset("gpt2-small")
    result = plan(model, cluster, global_batch=32, seq_len=1024, precision=precision)
    conf = write_config(result, str(tmp_path / "c.json"), {"preset": "gpt2-small"})
    assert conf["fp16"]["enabled"] == (precision == "fp16") and not conf["bf16"]["enabled"]
    if precision == "fp16":
        assert conf["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    run = load(tmp_path / "c.json")
    if precision == "fp16" and not fp16_supported():
        with pytest.raises(ConfigError, match="fp16 is not supported on this device"):
            validate(run, 8, model)
    else:
        assert validate(run, 8, model).tp == result["feasible"][0]["tp"]


def test_a_million_gpus_are_planned_and_absurd_counts_refused():
    import time

    from mt3d.parallel.topology import uniform_crossing

    t0 = time.perf_counter()
    result = plan(
        get_preset("gpt3-175b"), Cluster(2**20, 8, get_device("h100")), global_batch=2**21, seq_len=2048
    )
    assert result["feasible"] and time.perf_counter() - t0 < 30  # 7 s on a 2-core Xeon; divisors, not a scan
    assert uniform_crossing(2**20, 8, 8, 64) == {"tp": False, "dp": True, "pp": True}
    rejected = plan(
        get_preset("gpt3-175b"), Cluster(1536, 8, get_device("h100")), global_batch=1536, seq_len=2048
    )
    reasons = {r["reason"] for r in rejected["rejected"] if r.get("tp") == 3}
    assert reasons == {"tp 3 does not divide the 8 GPUs of a node: TP groups would cross nodes"}


def test_gemm_model_quantises_tiles_and_waves():
    """One more tile than the SMs hold costs a second wave (halved here by switching to 128 x 128
    tiles: 218 of them in 3 half-size waves); a K too small to hide the operands' traffic is
    memory-bound."""
    from mt3d.planner.compute import Gemm, gemm_seconds

    a100 = get_device("a100-80gb")
    full = gemm_seconds(Gemm(128 * 108, 256, 8192), a100)  # 108 tiles of 128 x 256: one wave
    assert gemm_seconds(Gemm(128 * 109, 256, 8192), a100) == pytest.approx(1.5 * full)
    assert gemm_seconds(Gemm(128 * 108 - 64, 256, 8192), a100) == pytest.approx(full)  # a partial tile
    thin = Gemm(65536, 65536, 8)
    traffic = 2 * (65536 * 8 * 2 + 65536**2) / (a100.hbm_gbps * 1e9 * 0.85)
    assert gemm_seconds(thin, a100) == pytest.approx(traffic)


def test_planner_fidelity_against_published_runs():
    """The fidelity table of README (python -m mt3d.bench planner): every row of PTD-P's Table 1 and
    its PTD-P rows of Table 2 within 10% with the one fitted GEMM fraction, which a refit reproduces."""
    from mt3d.bench.planner import MTNLG_RUNS, PTDP_TABLE1, PTDP_TABLE2, calibrate, predict
    from mt3d.planner.compute import GEMM_FRACTION

    for row in PTDP_TABLE1 + [r for r in PTDP_TABLE2 if "PTD-P" in r[0]]:
        assert abs(predict(row)["error"]) <= 0.10, predict(row)
    for row in PTDP_TABLE2 + MTNLG_RUNS:  # every layout that ran fits (ZeRO-3 530B at 640: 76.5 GB)
        assert predict(row)["rejected_for_memory_gb"] is None, row[0]
    small, large = predict(PTDP_TABLE1[0]), predict(PTDP_TABLE1[-2])
    assert large["predicted"] / small["predicted"] > 1.15  # large models run closer to peak, as published
    assert calibrate() == pytest.approx(GEMM_FRACTION, abs=0.01)


def test_a_two_million_token_sequence_is_planned_with_context_parallelism(tmp_path):
    """Llama-7B at 2M tokens on 64 H100s: nothing fits without cp (the smallest layout needs 152 GB per
    GPU), and the plan answers with a cp layout that fits, its exchange counted on the cp links."""
    from mt3d.planner.output import explain_infeasible

    cfg, cluster = get_preset("llama-7b"), Cluster(64, 8, get_device("h100"))
    without = plan(cfg, cluster, global_batch=8, seq_len=2**21, context=(1,))
    assert not without["feasible"]
    assert re.search(r"the smallest needs 1[45][0-9]\.\d GB per GPU", explain_infeasible(without))
    result = plan(cfg, cluster, global_batch=8, seq_len=2**21)
    best = result["feasible"][0]
    assert best["cp"] > 1 and best["memory_gb"] < 80 and best["cp_comm_s"] > 0
    assert all(r["cp"] > 1 and r["zero_stage"] <= 1 for r in result["feasible"])
    assert {"context parallelism runs inside DeepSpeed's pipeline engine"} <= {
        r["reason"].split(",")[0] for r in result["rejected"] if r.get("zero_stage", 0) >= 2
    }
    assert f"{best['cp']:>3}" in format_plan(result).splitlines()[3][3:8]
    write_config(result, str(tmp_path / "c.json"), {"preset": "llama-7b"})
    layout = validate(load(tmp_path / "c.json"), 64, cfg)  # the written config is a valid cp run
    assert (layout.cp, layout.tp, layout.micro_batch) == (best["cp"], best["tp"], best["micro_batch"])


def test_context_parallel_costs_divide_activations_and_count_each_exchange():
    from mt3d.planner.traffic import cp_bytes, cp_layer_elements

    cfg = get_preset("llama-7b")
    prec = Precision.of("bf16", 1)
    acts = {
        cp: memory_bytes(cfg, 32000, 65536, Layout(1, 1, 8 // cp, 1, 1, 1, True, False, cp=cp), prec)[
            "activations"
        ]
        for cp in (1, 2, 4)
    }
    assert 1.9 < acts[1] / acts[2] < 2.1 and 1.9 < acts[2] / acts[4] < 2.1  # ~1/cp (the logits too)
    # a local layer whose W d - 1 keys fit in a chunk takes the halo: its volume does not grow with s
    local = resolve_model({"preset": "tiny-llama", "attention": {"window": 64}})
    halo = [cp_bytes(local, s, 1, 1, 4, 1, 2, local.layers) for s in (4096, 8192)]
    assert halo[0] == halo[1] == 8 * 0.75 * 63 * local.kv_heads * local.head_dim * 2 * local.layers
    whole = resolve_model({"preset": "tiny-llama"})
    gathered = [cp_bytes(whole, s, 1, 1, 4, 1, 2, whole.layers, exchange="allgather") for s in (4096, 8192)]
    assert gathered[1] == 2 * gathered[0]
    assert cp_layer_elements("alltoall", 4, 1, 64, 8, 2, 8, 0) == 2 * 0.75 * 16 * (16 + 8) * 8  # kv 2 -> 4


def test_a_mixture_of_experts_is_planned_with_all_experts_in_memory_and_k_in_time():
    """Mixtral 8x7B on 64 H100s: every expert's weights and states in memory (46.7B parameters), the
    time of the 2 experts a token visits (12.9B active), no layout MoE training refuses (ZeRO-3)."""
    from mt3d.planner.compute import block_gemms

    cfg, cluster = get_preset("mixtral-8x7b"), Cluster(64, 8, get_device("h100"))
    assert round(cfg.num_params() / 1e9, 1) == 46.7 and round(cfg.active_params() / 1e9, 1) == 12.9
    dense = get_preset("mistral-7b")  # the same attention and width, one MLP of the same size
    assert sum(g.m * g.n * g.k for g in block_gemms(cfg, 1, 1)[2:]) == 2 * sum(
        g.m * g.n * g.k for g in block_gemms(dense, 1, 1)[2:]
    )  # top-2: twice the MLP GEMM work of one expert
    per_token = cfg.flops_per_token(4096, 32000) / 3
    assert 2 * cfg.active_params() < per_token < 2.4 * cfg.active_params()  # plus attention scores
    result = plan(cfg, cluster, global_batch=512, seq_len=4096)
    assert result["feasible"]
    assert all(r["zero_stage"] <= 2 for r in result["feasible"])
    best = result["feasible"][0]
    assert best["ep"] > 1  # 8 experts split over ep ranks inside a node: less memory, a cheap all-to-all
    t, p, ep = best["tp"], best["pp"], best["ep"]
    held = stage_params(cfg, 32000, t, p, ep)
    assert best["memory_gb"] * 1e9 > 0.9 * 4 * held  # bf16 weights and gradients of experts / ep, not 2
    spec = cfg.moe_spec
    blocks = -(-cfg.layers // p)
    left_out = blocks * (spec.experts - spec.experts // ep) * cfg.mlp_params(spec.expert_ffn) / t
    assert abs(stage_params(cfg, 32000, t, p) - held - left_out) <= 1e-6 * held
    assert best["ep_comm_s"] > 0 and Layout(1, 1, 16, 1, 1, 1, False, False, ep=8).data == 2


def test_another_stacks_layout_is_pinned_from_the_command_line_and_explained(capsys):
    """--tensor/--pipeline/--data/--micro-batch/--zero/--offload/--context/--virtual-stages pin one layout;
    --explain prints the components its step time and memory are the sums of."""
    from mt3d.cli import main
    from mt3d.planner.output import MEMORY_PARTS, TIME_PARTS

    argv = ["plan", "--model", "llama-7b", "--gpus", "64", "--gpus-per-node", "8", "--gpu", "h100",
            "--seq-len", "4096", "--tensor", "4", "--pipeline", "2", "--data", "8", "--micro-batch", "1",
            "--zero", "1", "--offload", "none", "--context", "1", "--virtual-stages", "1"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["feasible"]
    got = {
        (r["tp"], r["pp"], r["dp"], r["cp"], r["micro_batch"], r["zero_stage"], r["offload"]) for r in rows
    }
    assert got == {(4, 2, 8, 1, 1, 1, "none")}  # only recompute and SP vary
    assert main([*argv, "--explain"]) == 0
    text = capsys.readouterr().out.split("layout: tp 4 cp 1 ep 1 pp 2 dp 8 v 1", 1)[1]
    time = [float(line.split()[-3]) for line in text.splitlines() if line.strip().endswith("%")]
    total = float(text.split("step time ")[1].split()[0])
    assert len(time) == len(TIME_PARTS) and abs(sum(time) - total) <= 2e-3 * total
    mem = [float(ln.split()[-2]) for ln in text.splitlines() if ln.strip().endswith(" GB") and "(" not in ln]
    assert len(mem) == len(MEMORY_PARTS) and abs(sum(mem) - float(text.split("memory ")[1].split()[0])) < 0.01
    with pytest.raises(SystemExit):
        main([*argv, "--zero", "4"])  # argparse: ZeRO stages are 0-3


def test_another_stacks_recompute_attention_kernel_and_pipeline_transfers_are_flags(capsys):
    """--recompute pins the recompute mode (selective: less memory than none, no more than full
    recompute's compute), --attention-kernel materialized costs time, --pp-scatter-gather shrinks the
    stage-boundary transfers; --activation-model korthikanti sizes memory as Megatron's Table 2."""
    from mt3d.cli import main

    base = ["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "a100-80gb",
            "--seq-len", "2048", "--global-batch", "64", "--tensor", "2", "--pipeline", "2", "--micro-batch",
            "2", "--zero", "1", "--offload", "none", "--context", "1", "--virtual-stages", "1",
            "--json"]  # fmt: skip

    def rows(*extra):
        assert main([*base, *extra]) == 0
        return [r for r in json.loads(capsys.readouterr().out)["feasible"] if not r["sequence_parallel"]]

    by_mode = {m: rows("--recompute", m)[0] for m in ("none", "selective", "full")}
    assert {m: (r["recompute"], r["selective"]) for m, r in by_mode.items()} == {
        "none": (False, False),
        "selective": (False, True),
        "full": (True, False),
    }
    none, sel, full = (by_mode[m] for m in ("none", "selective", "full"))
    assert full["memory_gb"] < sel["memory_gb"] < none["memory_gb"]
    assert none["compute_s"] < sel["compute_s"] < full["compute_s"]
    flash = rows("--recompute", "none")[0]
    materialized = rows("--recompute", "none", "--attention-kernel", "materialized")[0]
    assert materialized["compute_s"] > flash["compute_s"]
    # another stack without SP sends whole stage-boundary tensors; PTD-P's scatter sends 1/t, as
    # DeepSpeed's engine (mt3d's) does
    whole = rows("--recompute", "none", "--other-stack", "--overlap", "tp")[0]
    split = rows("--recompute", "none", "--other-stack", "--overlap", "tp", "--pp-scatter-gather")[0]
    assert split["pp_comm_s"] == pytest.approx(whole["pp_comm_s"] / 2) and split["pp_comm_s"] > 0
    assert flash["pp_comm_s"] == pytest.approx(split["pp_comm_s"])
    korthikanti = rows("--recompute", "none", "--activation-model", "korthikanti")[0]
    assert korthikanti["memory_gb"] != flash["memory_gb"]
    # --overlap dp: the gradient reduction hides behind the last micro-batch's backward but its last
    # bucket (a stage of 1.3B / pp 2 / tp 2 holds 8-9 buckets of 40M gradients)
    from mt3d.planner.costs import dp_hidden

    hidden = rows("--recompute", "none", "--overlap", "dp")[0]
    assert 0 < hidden["dp_comm_s"] < flash["dp_comm_s"] and hidden["compute_s"] == flash["compute_s"]
    assert hidden["dp_comm_s"] == pytest.approx(
        flash["dp_comm_s"] - dp_hidden(flash["dp_comm_s"], 330e6, flash["compute_s"] / 16, False), rel=0.05
    )
    assert dp_hidden(1.0, 400e6, 0.3, False) == pytest.approx(0.2)  # capped by the backward (2/3 x 0.3)
    assert dp_hidden(1.0, 400e6, 9.0, True) == pytest.approx(0.9)  # all but the last of 10 buckets


def test_optimizer_state_dtype_is_a_planner_flag(capsys):
    """16 / 12 / 10 bytes per parameter without ZeRO for fp32, bf16-moments and bf16 optimizer states;
    Llama-7B on 8 H100s with another stack's plain data parallelism fits only with bf16 master weights
    and moments. mt3d's ZeRO-0 runs DeepSpeed's BF16 optimizer (its states partitioned: it fits with
    fp32 states), which takes no bf16 states (refused, as at start-up)."""
    from mt3d.cli import main

    per_param = [
        model_state_bytes(1.0, 8, 0, Precision.of("bf16", 0, s)) for s in ("fp32", "bf16-moments", "bf16")
    ]
    assert per_param == [16.0, 12.0, 10.0]
    with pytest.raises(ValueError, match="optimizer states must be one of"):
        Precision.of("bf16", 1, "fp8")
    argv = ["plan", "--model", "llama-7b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "h100",
            "--seq-len", "4096", "--global-batch", "64", "--tensor", "1", "--pipeline", "1", "--zero", "0",
            "--offload", "none", "--context", "1", "--recompute", "full", "--micro-batch", "1",
            "--json"]  # fmt: skip
    fits = {}
    for states, stack in product(("fp32", "bf16"), (["--other-stack"], [])):
        rc = main([*argv, "--optimizer-states", states, *stack])  # 1: nothing feasible
        out = json.loads(capsys.readouterr().out)
        fits[states, bool(stack)] = (rc, bool(out["feasible"]))
        if not stack and states == "bf16":
            assert any("needs ZeRO 1-3" in r["reason"] for r in out["rejected"]), out["rejected"]
    assert fits == {("fp32", True): (1, False), ("bf16", True): (0, True), ("fp32", False): (0, True),
                    ("bf16", False): (1, False)}  # fmt: skip


def test_fp32_gradients_are_a_planner_flag(capsys, tmp_path):
    """--grad-dtype fp32 beside bf16 weights at ZeRO-1: Megatron-Core's distributed optimizer holds
    2 + 4 + 12/d bytes per parameter, no reduce bucket beside its gradient buffer; mt3d's (DeepSpeed's
    BF16 optimizer, as at ZeRO-0 with bf16 gradients) keeps the bf16 gradients too unless its
    overlapped reduction folds each in (tests/test_training.py measures both), and at the step's end
    holds its all-reduce's cast copy. The reduction sends 4 + 2 bytes per parameter and ring pass.
    mt3d plans it only where DeepSpeed's BF16 optimizer runs (bf16, ZeRO-1, fp32 optimizer states),
    another stack anywhere; the written config accumulates in fp32."""
    from mt3d.cli import main
    from mt3d.planner.costs import DEEPSPEED_ALLREDUCE_ELEMENTS, reduction_bytes
    from mt3d.planner.traffic import dp_bytes

    cfg, d = get_preset("gpt3-1.3b"), 8
    lay = Layout(1, 1, d, 1, 8, 1, False, False)
    params = stage_params(cfg, 50257, 1, 1)
    bf16, fp32 = Precision.of("bf16", 1), Precision.of("bf16", 1, grads="fp32")
    base = memory_bytes(cfg, 50257, 2048, lay, bf16)
    megatron = memory_bytes(cfg, 50257, 2048, lay, fp32, mt3d_engine=False)
    assert megatron["model_states"] == pytest.approx((2 + 4 + 12 / d) * params)
    assert megatron["model_states"] - base["model_states"] == pytest.approx(2 * params)
    assert megatron["buckets"] == 0 < base["buckets"] == 5e8 * 2
    ours = memory_bytes(cfg, 50257, 2048, lay, fp32)
    assert ours["model_states"] == pytest.approx((2 + 4 + 2 + 12 / d) * params) and ours["buckets"] == 0
    folded = memory_bytes(cfg, 50257, 2048, lay, fp32, overlap=("dp",))
    assert folded["model_states"] == pytest.approx(megatron["model_states"])
    # mt3d's ZeRO-0 with bf16 runs the same optimizer (bf16 buffer): not the 16 bytes of plain DP
    zero0 = memory_bytes(cfg, 50257, 2048, Layout(1, 1, d, 1, 8, 0, False, False), Precision.of("bf16", 0))
    assert zero0["model_states"] == pytest.approx((2 + 2 + 2 + 12 / d) * params)
    # once the activations are gone: the all-reduce's copy of the fp32 buffer (two groups: one batch
    # of DeepSpeed's below 500M gradients) and its bf16 cast; the overlapped reduction's bucket copies;
    # ZeRO-1's fp32 copy of the gradient partition, after freeing the rest (nothing net at d 8)
    assert reduction_bytes(4e8, lay, fp32, (), True, 5e8) == pytest.approx((0, 4e8 * (4 + 2)))
    assert reduction_bytes(params, lay, fp32, (), True, 5e8) == pytest.approx((0, params * 2))
    assert params > DEEPSPEED_ALLREDUCE_ELEMENTS  # its groups go alone, uncopied
    assert reduction_bytes(params, lay, fp32, ("dp",), True, 5e8) == pytest.approx((0, 2 * params))
    assert reduction_bytes(params, lay, bf16, ("dp",), True, 5e8) == pytest.approx((1e9, 2 * params))
    two = Layout(1, 1, 2, 1, 8, 1, False, False)
    assert reduction_bytes(params, lay, bf16, (), True, 5e8) == (1e9, 0)
    assert reduction_bytes(params, two, bf16, (), True, 5e8) == pytest.approx((1e9, params / 2 * 6 - params))
    with pytest.raises(ValueError, match="gradients must be one of"):
        Precision.of("bf16", 1, grads="fp8")
    # ZeRO-1: (d-1)/d of the gradients reduce-scattered and of the weights all-gathered
    assert dp_bytes(params, 2, 4, d, 1) == pytest.approx((d - 1) / d * params * (4 + 2))
    assert dp_bytes(params, 2, 2, d, 0) == pytest.approx(2 * (d - 1) / d * params * 2)
    argv = ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--gpus-per-node", "8", "--gpu", "h100",
            "--seq-len", "2048", "--global-batch", "64", "--tensor", "1", "--pipeline", "1", "--context", "1",
            "--offload", "none", "--recompute", "none", "--micro-batch", "2", "--json"]  # fmt: skip
    plans = {}
    for extra in ([], ["--grad-dtype", "fp32"], ["--grad-dtype", "fp32", "--other-stack"]):
        assert main([*argv, *extra]) == 0
        plans[tuple(extra)] = json.loads(capsys.readouterr().out)
    param, mt3d, other = plans.values()
    assert {r["zero_stage"] for r in mt3d["feasible"]} == {1}
    assert {r["zero_stage"] for r in other["feasible"]} == {0, 1, 2, 3}
    assert any("BF16 optimizer" in r["reason"] for r in mt3d["rejected"])
    z1 = next(r for r in param["feasible"] if r["zero_stage"] == 1)
    z1_fp32 = next(r for r in mt3d["feasible"])
    # 2 bytes of fp32 gradients more and the bf16 ones kept, less the bucket (the activations outweigh
    # the all-reduce's flat copies)
    assert z1_fp32["memory_gb"] - z1["memory_gb"] == pytest.approx((4 * params - 1e9) / 1e9)
    assert z1_fp32["dp_comm_s"] == pytest.approx(z1["dp_comm_s"] * 6 / 4)
    assert main([*argv, "--grad-dtype", "fp32", "--optimizer-states", "bf16"]) == 1  # DeepSpeed ignores one
    capsys.readouterr()
    out = tmp_path / "fp32-grads.json"
    assert main([*argv, "--grad-dtype", "fp32", "--write-config", str(out)]) == 0
    capsys.readouterr()
    written = json.loads(out.read_text())
    assert written["data_types"] == {"grad_accum_dtype": "fp32"} and written["bf16"]["enabled"]
    assert written["zero_optimization"]["stage"] == 1
    validate(load(out), 8, resolve_model(load(out).mt3d.model))  # and mt3d starts from it


def test_another_stacks_rules_and_the_fidelity_rows_go_through_the_command_line(capsys):
    """ZeRO-0 with a pipeline is mt3d's DeepSpeed rule, not Megatron's: --other-stack plans it. The
    fidelity benchmark states each published run with mt3d plan's own flags."""
    from mt3d.bench.planner import PTDP_TABLE1, command_line
    from mt3d.cli import build_parser, main

    argv = ["plan", "--model", "gpt3-1.3b", "--gpus", "16", "--gpus-per-node", "8", "--gpu", "a100-80gb",
            "--seq-len", "2048", "--global-batch", "64", "--tensor", "2", "--pipeline", "2", "--zero", "0",
            "--micro-batch", "2", "--offload", "none", "--context", "1", "--json"]  # fmt: skip
    main(argv)
    assert not json.loads(capsys.readouterr().out)["feasible"]  # mt3d: ZeRO-0 with pp > 1 is refused
    assert main([*argv, "--other-stack"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]
    args = build_parser().parse_args(["plan", "--model", "-", *command_line(PTDP_TABLE1[5])])
    assert (args.tensor, args.pipeline, args.virtual_stages, args.recompute, args.attention_kernel) == (
        (8,),
        (4,),
        (3,),
        ("full",),
        "materialized",
    )
    assert args.other_stack and args.pp_scatter_gather and args.activation_model == "korthikanti"


def test_posted_pipeline_transfers_follow_the_simulated_schedule():
    """costs.pp_posted_seconds (the planner's --overlap pp) against pipeline.schedule.simulate with
    the schedule mt3d runs: within 10% for messages from a tenth of a chunk's forward to twice it."""
    from mt3d.pipeline.schedule import simulate
    from mt3d.planner.costs import pp_posted_seconds

    for p, v, m in ((2, 1, 8), (4, 1, 16), (4, 2, 16), (4, 2, 32), (8, 1, 32), (8, 2, 32)):
        f, b = 1.0 / v, 2.0 / v
        free = simulate(p, v, m, fwd_s=f, bwd_s=b)["makespan"]
        for ratio in (0.1, 0.5, 1.0, 2.0):
            msg = ratio * f
            sim = simulate(p, v, m, fwd_s=f, bwd_s=b, p2p_s=msg, posted=True)["makespan"] - free
            model = pp_posted_seconds(2 * v * m * msg, p, v, m, msg, f)
            assert model == pytest.approx(sim, rel=0.10), (p, v, m, ratio)
    assert pp_posted_seconds(1.0, 4, 2, 4, 0.01, 1.0) == 1.0  # m = p: all forwards first, nothing hides


def test_posted_pipeline_transfers_only_where_a_schedule_posts_them():
    """mt3d's schedule engine posts at v 1 too (m a multiple of pp); another stack only interleaved
    (Megatron-LM refuses overlap_p2p_comm with its 1F1B): its v 1 step keeps the blocking transfers."""
    from mt3d.planner.costs import posts_p2p

    cfg, bw = get_preset("gpt3-175b"), {"tp": 300.0, "pp": 2.0, "dp": 25.0}
    kw = dict(peak_tflops=312, efficiency=0.5, bw=bw, overlap=("pp",))
    for v in (1, 2):
        lay = Layout(8, 8, 1, 1, 64, 1, False, True, v)
        assert posts_p2p(("pp",), lay) and posts_p2p(("pp",), lay, mt3d_engine=False) == (v > 1)
        ours, other = (step_time(cfg, 50257, 2048, 64, lay, **kw, mt3d_engine=e)["pp_comm_s"] for e in (1, 0))
        blocking = step_time(cfg, 50257, 2048, 64, lay, **{**kw, "overlap": ()})["pp_comm_s"]
        assert ours < blocking and other == (blocking if v == 1 else ours)
    assert not posts_p2p(("pp",), Layout(8, 8, 1, 1, 12, 1, False, True))  # 12 micro-batches, pp 8


@pytest.mark.parametrize("model", ["gpt3-1.3b", "tiny-qwen3-moe"])
@pytest.mark.parametrize("sp", [True, False])
def test_tp_overlap_hides_the_column_linears_backward_transfers(model, sp):
    """mt3d's layers always overlap (--overlap tp): with GEMMs that outlast the transfers (a fast
    NVLink), a dense block hides its 2 column linears' input-gradient reduce-scatters and 2 input
    re-gathers of its 10 half-all-reduces with SP, 2 of its 4 all-reduces without; a sparse block's
    experts take their input whole, so only its QKV linear's (2 of 9, 2 of 8). --other-stack
    --overlap none counts every transfer. Full recompute runs the forward's transfers again."""
    from mt3d.cli import build_parser, plan_inputs

    cfg = get_preset(model)
    dense = 1 - cfg.sparse_layers / cfg.layers

    def tp_comm(*extra, recompute="none"):
        args = build_parser().parse_args(
            ["plan", "--model", model, "--gpus", "8", "--gpu", "h100", "--seq-len", "2048", "--vocab", "512",
             "--global-batch", "64", "--tensor", "2", "--pipeline", "1", "--micro-batch", "4", "--zero", "1",
             "--offload", "none", "--context", "1", "--recompute", recompute, "--nvlink-gbps", "5000",
             "--expert-tensor", "2", *extra]  # experts split over tp (whole ones: the folds test)
        )  # fmt: skip
        rows = plan(cfg, **plan_inputs(args, cfg))["feasible"]
        return next(r["tp_comm_s"] for r in rows if r["sequence_parallel"] == sp)

    exposed, none = tp_comm(), tp_comm("--other-stack", "--overlap", "none")
    assert tp_comm("--overlap", "dp") == exposed  # mt3d: tp always counted
    halves = 8 + (1 + dense if sp else 0)
    assert 1 - exposed / none == pytest.approx((2 + 2 * dense) / halves)
    assert tp_comm("--other-stack", "--overlap", "none", recompute="full") == pytest.approx(
        none * (halves + 4) / halves
    )
    # another stack's --tp-comm-overlap (--overlap tp-comm): with SP every transfer beside a GEMM hides,
    # the forward's too (all 10 of a dense block, its attention's 5 of a sparse block's 9; with full
    # recompute the forward's 4 again, 2 of them a sparse block's); without SP it is tp's
    comm = tp_comm("--other-stack", "--overlap", "tp-comm")
    if sp:
        assert 1 - comm / none == pytest.approx((5 + 5 * dense) / halves)
        again = tp_comm("--other-stack", "--overlap", "tp-comm", recompute="full")
        unhidden = halves + 4 - (7 + 7 * dense)
        assert again == pytest.approx(none * unhidden / halves, abs=1e-12)
    else:
        assert comm == pytest.approx(exposed)
    with pytest.raises(UserError, match="add --other-stack"):
        tp_comm("--overlap", "tp-comm")


def test_written_config_runs_the_overlaps_the_plan_assumed(tmp_path, capsys):
    """--write-config with --overlap dp,pp sets mt3d.train.overlap.grad_reduce and p2p (tp needs no key:
    mt3d's layers always overlap it), and the config validates; a layout whose micro-batches per step
    are not a multiple of pp gets no p2p key (mt3d's schedule engine could not run it)."""
    from mt3d.cli import main

    def written(batch):
        path = tmp_path / f"c{batch}.json"
        argv = ["plan", "--model", "gpt2-small", "--gpus", "8", "--gpu", "h100", "--seq-len", "1024",
                "--global-batch", str(batch), "--tensor", "1", "--pipeline", "2", "--zero", "1",
                "--micro-batch", "1", "--offload", "none", "--context", "1", "--virtual-stages", "1",
                "--overlap", "tp,dp,pp", "--json", "--write-config", str(path)]  # fmt: skip
        assert main(argv) == 0
        capsys.readouterr()
        run = load(path)
        validate(run, 8, resolve_model(run.mt3d.model))
        return run.mt3d.train.overlap

    overlap = written(64)  # dp 4, m 16
    assert (overlap.grad_reduce, overlap.p2p) == (True, True)
    overlap = written(12)  # dp 4, m 3: not a multiple of pp 2
    assert (overlap.grad_reduce, overlap.p2p) == (True, False)


def test_deepspeed_still_allocates_the_reduce_buckets_the_memory_model_counts():
    """``memory_bytes`` counts ZeRO's reduce bucket in the parameters' dtype: ZeRO-3 keys its buckets
    by the communication dtype (the parameters' unless configured) and allocates each in that dtype;
    ZeRO-1/2 stage in the gradient-accumulation dtype only when gradients are not partitioned and it
    differs from the weights', which never happens in mt3d: unset, it is the weights' dtype, and fp32
    accumulation beside bf16 weights at ZeRO-1 picks the BF16 optimizer (no bucket) instead."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    types = inspect.getsource(DeepSpeedEngine.get_data_types)
    assert "if self._config.grad_accum_dtype is None:" in types and "grad_accum_dtype = model_dtype" in types
    check = inspect.getsource(DeepSpeedEngine._do_optimizer_sanity_check)
    assert "model_dtype == torch.bfloat16 and grad_accum_dtype == torch.float32" in check
    assert "return BFLOAT16" in check
    # and no 16-bit weights beside fp32 gradients without ZeRO (config.rules.grad_accum_conflict refuses it)
    assert 'raise NotImplementedError(f"unsupported mix of {model_dtype=} and {grad_accum_dtype=}")' in check
    comm = inspect.getsource(DeepSpeedEngine.communication_data_type.fget)
    assert "return torch.float16" in comm and "return torch.bfloat16" in comm  # unless configured

    z3 = stage3.DeepSpeedZeroOptimizer_Stage3
    assert "comm_dtypes = {self.communication_data_type}" in inspect.getsource(z3.__init__)
    setup = inspect.getsource(z3._setup_for_real_optimizer)
    assert "for dtype, bucket in self.ipg_buckets.items():" in setup and "dtype=dtype," in setup
    z12 = stage_1_and_2.DeepSpeedZeroOptimizer
    assert "dtype=self._gradient_reduction_buffer_dtype()" in inspect.getsource(z12.setup_buckets)
    assert "if self.use_grad_accum_attribute else self.dtype" in inspect.getsource(
        z12._gradient_reduction_buffer_dtype
    )
    init = inspect.getsource(z12.__init__)
    assert "if self.use_separate_grad_accum and not self.partition_gradients:" in init


def test_time_model_follows_what_moves_and_what_runs():
    """Three time bugs and the other-stack choices the held-out runs need, each against its formula:
    stage transfers of 1/t of the activation under SP and on DeepSpeed's engine (memory counted the
    shard, time the whole); causal flash attention over the tiles it visits (it was timed over s x s);
    ZeRO-2/3 reductions and ZeRO-3 gathers every micro-batch (counted once per step); a sequence-shard
    expert dispatch, FSDP's states and TransformerEngine's gated-MLP activations."""
    from mt3d.config import resolve_model
    from mt3d.planner.compute import FLASH_FRACTION, GEMM_FRACTION, causal_share, micro_batch_seconds
    from mt3d.planner.costs import Layout, Precision, memory_bytes, step_time
    from mt3d.planner.hardware import get_device
    from mt3d.planner.search import Cluster, bandwidths
    from mt3d.planner.traffic import ep_node_traffic

    dev = get_device("h100")
    cfg = resolve_model({"preset": "llama-7b"})
    bw = bandwidths(Cluster(64, 8, dev), 8, 4)
    kw = dict(peak_tflops=dev.peak_tflops, efficiency=None, bw=bw, device=dev)
    act = 4096 * 1 * cfg.hidden * 2  # one micro-batch's stage-boundary tensor, bf16

    def pp_seconds(sp, mt3d):
        lay = Layout(8, 4, 2, 1, 16, 1, False, sp)
        return step_time(cfg, 32000, 4096, 32, lay, mt3d_engine=mt3d, **kw)["pp_comm_s"]

    one = act / (bw["pp"] * 1e9)  # seconds of one whole transfer; 1F1B: 2 per micro-batch
    assert pp_seconds(False, False) == pytest.approx(2 * 16 * one)
    for sp, mt3d in ((True, False), (False, True), (True, True)):
        assert pp_seconds(sp, mt3d) == pytest.approx(2 * 16 * one / 8), (sp, mt3d)

    flash = micro_batch_seconds(cfg, 32000, 4096, 1, 1, 1, dev, with_logits=False)["attention_s"]
    flops = 4.0 * 4096 * 4096 * causal_share(4096) * cfg.q_size * 3  # forward + backward (2x)
    assert flash == pytest.approx(flops / (dev.gemm_tflops * GEMM_FRACTION * 1e12 * FLASH_FRACTION))
    assert causal_share(2048) == 17 / 32 and causal_share(128) == 1.0

    def dp_seconds(zero, m):
        lay = Layout(1, 1, 64, 1, m, zero, False, False)
        return step_time(cfg, 32000, 4096, 64 * m, lay, overlap=(), **kw)["dp_comm_s"]

    assert dp_seconds(2, 4) == pytest.approx(4 * dp_seconds(2, 1))
    assert dp_seconds(1, 4) == pytest.approx(dp_seconds(1, 1))
    compute = {m: step_time(cfg, 32000, 4096, 64 * m, Layout(1, 1, 64, 1, m, 3, False, False), **kw)
               for m in (1, 4)}  # fmt: skip
    exposed = {m: compute[m]["dp_comm_s"] + 0.5 * compute[m]["compute_s"] for m in (1, 4)}  # ZERO3_OVERLAP
    assert exposed[4] == pytest.approx(4 * exposed[1], rel=1e-6)

    moe = resolve_model({"preset": "mixtral-8x7b"})
    ep_lay = Layout(2, 1, 32, 1, 4, 1, False, True, ep=8)
    split = bandwidths(Cluster(64, 8, dev), 2, 1, ep=8)  # each ep group: 2 hosts x 4 ranks
    assert (split["ep_hosts"], split["ep_per_host"], split["ep_within"]) == (2, 4, dev.intra_gbps)
    one_hop = {k: v for k, v in split.items() if not k.startswith(("ep_hosts", "ep_per_host", "ep_within"))}
    kw_ep = {**kw, "bw": one_hop}
    ep = {d: step_time(moe, 32000, 4096, 128, ep_lay, ep_dispatch=d, **kw_ep)["ep_comm_s"]
          for d in ("whole", "sequence-shard")}  # fmt: skip
    # a sequence shard per TP rank (half the rows at t 2), then the routed rows (k 2 per token) gathered
    # and scattered over the expert-TP pair, forward and backward: 4 (t-1)/t (k-1) T h per sparse layer
    gather = 4 * 1 / 2 * 1 * 4096 * moe.hidden * 2 * moe.layers * 4 / (kw_ep["bw"]["tp"] * 1e9)
    assert ep["sequence-shard"] == pytest.approx(ep["whole"] / 2 + gather) and ep["whole"] > 0
    # mt3d's dispatch over the hosts (expert_dispatch "node"): each token once per other host across,
    # then within the host; 4 micro-batches of 4096 tokens, 32 sparse layers, bf16 rows
    node = step_time(moe, 32000, 4096, 128, ep_lay, **{**kw, "bw": split})["ep_comm_s"]
    across, within = ep_node_traffic(2, 4, 4096, 2, moe.hidden, 8)
    per = [(r * 2 + m * 4 + c * 8) * moe.layers * 4 for r, m, c in (across, within)]
    assert node == pytest.approx((per[0] / split["ep"] + per[1] / split["ep_within"]) / 1e9)
    assert node < ep["whole"]

    z3 = Layout(1, 1, 64, 1, 1, 3, False, False)
    from mt3d.planner.layout import fsdp_precision

    prec = Precision.of("bf16", 3)
    ds = memory_bytes(cfg, 32000, 4096, z3, prec)["model_states"]
    fsdp = memory_bytes(cfg, 32000, 4096, z3, fsdp_precision(prec), fsdp=True)["model_states"]
    params = cfg.num_params(32000)
    assert fsdp_precision(prec).param == 4 and fsdp_precision(prec).master == 0
    # DeepSpeed's ZeRO-3 keeps fp32 master + 16-bit shards and 16-bit gradients; FSDP fp32 weights and
    # gradients (no master), and gathers two blocks at a time where DeepSpeed prefetches 1e9 elements
    assert fsdp_precision(prec).grad == 4
    assert ds - fsdp == pytest.approx(min(params, 1e9) * 2 - 4 * params / 32, rel=1e-3)
    lay = Layout(1, 1, 8, 1, 1, 1, False, False)
    mt3d_act = memory_bytes(cfg, 32000, 4096, lay, prec)["activations"]
    te_act = memory_bytes(cfg, 32000, 4096, lay, prec, activation_model="te")["activations"]
    assert mt3d_act - te_act == pytest.approx(32 * 4096 * cfg.ffn * 2, rel=1e-6)  # one ffn per token, bf16


def _planned(dims: dict, argv: list[str]) -> dict:
    from mt3d.model.config import ModelConfig
    from mt3d.planner.args import plan_inputs, plan_parser
    from mt3d.planner.search import plan

    cfg = ModelConfig(**dims)
    inputs = plan_inputs(plan_parser().parse_args(["--model", "-", *argv]), cfg)
    return plan(cfg, inputs.pop("cluster"), **inputs)


def test_layouts_that_ran_on_80_gb_cards_fit():
    """Two published layouts the planner refused (issue 45): Llama 3.1 405B on 576 H100s at tp 8 pp 9
    cp 2 v 7 (NeMo's recipe: Megatron-Core, FP8, fp32 gradients), and MPT-30B on 8 H100s with FSDP,
    full recompute and micro-batch 3 (llm-foundry). Both need more than 78 GB (80e9 bytes less the
    reserve) and fit in what the card holds: 81,559 MiB = 85.5e9 bytes."""
    from mt3d.planner.hardware import get_device

    assert get_device("h100").memory_gb == pytest.approx(85.52, abs=0.01)
    llama = dict(name="llama-405b", hidden=16384, layers=126, heads=128, kv_heads=8, ffn=53248,
                 vocab_size=128256, max_seq_len=131072, position="rope", norm="rmsnorm", mlp="swiglu",
                 bias=False, tie_embeddings=False)  # fmt: skip
    megatron = ["--other-stack", "--gpu", "h100", "--gpus-per-node", "8", "--precision", "bf16",
                "--offload", "none", "--zero", "1", "--recompute", "none", "--grad-dtype", "fp32",
                "--overlap", "tp-comm,dp,pp", "--activation-model", "te", "--fp8", "tensorwise"]  # fmt: skip
    layout = ["--gpus", "576", "--global-batch", "252", "--seq-len", "8192", "--tensor", "8",
              "--pipeline", "9", "--context", "2", "--virtual-stages", "7", "--micro-batch", "1",
              "--data", "4"]  # fmt: skip
    ran = [r for r in _planned(llama, megatron + layout)["feasible"] if r["sequence_parallel"]]
    assert ran and 78 < ran[0]["memory_gb"] < 85.52 - 2, ran[:1]
    mpt = dict(name="mpt-30b", hidden=7168, layers=48, heads=64, ffn=28672, vocab_size=50432,
               max_seq_len=8192, position="rope", norm="layernorm", mlp="gelu", bias=False)  # fmt: skip
    fsdp = ["--other-stack", "--fsdp", "--gpu", "h100", "--gpus-per-node", "8", "--precision", "bf16",
            "--offload", "none", "--gpus", "8", "--global-batch", "504", "--seq-len", "2048", "--tensor", "1",
            "--pipeline", "1", "--data", "8", "--micro-batch", "3", "--zero", "3", "--recompute", "full",
            "--overlap", "none", "--grad-dtype", "param"]  # fmt: skip
    ran = _planned(mpt, fsdp)["feasible"]
    assert ran and ran[0]["memory_gb"] < 85.52 - 2, ran[:1]


def test_the_shared_expert_hides_what_it_overlaps_of_the_dispatch():
    """The shared expert computes while the routed rows travel (and its backward while their gradients
    return): the planner takes off the step's expert all-to-all the smaller of the dispatch's half and
    the shared experts' share of the compute (18 h s_ffn FLOPs a token per sparse layer); a model
    without a shared expert hides nothing. The per-token rows count each rank a token reaches once."""
    from mt3d.planner.search import bandwidths
    from mt3d.planner.traffic import ep_layer_traffic, ep_ranks_per_token

    dev = get_device("h100")
    kw = dict(peak_tflops=dev.peak_tflops, efficiency=None, device=dev)
    lay = Layout(2, 8, 64, 1, 128, 1, True, True, ep=64)  # Megatron-Bridge's DeepSeek-V3 layout
    kw["bw"] = bandwidths(Cluster(1024, 8, dev), 2, 8, ep=64)
    ds = resolve_model({"preset": "deepseek-v3"})
    row = step_time(ds, 129280, 4096, 8192, lay, **kw)
    spec = ds.moe_spec
    share = 18 * ds.hidden * spec.shared_ffn * ds.sparse_layers / ds.flops_per_token(4096, 129280)
    exposed = row["ep_comm_s"] + row["ep_hidden_s"]
    assert row["ep_hidden_s"] > 0
    assert row["ep_hidden_s"] == pytest.approx(min(0.5 * exposed, share * row["compute_s"]))
    mixtral = resolve_model({"preset": "mixtral-8x7b"})
    assert step_time(mixtral, 32000, 4096, 128, Layout(2, 1, 32, 1, 4, 1, False, True, ep=8), **{
        **kw, "bw": bandwidths(Cluster(64, 8, dev), 2, 1, ep=8)})["ep_hidden_s"] == 0.0  # fmt: skip
    # DeepSeek-V3's top-8 of 256 experts at ep 64: 7.68 ranks a token, not 8
    assert ep_ranks_per_token(64, 256, 8) == pytest.approx(7.6758, abs=1e-4)
    rows, meta, counts = ep_layer_traffic(64, 4096, 8, 7168, 256)
    whole = ep_layer_traffic(64, 4096, 8, 7168, 256, dedup=False)[0]
    assert rows / whole == pytest.approx(7.6758 / 8, abs=1e-4)
    assert meta == pytest.approx(rows * 8 / 7168) and counts == pytest.approx(63)
    # at top-1 the model sends once per assignment (MoESpec.dispatch_once): no metadata, E counts
    from mt3d.model.config import ModelConfig
    from mt3d.planner.timing import ep_bytes

    d = get_preset("mixtral-8x7b").to_dict()
    d["moe"] = {**d["moe"], "top_k": 1}
    top1 = ModelConfig.from_dict(d)
    assert not top1.moe_spec.dispatch_once and mixtral.moe_spec.dispatch_once
    per_layer = 7 / 8 * (4 * 4096 * 1 * top1.hidden * 2 + 8 * 8)  # f (4 T k h) bf16 + f E int64 counts
    assert ep_bytes(top1, 4096, 1, 8, 2, top1.layers, False) == (pytest.approx(top1.layers * per_layer), 0.0)


def test_dispatch_chunks_hide_the_all_to_all_behind_the_routed_experts(tmp_path):
    """``--overlap ep`` (``train.overlap.dispatch_chunks`` at ``DISPATCH_CHUNKS``): all but 1/n of the
    expert all-to-all hides behind the routed experts' compute (6 k h e_ffn x 3 FLOPs a token per sparse
    layer), the shared expert behind 1/(2n) of it; the experts' GEMMs run in n chunks of the rows (same
    FLOPs). DeepSeek-V3 at Megatron-Bridge's layout with whole experts (1,024 H100s, tp 2 pp 8 ep 64 etp
    1): >= 300 TFLOP/s predicted (issue 46's target), and the written config carries the chunks."""
    from mt3d.planner.choices import DISPATCH_CHUNKS
    from mt3d.planner.compute import expert_gemms
    from mt3d.planner.search import bandwidths
    from mt3d.planner.timing import ep_bytes

    n = DISPATCH_CHUNKS
    ds = resolve_model({"preset": "deepseek-v3"})
    flops = [sum(w * g.flops for g, w in expert_gemms(ds, 4096, 2, 64, 1, c)) for c in (1, n)]
    assert flops[1] == pytest.approx(flops[0], rel=1e-12)
    dev = get_device("h100")
    lay = Layout(2, 8, 64, 1, 128, 1, True, True, ep=64, etp=1, virtual_stages=4)
    kw = dict(peak_tflops=dev.peak_tflops, efficiency=None, device=dev,
              bw=bandwidths(Cluster(1024, 8, dev), 2, 8, ep=64, expert_tensor=1))  # fmt: skip
    plain, chunked = (step_time(ds, 129280, 4096, 8192, lay, **kw, overlap=o) for o in ((), ("ep",)))
    assert (plain["dispatch_chunks"], chunked["dispatch_chunks"]) == (1, n)
    sent = chunked["ep_comm_s"] + chunked["ep_hidden_s"]
    assert sent == pytest.approx(plain["ep_comm_s"] + plain["ep_hidden_s"])
    spec, per_token = ds.moe_spec, 18 * ds.hidden * ds.sparse_layers / ds.flops_per_token(4096, 129280)
    routed = min(sent * (1 - 1 / n), per_token * spec.top_k * spec.expert_ffn * chunked["compute_s"])
    shared = min(sent / (2 * n), per_token * spec.shared_ffn * chunked["compute_s"])
    assert chunked["ep_hidden_s"] == pytest.approx(routed + shared)
    assert chunked["ep_comm_s"] < 0.25 * plain["ep_comm_s"]
    assert plain["tflops_per_gpu"] < 300 <= chunked["tflops_per_gpu"], (plain, chunked)
    moe = {**get_preset("tiny-mixtral").to_dict(), "vocab_size": 512, "kv_heads": 4}
    argv = ["--gpus", "2", "--gpu", "h100", "--global-batch", "8", "--seq-len", "256", "--expert", "2",
            "--overlap", "ep"]  # fmt: skip
    conf = write_config(_planned(moe, argv), str(tmp_path / "plan.json"), moe)
    assert conf["mt3d"]["train"]["overlap"] == {"dispatch_chunks": n}
    argv[argv.index("--expert") + 1] = "1"
    conf = write_config(_planned(moe, argv), str(tmp_path / "plan1.json"), moe)
    assert "overlap" not in conf["mt3d"]["train"]  # ep 1: nothing to pipeline, nothing written
    # at top-1 chunks take the deduplicating exchange: the same rows, plus their metadata (4 k fp32 a row
    # over the four crossings) and chunks x ep counts in place of one per expert
    top1 = dataclasses.replace(resolve_model({"preset": "tiny-mixtral"}), moe={**moe["moe"], "top_k": 1})
    one, two = (ep_bytes(top1, 1024, 1, 4, 2, top1.layers, False, chunks=c)[0] for c in (1, 2))
    f, layers = 3 / 4, top1.sparse_layers
    assert two - one == pytest.approx(layers * (f * 1024 * 4 * 4 + (f * 4 * 2 - f * 4) * 8))


def test_the_planner_folds_whole_experts_over_tensor_and_data():
    """Expert-tensor degree etp (mt3d.parallel.expert_tensor): the experts' states split over etp and
    partitioned over edp = tp x cp x dp / (etp x ep); the routed GEMMs run as grouped GEMMs of the
    same FLOPs, each rank dispatching 1/(tp / etp) of its tokens. At the layout Megatron-Bridge trains
    DeepSeek-V3 with (1,024 H100s, tp 2, pp 8, ep 64) whole experts (etp 1) beat experts split over tp,
    the search tries both, and --expert-tensor pins it (into the written config too)."""
    from mt3d.planner.compute import block_gemms, expert_gemms
    from mt3d.planner.layout import stage_expert_params
    from mt3d.planner.search import bandwidths

    ds = resolve_model({"preset": "deepseek-v3"})
    folded, split = (Layout(2, 8, 64, 1, 128, 1, True, True, ep=64, etp=e) for e in (1, None))
    assert (folded.data, split.data, folded.expert_tp, split.expert_tp) == (2, 1, 1, 2)
    experts = stage_expert_params(ds, 1, 8, 64)
    moved = stage_params(ds, 129280, 2, 8, 64, 1) - stage_params(ds, 129280, 2, 8, 64)
    assert moved == pytest.approx(experts / 2)
    mlp = sum(g.flops for g in block_gemms(ds, 4096, 2)[2:])
    for etp in (1, 2):
        assert sum(w * g.flops for g, w in expert_gemms(ds, 4096, 2, 64, etp)) == pytest.approx(mlp, rel=1e-9)
    dev = get_device("h100")
    kw = dict(peak_tflops=dev.peak_tflops, efficiency=None, device=dev)
    bws = [bandwidths(Cluster(1024, 8, dev), 2, 8, ep=64, expert_tensor=lay.etp) for lay in (folded, split)]
    # folded, an ep group of 64 fills 8 hosts (tp x dp on each); split over tp, it spans 16 hosts x 4
    assert [(bw["ep_hosts"], bw["ep_per_host"]) for bw in bws] == [(8, 8), (16, 4)]
    one_hop = [{k: v for k, v in bw.items() if k not in ("ep_hosts", "ep_per_host", "ep_within")}
               for bw in bws]  # fmt: skip
    rows = [step_time(ds, 129280, 4096, 8192, lay, **kw, bw=bw) for lay, bw in zip((folded, split), one_hop)]
    # half the rows dispatched per rank; the hidden share is the shared expert's in both
    sent = [r["ep_comm_s"] + r["ep_hidden_s"] for r in rows]
    assert sent[0] == pytest.approx(sent[1] / 2)
    rows = [step_time(ds, 129280, 4096, 8192, lay, **kw, bw=bw) for lay, bw in zip((folded, split), bws)]
    assert rows[0]["tflops_per_gpu"] > 1.4 * rows[1]["tflops_per_gpu"]

    def planned(zero_stages=(1,), **pins):
        return plan(ds, Cluster(1024, 8, dev), global_batch=8192, seq_len=4096, vocab=129280,
                    micro_batches=(1,), zero_stages=zero_stages, virtual_stages=(1,), offloads=("none",),
                    context=(1,),
                    pins={"tp": (2,), "pp": (8,), "ep": (64,), **pins})  # fmt: skip

    result = planned((1, 2))
    best = result["feasible"][0]
    assert best["etp"] == 1 and best["zero_stage"] == 1
    assert any(r["etp"] is None for r in result["feasible"])  # etp = tp tried too
    at_pp1 = planned((0,), pp=(1,))  # folded without ZeRO runs (mt3d.ds.experts.reduce_folded): weighed
    assert any(r.get("etp") == 1 for r in at_pp1["feasible"] + at_pp1["rejected"])
    assert not any("folded expert layout" in r["reason"] for r in at_pp1["rejected"])
    assert any(r["etp"] == 1 for r in planned((2,), pp=(1,))["feasible"])  # folded at ZeRO-2 runs
    assert {r["etp"] for r in planned(etp=(2,))["feasible"]} == {None}
    at_ep1 = planned(ep=(1,), etp=(1,))
    assert at_ep1["rejected"] and all(r.get("etp") is None for r in at_ep1["rejected"] + at_ep1["feasible"])
    # mt3d overlaps the gradient reduction of a folded layout, but no mixture of experts' at pp > 1
    # (rules.overlap_moe_conflict): credited at pp 1 only, and written into the config there alone
    for pp, lay in ((8, folded), (1, dataclasses.replace(folded, pp=1, grad_accum=16))):
        bw = bandwidths(Cluster(1024, 8, dev), 2, pp, ep=64, expert_tensor=1)
        dp = [step_time(ds, 129280, 4096, 8192, lay, **kw, bw=bw, overlap=o)["dp_comm_s"]
              for o in ((), ("dp",))]  # fmt: skip
        assert (dp[0] == dp[1] > 0) if pp > 1 else (dp[0] > dp[1])


def test_fp8_dispatch_counts_the_forward_dispatch_in_one_byte_plus_scales(tmp_path):
    """``--fp8-dispatch`` (``train.fp8.dispatch``): of a routed row's four crossings (dispatch, combine
    and both gradients) the forward's dispatch is sent as e4m3 with its tiles' scales (1 + 1/32 bytes a
    value for mxfp8 and blockwise), the rest in bf16; metadata and counts unchanged. The flag needs a
    tiled --fp8 (one line, before planning) and puts ``dispatch`` in the emitted config."""
    from mt3d.planner.timing import ep_bytes
    from mt3d.planner.traffic import ep_layer_traffic

    ds = resolve_model({"preset": "deepseek-v3"})
    plain = ep_bytes(ds, 4096, 1, 64, 2, ds.layers, False)[0]
    for recipe in ("mxfp8", "blockwise"):
        fp8 = ep_bytes(ds, 4096, 1, 64, 2, ds.layers, False, fp8_dispatch=recipe)[0]
        spec = ds.moe_spec  # group-limited routing: a token reaches at most 4 of 8 groups
        rows = ep_layer_traffic(64, 4096, 8, ds.hidden, 256, True, spec.n_group, spec.topk_group)[0]
        rows *= ds.sparse_layers  # elements
        assert plain - fp8 == pytest.approx(rows / 4 * (2 - 1 - 1 / 32))
    with pytest.raises(UserError, match="--fp8-dispatch casts the dispatch in a tiled recipe"):
        _planned(ds.to_dict(), ["--gpus", "8", "--fp8-dispatch", "--fp8", "rowwise"])
    moe = {**get_preset("tiny-mixtral").to_dict(), "vocab_size": 512, "kv_heads": 4}
    argv = ["--gpus", "2", "--gpu", "h100", "--global-batch", "8", "--seq-len", "256", "--expert", "2",
            "--fp8", "mxfp8", "--fp8-dispatch"]  # fmt: skip
    result = _planned(moe, argv)
    assert result["fp8_dispatch"] and result["feasible"][0]["ep"] == 2
    conf = write_config(result, str(tmp_path / "plan.json"), moe)
    assert conf["mt3d"]["train"]["fp8"] == {"recipe": "mxfp8", "dispatch": True}


def test_muon_counts_one_momentum_and_the_newton_schulz_gemms():
    """``mt3d plan --optimizer muon``: the matrices Muon orthogonalises (llama-1b: q, k, v, o, gate, up
    and down of every block, counted here from the dimensions) hold one fp32 momentum instead of two
    moments; the step adds 5 (4 m^2 n + 2 m^3) FLOPs per matrix at the GEMM rate, over pp and, with ZeRO,
    over the data-parallel ranks; ZeRO-3 and offload are rejected, and the written config is Muon's and
    passes ``mt3d train --check``."""
    import tempfile

    from mt3d.planner.muon import OPTIMIZERS, muon_cost, ns_flops

    cfg = resolve_model({"preset": "llama-1b"})
    v, h, hd, f = cfg.vocab_size, cfg.hidden, cfg.head_dim, cfg.ffn
    shapes = [(cfg.heads * hd, h), (cfg.kv_heads * hd, h), (cfg.kv_heads * hd, h), (h, cfg.heads * hd),
              (f, h), (f, h), (h, f)]  # fmt: skip
    cost = muon_cost(cfg, v)
    assert cost.fraction == pytest.approx(cfg.layers * sum(r * c for r, c in shapes) / cfg.num_params(v))
    assert cost.dense_flops == pytest.approx(cfg.layers * sum(ns_flops(r, c) for r, c in shapes))
    assert cost.expert_flops == 0 and ns_flops(4, 8) == 5 * (4 * 16 * 8 + 2 * 64)
    argv = ["--gpus", "8", "--gpu", "h100", "--global-batch", "64", "--seq-len", "2048", "--tensor", "1",
            "--pipeline", "1", "--zero", "1", "--offload", "none", "--micro-batch", "1"]  # fmt: skip
    adam, muon = (_planned(cfg.to_dict(), [*argv, "--optimizer", o])["feasible"][0] for o in OPTIMIZERS)
    states = cfg.num_params(v) * cost.fraction * 4 / 8  # one fp32 momentum fewer, over dp 8
    got = adam["memory"]["model_states"] - muon["memory"]["model_states"]
    assert got == pytest.approx(states / 1e9, rel=1e-3)  # the stage's parameters: the vocabulary padded
    from mt3d.planner.hardware import get_device

    dev = get_device("h100")
    ns = cost.dense_flops / 8 / (dev.gemm_tflops * 0.78 * 1e12)
    assert muon["optimizer_s"] - adam["optimizer_s"] == pytest.approx(ns, rel=1e-6)
    z3 = _planned(cfg.to_dict(), [*argv[:-6], "--zero", "3", "--micro-batch", "1", "--optimizer", "muon"])
    reasons = [r["reason"] for r in z3["rejected"]]
    assert not z3["feasible"] and any("mt3d runs Muon with ZeRO stage 0-2" in r for r in reasons)
    with tempfile.TemporaryDirectory() as d:
        result = _planned(cfg.to_dict(), argv + ["--optimizer", "muon"])
        conf = write_config(result, f"{d}/plan.json", {"preset": "llama-1b"}, cfg)
    assert conf["optimizer"]["type"] == "Muon" and conf["optimizer"]["params"]["momentum"] == 0.95
