"""Zero-bubble pipeline orders (mt3d.pipeline.zero_bubble): made, replayed and checked without
processes. The bubble figures are the simulator's (pass times F = B = W, free transfers), the
paper's setting; 1F1B's is held against PTD-P's formula (FORMULAS.md)."""

import dataclasses

import pytest
import torch

from mt3d.pipeline import zero_bubble as zb
from mt3d.pipeline.zero_bubble import B, F, Pass, W

SIZES = [(2, 4), (2, 8), (3, 7), (4, 4), (4, 8), (4, 5)]


def mean_idle(run):
    return sum(run["idle"]) / len(run["idle"])


@pytest.mark.parametrize("p,m", SIZES)
def test_each_schedule_runs_every_pass_once_after_its_inputs_within_1f1bs_memory(p, m):
    one = zb.replay("1f1b", p, m)
    # 1F1B's order has PTD-P's bubble exactly, and holds p - r micro-batches on rank r
    assert mean_idle(one) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert one["peak"] == [min(p - r, m) for r in range(p)]
    for name in ("zb-h1", "zbv"):
        run = zb.replay(name, p, m)  # raises on a pass missing, repeated, early or over memory
        stages = zb.placement(name, p)
        passes = [x for order in run["orders"] for x in order]
        assert len(passes) == len(set(passes)) == 3 * len(stages) * m
        for r, order in enumerate(run["orders"]):
            assert {stages[x.stage] for x in order} == {r}
            for x in order:  # each W after its own B on the rank
                if x.kind == W:
                    assert order.index(Pass(B, x.stage, x.mb)) < order.index(x)
        # activations held: never more than 1F1B's peak (p micro-batches; the V's units are halves)
        assert max(run["peak"]) * (1 / zb.SCHEDULES[name]) <= max(one["peak"])
        assert mean_idle(run) < mean_idle(one)


def test_the_bubble_falls_as_the_paper_says():
    """ZB-H1 leaves (p - 1) F of each rank idle where 1F1B leaves (p - 1)(F + B + W) at p = 2 (the
    paper's third; at p 4, m 8 one pass more than that, as the order search finds it: 0.52 of 1F1B's);
    ZB-V leaves under a quarter of 1F1B's at p 2, m 4 and p 4, m 8."""
    for p, m, h1_ratio, v_ratio in [(2, 4, 0.40, 0.25), (4, 8, 0.55, 0.25), (2, 8, 0.40, 0.25)]:
        one = mean_idle(zb.replay("1f1b", p, m))
        h1, v = mean_idle(zb.replay("zb-h1", p, m)), mean_idle(zb.replay("zbv", p, m))
        assert h1 <= h1_ratio * one and v <= v_ratio * one, (p, m, one, h1, v)
    assert zb.replay("zb-h1", 2, 4)["makespan"] == 3 * 4 + 1  # m (F + B + W) + (p - 1) F


def test_the_v_puts_the_first_and_last_stage_on_rank_0():
    assert zb.placement("zbv", 4) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert zb.placement("zb-h1", 4) == [0, 1, 2, 3]
    # the loss's gradient turns around on rank 0: its first B is of the last stage
    first_b = next(x for x in zb.orders("zbv", 2, 4)[0] if x.kind == B)
    assert first_b.stage == 3


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv"])
def test_the_chart_draws_the_replay(name):
    """docs/training.md's figure: each rank's row holds its passes (F, B, W; the V's second chunk in
    lower case) and as many idle slots as the replay's idle fraction of the step."""
    run, rows = zb.replay(name, 2, 4), zb.chart(name, 2, 4).splitlines()
    slots = round(run["makespan"] * zb.SCHEDULES[name])
    for r, row in enumerate(rows):
        body = row.split("|")[1]
        assert len(body) == 2 * slots and body.count("..") / slots == pytest.approx(run["idle"][r])
        kinds = {body[k] for k in range(0, len(body), 2)} - {"."}
        assert kinds == {"1f1b": {"F", "B"}, "zb-h1": {"F", "B", "W"}, "zbv": set("FBWfbw")}[name]


def test_the_simulator_takes_each_stages_own_pass_times():
    """``simulate(per_pass=...)`` (the bubble benchmark's prediction): equal times give the plain run's
    figures; a loss stage twice as slow (the V's rank 0, chunk 1) makes the step longer and the other
    rank idle more."""

    def times(loss):
        cells = {(r, c): 0.5 for r in range(2) for c in range(2)}
        return {k: {**cells, (0, 1): 0.5 * (loss if k != "wgt" else 1)} for k in ("fwd", "bwd", "wgt")}

    plain = zb.simulate("zbv", 2, 4)
    assert zb.simulate("zbv", 2, 4, per_pass=times(1.0)) == plain
    slow = zb.simulate("zbv", 2, 4, per_pass=times(2.0))
    assert slow["makespan"] > plain["makespan"] and slow["idle"][1] > plain["idle"][1]


def test_the_planners_bubble_is_the_replays():
    """``bubble_share`` (the planner's model): ZB-V's (p - 1) / (6 m) is the replay's exactly; ZB-H1's
    (p - 1) / (3 m), the paper's, is the replay's at p 2 and under it by at most a third at p 4."""
    for p, m in ((2, 4), (3, 6), (4, 8), (4, 16), (8, 16)):
        idle = sum(zb.replay("zbv", p, m)["idle"]) / p
        share = zb.bubble_share("zbv", p, m)
        assert idle == pytest.approx(share / (1 + share), abs=1e-12), (p, m)
    h1 = lambda p, m: sum(zb.replay("zb-h1", p, m)["idle"]) / p  # noqa: E731
    assert h1(2, 4) == pytest.approx(1 / 13) and zb.bubble_share("zb-h1", 2, 4) == pytest.approx(1 / 12)
    share = zb.bubble_share("zb-h1", 4, 16)
    assert share / (1 + share) < h1(4, 16) <= (4 / 3 * share) / (1 + 4 / 3 * share) + 1e-12
    assert zb.bubble_share("1f1b", 4, 8, v=2) == 3 / 16


def test_replay_takes_transfer_and_pass_times():
    """Slower transfers stretch every schedule; B's and W's times are the ones given (the V's
    passes are half a rank's layers)."""
    for name in ("1f1b", "zb-h1", "zbv"):
        free = zb.replay(name, 4, 8)
        slow = zb.replay(name, 4, 8, p2p=0.5)
        assert slow["makespan"] > free["makespan"]
    one = zb.replay("1f1b", 2, 4, fwd=1.0, bwd=2.0, wgt=0.5)
    assert one["makespan"] == pytest.approx((4 + 1) * 3.5)  # (m + p - 1)(F + B + W)


def test_replay_refuses_orders_that_cannot_run():
    good = zb.orders("zb-h1", 2, 4)

    def broken(edit):
        programs = [list(o) for o in good]
        edit(programs)
        return programs

    def w_before_b(programs):
        i = programs[1].index(Pass(W, 1, 0))
        j = programs[1].index(Pass(B, 1, 0))
        programs[1][i], programs[1][j] = programs[1][j], programs[1][i]

    def missing(programs):
        programs[0].remove(Pass(W, 0, 3))

    def repeated(programs):
        programs[0].append(Pass(W, 0, 3))

    def backwards_first(programs):  # rank 0 waits for a B that needs its own later forward
        programs[0].remove(Pass(F, 0, 0))
        programs[0].append(Pass(F, 0, 0))

    for edit in (w_before_b, missing, repeated, backwards_first):
        with pytest.raises(AssertionError):
            zb.replay("zb-h1", 2, 4, broken(edit))


def test_bad_sizes_and_names_are_one_line():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb-h2'; choose one of 1f1b, zb-h1, zbv"):
        zb.check("zb-h2", 4, 8)
    with pytest.raises(ValueError, match="needs pipeline >= 2, got 1"):
        zb.check("zbv", 1, 8)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        zb.check("zb-h1", 2, 0)


def test_passes_are_plain_values():
    x = Pass(F, 1, 2)
    assert dataclasses.astuple(x) == ("F", 1, 2) and x == Pass("F", 1, 2) and hash(x) == hash(Pass("F", 1, 2))


TIMES = [dict(), dict(bwd=2.0, wgt=0.5), dict(bwd=0.7, wgt=1.3, p2p=0.3), dict(p2p=0.1)]


@pytest.mark.parametrize("name", list(zb.SCHEDULES))
def test_the_instruction_programs_run_the_orders_through_the_engines_simulator(name):
    """``rank_programs`` under ``pipeline.schedule``'s simulator (posted transfers, batches completing
    in order, every message the one its receiver expects): no deadlock at any size or pass times,
    every pass once, and at unit times the orders' own makespan (no transfer holds anything up)."""
    from mt3d.pipeline.schedule import COMMIT, LOCAL_ACT, SEND_ACT, SEND_GRAD

    for p in (2, 3, 4):
        for m in (1, 2, 3, p, 2 * p + 1):
            stages = len(zb.placement(name, p))
            programs = zb.rank_programs(name, p, m)
            assert all(step[-1].kind == COMMIT for steps in programs for step in steps)
            ops = [o for steps in programs for step in steps for o in step]
            remote = sum(o.kind in (SEND_ACT, SEND_GRAD) for o in ops)
            assert remote == 2 * m * (p - 1) * zb.SCHEDULES[name]  # the V turns on its rank
            assert sum(o.kind == LOCAL_ACT for o in ops) == (m if name == "zbv" else 0)
            for times in TIMES:
                sim = zb.simulate(name, p, m, **times)
                assert (sim["fwd"], sim["bwd"], sim["messages"]) == (stages * m, stages * m, remote)
                assert sim.get("wgt", 0) == (0 if name == "1f1b" else stages * m)
                ideal = zb.replay(name, p, m, **times)["makespan"]
                if not times:
                    assert sim["makespan"] == pytest.approx(ideal, abs=1e-12)
                else:  # fixed programs cannot adapt to other times as the replay's passes do
                    assert ideal - 1e-9 <= sim["makespan"] <= 1.16 * ideal


def test_the_simulator_refuses_a_broken_program():
    """A receive out of the sender's order, a W before its B, a hand-over to another rank: each an
    AssertionError naming the rank."""
    from mt3d.pipeline.schedule import LOCAL_GRAD, RECV_ACT, RECV_GRAD, WGT, Op, simulate_programs

    def run(programs, name="zbv", p=2):
        return simulate_programs(programs, zb.stages(name, p))

    good = zb.rank_programs("zbv", 2, 3)
    run(good)
    recvs = [
        (k, i)
        for k, step in enumerate(good[1])
        for i, o in enumerate(step)
        if o.kind in (RECV_ACT, RECV_GRAD)
    ]
    swapped = [[list(s) for s in steps] for steps in good]
    (k1, i1), (k2, i2) = recvs[0], recvs[1]
    swapped[1][k1][i1], swapped[1][k2][i2] = swapped[1][k2][i2], swapped[1][k1][i1]
    with pytest.raises(AssertionError, match="rank 1 expected"):
        run(swapped)
    early = [[list(s) for s in steps] for steps in good]
    w = next(k for k, step in enumerate(early[0]) if step[0].kind == WGT)
    early[0].insert(0, early[0].pop(w))
    with pytest.raises(AssertionError, match="rank 0: .* before its input gradient"):
        run(early)
    turned = [[list(s) for s in steps] for steps in zb.rank_programs("zb-h1", 2, 2)]
    turned[1].insert(-1, [Op(LOCAL_GRAD, 0, 0)])
    with pytest.raises(AssertionError, match="hands over to rank 0"):
        run(turned, "zb-h1")


def zb_config(tmp_path, name, pp=2, schedule="zb-h1", model=None, **train):
    from helpers import TINY_LLAMA, tiny_config

    raw = tiny_config(tmp_path / name, model=model or TINY_LLAMA, pp=pp, **train)
    raw["mt3d"]["parallel"]["schedule"] = schedule
    raw["mt3d"]["parallel"]["virtual_stages"] = 2 if schedule == "zbv" else 1
    return raw


def test_zb_h1_trains_as_one_process_in_fp32_and_as_1f1b_in_bf16_and_resumes_under_1f1b(tmp_path):
    """ZB-H1 on DeepSpeed's pipeline engine (pp 2, 5 steps, 4 micro-batches): losses and gradient norms
    equal the one-process run's within 1e-5 in fp32, at dp 1 and at pp 2 x dp 2 (ZeRO-1's gradient
    hooks see W's gradients); in bf16 they equal 1F1B's run on the same engine bit for bit, with
    ZeRO-1's bf16 gradients and with fp32 gradient accumulation (DeepSpeed's BF16 optimizer, which
    takes W's gradients through its hooks); the step-3 checkpoint resumes under plain 1F1B
    (DeepSpeed's own schedule) onto the same steps. At pp 2 x dp 2 the data-parallel reduction
    overlapped with the last B and W (``overlap.grad_reduce``) gives the same steps bit for bit under
    ZB-H1 and ZB-V (with a tied embedding, one parameter that rank 0's two chunks finish)."""
    from helpers import TINY_EVERY, run_grouped, step_records

    step3 = str(tmp_path / "zb" / "checkpoints" / "step_00000003")
    bf16 = {"bf16": {"enabled": True}}
    # gradients accumulated in fp32: DeepSpeed's BF16 optimizer, whose copy to fp32 must follow W
    fp32_accum = {**bf16, "data_types": {"grad_accum_dtype": "fp32"}}

    def plain(name, extra):  # 1F1B on the same engine as the zero-bubble one
        raw = {**zb_config(tmp_path, name, schedule="1f1b"), **extra}
        raw["mt3d"]["train"]["overlap"] = {"p2p": True}
        return raw

    dp2 = zb_config(tmp_path, "zb-dp2", global_batch=16)  # pp 2 x dp 2: ZeRO-1 partitions over dp
    # the data-parallel reduction overlapped: buckets final in the last B (norms) or the last W (linears)
    reduce = {"grad_reduce": True, "bucket_elements": 3000}
    # ZB-V with a tied embedding: the embedding and the head one parameter on rank 0, finished twice
    dp2_reduce, zbv, zbv_reduce = (
        zb_config(tmp_path, name, schedule=schedule, global_batch=16, model=TINY_EVERY if schedule == "zbv"
                  else None, **({"overlap": reduce} if on else {}))
        for name, schedule, on in (("zb-dp2-reduce", "zb-h1", True), ("zbv-dp2", "zbv", False),
                                   ("zbv-dp2-reduce", "zbv", True))
    )  # fmt: skip
    ref, zb_fp32, resumed, zb_bf16, one_bf16, zb_accum, one_accum, ref16, zb_dp2, *overlapped = run_grouped([
        (1, zb_config(tmp_path, "ref", pp=1, schedule="1f1b")),
        (2, zb_config(tmp_path, "zb", save_interval=3)),
        (2, zb_config(tmp_path, "resumed", schedule="1f1b", resume=step3)),
        (2, {**zb_config(tmp_path, "zb-bf16"), **bf16}),
        (2, plain("1f1b-bf16", bf16)),
        (2, {**zb_config(tmp_path, "zb-accum"), **fp32_accum}),
        (2, plain("1f1b-accum", fp32_accum)),
        (1, zb_config(tmp_path, "ref16", pp=1, schedule="1f1b", global_batch=16)),
        (4, dp2),
        (4, dp2_reduce),
        (4, zbv),
        (4, zbv_reduce),
    ])  # fmt: skip
    for got, want in ((zb_fp32, ref), (zb_dp2, ref16)):
        got, want = step_records(got), step_records(want)
        assert len(got) == len(want) == 5 and want[-1]["loss"] < want[0]["loss"]
        for a, b in zip(got, want, strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    ref = step_records(ref)
    resumed = step_records(resumed)
    assert [r["step"] for r in resumed] == [4, 5]
    for a, b in zip(resumed, ref[3:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    pick = lambda rs: [(r["loss"], r["grad_norm"]) for r in step_records(rs)]  # noqa: E731
    assert pick(zb_bf16) == pick(one_bf16) and len(pick(zb_bf16)) == 5
    assert pick(zb_accum) == pick(one_accum) and len(pick(zb_accum)) == 5
    dp2_reduce, zbv, zbv_reduce = overlapped
    assert pick(dp2_reduce) == pick(zb_dp2) and pick(zbv_reduce) == pick(zbv) and len(pick(zbv)) == 5


def test_zbv_trains_as_one_process_with_the_v_placement_and_resumes_under_zb_h1(tmp_path):
    """ZB-V (two chunks per rank in a V, pp 2 and tp 2 x pp 4, fp32, 5 steps) equals one process within
    1e-5 (losses and gradient norms): the tiny Llama, with its evaluation (the V's forwards alone);
    every block option with a tied embedding (the embedding and the head one module on rank 0) and 3
    micro-batches, not a multiple of pipeline; tp 2 x pp 4 (world 8) with sequence parallelism and
    selective recompute on 8 layers. The step-3 checkpoint resumes under ZB-H1 (one chunk per rank)
    onto the same steps."""
    from mt3d.training.metrics import read_metrics

    from helpers import TINY_EVERY, TINY_LLAMA, run_grouped, step_records

    step3 = str(tmp_path / "zbv" / "checkpoints" / "step_00000003")
    deep = {**TINY_LLAMA, "layers": 8}
    wide = zb_config(tmp_path, "tp2-pp4", pp=4, schedule="zbv", model=deep,
                     recompute={"granularity": "selective"})  # fmt: skip
    wide["mt3d"]["parallel"].update(tensor=2, sequence_parallel=True)
    evaluated = {"eval_interval": 5, "eval_batches": 1}
    runs = run_grouped([
        (1, zb_config(tmp_path, "ref", pp=1, schedule="1f1b", **evaluated)),
        (2, zb_config(tmp_path, "zbv", schedule="zbv", save_interval=3, **evaluated)),
        (2, zb_config(tmp_path, "resumed", resume=step3)),
        (1, zb_config(tmp_path, "every-ref", pp=1, schedule="1f1b", model=TINY_EVERY, global_batch=6)),
        (2, zb_config(tmp_path, "every", schedule="zbv", model=TINY_EVERY, global_batch=6)),
        (1, zb_config(tmp_path, "deep-ref", pp=1, schedule="1f1b", model=deep)),
        (8, wide),
    ])  # fmt: skip
    ref, zbv, resumed, every_ref, every, deep_ref, tp_pp = runs
    for got, want in ((zbv, ref), (every, every_ref), (tp_pp, deep_ref)):
        got, want = step_records(got), step_records(want)
        assert len(got) == len(want) == 5 and want[-1]["loss"] < want[0]["loss"]
        for a, b in zip(got, want, strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    evals = [[r["eval_loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "eval_loss" in r]
             for name in ("zbv", "ref")]  # fmt: skip
    assert len(evals[0]) == 1 and abs(evals[0][0] - evals[1][0]) <= 1e-5 * evals[1][0], evals
    resumed, ref = step_records(resumed), step_records(ref)
    assert [r["step"] for r in resumed] == [4, 5]
    for a, b in zip(resumed, ref[3:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)


def weight_passes_worker(raw):
    """One training step of ``raw``'s engine: for each of this rank's W passes, the weight gradients it
    ran and the FP8 GEMMs (``torch._scaled_mm``) among them."""
    from mt3d.bench.common import build_engine, train_step
    from mt3d.ds.interleaved import WeightPass

    _, layout, rt, engine, data, _ = build_engine(raw)
    seen, run, scaled_mm = [], engine._INSTRUCTION_MAP[WeightPass], torch._scaled_mm
    calls = [0]

    def counting_mm(*args, **kwargs):
        calls[0] += 1
        return scaled_mm(*args, **kwargs)

    def counting(self, buffer_id, chunk):
        queued, calls[0] = len(self._weight_grads[buffer_id]), 0
        run(self, buffer_id, chunk)
        seen.append((queued, calls[0]))

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, WeightPass: counting}
    torch._scaled_mm = counting_mm
    try:
        train_step(engine, layout, rt, data, layout.micro_batch, 0)
    finally:
        torch._scaled_mm = scaled_mm
    return seen


def fp8_zb_config(tmp_path, name, schedule, recipe, tp=1):
    """A bf16 run with FP8 linears (1F1B on the zero-bubble schedules' own engine: posted transfers)."""
    raw = zb_config(tmp_path, name, schedule=schedule, tp=tp)
    raw["bf16"] = {"enabled": True}
    raw["mt3d"]["parallel"]["sequence_parallel"] = tp > 1
    raw["mt3d"]["train"]["fp8"] = {"recipe": recipe, "all_gather": tp > 1}
    if schedule == "1f1b":
        raw["mt3d"]["train"]["overlap"] = {"p2p": True}
    return raw


def test_the_engine_runs_a_w_pass_per_micro_batch_with_the_linears_weight_gradients(tmp_path):
    """The W passes really run (the results above would match under 1F1B too): one per micro-batch on
    each rank, each computing the weight gradients of that stage's linears (2 blocks of 4 linears; the
    last stage's output head too); with FP8 linears each block linear's weight-gradient GEMM is an
    FP8 one in W (the output head keeps its precision)."""
    from mt3d.parallel.spawn import spawn

    plain, fp8 = zb_config(tmp_path, "w"), fp8_zb_config(tmp_path, "w-fp8", "zb-h1", "tensorwise")
    assert spawn(weight_passes_worker, 2, plain, timeout=240) == [[(8, 0)] * 4, [(9, 0)] * 4]
    assert spawn(weight_passes_worker, 2, fp8, timeout=240) == [[(8, 8)] * 4, [(9, 8)] * 4]


def test_fp8_linears_under_the_zero_bubble_schedules_train_as_under_1f1b(tmp_path):
    """FP8 linears with their weight-gradient GEMMs deferred to W (the output gradient's FP8 cast and
    the kept FP8 input rows held for W under tensorwise; the bf16 rows, cast per GEMM, under rowwise;
    SP's shard gathered again in W after the FP8 all-gather forward): ZB-H1 at pp 2 (tensorwise) and
    ZB-V at tp 2 x pp 2 with SP and rowwise's FP8 all-gather take the same 5 steps bit for bit as
    1F1B on the same engine (losses and gradient norms, bf16)."""
    from helpers import run_grouped, step_records

    runs = run_grouped([
        (2, fp8_zb_config(tmp_path, "zb", "zb-h1", "tensorwise")),
        (2, fp8_zb_config(tmp_path, "plain", "1f1b", "tensorwise")),
        (4, fp8_zb_config(tmp_path, "zbv", "zbv", "rowwise", tp=2)),
        (4, fp8_zb_config(tmp_path, "plain-tp", "1f1b", "rowwise", tp=2)),
    ])  # fmt: skip
    zb, plain, zbv, plain_tp = ([(r["loss"], r["grad_norm"]) for r in step_records(rs)] for rs in runs)
    assert zb == plain and zbv == plain_tp and len(zb) == len(zbv) == 5
    assert zb != zbv  # the two recipes (and layouts) round differently: each pair compared its own


def test_compiled_zb_h1_trains_as_one_process_with_its_w_passes(tmp_path):
    """train.compile (inductor, CPU) under ZB-H1 at pp 2: the same 5 steps as one process within 1e-5
    (fp32 losses and gradient norms), and each W pass still runs its stage's linears' weight
    gradients (8 and 9, as uncompiled)."""
    from mt3d.parallel.spawn import spawn

    from helpers import run_grouped, step_records

    ref, got = (step_records(r) for r in run_grouped([
        (1, zb_config(tmp_path, "ref", pp=1, schedule="1f1b")),
        (2, zb_config(tmp_path, "zb", compile=True)),
    ], timeout=900))  # fmt: skip
    assert len(ref) == len(got) == 5
    for a, b in zip(got, ref, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    passes = spawn(weight_passes_worker, 2, zb_config(tmp_path, "w", compile=True), timeout=600)
    assert passes == [[(8, 0)] * 4, [(9, 0)] * 4]


def test_compiled_blocks_defer_their_linears_weight_gradients():
    """train.compile under the zero-bubble schedules: torch.compile traces a block's backward ahead of
    time, with no B running, so a linear traced into it would compute its weight gradient in B and
    leave W nothing (found: 0 of 4 queued). Under a split backward each deferring linear runs outside
    the trace (``deferred.deferrable``; a graph break around each of the 4, the code between them
    compiled): the compiled block queues the same 4 weight gradients as the eager one, and W gives the
    same gradients. Without the split the block still traces whole (tests/test_fp8.py)."""
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.parallel import deferred
    from mt3d.parallel.state import AxisGroup

    cfg = ModelConfig(hidden=64, layers=2, heads=4, position="rope", norm="rmsnorm", mlp="swiglu",
                      bias=False, max_seq_len=32, ffn=128)  # fmt: skip
    torch.manual_seed(0)
    deferred.split_backward(True)
    try:
        block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), dtype=torch.float32), 0)
        x = torch.randn(2, 32, 64, requires_grad=True)
        runs = []
        for run in (block, torch.compile(block, backend="aot_eager")):
            block.zero_grad(set_to_none=True)
            y = run(x)
            with deferred.deferring(deferred.WeightGrads()) as queue:
                y.square().sum().backward()
            in_b = {n for n, p in block.named_parameters() if p.grad is not None}
            queued = len(queue)
            queue.run()
            runs.append((queued, in_b, {n: p.grad.clone() for n, p in block.named_parameters()}))
        explained = torch._dynamo.explain(block)(x)
    finally:
        deferred.split_backward(False)
        torch._dynamo.reset()
    (eager, eager_b, eager_grads), (compiled, compiled_b, compiled_grads) = runs
    assert eager == compiled == 4 and eager_b == compiled_b == {"norm1.weight", "norm2.weight"}
    for name, g in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], g, rtol=1e-5, atol=1e-6, msg=name)
    assert explained.graph_count == 5 and explained.graph_break_count == 4


@pytest.mark.parametrize(
    "parallel,train,message",
    [
        ({"schedule": "zb-h2"}, {}, "unknown mt3d.parallel.schedule 'zb-h2'; choose one of 1f1b, zb-h1, zbv"),
        ({"schedule": "zbv", "virtual_stages": 1}, {}, "two chunks per rank in a V: set virtual_stages to 2"),
        ({"schedule": "zb-h1", "pipeline": 1}, {}, "it needs pipeline >= 2"),
        ({"schedule": "zb-h1", "virtual_stages": 2}, {}, "runs one chunk per rank: set virtual_stages to 1"),
        (  # interleaved 1F1B's minimum: a multiple of pipeline (the zero-bubble ones run any count)
            {"schedule": "1f1b", "virtual_stages": 2},
            {"batch": 6},
            "the interleaved schedule needs micro-batches per step (3 = gradient_accumulation_steps)",
        ),
    ],
)
def test_bad_schedules_are_refused_before_process_groups(tmp_path, parallel, train, message):
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    raw = zb_config(tmp_path, "bad", global_batch=train.pop("batch", 8))
    raw["mt3d"]["parallel"].update(parallel)
    raw["mt3d"]["train"].update(train)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(from_dict(raw), raw["mt3d"]["parallel"]["pipeline"], resolve_model(raw["mt3d"]["model"]))
