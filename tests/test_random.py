"""TP-aware RNG: dropout inside TP regions differs per rank, outside matches; recompute is exact."""

import torch
import torch.nn.functional as F

from mt3d.parallel.random import RNGTracker, checkpoint, seed_everything
from mt3d.parallel.spawn import spawn
from mt3d.parallel.state import AxisGroup


def tp_group():
    import torch.distributed as dist

    from mt3d.ds.topology import map_ranks
    from mt3d.parallel.state import ParallelState

    return ParallelState.build(map_ranks(dist.get_world_size(), tp=dist.get_world_size())).tp


def masks_worker():
    tp = tp_group()
    seed_everything(123)
    tracker = RNGTracker.for_tp(123, tp)
    x = torch.ones(4, 8, 16)
    outside = F.dropout(x, 0.5, True)
    with tracker.fork():
        inside = F.dropout(x, 0.5, True)
    outside_after = F.dropout(x, 0.5, True)
    return outside, inside, outside_after


def test_dropout_masks_inside_and_outside_tp_regions():
    (o0, i0, a0), (o1, i1, a1) = spawn(masks_worker, 2)
    assert torch.equal(o0, o1) and torch.equal(a0, a1)  # replicated region: same mask on both ranks
    assert not torch.equal(i0, i1)  # TP region: each rank its own mask
    assert not torch.equal(o0, a0)  # the default stream advanced, the fork did not disturb it


def run(tp, use_checkpoint, partition=False):
    seed_everything(7)
    tracker = RNGTracker.for_tp(7, tp)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 16, generator=g).requires_grad_()
    x = torch.randn(2, 8, 16, generator=g).requires_grad_()
    dy = torch.randn(2, 8, 16, generator=g)

    def fn(h):
        h = F.dropout(h @ w, 0.3, True)
        with tracker.fork():
            h = F.dropout(torch.tanh(h), 0.3, True)
        return h * 2

    y = checkpoint(fn, x, tracker=tracker, tp=tp, partition=partition) if use_checkpoint else fn(x)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, torch.rand(3)


def test_recompute_reproduces_both_random_streams():
    tp = AxisGroup.alone("tp")
    plain = run(tp, False)
    ckpt = run(tp, True)
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def partition_worker():
    tp = tp_group()
    return run(tp, False), run(tp, True, partition=True)


def test_partitioned_recompute_matches_under_tp():
    for plain, ckpt in spawn(partition_worker, 2):
        for a, b in zip(plain, ckpt):
            assert torch.equal(a, b)


def test_checkpoint_is_a_plain_call_without_grad():
    tracker = RNGTracker.for_tp(1, AxisGroup.alone("tp"))
    with torch.no_grad():
        y = checkpoint(lambda h: h * 3, torch.ones(2, 4, 2), tracker=tracker)
    assert torch.equal(y, torch.full((2, 4, 2), 3.0))
