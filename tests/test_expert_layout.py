"""The expert layout (mt3d.parallel.expert_layout): folded over tp x cp x dp, and the layout before
folding reproduced exactly (issue 46; pure, no processes except the block-level equality)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mt3d.parallel.expert_layout import ExpertLayout, ExpertLayoutError
from mt3d.parallel.topology import place


@pytest.mark.parametrize(
    "world,tp,pp,cp,ep,order",
    [(8, 2, 1, 1, 2, "tp-cp-ep-dp-pp"), (16, 2, 2, 2, 2, "tp-cp-ep-dp-pp"),
     (16, 1, 1, 2, 4, "tp-ep-cp-dp-pp"), (24, 2, 3, 1, 2, "tp-dp-pp"), (32, 2, 2, 2, 2, "tp-dp-cp-ep-pp")],
)  # fmt: skip
def test_the_layout_before_folding_is_the_grid_mt3d_always_used(world, tp, pp, cp, ep, order):
    """etp = tp and ep dividing dp: the same ep and edp groups as the placement's own, and the same
    DeepSpeed grid (so checkpoints and ZeRO files keep their names)."""
    pl = place(world, tp, pp, cp=cp, ep=ep, order=order, warn=False)
    lay = ExpertLayout.resolve(tp, cp, pl.dp, ep)
    assert not lay.folded and lay.grid_ep == ep and lay.edp == pl.dp // ep * cp
    assert sorted(map(sorted, lay.groups(pl.grid, "ep"))) == sorted(map(sorted, pl.groups("ep")))
    assert sorted(map(sorted, lay.groups(pl.grid, "edp"))) == sorted(map(sorted, pl.groups("edp")))
    assert sorted(map(sorted, lay.groups(pl.grid, "etp"))) == sorted(map(sorted, pl.groups("tp")))
    # the grid DeepSpeed was given before folding: [pipe, (dp / ep, cp), (ep, tp)], grid order
    pp_, dpe, g, cp_, tp_ = pl.grid.shape
    before = pl.grid.transpose(0, 1, 3, 2, 4).reshape(pp_, dpe * cp_, g * tp_)
    np.testing.assert_array_equal(lay.deepspeed_grid(pl.grid), before)
    np.testing.assert_array_equal(pl.deepspeed_grid(), before)


@pytest.mark.parametrize(
    "world,tp,pp,cp,ep,etp",
    [(4, 2, 1, 1, 4, 1), (4, 2, 2, 1, 2, 1), (2, 1, 1, 2, 2, 1), (16, 4, 1, 2, 8, 1), (16, 4, 1, 1, 2, 2),
     (8, 2, 1, 2, 4, 2), (8, 4, 1, 1, 2, 1)],
)  # fmt: skip
def test_folded_layouts_cover_each_stage_once_and_hold_whole_weight_sets(world, tp, pp, cp, ep, etp):
    """Every rank of a stage is in one (edp, ep, etp) coordinate; an etp group lies inside a TP group;
    the ranks DeepSpeed's grid puts in one 'data' group hold the same weights (the same tp shard and
    the same experts) and every other pair does not."""
    dp = world // (tp * pp * cp)
    lay = ExpertLayout.resolve(tp, cp, dp, ep, etp)
    g = lay.grid_ep
    pl = place(world, tp, pp, cp=cp, ep=g, warn=False)
    eg = lay.expert_grid(pl.grid)
    assert eg.shape == (pp, lay.edp, ep, etp) and sorted(eg.ravel().tolist()) == list(range(world))
    tp_of = {r: pl.coord(r)["tp"] for r in range(world)}
    stage_of = {r: pl.coord(r)["pp"] for r in range(world)}
    tp_groups = [set(x) for x in pl.groups("tp")]
    assert all(any(set(x) <= t for t in tp_groups) for x in lay.groups(pl.grid, "etp"))
    weights = {}  # rank -> (stage, tp rank, ep rank, etp rank): what it holds
    for s, d, e, t in itertools.product(*map(range, eg.shape)):
        r = int(eg[s, d, e, t])
        weights[r] = (s, tp_of[r], e, t)
    ds = lay.deepspeed_grid(pl.grid)
    assert ds.shape == (pp, world // pp // lay.model_ranks, lay.model_ranks)
    for s in range(pp):
        for m in range(ds.shape[2]):
            assert len({weights[int(r)] for r in ds[s, :, m]}) == 1
        assert len({weights[int(r)] for r in ds[s, 0, :]}) == ds.shape[2]
    assert {stage_of[int(r)] for r in ds[0].ravel()} == {0}


def test_whole_experts_fold_over_tp_first_then_dp_then_cp():
    """etp 1 at tp 2: an ep group of 2 is a TP pair (inside an NVLink island); of 4 at dp 2 it takes
    the TP pairs of two dp ranks; at cp 2 x dp 1 it takes the cp ranks."""
    pl = place(4, 2, 1, ep=1, warn=False)  # tp 2 x dp 2
    assert ExpertLayout.resolve(2, 1, 2, 2, 1).groups(pl.grid, "ep") == [[0, 1], [2, 3]]
    lay = ExpertLayout.resolve(2, 1, 2, 4, 1)
    pl = place(4, 2, 1, ep=lay.grid_ep, warn=False)
    assert lay.grid_ep == 2 and lay.groups(pl.grid, "ep") == [[0, 1, 2, 3]] and lay.edp == 1
    lay = ExpertLayout.resolve(1, 2, 1, 2, 1)
    pl = place(2, 1, 1, cp=2, warn=False)
    assert lay.folded and lay.grid_ep == 1 and lay.groups(pl.grid, "ep") == [[0, 1]]


@pytest.mark.parametrize(
    "args,match",
    [((2, 1, 2, 2, 3), "expert_tensor = 3 must divide tensor = 2"),
     ((2, 1, 2, 3, 1), "expert_tensor x expert = 1 x 3 must divide"),
     ((2, 1, 4, 8, 2), "must divide tensor x context x data = 2 x 1 x 4 = 8"),
     ((2, 1, 2, 0, 1), "mt3d.parallel.expert must be a positive integer")],
)  # fmt: skip
def test_bad_expert_layouts_are_one_line(args, match):
    with pytest.raises(ExpertLayoutError, match=match):
        ExpertLayout.resolve(*args)
    with pytest.raises(ExpertLayoutError, match="not divisible by expert = 4"):
        ExpertLayout.resolve(2, 1, 2, 4, 1, experts=6)
    with pytest.raises(ExpertLayoutError, match=r"inner size \(30\) is not divisible by expert_tensor = 4"):
        ExpertLayout.resolve(4, 1, 1, 1, 4, expert_ffn=30)
    from mt3d.config import resolve_model
    from mt3d.config.rules import folding_conflict

    spec = resolve_model({"preset": "tiny-mixtral"}).moe_spec
    degrees = {"tp": 2, "cp": 1, "dp": 2, "ep": 4, "etp": 1}
    why = folding_conflict(spec, degrees, 1, seq_len=33)
    assert "seq_len / context = 33 tokens are not divisible by tensor / expert_tensor = 2" in why
    assert folding_conflict(spec, degrees, 1, seq_len=33, sp=True) is None  # SP checks seq_len itself
    assert folding_conflict(spec, degrees, 1, seq_len=32) is None


def test_checkpoints_place_experts_by_the_layout_and_refuse_partial_expert_tp_reshards():
    """DeepSpeed's 'model' coordinate of expert rank e, expert-TP rank r is e x etp + r (e x tp + r
    before folding) and maps back; a reshard into experts split over part of the TP group is refused
    (whole experts and experts split over all of tp are not), and a layout differing only in etp counts
    as changed."""
    from types import SimpleNamespace

    from mt3d.checkpoint.reshard import folded_reshard_conflict
    from mt3d.checkpoint.resume import ResumePlan

    before, whole = ExpertLayout(2, 1, 4, 2, 2), ExpertLayout(2, 1, 2, 4, 1)
    assert [before.model_rank(e, r) for e in range(2) for r in range(2)] == [0, 1, 2, 3]
    assert [whole.model_rank(e, 0) for e in range(4)] == [0, 1, 2, 3]
    for lay in (before, whole, ExpertLayout(4, 1, 2, 4, 2)):
        for e, r in itertools.product(range(lay.ep), range(lay.etp)):
            assert lay.expert_coordinates(lay.model_rank(e, r)) == (e, r)
    folded = {"tp": 2, "pp": 1, "dp": 2, "ep": 4, "etp": 1, "zero_stage": 1}
    plain = {"tp": 2, "pp": 1, "dp": 2, "ep": 2, "zero_stage": 1}
    for saved, target in (
        (plain, {**plain, "dp": 4}),
        (folded, plain),
        (plain, folded),
        (folded, {**folded, "dp": 4}),
    ):
        assert folded_reshard_conflict(saved, target) is None
    partial = {"tp": 4, "pp": 1, "dp": 1, "ep": 2, "etp": 2, "zero_stage": 1}
    assert "resharding into expert_tensor 2 with tensor 4" in folded_reshard_conflict(folded, partial)
    layout = SimpleNamespace(saved=lambda: {**plain, "ep": 4, "virtual_stages": 1, "stage_blocks": None,
                                            "offload": "none"})  # fmt: skip
    plan = ResumePlan(path=None, meta={"layout": {**folded, "virtual_stages": 1}}, manifest={})
    assert plan.layout_changed(layout)  # the same degrees, experts split differently
    same = {**plain, "ep": 4, "etp": 2, "virtual_stages": 1}
    plan = ResumePlan(path=None, meta={"layout": same}, manifest={})
    assert not plan.layout_changed(layout)  # etp recorded as tp is the layout before folding


def _folded_block(tp_group, ep_group, tpo_group, sp, tp_rank=0, ep_rank=0, capacity=None):
    import torch

    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.parallel.state import AxisGroup

    cfg = ModelConfig.from_dict(dict(hidden=32, layers=1, heads=4, ffn=64, position="rope", norm="rmsnorm",
                                     mlp="swiglu", bias=False,
                                     moe=dict(experts=4, top_k=2, expert_ffn=32, shared_ffn=32,
                                              capacity_factor=capacity)))  # fmt: skip
    ctx = BuildContext(tp=tp_group, ep=ep_group, etp=AxisGroup.alone("etp", tp_rank) if tpo_group else None,
                       tpo=tpo_group, sequence_parallel=sp, seed=5)  # fmt: skip
    block = TransformerBlock(cfg, ctx, 0)
    with torch.no_grad():
        block.mlp.router.weight.mul_(30)
    return block.double()


def _folded_batch(d):
    import torch

    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(10 + d), dtype=torch.float64)


def _folded_worker(sp, capacity):
    """tp 2 x dp 2, ep 4 over all of them, whole experts (etp 1)."""
    import torch
    import torch.distributed as dist

    from mt3d.parallel.state import AxisGroup

    me = dist.get_rank()
    t, d = me % 2, me // 2
    tps = [dist.new_group([2 * i, 2 * i + 1]) for i in range(2)]
    everyone = dist.new_group([0, 1, 2, 3])
    tpg = AxisGroup("tp", (2 * d, 2 * d + 1), t, tps[d])
    block = _folded_block(tpg, AxisGroup("ep", (0, 1, 2, 3), me, everyone), tpg, sp, t, me, capacity)
    x = _folded_batch(d)
    if sp:
        x = x.chunk(2, dim=1)[t]
    x = x.clone().requires_grad_()
    out = block(x)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("sp,capacity", [(False, None), (True, None), (False, 0.5), (True, 0.5)])
def test_whole_experts_folded_over_tp_and_dp_equal_one_process(sp, capacity):
    """tp 2 x dp 2 with ep 4 and etp 1: each rank holds one whole expert and routes its own tokens (its
    sequence shard with SP, else half of the tokens its TP pair shares), sent once per rank to the
    expert's rank among all four; outputs and input gradients equal one process on each dp rank's
    batch, an expert's gradient the sum over both batches, the router's (without SP) the batch's.
    With a capacity factor (half the fair share, a skewed router) each rank keeps what one process
    keeps of its tokens: "first come" counted over both TP ranks' parts of each sequence."""
    import torch

    from mt3d.parallel.layers import shard_of
    from mt3d.parallel.spawn import spawn
    from mt3d.parallel.state import AxisGroup

    ref = _folded_block(AxisGroup.alone("tp"), None, None, False, capacity=capacity)
    if capacity is not None:  # assignments really drop
        dropless = _folded_block(AxisGroup.alone("tp"), None, None, False)
        assert not torch.allclose(ref(_folded_batch(0)), dropless(_folded_batch(0)))
    want, grads = [], []
    for d in range(2):
        ref.zero_grad()
        x = _folded_batch(d).requires_grad_()
        out = ref(x)
        out.backward(torch.ones_like(out))
        want.append((out.detach(), x.grad))
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    params = dict(ref.named_parameters())
    for rank, (out, dx, got) in enumerate(spawn(_folded_worker, 4, sp, capacity, timeout=300)):
        t, d = rank % 2, rank // 2
        w_out, w_dx = want[d]
        if sp:
            w_out, w_dx = w_out.chunk(2, dim=1)[t], w_dx.chunk(2, dim=1)[t]
        torch.testing.assert_close(out, w_out)
        torch.testing.assert_close(dx, w_dx)
        experts = sorted({int(n.split(".")[2]) for n in got if ".experts." in n})
        assert experts == [rank], experts
        for name, g in got.items():
            if ".experts." in name:  # whole: every batch's tokens reach it
                torch.testing.assert_close(g, grads[0][name] + grads[1][name], msg=name)
            elif not sp:  # with SP, replicated weights hold partial gradients (summed by the engine)
                torch.testing.assert_close(g, shard_of(grads[d][name], params[name], t, 2), msg=name)
