"""A tensor-parallel transformer block: exact collectives (Megatron's 2 + 2, plus one small all-reduce
per replicated parameter whose gradient is partial on each rank) and parity with tp=1.

"every-option" switches on every block option at once (no family has them all): q/k/v and output
biases, per-head q/k norms over head_dim != hidden / heads, (1 + w) norms, post-norms, GeGLU,
score soft-capping, a custom score scale and a 3-key window on 8 positions. It runs in fp64: its
post-norms divide small attention outputs by their RMS, which lifts fp32 summation-order noise to
~1e-5 of the gradients, while in fp64 every layout agrees to 1e-10.
"""

import pytest
import torch

from mt3d.model.blocks import BuildContext, TransformerBlock
from mt3d.model.config import ModelConfig
from mt3d.parallel.commlog import CollectiveLog
from mt3d.parallel.layers import shard_of
from mt3d.parallel.spawn import spawn
from mt3d.parallel.state import AxisGroup

B, S = 2, 8
CONFIGS = {
    "gpt": dict(hidden=32, layers=2, heads=4, ffn=64, max_seq_len=S),
    "llama": dict(
        hidden=32,
        layers=2,
        heads=8,
        kv_heads=4,
        ffn=48,
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
    ),
    "every-option": dict(
        hidden=32,
        layers=2,
        heads=8,
        kv_heads=4,
        head_dim=16,
        ffn=48,
        position="rope",
        norm="rmsnorm",
        norm_unit_offset=True,
        mlp="geglu",
        qk_norm=True,
        post_norms=True,
        attn_softcap=2.0,
        query_pre_attn_scalar=10.0,
        attention={"window": 3},
    ),
}
# a sparse block whose shared expert is an MLP with a TP region of its own beside the routed experts'
CONFIGS["moe-shared"] = dict(CONFIGS["llama"], moe=dict(experts=4, top_k=2, expert_ffn=16, shared_ffn=24))


DTYPE = {"every-option": torch.float64}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(B, S, 32, generator=g, dtype=dtype), torch.randn(B, S, 32, generator=g, dtype=dtype)


def run_block(tp: AxisGroup, arch: str, sp: bool):
    cfg = ModelConfig(**CONFIGS[arch])
    dtype = DTYPE.get(arch, torch.float32)
    block = TransformerBlock(cfg, BuildContext(tp=tp, seed=5, sequence_parallel=sp, dtype=dtype), layer=0)
    x, dy = inputs(dtype)
    if sp and tp.size > 1:
        x, dy = x.chunk(tp.size, 1)[tp.rank], dy.chunk(tp.size, 1)[tp.rank]
    x = x.clone().requires_grad_()
    with CollectiveLog() as fwd:
        y = block(x)
    with CollectiveLog() as bwd:
        y.backward(dy)
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters()}
    log = lambda lg: [(c.op, c.numel, c.ranks) for c in lg.calls]  # noqa: E731
    return dict(y=y.detach(), dx=x.grad.detach(), grads=grads, fwd=log(fwd), bwd=log(bwd))


def worker(arch, sp):
    import torch.distributed as dist

    from mt3d.ds.topology import map_ranks
    from mt3d.parallel.state import ParallelState

    w = dist.get_world_size()
    return run_block(ParallelState.build(map_ranks(w, tp=w)).tp, arch, sp)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_block_collectives_and_parity(tp, sp):
    results = {arch: spawn(worker, tp, arch, sp, timeout=180) for arch in CONFIGS}
    bsh = B * S * 32
    ranks = tuple(range(tp))
    for arch, per_rank in results.items():
        ref = run_block(AxisGroup.alone("tp"), arch, False)
        cfg = ModelConfig(**CONFIGS[arch])
        block = TransformerBlock(
            cfg, BuildContext(tp=AxisGroup("tp", ranks, 0, None), sequence_parallel=sp), 0
        )
        params = dict(block.named_parameters())
        for rank, got in enumerate(per_rank):
            big_f = [c for c in got["fwd"] if c[1] == bsh]
            big_b = [c for c in got["bwd"] if c[1] == bsh]
            assert all(c[2] == ranks for c in got["fwd"] + got["bwd"]), "every collective is on the TP group"
            assert tp_units(got["fwd"] + got["bwd"], bsh) == planned_units(cfg, tp, sp), (arch, got)
            dense = cfg.moe is None  # a sparse block also gathers the router's weights and choices (small)
            if dense and not sp:
                assert [c[0] for c in got["fwd"]] == ["all_reduce"] * 2, got["fwd"]
                assert [c[0] for c in big_b] == ["all_reduce"] * 2, got["bwd"]
                assert len(big_f) == 2
            elif dense:
                ops = lambda cs: sorted(c[0].split("_single")[0].split("_tensor")[0] for c in cs)  # noqa: E731
                assert ops(big_f) == ["all_gather"] * 2 + ["reduce_scatter"] * 2, got["fwd"]
                # and the QKV and MLP-in linears gather their kept input shards again
                assert ops(big_b) == ["all_gather"] * 4 + ["reduce_scatter"] * 2, got["bwd"]
                assert len(got["fwd"]) == 4
            # the rest: one small all-reduce per replicated parameter with a partial gradient (norms
            # and row biases under SP, q/k head norms always)
            small = sorted(c[1] for c in got["bwd"] if c[1] != bsh)
            partial = sorted(p.numel() for p in params.values() if getattr(p, "tp_partial_grad", False))
            if dense:
                assert all(c[0] == "all_reduce" for c in got["bwd"] if c[1] != bsh) and small == partial
            y, dx = ref["y"], ref["dx"]
            if sp:
                y, dx = y.chunk(tp, 1)[rank], dx.chunk(tp, 1)[rank]
            tol = TOL[DTYPE.get(arch, torch.float32)]
            torch.testing.assert_close(got["y"], y, **tol)
            torch.testing.assert_close(got["dx"], dx, **tol)
            for name, g in got["grads"].items():
                want = shard_of(ref["grads"][name], params[name], rank, tp)
                torch.testing.assert_close(g, want, **tol, msg=f"{arch} grad {name}")


def tp_units(calls, bsh: int) -> float:
    """A block's b*s*h-sized TP transfers in all-reduces (an all-gather or a reduce-scatter is half)."""
    return sum(1.0 if op.startswith("all_reduce") else 0.5 for op, numel, _ in calls if numel == bsh)


def planned_units(cfg: ModelConfig, tp: int, sp: bool) -> float:
    """What the planner's TP time counts for one block and micro-batch (``costs._tp_seconds``, through
    ``traffic.tp_bytes``), in all-reduces of b*s*h: 4 in a dense block (5 with SP's re-gathers), 6 in
    a sparse block with a shared expert (7)."""
    from mt3d.planner.costs import Layout, _tp_seconds
    from mt3d.planner.traffic import ring_factor

    lay = Layout(tp, 1, 1, B, 1, 0, False, sp)
    return _tp_seconds(cfg, S, lay, 1.0, 1, {"tp": 1e-9}, False, ()) / ring_factor(tp)
