"""The interleaved 1F1B schedule (virtual stages): the schedule itself, parity with one process at
every layout, exact resume and reshard to and from v = 1, and bad input."""

import pytest

from mt3d.config import ConfigError, from_dict, resolve_model, validate
from mt3d.parallel.spawn import spawn
from mt3d.pipeline.schedule import backward_item, forward_item, rank_steps, simulate, warmup

from helpers import TINY_GPT, TINY_LLAMA, run_grouped, step_records, tiny_config

# 8 blocks: enough for 4 stages x 2 chunks
MODELS = {"gpt2": {**TINY_GPT, "layers": 8}, "llama": {**TINY_LLAMA, "layers": 8}}
RTOL = 1e-5


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_the_schedule_runs_every_pass_once_without_deadlock(p, v):
    """Rendezvous FIFO channels per pair (NCCL has no tags), p = 2 included (up- and downstream peer
    are the same rank), training and evaluation, m from p to 4p; each commit waited for, and posted
    ahead with the split steps (mt3d.train.overlap.p2p)."""
    for m in range(p, 4 * p + 1, p):
        for train in (True, False):
            for posted in (False, True):
                counts = simulate(p, v, m, train, posted=posted)
                assert counts["fwd"] == p * v * m and counts.get("bwd", 0) == (p * v * m if train else 0)


@pytest.mark.parametrize("p, v", [(2, 1), (4, 1), (4, 2), (8, 2)])
def test_posted_transfers_wait_only_on_the_first_micro_batchs_trip(p, v):
    """Transfers a tenth of a chunk's forward: waiting at every commit exposes one per step or more;
    posted ahead with a commit after each pass only the first micro-batch's trip through the p v
    virtual stages and back waits, 2 (p v - 1) transfers, whatever m. Posted with one commit per step
    (the activation leaves after the backward that follows its forward) hides nothing."""
    f, b = 1.0 / v, 2.0 / v
    for m in (2 * p, 4 * p):
        free = simulate(p, v, m, fwd_s=f, bwd_s=b)["makespan"]
        exposed = {
            mode: (simulate(p, v, m, fwd_s=f, bwd_s=b, p2p_s=0.1 * f, posted=posted, split=split)["makespan"]
                   - free) / (0.1 * f)
            for mode, posted, split in (("blocking", False, False), ("posted", True, True),
                                        ("one commit", True, False))
        }  # fmt: skip
        assert exposed["posted"] == pytest.approx(2 * (p * v - 1))
        assert exposed["blocking"] >= v * m and exposed["one commit"] == pytest.approx(exposed["blocking"])
        # waiting as mt3d's engine does (each batch in posting order, sends included) changes nothing here
        in_order = simulate(p, v, m, fwd_s=f, bwd_s=b, p2p_s=0.1 * f, posted=True, in_order=True)
        assert (in_order["makespan"] - free) / (0.1 * f) == pytest.approx(exposed["posted"])


def test_in_order_waits_expose_more_once_a_transfer_outlasts_part_of_a_forward():
    """The engine's in-order waits (``simulate(in_order=True)``) against waiting on the input alone,
    which ``costs.pp_posted_seconds`` follows: equal while a transfer takes at most a quarter of a
    chunk's forward (at p 8, v 2, m 16; at v 1 and at p 4 up to half); beyond, at p 8, v 1, m 16 with
    transfers 0.8 of a forward 18.5 transfer times exposed instead of 14, at 1.0 20 instead of 14,
    and at v 2 with 0.3 31.3 instead of 30 (the planner is optimistic there)."""

    def exposed(p, v, m, ratio, in_order):
        f, b = 1.0 / v, 2.0 / v
        free = simulate(p, v, m, fwd_s=f, bwd_s=b)["makespan"]
        run = simulate(p, v, m, fwd_s=f, bwd_s=b, p2p_s=ratio * f, posted=True, in_order=in_order)
        return (run["makespan"] - free) / (ratio * f)

    for p, v, bound in ((8, 1, 0.5), (8, 2, 0.25), (4, 2, 0.5)):
        for ratio in (0.1, bound):
            assert exposed(p, v, 16, ratio, True) == pytest.approx(exposed(p, v, 16, ratio, False))
        assert exposed(p, v, 16, bound + 0.05, True) > exposed(p, v, 16, bound + 0.05, False) + 0.3
    assert (exposed(8, 1, 16, 0.8, True), exposed(8, 1, 16, 0.8, False)) == pytest.approx((18.5, 14.0))
    assert (exposed(8, 1, 16, 1.0, True), exposed(8, 1, 16, 1.0, False)) == pytest.approx((20.0, 14.0))
    assert (exposed(8, 2, 16, 0.3, True), exposed(8, 2, 16, 0.3, False)) == pytest.approx((31 + 1 / 3, 30.0))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_the_schedule_idles_exactly_ptd_ps_bubble(p):
    """With chunks of 1/v stage (forward f/v, backward b/v) and free p2p, every rank idles exactly
    (p - 1) / (v m + p - 1) of the step: interleaving divides the bubble by v, whatever b/f."""
    for v in (1, 2, 4):
        for m in (p, 2 * p, 4 * p):
            for f, b in ((1.0, 2.0), (1.0, 1.0)):
                sim = simulate(p, v, m, fwd_s=f / v, bwd_s=b / v)
                theory = (p - 1) / (v * m + p - 1)
                assert sim["makespan"] == pytest.approx((m + (p - 1) / v) * (f + b))
                assert sim["idle"] == pytest.approx([theory] * p), (v, m, f, b)


def test_ptd_p_order_and_warmup():
    """Megatron-LM's order for p = 2, v = 2, m = 4: forwards go chunk 0 for micro-batches 0-1, chunk 1
    for 0-1, then chunk 0 for 2-3...; backwards run the chunks in reverse; rank 0 warms up with
    (p - r - 1) * 2 + (v - 1) * p = 4 forwards, rank 1 with 2; m = p runs all forwards first."""
    assert [forward_item(k, 2, 2) for k in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3)]
    assert [backward_item(k, 2, 2) for k in range(4)] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    assert [warmup(2, 2, 4, r) for r in (0, 1)] == [4, 2] and warmup(2, 2, 2, 0) == 4
    first_bwd = next(i for i, s in enumerate(rank_steps(2, 2, 4, 0)) if any(o.kind == "bwd" for o in s))
    fwds_before = sum(o.kind == "fwd" for s in rank_steps(2, 2, 4, 0)[:first_bwd] for o in s)
    assert fwds_before == 4


def layout_config(tmp_path, model, tp, pp, v, **kw):
    raw = tiny_config(tmp_path / f"run_{tp}{pp}{v}{len(kw)}", model=model, tp=tp, pp=pp, **kw)
    raw["mt3d"]["parallel"]["virtual_stages"] = v
    return raw


def assert_same(got, ref, what):
    assert [r["step"] for r in got] == [r["step"] for r in ref] and len(ref) == 5
    for a, b in zip(got, ref):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), f"{what} step {a['step']} {key}: {a} vs {b}"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_interleaved_layout_matches_one_process(tmp_path, arch):
    model = MODELS[arch]
    layouts = [(1, 1, 1, 1), (1, 2, 1, 2), (1, 4, 1, 2), (2, 2, 2, 2), (1, 2, 1, 3)]
    runs = [(tp * pp * dp, layout_config(tmp_path, model, tp, pp, v)) for tp, pp, dp, v in layouts]
    if arch == "gpt2":  # sequence parallelism and recompute through the interleaved chunks
        raw = tiny_config(tmp_path / "sp", model=model, tp=2, pp=2, recompute={"interval": 1})
        raw["mt3d"]["parallel"].update(virtual_stages=2, sequence_parallel=True)
        layouts.append("(2, 2, 1, 2) SP + recompute")
        runs.append((4, raw))
    ref, *got = run_grouped(runs)
    assert ref[-1]["loss"] < ref[0]["loss"]
    for layout, records in zip(layouts[1:], got, strict=True):
        assert_same(records, ref, f"{arch} (tp, pp, dp, v)={layout}")


def test_interleaved_checkpoints_resume_exactly_and_reshard(tmp_path):
    model = MODELS["gpt2"]

    def config(d, steps, pp, v, **kw):
        raw = tiny_config(tmp_path / d, model=model, pp=pp, steps=steps, **kw)
        raw["mt3d"]["parallel"]["virtual_stages"] = v
        return raw

    def losses(records):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(records)]

    step3 = tmp_path / "b" / "checkpoints" / "step_00000003"
    targets = [(1, 1), (4, 1), (4, 2)]
    straight, _, resumed, *got = run_grouped(
        [(2, config("a", 6, 2, 2)), (2, config("b", 3, 2, 2, save_at_end=True)),
         (2, config("b", 6, 2, 2, resume="auto"))]
        + [(pp, config(f"to{pp}{v}", 6, pp, v, resume=str(step3))) for pp, v in targets]
    )  # fmt: skip
    straight = losses(straight)
    assert losses(resumed)[3:] == straight[3:]  # bit for bit
    for (pp, v), records in zip(targets, got, strict=True):
        assert [s for s, _, _ in losses(records)] == [4, 5, 6]
        for (_, a, ga), (_, b, gb) in zip(losses(records), straight[3:]):
            assert abs(a - b) <= RTOL * abs(b) and abs(ga - gb) <= RTOL * abs(gb), (pp, v, straight)


def test_nan_skipping_and_sigterm_save_at_v2(tmp_path):
    """A NaN gradient on the last rank skips the step everywhere; SIGTERM saves and exits 75; the run
    resumes to the losses of one that was never stopped."""
    from mt3d.checkpoint.manager import complete_checkpoints
    from mt3d.training.session import EXIT_PREEMPTED

    from helpers import train_rc_worker

    def config(d):
        raw = tiny_config(tmp_path / d, model=MODELS["llama"], pp=2, steps=7)
        raw["mt3d"]["parallel"]["virtual_stages"] = 2
        return raw

    straight = spawn(train_rc_worker, 2, config("a"), env={"MT3D_FAULTS": "nan_grad@3:1"})
    assert [rc for rc, _ in straight] == [0, 0]
    ref = {r["step"]: r for r in step_records(straight[0][1])}
    assert ref[3]["skipped"] == 1 and ref[3]["grad_norm"] is None and ref[4]["bad_streak"] == 0
    raw = config("b")
    stopped = spawn(train_rc_worker, 2, raw, env={"MT3D_FAULTS": "nan_grad@3:1,sigterm@4:0"})
    assert [rc for rc, _ in stopped] == [EXIT_PREEMPTED] * 2
    assert [c.name for c in complete_checkpoints(tmp_path / "b" / "checkpoints")] == ["step_00000004"]
    raw["mt3d"]["train"]["resume"] = "auto"
    resumed = spawn(train_rc_worker, 2, raw)
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(resumed[0][1]) if r["step"] > 4]
    assert got == [(s, ref[s]["loss"], ref[s]["grad_norm"]) for s in (5, 6, 7)]


@pytest.mark.parametrize(
    "parallel, train_batch, message",
    [
        ({"pipeline": 1, "virtual_stages": 2}, 8, "virtual_stages 2 needs pipeline >= 2"),
        ({"pipeline": 2, "virtual_stages": 0}, 8, "virtual_stages must be >= 1"),
        (
            {"pipeline": 4, "virtual_stages": 2},
            8,
            "4 layers cannot fill pipeline 4 x virtual_stages 2 = 8 chunks",
        ),
        ({"pipeline": 2, "virtual_stages": 2}, 6, "micro-batches per step (3 = gradient_accumulation_steps)"),
        (
            {"pipeline": 2, "virtual_stages": 2, "stage_layers": [2, 2]},
            8,
            "must list 2 x 2 chunks adding up to 4",
        ),
    ],
)
def test_bad_virtual_stage_configs_are_refused_before_process_groups(
    tmp_path, parallel, train_batch, message
):
    raw = tiny_config(tmp_path, global_batch=train_batch)
    raw["mt3d"]["parallel"].update(parallel)
    run = from_dict(raw)
    world = parallel["pipeline"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(run, world, resolve_model(run.mt3d.model))
    raw["zero_optimization"]["stage"] = 2
    raw["mt3d"]["parallel"] = {"pipeline": 2, "virtual_stages": 2}
    with pytest.raises(ConfigError, match="ZeRO stage 2 cannot be used with pipeline=2"):
        validate(from_dict(raw), 2, resolve_model(raw["mt3d"]["model"]))
