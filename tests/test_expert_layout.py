"""The expert layout (mt3d.parallel.expert_layout): folded over tp x cp x dp, and the layout before
folding reproduced exactly (branch expert-layouts, issue 46; pure, no processes)."""

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
    np.testing.assert_array_equal(lay.deepspeed_grid(pl.grid), pl.deepspeed_grid())


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
