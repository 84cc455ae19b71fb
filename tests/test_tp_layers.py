"""Parity of every tensor-parallel layer with its unsharded reference, forward and backward.

For each tp in (1, 2, 4) one spawned run executes every layer in fp32 and fp64, with and
without sequence parallelism; the same function run with a one-rank group is the reference.
"""

import pytest
import torch
import torch.nn.functional as F

from mt3d.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from mt3d.parallel.deferred import WeightGrads, deferring, split_backward
from mt3d.parallel.layers import (
    ColumnParallelLinear,
    NormalInit,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab,
)
from mt3d.parallel.spawn import spawn
from mt3d.parallel.state import AxisGroup

B, S, H, FFN, V = 2, 8, 16, 32, 100
PARTS = (8, 16)  # a fused column-parallel output (e.g. k and q) split part by part
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def tp_group():
    import torch.distributed as dist

    from mt3d.ds.topology import map_ranks
    from mt3d.parallel.state import ParallelState

    w = dist.get_world_size()
    return ParallelState.build(map_ranks(w, tp=w)).tp


def full_data(dtype):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, :3] = IGNORE_INDEX
    return dict(
        x=r(B, S, H),
        dy_col=r(B, S, sum(PARTS)),
        bias_col=r(sum(PARTS)),
        dy_gcol=r(B, S, FFN),
        x_row=r(B, S, FFN),
        dy_row=r(B, S, H),
        bias_row=r(H),
        ids=torch.randint(0, V, (B, S), generator=g),
        dy_emb=r(B, S, H),
        logits=3 * r(B, S, V),
        target=target,
    )


def seq_shard(t, rank, n):
    return t.chunk(n, dim=1)[rank]


def last_shard(t, rank, n, parts=None):
    if parts is None:
        return t.chunk(n, dim=-1)[rank]
    pieces = t.split(list(parts), dim=-1)
    return torch.cat([p.chunk(n, dim=-1)[rank] for p in pieces], dim=-1)


def backward(loss, weights, split: bool) -> None:
    """``loss.backward()``, or (``split``) B then W (``mt3d.parallel.deferred``): B leaves each linear's
    weight gradient to W, which accumulates it through autograd, so the weight's hooks see it there.
    torch runs a weight's hooks in B too, with no gradient (the None its function returned): a hook
    on a split linear's weight must let None pass (the engine's reduction hooks count on W)."""
    if not split:
        loss.backward()
        return
    queue, seen = WeightGrads(), []
    hooks = [
        w.register_hook(lambda g: seen.append(("B" if queue.items else "W", g is not None))) for w in weights
    ]
    with deferring(queue):
        loss.backward()
    assert all(w.grad is None for w in weights) and len(queue) == len(weights), (len(queue), len(weights))
    queue.run()
    assert len(queue) == 0 and all(w.grad is not None for w in weights)
    assert seen == [("B", False)] * len(weights) + [("W", True)] * len(weights), seen
    for h in hooks:
        h.remove()


def run_layers(tp: AxisGroup, dtype, sp: bool, split: bool = False) -> dict:
    """Run every layer once on this rank (``split``: each backward as B then W); return local outputs
    and gradients."""
    split_backward(split)
    try:
        return _run_layers(tp, dtype, sp, split)
    finally:
        split_backward(False)


def _run_layers(tp: AxisGroup, dtype, sp: bool, split: bool) -> dict:
    d = full_data(dtype)
    n, rk = tp.size, tp.rank
    out = {}

    col = ColumnParallelLinear(
        H, sum(PARTS), tp=tp, parts=PARTS, sequence_parallel=sp, init=NormalInit(0.3, 11), dtype=dtype
    )
    with torch.no_grad():
        col.bias.copy_(last_shard(d["bias_col"], rk, n, PARTS))
    x = (seq_shard(d["x"], rk, n) if sp else d["x"]).clone().requires_grad_()
    y = col(x)
    backward((y * last_shard(d["dy_col"], rk, n, PARTS)).sum(), [col.weight], split)
    out["col"] = dict(y=y, dx=x.grad, w=col.weight, dw=col.weight.grad, db=col.bias.grad)

    gcol = ColumnParallelLinear(H, FFN, tp=tp, gather_output=True, init=NormalInit(0.3, 12), dtype=dtype)
    x = d["x"].clone().requires_grad_()
    y = gcol(x)
    backward((y * d["dy_gcol"]).sum(), [gcol.weight], split)
    out["gcol"] = dict(y=y, dx=x.grad, dw=gcol.weight.grad)

    row = RowParallelLinear(FFN, H, tp=tp, sequence_parallel=sp, init=NormalInit(0.3, 13), dtype=dtype)
    with torch.no_grad():
        row.bias.copy_(d["bias_row"])
    x = last_shard(d["x_row"], rk, n).clone().requires_grad_()
    y = row(x)
    backward((y * (seq_shard(d["dy_row"], rk, n) if sp else d["dy_row"])).sum(), [row.weight], split)
    out["row"] = dict(y=y, dx=x.grad, w=row.weight, dw=row.weight.grad, db=row.bias.grad)

    srow = RowParallelLinear(FFN, H, tp=tp, input_is_parallel=False, init=NormalInit(0.3, 14), dtype=dtype)
    x = d["x_row"].clone().requires_grad_()
    y = srow(x)
    backward((y * d["dy_row"]).sum(), [srow.weight], split)
    out["srow"] = dict(y=y, dx=x.grad, dw=srow.weight.grad)

    emb = VocabParallelEmbedding(V, H, tp=tp, sequence_parallel=sp, init=NormalInit(0.3, 15), dtype=dtype)
    y = emb(d["ids"])
    backward((y * (seq_shard(d["dy_emb"], rk, n) if sp else d["dy_emb"])).sum(), [], split)  # nothing left
    out["emb"] = dict(y=y, w=emb.weight, dw=emb.weight.grad, start=emb.vocab_start)

    vp = pad_vocab(V, n)
    padded = torch.cat(
        [d["logits"], torch.full((B, S, vp - V), 50.0, dtype=dtype)], dim=-1
    )  # must be ignored
    logits = last_shard(padded, rk, n).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, d["target"], tp, V)
    (loss * torch.linspace(0.5, 1.5, B * S, dtype=dtype).view(B, S)).sum().backward()
    out["ce"] = dict(loss=loss, dlogits=logits.grad)
    return {
        k: {kk: (vv.detach().clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
        for k, v in out.items()
    }


def worker():
    tp = tp_group()
    return {
        (str(dt), sp, split): run_layers(tp, dt, sp, split)
        for dt in (torch.float32, torch.float64)
        for sp in (False, True)
        for split in (False, True)
    }


@pytest.fixture(scope="module", params=[1, 2, 4])
def runs(request):
    return request.param, spawn(worker, request.param, timeout=240)


def rel(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def reference(dtype):
    return run_layers(AxisGroup.alone("tp"), dtype, False)


def close(a, b, dtype, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert rel(a, b) <= TOL[dtype], f"{what}: relative error {rel(a, b):.3g}"


def each_rank(runs):
    n, results = runs
    for dtype in (torch.float32, torch.float64):
        ref = reference(dtype)
        for sp in (False, True):
            for split in (False, True):  # the backward split into B and W, as zero-bubble runs it
                for rank, res in enumerate(results):
                    yield n, rank, dtype, sp, res[(str(dtype), sp, split)], ref


def test_column_parallel_linear(runs):
    for n, rk, dt, sp, r, ref in each_rank(runs):
        got, want = r["col"], ref["col"]
        close(got["y"], last_shard(want["y"], rk, n, PARTS), dt, "y")  # SP: input shard, full-sequence output
        close(got["dx"], seq_shard(want["dx"], rk, n) if sp else want["dx"], dt, "dx")
        # init: this shard is the same slice of the unsharded init, part by part
        close(got["w"], last_shard(want["w"].T, rk, n, PARTS).T, dt, "w")
        close(got["dw"], last_shard(want["dw"].T, rk, n, PARTS).T, dt, "dw")
        close(got["db"], last_shard(want["db"], rk, n, PARTS), dt, "db")
        g, wg = r["gcol"], ref["gcol"]
        close(g["y"], wg["y"], dt, "gathered y")
        close(g["dx"], wg["dx"], dt, "gathered dx")
        close(g["dw"], wg["dw"].chunk(n, 0)[rk], dt, "gathered dw")


def test_row_parallel_linear(runs):
    for n, rk, dt, sp, r, ref in each_rank(runs):
        got, want = r["row"], ref["row"]
        close(got["y"], seq_shard(want["y"], rk, n) if sp else want["y"], dt, "y")
        close(got["dx"], last_shard(want["dx"], rk, n), dt, "dx")
        close(got["w"], last_shard(want["w"], rk, n), dt, "w")
        close(got["dw"], last_shard(want["dw"], rk, n), dt, "dw")
        close(got["db"], want["db"], dt, "db (summed over TP when sequence-parallel)")
        s, ws = r["srow"], ref["srow"]
        close(s["y"], ws["y"], dt, "scattered-input y")
        close(s["dx"], ws["dx"], dt, "scattered-input dx")


def test_vocab_parallel_embedding(runs):
    for n, rk, dt, sp, r, ref in each_rank(runs):
        got, want = r["emb"], ref["emb"]
        close(got["y"], seq_shard(want["y"], rk, n) if sp else want["y"], dt, "y")
        start, rows = got["start"], got["w"].shape[0]
        real = max(0, min(rows, V - start))
        close(got["w"][:real], want["w"][start : start + real], dt, "w")
        close(got["dw"][:real], want["dw"][start : start + real], dt, "dw")
        assert torch.count_nonzero(got["w"][real:]) == 0 and torch.count_nonzero(got["dw"][real:]) == 0


def test_vocab_parallel_cross_entropy(runs):
    n, results = runs
    for dt in (torch.float32, torch.float64):
        d = full_data(dt)
        logits = d["logits"].clone().requires_grad_()
        want = F.cross_entropy(
            logits.transpose(1, 2), d["target"], reduction="none", ignore_index=IGNORE_INDEX
        )
        (want * torch.linspace(0.5, 1.5, B * S, dtype=dt).view(B, S)).sum().backward()
        vp = pad_vocab(V, n)
        want_grad = torch.cat([logits.grad, torch.zeros(B, S, vp - V, dtype=dt)], dim=-1)
        for rk, res in enumerate(results):
            got = res[(str(dt), False, False)]["ce"]
            close(got["loss"], want.detach(), dt, "loss")
            assert torch.all(got["loss"][0, :3] == 0)
            close(got["dlogits"], last_shard(want_grad, rk, n), dt, "dlogits")


def test_whole_vocabulary_cross_entropy_of_bf16_logits_is_fp32_and_keeps_no_fp32_copy():
    """tp 1 with bf16 logits: the loss is fp32 cross entropy of the upcast logits (padded columns and
    ignored targets excluded), the gradient theirs rounded to bf16, and what autograd keeps for
    the backward is the bf16 logits and one fp32 value per token (the fp32 logits were kept before)."""
    tp = AxisGroup.alone("tp")
    g = torch.Generator().manual_seed(0)
    real, padded = 40, 48
    logits = (torch.randn(2, 16, padded, generator=g) * 4).bfloat16()
    logits[..., real:] = 60.0
    target = torch.randint(0, real, (2, 16), generator=g)
    target[0, :5] = IGNORE_INDEX
    weight = torch.rand(2, 16, generator=g)
    x = logits.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(x, target, tp, real)
    (loss * weight).sum().backward()
    ref = logits[..., :real].float().requires_grad_()
    want = F.cross_entropy(ref.transpose(1, 2), target, reduction="none", ignore_index=IGNORE_INDEX)
    (want * weight).sum().backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    grad = torch.cat([ref.grad, torch.zeros(2, 16, padded - real)], dim=-1).bfloat16()
    torch.testing.assert_close(x.grad, grad, rtol=8e-3, atol=1e-7)  # one bf16 rounding apart at most
    assert x.grad.dtype == torch.bfloat16 and torch.all(x.grad[..., real:] == 0)
    assert max(t.numel() * t.element_size() for t in saved) == logits.numel() * 2


def test_whole_vocabulary_cross_entropy_paths_agree_in_fp32():
    """tp 1 runs torch's fused cross entropy for fp32 logits off the GPU and mt3d's own function (saved
    logits and log-sum-exp) on a GPU and for half logits: on the same fp32 logits, with padded columns
    and ignored targets, both give the same loss and gradient."""
    from mt3d.parallel.cross_entropy import _WholeVocabCrossEntropy

    tp = AxisGroup.alone("tp")
    g = torch.Generator().manual_seed(1)
    real, padded = 40, 48
    logits = torch.randn(2, 16, padded, generator=g) * 4
    logits[..., real:] = 60.0
    target = torch.randint(0, real, (2, 16), generator=g)
    target[1, :4] = IGNORE_INDEX
    weight = torch.rand(2, 16, generator=g)
    paths = {
        "fused": lambda x: vocab_parallel_cross_entropy(x, target, tp, real),
        "own": lambda x: _WholeVocabCrossEntropy.apply(x, target, real, IGNORE_INDEX),
    }
    got = {}
    for name, fn in paths.items():
        x = logits.clone().requires_grad_()
        loss = fn(x)
        (loss * weight).sum().backward()
        got[name] = (loss.detach(), x.grad)
    torch.testing.assert_close(got["fused"][0], got["own"][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["fused"][1], got["own"][1], rtol=1e-6, atol=1e-7)
    assert torch.all(got["fused"][1][..., real:] == 0) and torch.all(got["fused"][0][1, :4] == 0)


def test_cross_entropy_is_stable_for_huge_logits():
    tp = AxisGroup.alone("tp")
    logits = torch.tensor([[[1e4, 0.0, -1e4]]], requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.tensor([[1]]), tp, 3)
    assert torch.isfinite(loss).all() and loss.item() == pytest.approx(1e4)
    loss.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_split_parameters_are_marked_for_deepspeed():
    tp = AxisGroup.alone("tp")
    col = ColumnParallelLinear(4, 8, tp=tp, init=NormalInit(0.02, 1))
    row = RowParallelLinear(8, 4, tp=tp, init=NormalInit(0.02, 1))
    emb = VocabParallelEmbedding(10, 4, tp=tp, init=NormalInit(0.02, 1))
    assert col.weight.tensor_model_parallel and col.bias.tensor_model_parallel
    assert row.weight.tensor_model_parallel and not getattr(row.bias, "tensor_model_parallel", False)
    assert emb.weight.tensor_model_parallel and emb.weight.shape == (128, 4)


def test_indivisible_sizes_are_refused():
    tp = AxisGroup("tp", (0, 1, 2), 0, None)
    with pytest.raises(ValueError, match="not divisible by tensor-parallel size 3"):
        ColumnParallelLinear(4, 8, tp=tp, init=NormalInit(0.02, 1))
    with pytest.raises(ValueError, match="do not add up"):
        ColumnParallelLinear(4, 9, tp=AxisGroup.alone("tp"), parts=(4, 4), init=NormalInit(0.02, 1))


def _sp_saved_worker():
    tp = tp_group()
    out = {}
    for keep in (False, True):
        layer = ColumnParallelLinear(16, 32, tp=tp, sequence_parallel=True, init=NormalInit(0.3, 11),
                                     keep_gathered=keep)  # fmt: skip
        x = torch.randn(2, 8, 16, requires_grad=True)
        kept: list = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t, lambda t: t):
            y = layer(x)
        y.sum().backward()
        weight = layer.weight.untyped_storage().data_ptr()
        out[keep] = sum(t.numel() for t in kept if t.untyped_storage().data_ptr() != weight)
    return out


def test_sequence_parallel_linear_keeps_its_input_shard():
    """Under SP a column-parallel linear keeps its 1/tp input shard for the backward (all-gathered
    again there); ``keep_gathered`` keeps the whole gathered input, tp times as much."""
    for got in spawn(_sp_saved_worker, 2, timeout=120):
        assert got[False] == 2 * 8 * 16 and got[True] == 2 * got[False], got


def test_a_split_backward_of_the_recomputing_linear_matches_the_plain_one():
    """Selective recompute's linear (``forward_recomputing``) split into B and W: the same gradients."""
    dtype = torch.float64
    d = full_data(dtype)
    grads = {}
    for split in (False, True):
        split_backward(split)
        try:
            row = RowParallelLinear(FFN, H, tp=AxisGroup.alone("tp"), init=NormalInit(0.3, 13), dtype=dtype)
            x = d["x_row"].clone().requires_grad_()
            y = row.forward_recomputing(x, torch.nn.functional.silu)
            backward((y * d["dy_row"]).sum(), [row.weight], split)
            grads[split] = (x.grad, row.weight.grad, row.bias.grad)
        finally:
            split_backward(False)
    for a, b in zip(grads[True], grads[False], strict=True):
        assert torch.equal(a, b)
