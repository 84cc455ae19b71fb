"""Benchmarks that run in the suite: the GPU benchmark's CPU smoke mode and the collective count."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mt3d.bench.report import render
from mt3d.parallel.spawn import spawn

ROOT = Path(__file__).resolve().parents[1]


def bench(*args, timeout=600):
    out = subprocess.run(
        [sys.executable, "-m", "mt3d.bench", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [json.loads(line[6:]) for line in out.stdout.splitlines() if line.startswith("BENCH ")]
    assert len(lines) == 1
    return lines[0], out.stdout


def test_gpu_suite_smoke_mode_on_cpu(tmp_path):
    """The suite a lent GPU runs first, in its CPU smoke mode: the GEMM sweep and the one-GPU MFU
    benchmark (mt3d with and without selective recompute and with the optimizer offloaded, beside
    transformers + DeepSpeed), each in its own process, and the dated record with every step's output;
    --only runs some steps; without --smoke and a GPU: exit 2."""
    rec, text = bench("gpu-suite", "--smoke", "--out", str(tmp_path))
    assert [(s["step"], s["status"]) for s in rec["steps"]] == [("gemm", "ok"), ("gpu", "ok")]
    gemm, gpu = (s["bench"] for s in rec["steps"])
    assert gemm["smoke"] is True and [r["shape"] for r in gemm["rows"]] == ["square 256", "mlp-in h128"]
    assert all(r["tflops"] > 0 for r in gemm["rows"]) and gemm["best_tflops"] == max(
        r["tflops"] for r in gemm["rows"]
    )
    frameworks = sorted((r["model"], r["framework"]) for r in gpu["rows"])  # one model in smoke mode
    assert frameworks == sorted(
        ("gpt3-1.3b", f)
        for f in ("mt3d", "mt3d recompute=selective", "mt3d offload=opt-cpu", "transformers+deepspeed")
    )  # fmt: skip
    assert all(r["tokens_per_s"] > 0 and r["tflops"] > 0 for r in gpu["rows"]) and gpu["smoke"] is True
    assert "| gpt3-1.3b | mt3d |" in render([gpu])
    log = Path(rec["record"]).read_text()
    assert Path(rec["record"]).parent == tmp_path and "best measured" in log and "vs_transformers" in log
    out = subprocess.run([sys.executable, "-m", "mt3d.bench", "gpu-suite"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # fmt: skip
    assert out.returncode == 2 and "no GPU here" in out.stderr
    rec, _ = bench("gpu-suite", "--smoke", "--only", "gemm", "--out", str(tmp_path))
    assert [s["step"] for s in rec["steps"]] == ["gemm"] and rec["record"].endswith("-gemm.log")


def test_comm_benchmark_matches_megatron_theory():
    rec, _ = bench("comm", "--tp", "2")
    assert [(r["tp"], r["sp"]) for r in rec["rows"]] == [(2, False), (2, True)]
    for r in rec["rows"]:
        assert r["ratio"] == 1.0, r  # no collective beyond 8*b*s*h*(t-1)/t per layer (SP: 10, see comm.py)
    plain, sp = rec["rows"]
    assert plain["per_layer"] == {"all_reducex4096": 4.0}  # 2 forward + 2 backward
    calls = lambda prefix: sum(
        n for k, n in sp["per_layer"].items() if k.startswith(prefix) and k.endswith("x4096")
    )  # noqa: E731
    assert calls("all_gather") == 6.0 and calls("reduce_scatter") == 4.0  # 2 re-gathers of kept shards


def test_comm_benchmark_measures_each_context_exchange_at_its_volume():
    """The elements each cp rank sends per layer equal the planner's volumes (planner.traffic), and the
    halo's and the Gated DeltaNet layers' (state maps and the convolution's halo) do not grow with the
    sequence."""
    rec, text = bench("comm", "--tp", "", "--cp", "2")
    rows = rec["cp_rows"]
    assert [(r["kind"], r["seq_len"]) for r in rows] == [
        ("alltoall", 64), ("allgather", 64), ("halo", 64), ("halo", 128), ("gdn", 64), ("gdn", 128)
    ]  # fmt: skip
    assert all(r["ratio"] == 1.0 and r["elements_per_layer"] > 0 for r in rows), rows
    assert rows[2]["elements_per_layer"] == rows[3]["elements_per_layer"] < rows[1]["elements_per_layer"]
    assert rows[4]["elements_per_layer"] == rows[5]["elements_per_layer"]
    assert rows[0]["calls_per_layer_per_micro"] == "all_to_all_single:8"  # q, k, v, out; each way
    assert "| 2 | halo | 128 |" in render([rec])


def test_comm_benchmark_measures_the_expert_all_to_all_at_its_volume():
    """One MoE layer at ep 2 with 4 experts, top-2 and top-4: each token sent once per rank holding any
    of its experts (the counts, the rows and their routing metadata, the combined rows back, and the
    backward) at f D T (4 h + 4 k) + f ep elements per rank, D the ranks a token reaches; and once per
    assignment at f (4 T k h + E) (planner.traffic.ep_layer_elements), every k-subset routed in turn."""
    from mt3d.planner.traffic import ep_ranks_per_token

    args = ("--ep", "2", "--ep-experts", "4", "--ep-top-k", "2,4", "--ep-tokens", "12")
    rec, _ = bench("comm", "--tp", "", *args)
    rows = {(r["top_k"], r["dispatch"]): r for r in rec["ep_rows"]}
    assert sorted(rows) == [(2, "dedup"), (2, "per-assignment"), (4, "dedup"), (4, "per-assignment")]
    assert all(r["ratio"] == 1.0 for r in rows.values())
    assert [rows[2, d]["calls"] for d in ("dedup", "per-assignment")] == [5, 5]  # fp32: metadata as columns
    # a token's 2 of 4 experts share a rank in 2 of the 6 pairs: 5/3 ranks; its 4 of 4 span both
    assert ep_ranks_per_token(2, 4, 2) == pytest.approx(5 / 3) and ep_ranks_per_token(2, 4, 4) == 2.0
    for k in (2, 4):
        d = ep_ranks_per_token(2, 4, k)
        assert rows[k, "dedup"]["theory"] == pytest.approx(0.5 * 12 * d * (4 * 32 + 4 * k) + 0.5 * 2)
        assert rows[k, "per-assignment"]["theory"] == 0.5 * (4 * 12 * k * 32 + 4)
    # top-4 of 4: two rows a token instead of four
    assert rows[4, "dedup"]["elements_per_layer"] < 0.6 * rows[4, "per-assignment"]["elements_per_layer"]


def test_bubble_benchmark_runs_every_schedule():
    """Smoke: a tiny p=2 pipeline under DeepSpeed's 1F1B, the interleaved schedule, ZB-H1 and ZB-V; the
    figures are overhead-dominated at this size (the measured ones are in docs/benchmarks)."""
    from mt3d.pipeline import zero_bubble

    rec, text = bench("bubble", "--stages", "2", "--micro-batches", "4", "--virtual", "1,2", "--steps", "2",
                      "--hidden", "64", "--schedules", "1f1b,zb-h1,zbv", "--memory")  # fmt: skip
    rows = rec["rows"]
    assert [(r["schedule"], r["p"], r["m"], r["v"]) for r in rows] == [
        ("1f1b", 2, 4, 1), ("1f1b", 2, 4, 2), ("zb-h1", 2, 4, 1), ("zbv", 2, 4, 2)
    ]  # fmt: skip
    for r in rows:
        assert len(r["per_stage"]) == 2 and all(0 <= x < 1 for x in r["per_stage"])
        assert r["speedup"] == rows[0]["step_s"] / r["step_s"]
    for r in rows[:2]:
        assert r["theory"] == (r["p"] - 1) / (r["v"] * r["m"] + r["p"] - 1)
        assert r["ideal_speedup"] == (r["m"] + r["p"] - 1) / (r["m"] + (r["p"] - 1) / r["v"])
    for r in rows[2:]:  # the paper's unit-time figures: 0.077 and 0.040 at p 2, m 4
        idle = zero_bubble.replay(r["schedule"], 2, 4)["idle"]
        assert r["theory"] == sum(idle) / 2 and r["theory"] < rows[0]["theory"] / 2
    assert rows[1]["predicted"] is None and all(0 < rows[k]["predicted"] < 1 for k in (0, 2, 3))
    assert "| zbv | 2 | 4 | 2 |" in render([rec])
    # --memory: each rank's activation peak (MB), the largest against 1F1B's
    for r in rows:
        assert len(r["act_peak_mb"]) == 2 and all(x > 0 for x in r["act_peak_mb"])
        assert r["act_peak_vs_1f1b"] == pytest.approx(max(r["act_peak_mb"]) / max(rows[0]["act_peak_mb"]))


def test_activation_peak_counts_every_allocation_up_to_the_optimizer_step():
    """The bubble benchmark's activation peak: allocations and frees summed in time order until the
    optimizer step (a profiled region named as the instrumented engine names it), whose own buffers
    are left out."""
    from torch.profiler import record_function

    from mt3d.bench.bubble import activation_peak

    def step():
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(2_000_000)  # 8 MB: 12 MB held
        del a
        c = torch.empty(500_000)  # 10 MB held
        with record_function("OptimizerStep"):
            d = torch.empty(10_000_000)  # 40 MB more, after the passes
        del b, c, d

    assert activation_peak(step) == 12_000_000


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["gemm", "--smoke", "--reps", "0"], "argument --reps: must be >= 1, got 0"),
        (["comm", "--tp", "x"], "argument --tp: expected an integer, got 'x'"),
        (["comm", "--ep", "3"], "--ep 3 does not divide --ep-experts 8"),
        (["comm", "--ep", "2", "--ep-tokens", "100"], "--ep-tokens 100 is not a multiple of the 28"),
        (["comm", "--ep", "2", "--ep-top-k", "9"], "--ep-top-k 9 is more than --ep-experts 8"),
        (["attention", "--seq-lens", "0"], "argument --seq-lens: must be >= 1"),
        (["overhead", "--reps", "1.5"], "argument --reps: expected an integer"),
        (["overhead", "--global-batch", "10", "--micro", "4"], "--global-batch 10 is not a multiple of"),
        (["longctx", "--cp", "3", "--seq-len", "100"], "--seq-len 100 is not divisible by 2 x cp = 6"),
        (["memory", "--rows", "99"], "--rows 99: there are"),
        (["gpu-suite", "--smoke", "--out", "/proc/x"], "--out /proc/x is not writable"),
        (["bubble", "--virtual", "2", "--stages", "4", "--micro-batches", "6"], "micro-batches a multiple"),
        (["bubble", "--schedules", "zbv", "--layers-per-stage", "3"], "--layers-per-stage (3) even"),
        (["bubble", "--schedules", "zb-h2"], "--schedules"),
        (["fp8", "--hidden", "-16"], "argument --hidden: must be >= 1"),
        (["autoep", "--steps", "3"], "--steps must exceed the 3 warm-up steps"),
        (["autoep", "--ep", "3"], "--ep 3 does not divide the benchmark Mixtral's 8 experts"),
        (["autoep", "--folded-pairs", "-1"], "--folded-pairs must be 0 (no folded row) or more"),
        (["autoep", "--dispatch", "rank,node"], "--dispatch takes distinct values of rank, assignment"),
        (["autoep", "--dispatch", "rank,rank"], "got rank,rank"),
        (["autoep", "--ep", "1"], "--dispatch assignment needs --ep 2 or more"),
    ],
)  # fmt: skip
def test_benchmark_arguments_are_checked_before_any_process(argv, expect, capsys, monkeypatch):
    """Every benchmark's arguments are checked as the CLI checks its own: one line, exit 2, before any
    process is spawned (the spawn harness is made to fail if reached)."""
    from mt3d.bench.__main__ import main
    from mt3d.parallel import spawn

    monkeypatch.setattr(spawn, "spawn", lambda *a, **k: pytest.fail("a process was spawned"))
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals exit from the parser
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


def test_the_autoep_benchmarks_mt3d_half_trains_the_peer_model_alike_at_ep_1_and_2_and_folded(tmp_path):
    """``mt3d.bench autoep``'s mt3d side (the AutoEP side needs its own virtualenv: run by hand) on the
    model the peer script makes: the same losses and gradient norms at ep 2 as at ep 1 (dp 2), and in
    the folded row's whole-expert layout (tp 2 x dp 2, ep 4, expert_tensor 1) on the same rows, the
    optimizer DeepSpeed's ZeRO one, the loss falling on the benchmark's learnable rows; the folded row's
    GEMM shapes: whole experts, half as many per rank, as many rows each."""
    from mt3d.bench.autoep import expert_gemms, folded_layouts, mt3d_worker, token_batches
    from mt3d.bench.autoep_peer import make

    model, tokens = str(tmp_path / "mixtral"), str(tmp_path / "tokens.pt")
    make(model)
    torch.save(token_batches(4, 2), tokens)
    runs = [
        spawn(mt3d_worker, 2, model, tokens, str(tmp_path / f"ep{ep}"), ep, timeout=300)[0] for ep in (1, 2)
    ]
    # expert_dispatch "assignment" (each token once per expert, no routing metadata) trains alike
    each = spawn(mt3d_worker, 2, model, tokens, str(tmp_path / "each"), 2, 1, None, "assignment", timeout=300)
    assert runs[1]["dispatch_once"] and not each[0]["dispatch_once"]
    for a, b in zip(each[0]["steps"], runs[0]["steps"], strict=True):
        assert all(abs(a[key] - b[key]) <= 1e-5 * abs(b[key]) for key in ("loss", "grad_norm")), (a, b)
    layouts = folded_layouts(2)
    whole = layouts["whole"]
    runs.append(spawn(mt3d_worker, 4, model, tokens, str(tmp_path / "whole"), whole["ep"], whole["tp"],
                      whole["etp"], timeout=300)[0])  # fmt: skip
    one, two, folded = ([(s["loss"], s["grad_norm"]) for s in r["steps"]] for r in runs)
    for a, b in [*zip(two, one, strict=True), *zip(folded, one, strict=True)]:
        assert all(abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b)), (a, b)
    assert runs[1]["optimizer"] == runs[2]["optimizer"] == "ExpertZeroOptimizer" and one[-1][0] < one[0][0]
    split, gemm = expert_gemms(**layouts["split"]), expert_gemms(**whole)
    assert (split["experts_per_rank"], gemm["experts_per_rank"]) == (4, 2)
    assert split["rows_per_expert"] == gemm["rows_per_expert"] == 64 and gemm["up"] == "[64, 64] x [64, 256]"
    assert folded_layouts(8) is None  # 16 does not divide the 8 experts
