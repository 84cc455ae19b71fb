"""Mixture-of-experts: Mixtral, Qwen2-MoE and Qwen3-MoE against transformers (logits, the auxiliary
load-balancing loss, router gradients), training at every layout against one process (the aux loss
crossing pipeline stages), capacity-mode drops against a hand count, and bad MoE configs."""

import json
import math
import re
import shutil
from contextlib import nullcontext
from itertools import product
from pathlib import Path

import pytest
import torch

from mt3d.parallel.spawn import spawn

RTOL = 1e-5


def _hf_moe(family: str, d: Path, tok_dir: Path) -> Path:
    """A tiny HF MoE model made with transformers: 4 experts, top-2, a router sharp enough that
    tokens really choose (weights x 50), non-zero q/k/v biases where the family has them."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=300, max_position_embeddings=64, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.02)  # fmt: skip
    configs = {
        "mixtral": lambda: MixtralConfig(
            intermediate_size=48, num_local_experts=4, sliding_window=6, **common
        ),
        "qwen2_moe": lambda: Qwen2MoeConfig(
            intermediate_size=48,
            num_experts=4,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **common,
        ),  # fmt: skip
        "qwen3_moe": lambda: Qwen3MoeConfig(
            intermediate_size=48,
            num_experts=4,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            head_dim=16,
            **common,
        ),  # fmt: skip
    }
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs[family]())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight")):
                p.mul_(50)
            elif name.endswith("shared_expert_gate.weight"):
                p.normal_(0, 1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(d)
    for f in tok_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from mt3d.data.tokenizer import train_bpe

    d = tmp_path_factory.mktemp("tok")
    train_bpe(["the quick brown fox jumps over the lazy dog"] * 50, 300, d)
    return d


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_families_match_transformers(tmp_path, tok_dir, family):
    from transformers import AutoModelForCausalLM

    from mt3d.checkpoint.loading import from_pretrained
    from mt3d.model.inference import logits

    d = _hf_moe(family, tmp_path / family, tok_dir)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(d)
    model = from_pretrained(d)
    assert model.config.family == family and model.config.moe_spec.experts == 4
    with torch.no_grad():
        want = ref.eval()(ids).logits
        got = logits(model, ids, model.state, model.config.hidden)
    assert (got - want).abs().max().item() < 1e-4
    # the training loss: cross entropy plus 0.02 x transformers' aux loss, and its router gradients
    ref.train(), model.train()
    out = ref(ids, labels=ids, output_router_logits=True)
    first = out.router_logits[0].float().softmax(-1)
    assert first.max(-1).values.mean() > 0.5 and first.topk(2).indices.unique().numel() >= 3  # tokens choose
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    loss = model(ids, labels)
    aux = model.loss_fn.router_log[-1]["aux"]
    assert abs(aux.item() - out.aux_loss.item()) <= 1e-6 and aux.item() > 2.0  # top_k = 2: perfectly balanced
    assert abs(loss.item() - out.loss.item()) <= 1e-6 * out.loss.item()
    loss.backward(), out.loss.backward()
    mine = {n: p for n, p in model.named_parameters() if n.endswith("mlp.router.weight")}
    theirs = [p for n, p in ref.named_parameters() if n.endswith(("moe.gate.weight", "mlp.gate.weight"))]
    assert len(mine) == len(theirs) == (2 if family == "qwen2_moe" else 3)
    for a, b in zip(mine.values(), theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-8)


def test_capacity_mode_drops_the_assignments_a_hand_count_finds():
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.model.moe import start_stats
    from mt3d.parallel.state import AxisGroup

    moe = dict(experts=4, top_k=2, expert_ffn=16, capacity_factor=0.75)
    cfg = ModelConfig.from_dict(dict(hidden=32, layers=1, heads=4, ffn=64, position="rope", norm="rmsnorm",
                                     mlp="swiglu", bias=False, moe=moe))  # fmt: skip
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), seed=3), 0).train()
    with torch.no_grad():
        block.mlp.router.weight.mul_(40)  # a skewed router: some experts are over capacity
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    _, stats_f, stats_i = block((x, *start_stats(cfg.moe_spec, x)))
    # hand count: each expert keeps the first ceil(0.75 * 24 * 2 / 4) = 9 (token, slot) assignments
    h = block.norm2(x + block.attn(block.norm1(x)))
    chosen = (h @ block.mlp.router.weight.t()).softmax(-1).topk(2, dim=-1).indices.reshape(-1).tolist()
    taken, dropped = [0] * 4, 0
    for e in chosen:
        taken[e] += 1
        dropped += taken[e] > 9
    assert dropped > 0 and stats_i[4].item() == dropped
    assert stats_i[:4].tolist() == [chosen.count(e) for e in range(4)]
    block.eval()  # evaluation stays dropless
    assert block((x, *start_stats(cfg.moe_spec, x)))[2][4].item() == 0


def _first_come_worker(cp, n, samples, seq, k, e):
    """Rank (q, u) = (cp rank, tpo rank): the position of each of its assignments inside its expert,
    counted locally and moved by ``moe_routing.earlier_in_sequence``, with the global positions they
    must equal."""
    import torch.distributed as dist

    from mt3d.model.moe_routing import earlier_in_sequence
    from mt3d.parallel.state import AxisGroup

    me = dist.get_rank()
    q, u = divmod(me, n)
    tpos = [dist.new_group([a * n + b for b in range(n)]) for a in range(cp)]
    cps = [dist.new_group([a * n + b for a in range(cp)]) for b in range(n)]
    cp_group = AxisGroup("cp", tuple(a * n + u for a in range(cp)), q, cps[u]) if cp > 1 else None
    tpo_group = AxisGroup("tpo", tuple(q * n + b for b in range(n)), u, tpos[q]) if n > 1 else None
    index = torch.randint(e, (samples, seq, k), generator=torch.Generator().manual_seed(7))
    index[:, : seq // 3] = 0  # crowd one expert early in each sequence
    flat = index.flatten()  # one process: (sample, position, slot) order
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel()) - (counts.cumsum(0) - counts)[flat[order]]
    chunk = seq // (2 * cp)  # this cp rank's sequence: chunks q and 2cp-1-q; segment u of it
    mine = torch.cat([torch.arange(q * chunk, (q + 1) * chunk),
                      torch.arange((2 * cp - 1 - q) * chunk, (2 * cp - q) * chunk)])  # fmt: skip
    mine = mine.chunk(n)[u]
    local = index[:, mine].flatten()
    lorder = torch.argsort(local, stable=True)
    lcounts = torch.bincount(local, minlength=e)
    pos = torch.arange(local.numel()) - (lcounts.cumsum(0) - lcounts)[local[lorder]]
    pos = pos + earlier_in_sequence(local, lorder, samples, e, k, cp_group, tpo_group)
    flat_of_local = (torch.arange(samples)[:, None] * seq + mine[None, :])[..., None] * k + torch.arange(k)
    return pos, where[flat_of_local.flatten()[lorder]]


@pytest.mark.parametrize("cp,n", [(2, 3), (1, 2), (2, 2)])
def test_capacity_first_come_counts_every_ranks_part_of_the_sequence(cp, n):
    """Capacity's "first come" in one process's token order when cp ranks (zigzag chunks q and
    2cp-1-q) and n TP ranks (experts split over tp / n ranks: each routes one of n segments of the cp
    rank's sequence) route parts of the same sequences: every assignment's position inside its expert
    equals the one process's. cp 2 x n 3 puts a segment across the chunk boundary (two runs of
    positions on one rank)."""
    for pos, want in spawn(_first_come_worker, cp * n, cp, n, 2, 12 * n, 2, 4, timeout=120):
        assert torch.equal(pos, want), (pos, want)


@pytest.mark.parametrize("coef", [0.0, 0.01])
def test_router_statistics_carry_a_gradient_only_when_a_router_loss_uses_them(coef):
    """The per-layer router statistics (probability sums, z^2) feed the aux and z losses and the
    metrics: with both coefficients 0 they are computed without gradient (the router's gradient
    cannot depend on them), with the same values; the stream's ``stats_f`` stays differentiable."""
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.model.moe import start_stats
    from mt3d.parallel.state import AxisGroup

    moe = dict(experts=4, top_k=2, expert_ffn=16, aux_loss_coef=coef)
    cfg = ModelConfig.from_dict(dict(hidden=32, layers=1, heads=4, ffn=64, position="rope", norm="rmsnorm",
                                     mlp="swiglu", bias=False, moe=moe))  # fmt: skip
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), seed=3), 0).train()
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    _, stats_f, _ = block((x, *start_stats(cfg.moe_spec, x)))
    router = block.mlp.router.weight
    grad = torch.autograd.grad(stats_f.sum(), router, allow_unused=True)[0]
    assert stats_f.requires_grad and (grad is None) == (coef == 0.0)
    h = block.norm2(x + block.attn(block.norm1(x)))
    logits = h @ router.t()
    want = torch.cat([logits.softmax(-1).sum((0, 1)), torch.logsumexp(logits, -1).pow(2).sum()[None]])
    torch.testing.assert_close(stats_f.detach(), want, rtol=1e-5, atol=1e-5)


def _ep_block(tp, ep, tp_rank=0, ep_rank=0, groups=(None, None), capacity=None, bias=False, hosts=None,
              **ctx):  # fmt: skip
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.parallel.state import AxisGroup

    cfg = ModelConfig.from_dict(dict(hidden=32, layers=1, heads=4, ffn=64, position="rope", norm="rmsnorm",
                                     mlp="swiglu", bias=False,
                                     moe=dict(experts=4, top_k=2, expert_ffn=32, shared_ffn=32,
                                              capacity_factor=capacity, expert_bias=bias, router_bias=bias,
                                              swiglu_limit=7.0 if bias else None)))  # fmt: skip
    tpg = AxisGroup("tp", tuple(range(tp)), tp_rank, groups[0])
    epg = AxisGroup("ep", tuple(range(ep)), ep_rank, groups[1])
    block = TransformerBlock(cfg, BuildContext(tp=tpg, ep=epg, ep_hosts=hosts, seed=5, **ctx), 0)
    with torch.no_grad():
        block.mlp.router.weight.mul_(30)
        for name, p in block.mlp.named_parameters():
            if name.endswith(("router.bias", "down.bias")):  # gpt-oss's biases (whole on every rank)
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.5)
    return block


def _ep_batch(ep_rank):
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(10 + ep_rank), dtype=torch.float64)


def _ep_worker(tp, ep, capacity, bias):
    import torch.distributed as dist

    me = dist.get_rank()
    tp_groups = [dist.new_group([e * tp + t for t in range(tp)]) for e in range(ep)]
    ep_groups = [dist.new_group([e * tp + t for e in range(ep)]) for t in range(tp)]
    from mt3d.parallel.commlog import CollectiveLog

    t, e = me % tp, me // tp
    block = _ep_block(tp, ep, t, e, (tp_groups[e], ep_groups[t]), capacity, bias).double()
    runs = []
    # each token once per rank, or once per (token, expert); then once per rank in 3 chunks of tokens,
    # pipelined and one after another (train.overlap.dispatch_chunks); and more chunks than the 16 tokens
    variants = ((True, 1, True), (False, 1, True), (True, 3, True), (True, 3, False), (True, 20, True))
    for dedup, chunks, pipelined in variants:
        block.zero_grad(set_to_none=True)
        block.mlp.dedup, block.mlp.chunks, block.mlp.pipelined = dedup, chunks, pipelined
        x = _ep_batch(e).requires_grad_()
        with CollectiveLog() as log:
            out = block(x)
            out.backward(torch.ones_like(out))
        moved = sum(c.numel for c in log.calls if c.op == "all_to_all_single")
        runs.append((out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}, moved))
    return runs


@pytest.mark.parametrize("tp,ep,capacity,bias", [(1, 2, None, False), (2, 2, None, False), (1, 2, 0.5, False),
                                                 (2, 2, None, True)])  # fmt: skip
def test_expert_parallel_dispatch_equals_one_process(tp, ep, capacity, bias):
    """Each ep rank routes its own tokens; experts live on one ep rank each (split over tp), reached by
    all-to-all: outputs and input gradients are those of one process, and an expert's weight gradient
    sums the contributions of the tokens every ep rank sent it; so with each token sent once per rank
    (the default) and once per assignment, the first moving fewer elements; and with capacity
    dropping half the assignments (a token may keep one expert of two on a rank, or none); and with
    gpt-oss's router and expert biases (the down bias added by TP rank 0) and clamped SwiGLU."""
    from mt3d.parallel.layers import shard_of

    ref = _ep_block(1, 1, capacity=capacity, bias=bias).double()
    want, grads = [], {}
    for e in range(ep):
        ref.zero_grad()
        x = _ep_batch(e).requires_grad_()
        out = ref(x)
        out.backward(torch.ones_like(out))
        want.append((out.detach(), x.grad))
        grads[e] = {n: p.grad.clone() for n, p in ref.named_parameters()}
    params = dict(ref.named_parameters())
    # the saturated router's softmax (weights x 30) amplifies the rounding of the TP sum of the experts'
    # partial outputs in its backward (p (g - <p, g>) with p near 1); with gpt-oss's down biases, which
    # dominate those outputs, the router's and norm2's gradients at tp 2 move by up to 1.2e-6 relative
    # in fp64 (measured, both dispatches alike; 8e-8 with the biases at 0); the others hold fp64's default
    tol = dict(rtol=1e-5, atol=1e-7) if bias else {}
    for rank, runs in enumerate(spawn(_ep_worker, tp * ep, tp, ep, capacity, bias, timeout=300)):
        t, e = rank % tp, rank // tp
        for out, dx, got, _ in runs:
            torch.testing.assert_close(out, want[e][0]), torch.testing.assert_close(dx, want[e][1])
            experts = sorted({int(n.split(".")[2]) for n in got if ".experts." in n})
            assert experts == list(range(e * 4 // ep, (e + 1) * 4 // ep)), experts
            for name, g in got.items():
                full = sum(grads[i][name] for i in range(ep)) if ".experts." in name else grads[e][name]
                torch.testing.assert_close(g, shard_of(full, params[name], t, tp), msg=name, **tol)
        # top-2 of 4 experts on 2 ranks: some tokens have both experts on one rank, sent once
        assert runs[0][3] < runs[1][3], (runs[0][3], runs[1][3])
        # chunks send the same rows: only the one counts exchange grows, by (3 - 1) x ep integers
        assert runs[2][3] == runs[3][3] == runs[0][3] + 2 * ep, [r[3] for r in runs]


def _node_dispatch_worker():
    """ep 4 on two 'hosts' of two ranks, routed over the host ('node', two hops) and over the ep group
    ('rank'): per run the output, input and weight gradients, the elements this rank's all-to-alls
    sent to the other host, and its tokens' experts."""
    import torch.distributed as dist

    from mt3d.parallel.commlog import CollectiveLog
    from mt3d.parallel.state import AxisGroup

    me = dist.get_rank()
    everyone = dist.new_group([0, 1, 2, 3])
    rails = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    host, place = divmod(me, 2)
    hosts = (AxisGroup("ep_rail", (place, 2 + place), host, rails[place]),
             AxisGroup("ep_node", (2 * host, 2 * host + 1), place, nodes[host]), (0, 0, 1, 1))  # fmt: skip
    runs = []
    for how, chunks in ((hosts, 1), (None, 1), (hosts, 2)):
        block = _ep_block(1, 4, 0, me, (None, everyone), hosts=how, dispatch_chunks=chunks).double()
        seen = []
        block.mlp.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0].detach()))
        x = _ep_batch(me).requires_grad_()
        with CollectiveLog() as log:
            out = block(x)
            out.backward(torch.ones_like(out))
        # not the counts: one integer per member (one hop), or per member the rows and the second hop's 2
        # members' counts (the first of two hops, unchunked)
        counts = lambda c: c.numel in (len(c.ranks), 3 * len(c.ranks))  # noqa: E731
        crossing = sum(
            n for c in log.calls if c.op == "all_to_all_single" and not counts(c)
            for r, n in zip(c.ranks, c.sends) if r // 2 != host
        )  # fmt: skip
        logits = block.mlp.router(seen[0])
        experts = block.mlp._route(logits, logits.float().softmax(-1))[1].reshape(-1, 2)
        grads = {n: p.grad for n, p in block.named_parameters()}
        runs.append((out.detach(), x.grad, grads, crossing, experts))
    return runs


def test_node_dispatch_crosses_to_each_host_once_per_token():
    """``parallel.expert_dispatch`` "node" (ep 4 over two hosts of two ranks, one expert each): a token
    goes to the rank at its sender's place on each other host holding any of its experts, which passes
    it on within its host (DeepEP's inter-node route). Outputs and gradients equal one process in fp64
    (and the one-hop dispatch's); the elements sent across hosts, summed over the ranks, are 4h + 4k
    per token and other host holding any of its experts (one row there and back, forward and
    backward), against one per token and other-host rank for the one-hop dispatch."""
    ref = _ep_block(1, 1).double()
    want = []
    for rank in range(4):
        ref.zero_grad()
        x = _ep_batch(rank).requires_grad_()
        out = ref(x)
        out.backward(torch.ones_like(out))
        want.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in ref.named_parameters()}))
    per_row = 4 * 32 + 4 * 2
    totals = {"node": [0, 0], "rank": [0, 0]}
    for rank, (node, one_hop, chunked) in enumerate(spawn(_node_dispatch_worker, 4, timeout=120)):
        w_out, w_dx, w_grads = want[rank]
        # two chunks of tokens, each over both hops: the same rows cross, plus the first hop's one counts
        # exchange, which the filter keeps at 2 chunks (2 x (1 + 2) integers to the other host's member)
        assert chunked[3] == node[3] + 6, (chunked[3], node[3])
        for (out, dx, grads, crossing, experts), how in ((node, "node"), (one_hop, "rank"), (chunked, None)):
            torch.testing.assert_close(out, w_out), torch.testing.assert_close(dx, w_dx)
            for name, g in grads.items():  # an expert's gradient: every rank's tokens it took
                full = sum(w[2][name] for w in want) if ".experts." in name else w_grads[name]
                torch.testing.assert_close(g, full, msg=name)
            if how is None:  # the chunked node dispatch: checked, not counted
                continue
            away = [{int(e) for e in row if int(e) // 2 != rank // 2} for row in experts]
            totals[how][0] += crossing
            totals[how][1] += sum(1 for a in away if a) if how == "node" else sum(len(a) for a in away)
    assert all(sent == rows * per_row for sent, rows in totals.values()), totals
    assert 0 < totals["node"][0] < totals["rank"][0], totals


def test_bad_expert_dispatch_is_one_line(tmp_path):
    """An unknown ``expert_dispatch``, "node" or "assignment" without expert parallelism (before any
    process group), "assignment" in chunks, ``dispatch_chunks`` below 1 or without expert parallelism,
    and "node" where an ep group has different numbers of ranks on its hosts (once the hosts are known)."""
    from mt3d.config import ConfigError, from_dict, resolve_model, validate
    from mt3d.config.rules import dispatch_hosts_conflict
    from mt3d.ds.topology import map_ranks
    from mt3d.parallel.hosts import Host

    from helpers import tiny_config

    bad = (("nodes", 2, 1, "expert_dispatch must be one of rank, node, assignment, got 'nodes'"),
           ("node", 1, 1, "it needs a model with experts and parallel.expert > 1"),
           ("assignment", 1, 1, "'assignment' routes tokens to experts once per expert: it needs a model"),
           ("assignment", 2, 2, "set expert_dispatch 'rank' or dispatch_chunks 1"),
           ("rank", 2, 0, "mt3d.train.overlap.dispatch_chunks must be >= 1, got 0"),
           ("rank", 1, 2, "dispatch_chunks 2 pipelines the expert-parallel all-to-all: it needs a model with "
                          "experts and parallel.expert > 1"))  # fmt: skip
    for dispatch, ep, chunks, message in bad:
        raw = tiny_config(tmp_path, model={"preset": "tiny-mixtral"})
        raw["mt3d"]["parallel"].update(expert=ep, expert_dispatch=dispatch)
        raw["mt3d"]["train"]["overlap"] = {"dispatch_chunks": chunks}
        with pytest.raises(ConfigError, match=re.escape(message)):
            validate(from_dict(raw), 2, resolve_model(raw["mt3d"]["model"]))

    def placement(*slots):
        hosts = tuple(Host(f"h{i}", n) for i, n in enumerate(slots))
        return map_ranks(4, hosts=hosts, order="tp-cp-ep-dp-pp", islands=None, allow_crossing=False,
                         expert_tensor=None, tp=1, pp=1, cp=1, ep=4).placement  # fmt: skip

    assert dispatch_hosts_conflict("node", placement(2, 2)) is None
    assert "the same number of ranks on each of its hosts" in dispatch_hosts_conflict("node", placement(3, 1))
    assert dispatch_hosts_conflict("rank", placement(3, 1)) is None


def _overlap_worker():
    import torch.distributed as dist

    from mt3d.parallel import mappings

    me = dist.get_rank()
    block = _ep_block(1, 2, 0, me, (None, dist.new_group([0, 1]))).double()
    events = []
    posted = mappings._Posted
    post, wait = posted.post, posted.wait
    posted.post = lambda self, *a: (events.append("post"), post(self, *a))[1]
    posted.wait = lambda self: (events.append("wait"), wait(self))[1]
    for name, p in block.mlp.shared.named_parameters():
        p.register_hook(lambda g, name=name: events.append(f"shared {name}"))
    shared = block.mlp.shared.forward
    block.mlp.shared.forward = lambda x: (events.append("shared forward"), shared(x))[1]
    runs = []
    for chunks in (1, 2):
        block.mlp.chunks = chunks
        out = block(_ep_batch(me))
        events.append("backward")
        out.sum().backward()
        runs.append(list(events))
        events.clear()
    return runs


def test_the_shared_expert_runs_while_the_dispatch_travels():
    """The rows and their metadata are posted, the shared expert computes, then the rows are awaited
    (and the combine posted and awaited: one chunk); in the backward (after the combine's gradient)
    their gradients are posted back before the shared expert's backward and awaited after it (autograd
    runs the later-created of two ready nodes first). With the tokens in two chunks, the transfers and
    the experts interleave (``train.overlap.dispatch_chunks``)."""
    rows, back = ["post", "post"], ["wait", "wait"]  # fp64 rows and their metadata: two transfers each
    for events, chunked in spawn(_overlap_worker, 2, timeout=120):
        # two chunks: chunk 1's rows leave before chunk 0's experts run, each combine is posted after its
        # experts and both are awaited at the end; the backward mirrors it (chunk 0's combine gradient
        # travels during chunk 1's experts' backward, chunk 1's dispatch gradient during chunk 0's)
        forward = [*rows, "shared forward", *rows, *back, "post", *back, "post", "wait", "wait"]
        backward = ["post", "post", "wait", *rows, "wait", *rows, *back, "shared down.weight",
                    "shared up.weight", *back]  # fmt: skip
        assert chunked == [*forward, "backward", *backward], chunked
        forward = ["post", "post", "shared forward", "wait", "wait", "post", "wait"]  # ... then the combine
        backward = ["post", "wait", "post", "post", "shared down.weight", "shared up.weight", "wait", "wait"]
        assert events == [*forward, "backward", *backward], events


LAYOUTS = [  # (preset, world, parallel keys, and zero: the ZeRO stage when not 1)
    ("tiny-mixtral", 2, dict(expert=2)),
    ("tiny-mixtral", 2, dict(expert=2, zero=0)),  # mt3d's fp32 norm without ZeRO (mt3d.ds.engine)
    # the regular engine, gradients partitioned too; each token sent once per expert it is routed to
    ("tiny-mixtral", 2, dict(expert=2, zero=2, expert_dispatch="assignment")),
    ("tiny-mixtral", 4, dict(context=2, expert=2)),  # dense states over dp x cp = 4, experts' over cp 2
    ("tiny-mixtral", 4, dict(pipeline=2, expert=2, recompute=1)),  # aux statistics cross stages, recompute
    ("tiny-mixtral", 2, dict(context=2)),  # the aux statistics summed over the cp ranks' chunks
    ("tiny-mixtral-capacity", 2, dict(context=2)),  # capacity's "first come" in global token order
    ("tiny-qwen2-moe", 4, dict(pipeline=2, expert=2, virtual_stages=2)),  # shared expert, a dense layer
    # ZB-V: the stream tuple handed over at the V's turn, the loss and router log on rank 0
    ("tiny-mixtral", 4, dict(pipeline=2, expert=2, virtual_stages=2, schedule="zbv")),
    ("tiny-qwen2-moe", 8, dict(tensor=2, pipeline=2, expert=2, sequence_parallel=True)),
    # folded expert layouts (parallel.expert_layout): whole experts, ep over tp x dp, tp, cp
    ("tiny-mixtral", 4, dict(tensor=2, expert=4, expert_tensor=1)),
    pytest.param(
        "tiny-mixtral",
        4,
        dict(tensor=2, pipeline=2, expert=2, expert_tensor=1, sequence_parallel=True, recompute=1),
        marks=pytest.mark.xfail(
            strict=False,
            reason=(
                "known intermittent abort, cause not found: equal to one process when it runs, but on "
                "2026-11-29 in 2 of about 6 runs on a 2-core machine a rank aborted in gloo ('Received data "
                "size doesn't match expected size', a collective order that differs between ranks) at "
                "pipeline 2 x SP x recompute, folded; it has passed in every run since 2026-11-30"
            ),
        ),
    ),  # fmt: skip
    ("tiny-mixtral", 2, dict(context=2, expert=2, expert_tensor=1)),
    ("tiny-qwen2-moe", 4, dict(tensor=2, expert=2, expert_tensor=1)),  # the shared expert under folding
    ("tiny-mixtral", 4, dict(tensor=2, expert=4, expert_tensor=1, zero=2)),  # folded on the regular engine
    # folded without ZeRO (mt3d.ds.experts.reduce_folded): dense over dp 2, experts over their edp 2 replicas;
    # then experts repeating on DeepSpeed's 'model' axis (lcm(tp 4, ep 2) = 4 ranks) at dp 1, edp 2
    ("tiny-mixtral", 4, dict(tensor=2, expert=2, expert_tensor=1, zero=0)),
    ("tiny-deepseek-v3", 4, dict(tensor=4, expert=2, expert_tensor=1, zero=0)),
    # SP, edp 1; the dispatch pipelined in 2 chunks of tokens (train.overlap.dispatch_chunks)
    (
        "tiny-qwen3-moe",
        4,
        dict(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True, dispatch_chunks=2),
    ),  # fmt: skip
    # group-limited sigmoid routing, correction biases, a shared expert, a dense layer, MLA; edp 2; 3 chunks
    ("tiny-deepseek-v3", 4, dict(tensor=2, expert=2, expert_tensor=1, dispatch_chunks=3)),
    # GLM-4.5: q/k/v biases, q/k norms, RoPE over half of each head, DeepSeek's router; folded under SP
    ("tiny-glm4-moe", 4, dict(tensor=2, expert=4, expert_tensor=1, sequence_parallel=True)),
    # MiniMax-M2: q/k norms over all heads (sums of squares added over TP), sigmoid routing; folded, SP
    ("tiny-minimax-m2", 4, dict(tensor=2, expert=2, expert_tensor=1, sequence_parallel=True)),
    # Qwen3-Next: Gated DeltaNet blocks, gated attention, a gated shared expert, a dense block; tp 2 x pp 2 x
    # dp 2 with ep 2 and SP
    ("tiny-qwen3-next", 8, dict(tensor=2, pipeline=2, expert=2, sequence_parallel=True)),
    # expert_dispatch "node": the ep group of 4 on two hosts (a hostfile), tokens cross to each host once;
    # both hops pipelined in 2 chunks
    (
        "tiny-mixtral",
        4,
        dict(tensor=2, expert=4, expert_tensor=1, expert_dispatch="node", hosts=2, dispatch_chunks=2),
    ),  # fmt: skip
    # capacity's "first come" over the runs of each sequence that cp x tp/etp ranks route, SP; the kept
    # assignments dispatched in 2 chunks
    (
        "tiny-mixtral-capacity",
        4,
        dict(tensor=2, context=2, expert=2, expert_tensor=1, sequence_parallel=True, dispatch_chunks=2),
    ),  # fmt: skip
]


CAPACITY = {"preset": "tiny-mixtral", "moe": {"experts": 4, "top_k": 2, "expert_ffn": 64,
                                              "aux_loss_coef": 0.02, "capacity_factor": 0.5}}  # fmt: skip
"""tiny-mixtral with half its experts' fair share: assignments drop in every step."""


def _train(tmp_path, name, world, preset, recompute=0, zero=1, hosts=None, dispatch_chunks=1, **parallel):
    """``hosts``: split the ranks evenly over that many hosts (a hostfile)."""
    from helpers import step_records, tiny_config, train_worker

    model = CAPACITY if preset == "tiny-mixtral-capacity" else {"preset": preset}
    raw = tiny_config(tmp_path / name, model=model, recompute={"interval": recompute}, zero=zero)
    raw["mt3d"]["parallel"].update(parallel)
    raw["mt3d"]["train"].setdefault("overlap", {})["dispatch_chunks"] = dispatch_chunks
    if hosts:
        hostfile = tmp_path / f"{name}-hosts"
        hostfile.write_text("".join(f"node{i} slots={world // hosts}\n" for i in range(hosts)))
        raw["mt3d"]["parallel"]["hostfile"] = str(hostfile)
    return step_records(spawn(train_worker, world, raw, timeout=600)[0])


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe-ref")
    runs: dict[str, list] = {}

    def one_process(preset: str) -> list:  # each preset's run once, when a layout first needs it
        if preset not in runs:
            runs[preset] = _train(base, preset, 1, preset)
        return runs[preset]

    return one_process


@pytest.mark.parametrize(
    "preset,world,parallel",
    LAYOUTS,
    ids=[
        f"{m}-{w}-{'-'.join(map(str, p.values()))}" for m, w, p in (getattr(e, "values", e) for e in LAYOUTS)
    ],  # noqa: E501
)
def test_moe_training_matches_one_process(tmp_path, moe_reference, preset, world, parallel):
    ref = moe_reference(preset)
    got = _train(tmp_path, "run", world, preset, **parallel)
    assert len(ref) == len(got) == 5
    for a, b in zip(got, ref):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "expert_load_max_over_mean"):
            assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), (
                f"{parallel} step {a['step']} {key}: {a} vs {b}"
            )
        assert a["dropped_tokens"] == b["dropped_tokens"] and a["expert_load_max_over_mean"] >= 1.0
        assert (a["dropped_tokens"] > 0) == (preset == "tiny-mixtral-capacity")
    assert ref[0]["loss"] > ref[-1]["loss"]


def test_moe_checkpoints_resume_exactly_and_reshard(tmp_path):
    """pp 2 x ep 2 resumes bit for bit (the aux statistics are rebuilt every micro-batch, nothing else
    is state); its checkpoint (each ep rank's experts in its own files) reshards to one process, to
    ep 4, to tp 2 x ep 2 (DeepSpeed's universal loader slicing by tp, not tp x ep) and to ZeRO-2 at
    ep 2 (the regular engine), whose own checkpoint (module files per ep rank) resumes bit for bit
    and reads back in mt3d's reader."""
    from mt3d.checkpoint.reader import CheckpointReader

    from helpers import run_grouped, tiny_config

    def config(name, resume=None, zero=1, **parallel):
        raw = tiny_config(tmp_path / name, model={"preset": "tiny-mixtral"}, steps=6, save_interval=3,
                          zero=zero, **({"resume": resume} if resume else {}))  # fmt: skip
        raw["mt3d"]["parallel"].update(parallel)
        return raw

    step3 = str(tmp_path / "pp2" / "checkpoints" / "step_00000003")
    zero2 = tmp_path / "zero2" / "checkpoints" / "step_00000003"
    targets = ((1, {}), (4, dict(expert=4)), (4, dict(tensor=2, expert=2)), (2, dict(expert=2, zero=2)))
    runs = run_grouped(
        [(4, config("pp2", pipeline=2, expert=2)), (4, config("again", step3, pipeline=2, expert=2))]
        + [(world, config(f"to{i}", step3, **parallel)) for i, (world, parallel) in enumerate(targets)]
        + [(2, config("zero2", zero=2, expert=2)), (2, config("zero2again", str(zero2), zero=2, expert=2))],
        timeout=600,
    )
    two, again, *got, z2, z2again = [
        [(r["step"], r["loss"], r["grad_norm"], r["moe_aux_loss"]) for r in rs] for rs in runs
    ]
    assert again == two[3:] and z2again == z2[3:]  # bit for bit
    for records in got:
        for a, b in zip(records, two[3:], strict=True):
            assert a[0] == b[0] and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a[1:], b[1:])), (a, b)
    held = torch.load(zero2 / "mp_rank_01_model_states.pt", weights_only=False)["module"]
    name = next(k for k in held if ".experts.3." in k)  # ep rank 1's (experts 2, 3)
    assert torch.equal(CheckpointReader(zero2).full(name), held[name])
    _damaged_expert_files_are_refused_by_name(tmp_path, Path(step3))


def test_folded_sources_with_expert_data_replicas_or_stages_reshard(tmp_path):
    """Folded checkpoints whose experts span several ZeRO fragments (edp 2: tp 2 x dp 2, ep 2, etp 1,
    ordered by the ranks each optimizer file records) or several stages (tp 2 x pp 2, ep 2, etp 1)
    reshard to one process, continuing within 1e-6 of the run they leave (also checked by hand: cp 2
    x tp 2 sources, and each source to tp 2 x ep 4 etp 1)."""
    from helpers import run_grouped, tiny_config

    def config(name, resume=None, **parallel):
        raw = tiny_config(tmp_path / name, model={"preset": "tiny-mixtral"}, steps=6, save_interval=3,
                          **({"resume": resume} if resume else {}))  # fmt: skip
        raw["mt3d"]["parallel"].update(parallel)
        return raw

    sources = {"edp2": dict(tensor=2, expert=2, expert_tensor=1),
               "pp2": dict(tensor=2, pipeline=2, expert=2, expert_tensor=1)}  # fmt: skip
    runs = run_grouped([(4, config(n, **p)) for n, p in sources.items()]
                       + [(1, config(f"{n}-to-one", str(tmp_path / n / "checkpoints" / "step_00000003")))
                          for n in sources], timeout=600)  # fmt: skip
    straight, moved = runs[: len(sources)], runs[len(sources) :]
    for left, records in zip(straight, moved, strict=True):
        for a, b in zip(records, left[3:], strict=True):
            assert a["step"] == b["step"], (a, b)
            for key in ("loss", "grad_norm"):  # issue 46's bound for reshards: 1e-6 (1e-7 seen)
                assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (key, a, b)


def test_folded_checkpoints_resume_exactly_read_back_and_reshard(tmp_path):
    """tp 2 x ep 4 with whole experts (expert_tensor 1, ep over tp x dp) records etp in its manifest,
    resumes bit for bit, and mt3d's reader finds every weight (each expert in the file of its ep rank,
    DeepSpeed's 'model' coordinate e x etp + r) equal to the one-process run's; the same at ZeRO-2 (the
    regular engine: one module file per 'model' coordinate, written by its 'data' rank 0) and at ZeRO-0
    (the optimizer's states in those files too). Reshards,
    weights and optimizer states through the universal form: folded -> one process, folded -> experts
    split over tp (tp 2 x ep 2), one process -> folded, folded ZeRO-2 -> folded ZeRO-1 at ep 2, each
    continuing as the run it left (or the one process) does; and a bf16 run (DeepSpeed's bf16_ file
    names) to one process. bf16 at ZeRO-0 (mt3d's reduction around DeepSpeed's BF16 optimizer) trains as
    bf16 at ZeRO-1."""
    from mt3d.checkpoint.reader import CheckpointReader
    from mt3d.model.sharding import global_names

    from helpers import run_grouped, tiny_config

    def config(name, resume=None, zero=1, bf16=False, **parallel):
        raw = tiny_config(tmp_path / name, model={"preset": "tiny-mixtral"}, steps=6, save_interval=3,
                          zero=zero, **({"resume": resume} if resume else {}))  # fmt: skip
        raw["mt3d"]["parallel"].update(parallel)
        if bf16:  # DeepSpeed names its optimizer files bf16_zero_pp_rank_...
            raw["bf16"] = {"enabled": True}
        return raw

    folded = dict(tensor=2, expert=4, expert_tensor=1)
    step3, z2, z0 = (tmp_path / name / "checkpoints" / "step_00000003" for name in ("folded", "z2", "z0"))
    runs = run_grouped(
        [(1, config("one")), (4, config("folded", **folded)), (4, config("again", str(step3), **folded)),
         (4, config("z2", zero=2, **folded)), (4, config("z2again", str(z2), zero=2, **folded)),
         (4, config("b16", bf16=True, **folded)), (4, config("z0", zero=0, **folded)),
         (4, config("z0again", str(z0), zero=0, **folded)),
         (4, config("b16z0", bf16=True, zero=0, **folded))],
        timeout=600,
    )  # fmt: skip
    one, got, again, two, two_again, b16, zero0, zero0_again, b16_zero0 = [
        [(r["step"], r["loss"], r["grad_norm"]) for r in rs] for rs in runs
    ]
    assert again == got[3:] and two_again == two[3:] and zero0_again == zero0[3:]  # bit for bit
    # bf16 without ZeRO: mt3d's folded reduction wrapped around the BF16 optimizer's (measured 1e-4 from
    # ZeRO-1's, which reduces inside DeepSpeed's optimizer; a gradient reduced over the wrong ranks or
    # not divided moves the norm by 2x)
    for a, b in zip(b16_zero0, b16, strict=True):
        assert a[0] == b[0] and all(abs(x - y) <= 1e-3 * abs(y) for x, y in zip(a[1:], b[1:])), (a, b)
    for a, b in [*zip(got, one, strict=True), *zip(two, one, strict=True), *zip(zero0, one, strict=True)]:
        assert all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a[1:], b[1:])), (a, b)
    one3 = str(tmp_path / "one" / "checkpoints" / "step_00000003")
    b16_3 = str(tmp_path / "b16" / "checkpoints" / "step_00000003")
    moves = [(1, config("to-one", str(step3))), (4, config("to-split", str(step3), tensor=2, expert=2)),
             (4, config("from-one", one3, **folded)), (4, config("z2-to-ep2", str(z2), tensor=2, expert=2,
                                                                 expert_tensor=1)),
             (1, config("b16-to-one", b16_3, bf16=True))]  # fmt: skip
    # bf16: the master weights and moments move exactly; one process rounds its bf16 GEMMs otherwise
    tolerances = (RTOL, RTOL, RTOL, RTOL, 1e-2)
    for records, ref_run, tol in zip(run_grouped(moves, timeout=600), (got, got, one, two, b16), tolerances,
                                     strict=True):  # fmt: skip
        moved = [(r["step"], r["loss"], r["grad_norm"]) for r in records]
        for a, b in zip(moved, ref_run[3:], strict=True):
            assert a[0] == b[0] and all(abs(x - y) <= tol * abs(y) for x, y in zip(a[1:], b[1:])), (a, b)
    ref = CheckpointReader(tmp_path / "one" / "checkpoints" / "step_00000003")
    names = global_names(ref.cfg, ref.vocab)
    assert any(".experts.3." in n for n in names)
    assert sorted(p.name for p in z2.glob("mp_rank_*_model_states.pt")) == [
        f"mp_rank_{m:02d}_model_states.pt" for m in range(4)
    ]  # one per 'model' coordinate: lcm(tp 2, ep 4) = 4
    for path in (step3, z2, z0):
        reader = CheckpointReader(path)
        assert reader.meta["layout"]["etp"] == 1 and reader.meta["layout"]["ep"] == 4
        for name in names:
            torch.testing.assert_close(reader.full(name), ref.full(name), rtol=1e-4, atol=1e-5, msg=name)


def _damaged(src: Path, dest: Path, how: str) -> Path:
    """A copy of checkpoint ``src`` with one expert file damaged (``how``), its manifest re-hashed (so
    only the content checks can tell)."""
    from mt3d.checkpoint.manifest import describe_files, read_manifest, write_manifest

    shutil.copytree(src, dest)
    a, b = dest / "layer_02-model_00-model_states.pt", dest / "layer_02-model_01-model_states.pt"
    if how == "swapped":  # ep rank 0's experts where ep rank 1's belong, and back
        tmp = dest / "swap.tmp"
        a.rename(tmp), b.rename(a), tmp.rename(b)
    else:
        state = torch.load(b, weights_only=True)
        key = next(k for k in state if ".experts." in k and k.endswith("up.weight"))
        state[key] = state[key][:-2] if how == "shape" else state[key].fill_(float("nan"))
        torch.save(state, b)
    manifest = read_manifest(dest)
    write_manifest(dest, describe_files(dest, sorted(manifest["files"])), manifest["meta"])
    return dest


def _damaged_expert_files_are_refused_by_name(tmp_path: Path, step3: Path):
    """Expert files swapped between ep ranks, cut to the wrong shape or holding NaN (manifests re-hashed)
    are refused in one line on every rank before any rank steps: the swap and the shape from the files'
    indexes before DeepSpeed loads, the NaN (named with its expert) once loaded; export names it too."""
    from mt3d.checkpoint.loading import from_pretrained
    from mt3d.checkpoint.manifest import read_manifest
    from mt3d.checkpoint.resume import check_layer_files
    from mt3d.config import resolve_model
    from mt3d.errors import CheckpointError, UserError

    from helpers import tiny_config, train_rc_worker

    cfg = resolve_model({"preset": "tiny-mixtral"})
    cases = (
        ("swapped", "holds expert 2, but ep rank 0 of 2 holds experts 0-1"),
        ("shape", "up.weight has shape (126, 64), the saved layout (tp 1) needs (128, 64)"),
    )
    for how, match in cases:
        bad = _damaged(step3, tmp_path / f"bad-{how}" / "step_00000003", how)
        with pytest.raises(CheckpointError, match=re.escape(match)):
            check_layer_files(bad, read_manifest(bad), cfg)
    bad = _damaged(step3, tmp_path / "bad-nan" / "step_00000003", "nan")
    with pytest.raises(UserError, match=r"mlp\.experts\.\d\.up\.weight \(expert \d\) .* holds 8192 NaN"):
        from_pretrained(bad)
    for how in ("swapped", "nan"):
        raw = tiny_config(tmp_path / f"resume-{how}", model={"preset": "tiny-mixtral"}, steps=6,
                          resume=str(tmp_path / f"bad-{how}" / "step_00000003"))  # fmt: skip
        raw["mt3d"]["parallel"].update(pipeline=2, expert=2)
        assert [rc for rc, _ in spawn(train_rc_worker, 4, raw, timeout=300)] == [2] * 4, how


@pytest.mark.parametrize(
    "moe,match",
    [
        ({"experts": 4, "top_k": 5, "expert_ffn": 8}, "top_k 5 exceeds the 4 experts"),
        ({"experts": 4, "top_k": 2}, "model.moe needs 'expert_ffn'"),
        (
            {"experts": 4, "top_k": 2, "expert_ffn": 8, "router": "sigmoid"},
            "unknown model.moe keys \\['router'\\]",
        ),
        (
            {"experts": 4, "top_k": 2, "expert_ffn": 8, "dense_layers": [9]},
            "dense_layers entry 9 is not a block",
        ),
        (
            {"experts": 4, "top_k": 2, "expert_ffn": 8, "capacity_factor": 0},
            "capacity_factor must be a finite positive",
        ),
        ({"experts": 4, "top_k": 2, "expert_ffn": 8, "capacity_factor": math.inf}, "finite positive number"),
        ({"experts": 4, "top_k": 2, "expert_ffn": 8, "capacity_factor": math.nan}, "finite positive number"),
    ],
)
def test_bad_moe_configs_are_one_line(moe, match):
    from mt3d.model.config import ModelConfig, ModelConfigError

    with pytest.raises(ModelConfigError, match=match) as info:
        ModelConfig.from_dict(dict(hidden=32, layers=2, heads=4, moe=moe))
    assert "\n" not in str(info.value)


def test_one_window_families_refuse_mixed_local_and_global_layers():
    """Mixtral's and Qwen3-MoE's sliding_window covers every layer: a model with some global layers
    would be exported as all-local, so it is refused; Qwen2-MoE's layer_types can say it."""
    from mt3d.model.config import ModelConfig, ModelConfigError

    mixed = {"window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    moe = {"experts": 4, "top_k": 2, "expert_ffn": 8}
    for family in ("mixtral", "qwen3_moe"):
        with pytest.raises(ModelConfigError, match="sliding_window applies to every layer"):
            ModelConfig.from_dict(dict(family=family, hidden=32, layers=2, heads=4, moe=moe, attention=mixed))
    ModelConfig.from_dict(dict(family="qwen2_moe", hidden=32, layers=2, heads=4, moe=moe, attention=mixed))


@pytest.mark.parametrize(
    "parallel,zero,world,match",
    [
        ({}, 3, 2, "not supported with ZeRO-3 yet"),
        (dict(expert=2), 1, 3, "expert_tensor x expert = 1 x 2 must divide tensor x context x data = 1 x 1"),
        (dict(expert=3), 1, 3, "model.moe.experts = 4 is not divisible by parallel.expert 3"),
        (dict(tensor=2, expert=2, expert_tensor=3), 1, 4, "expert_tensor = 3 must divide tensor = 2"),
        (dict(tensor=2, expert_tensor=1), 1, 2, "expert_tensor 1 below tensor 2 folds whole experts over an"),
        (dict(tensor=2, expert=4, expert_tensor=1, pipeline=2), 1, 4, "must divide tensor x context x data"),
    ],
)
def test_bad_moe_layouts_are_one_line_before_process_groups(tmp_path, parallel, zero, world, match):
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    from helpers import tiny_config

    raw = tiny_config(tmp_path, model={"preset": "tiny-mixtral"}, zero=zero)
    raw["mt3d"]["parallel"].update(parallel)
    run = from_dict(raw)
    with pytest.raises(ConfigError, match=match) as info:
        validate(run, world, resolve_model(run.mt3d.model))
    assert "\n" not in str(info.value)


def test_unsupported_routing_is_refused_by_name(tmp_path, tok_dir):
    from mt3d.model.families import HFError
    from mt3d.model.hf import config_from_hf

    d = _hf_moe("qwen3_moe", tmp_path / "q", tok_dir)
    cfg = json.loads((d / "config.json").read_text())
    for change, match in (
        ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid' asks for sigmoid expert scoring"),
        ({"n_group": 8, "topk_group": 4}, "asks for grouped expert routing"),
        ({"num_experts_per_tok": 6}, "num_experts_per_tok 6 exceeds num_local_experts 4"),
    ):
        (d / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(HFError, match=match):
            config_from_hf(d)


def test_a_zero_shared_expert_over_trained_weights_is_refused(tmp_path, tok_dir):
    """Qwen2-MoE with ``shared_expert_intermediate_size: 0`` over a trained shared expert: transformers
    refuses the size mismatch; so does mt3d, in one line naming the size to set (it loaded the model
    without the shared expert, only logging the unused tensors)."""
    from mt3d.checkpoint.loading import open_source
    from mt3d.model.families import HFError

    d = _hf_moe("qwen2_moe", tmp_path / "q", tok_dir)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "shared_expert_intermediate_size": 0}))
    with pytest.raises(HFError, match="sets shared_expert_intermediate_size 0 but the weights hold a trained "
                       "shared expert") as err:  # fmt: skip
        open_source(d)
    size = cfg["shared_expert_intermediate_size"]
    assert f"set shared_expert_intermediate_size to {size}" in str(err.value)


def test_deepspeed_still_needs_what_mt3d_ds_experts_does():
    """Each reach of mt3d.ds.experts against the pinned DeepSpeed's source: the schedule's reduce step
    calls the two methods wrapped on the engine; ZeRO's and the BF16 optimizer's norms skip weights
    marked ds_pipe_replicated while clip_grad_norm_ (mt3d's fp32 guard) does not; the engine takes
    the MoE path only for its own MoE classes; the universal loader slices by the grid's slice size."""
    import inspect

    from deepspeed.runtime import bf16_optimizer, engine, utils
    from deepspeed.runtime.pipe import engine as pipe_engine
    from deepspeed.runtime.pipe import topology
    from deepspeed.runtime.zero import stage_1_and_2

    reduce = inspect.getsource(pipe_engine.PipelineEngine._exec_reduce_grads)
    assert "self.allreduce_gradients(" in reduce and "self._bf16_reduce_grads()" in reduce
    zero_norm = inspect.getsource(stage_1_and_2.DeepSpeedZeroOptimizer.get_grad_norm_direct)
    assert "PIPE_REPLICATED" in zero_norm
    assert "PIPE_REPLICATED" in inspect.getsource(bf16_optimizer.BF16_Optimizer.get_grads_for_norm)
    assert "PIPE_REPLICATED" not in inspect.getsource(utils.clip_grad_norm_)
    moe = inspect.getsource(engine.DeepSpeedEngine._configure_distributed_model)
    assert "isinstance(module, MoE)" in moe and "self.has_moe_layers = True" in moe
    from deepspeed.runtime import base_optimizer

    load = inspect.getsource(base_optimizer.ZeROOptimizer.load_hp_checkpoint_state_from_checkpoint_dir)
    assert "get_slice_parallel_world_size" in load
    assert "zip(self.optimizer.param_groups, optim_sd['param_groups'])" in load  # pad_param_groups
    # with ZeRO (mt3d.ds.experts.zero_optimizer): the engine builds the optimizer by the name swapped,
    # hands it MoE groups only on its own MoE path, picks the BF16 optimizer for bf16 ZeRO-1, lets only
    # ranks whose ZeRO rank equals their 'data' rank save, and lists zero files up to its 'data' size
    build = inspect.getsource(engine.DeepSpeedEngine._configure_zero_optimizer)
    assert "Stage1And2ZeroOptimizer = DeepSpeedZeroOptimizer" in build
    assert "has_moe_layers=self.has_moe_layers" in build
    assert "return BFLOAT16" in inspect.getsource(engine.DeepSpeedEngine._do_optimizer_sanity_check)
    saving = inspect.getsource(engine.DeepSpeedEngine._configure_checkpointing)
    assert "self.save_zero_checkpoint = param_rank == dp_rank" in saving
    names = inspect.getsource(engine.DeepSpeedEngine._get_all_zero_checkpoint_names)
    assert "dp_world_size=self.loaded_checkpoint_dp_world_size" in names
    # ... broadcasts every weight that is not its own MoE class's over the ZeRO group, and reduces each
    # group's squared norm on its own (expert_zero_optimizer folds them into one reduction)
    assert "group=self.seq_data_parallel_group" in inspect.getsource(engine.DeepSpeedEngine._broadcast_model)
    zero = stage_1_and_2.DeepSpeedZeroOptimizer
    norm = inspect.getsource(zero.scaled_global_norm)
    assert "self.get_grad_norm_direct(self.averaged_gradients[i], self.params_in_partition[i])" in norm
    assert "self._average_expert_grad_norms(norm_groups)" in norm
    assert "group=self.dp_process_group" in inspect.getsource(zero.get_grad_norm_direct)
    assert "self.slice_parallel_size" in inspect.getsource(
        topology.PipelineParallelGrid.get_slice_parallel_world_size
    )


def test_grouped_gemm_equals_a_loop_over_experts(monkeypatch):
    """A rank's experts as torch's grouped matmul (used wherever it works, this CPU included) and as
    one matmul per expert: the same outputs and gradients, an expert without rows among them; and so
    with the backward split for a zero-bubble schedule (B leaves every expert's weight gradient to W)."""
    from mt3d.config import resolve_model
    from mt3d.model import moe
    from mt3d.model.blocks import BuildContext
    from mt3d.parallel.deferred import WeightGrads, deferring, split_backward
    from mt3d.parallel.state import AxisGroup

    assert moe.grouped_gemm_works(torch.device("cpu"), torch.float32)
    cfg = resolve_model({"preset": "tiny-mixtral"})
    layer = moe.SparseMoE(cfg, BuildContext(tp=AxisGroup.alone("tp")), 0)
    xs = torch.randn(40, cfg.hidden, requires_grad=True)
    weights = torch.randn(40, cfg.hidden)
    got = {}
    for grouped, split in product((True, False), (False, True)):
        monkeypatch.setattr(moe, "grouped_gemm_works", lambda device, dtype, g=grouped: g)
        layer.zero_grad()
        xs.grad = None
        split_backward(split)
        try:
            y = layer._run_local(xs, [10, 0, 25, 5])
        finally:
            split_backward(False)
        queue = WeightGrads()
        with deferring(queue) if split else nullcontext():
            (y * weights).sum().backward()
        experts = list(layer.experts.parameters())
        if split:  # B: the input gradient only; W: every expert's weight gradients (an empty expert's 0)
            assert all(p.grad is None for p in experts) and len(queue) == (2 if grouped else 2 * 4)
            queue.run()
        got[grouped, split] = [y.detach(), xs.grad.clone(), *(p.grad.clone() for p in experts)]
    for key in ((True, True), (False, False), (False, True)):
        for a, b in zip(got[True, False], got[key], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _balancing_model(rate):
    from mt3d.model.blocks import BuildContext
    from mt3d.model.config import ModelConfig
    from mt3d.model.pipeline import StackedModel, layer_specs
    from mt3d.parallel.state import AxisGroup
    from mt3d.presets import get_preset

    d = get_preset("tiny-deepseek-v3").to_dict()
    d["moe"] = {**d["moe"], "bias_update_rate": rate}
    cfg = ModelConfig.from_dict(d)
    torch.manual_seed(0)
    model = StackedModel(layer_specs(cfg, BuildContext(tp=AxisGroup.alone("tp")), 64)).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.mul_(4)  # scores spread like a trained router's
    return model


def test_aux_loss_free_balancing_moves_the_bias_by_the_rate_and_evens_the_load():
    """DeepSeek-V3's aux-loss-free balancing on a fixed skewed batch (16 of 64 token ids), weights
    fixed: after each step every correction bias moves by exactly the rate against the sign of its
    expert's load error, nothing moves without a rate, and the max/mean load of the most loaded layer
    falls over 50 steps (1.66 at the first, 1.22 at most over the last ten: a 0.73 ratio)."""
    from mt3d.model.moe import Router, balance_experts
    from mt3d.parallel.state import AxisGroup

    ids = torch.randint(0, 16, (4, 32), generator=torch.Generator().manual_seed(3))
    alone = AxisGroup.alone("dense"), AxisGroup.alone("tp")
    model = _balancing_model(0.01)
    routers = [m for m in model.modules() if isinstance(m, Router) and m.e_score_correction_bias is not None]
    assert len(routers) == 3  # the first block is dense
    ratios = []
    for _ in range(50):
        before = [r.e_score_correction_bias.clone() for r in routers]
        with torch.no_grad():
            model(ids)
        loads = [r.load.float() for r in routers]
        ratios.append(balance_experts(model, *alone))
        for r, b, load in zip(routers, before, loads, strict=True):
            want = b + 0.01 * torch.sign(load.mean() - load)
            assert torch.equal(r.e_score_correction_bias, want) and r.load is None
        assert ratios[-1] == max(float(x.max() / x.mean()) for x in loads)
    assert ratios[0] >= 1.6 and max(ratios[-10:]) <= 0.75 * ratios[0], ratios
    frozen = _balancing_model(0.0)
    with torch.no_grad():
        frozen(ids)
    balance_experts(frozen, *alone)
    assert all(not bool(m.e_score_correction_bias.any()) for m in frozen.modules() if isinstance(m, Router)
               and m.e_score_correction_bias is not None)  # fmt: skip


def test_aux_loss_free_balancing_trains_alike_at_every_axis_and_resumes_exactly(tmp_path):
    """tiny-deepseek-v3 (rate 1e-3) for 6 steps on one process, resumed from its step 3, resharded from
    it to tp 2 (the biases are not in DeepSpeed's universal format: read from the source checkpoint),
    and at tp 2 x pp 2 x ep 2 with SP and full recompute (loads summed over the TP shards, counted once
    under recompute): the same losses, and the same correction biases in the final checkpoints."""
    from mt3d.checkpoint.loading import open_source

    from helpers import run_grouped, tiny_config

    def config(name, world=1, train=None, **parallel):
        raw = tiny_config(tmp_path / name, model={"preset": "tiny-deepseek-v3"}, steps=6, save_interval=3,
                          save_at_end=True, **(train or {}))  # fmt: skip
        raw["mt3d"]["parallel"].update(parallel)
        return world, raw

    step3 = str(tmp_path / "one" / "checkpoints" / "step_00000003")
    one, again, resharded, spread = run_grouped(
        [config("one"), config("again", train={"resume": step3}),
         config("resharded", 2, {"resume": step3}, tensor=2),
         config("spread", 8, {"recompute": {"interval": 1}}, tensor=2, pipeline=2, expert=2,
                sequence_parallel=True)],
        timeout=600,
    )  # fmt: skip
    rec = lambda rs: [(r["step"], r["loss"], r["grad_norm"]) for r in rs if "grad_norm" in r]  # noqa: E731
    assert rec(again) == rec(one)[3:]
    for a, b in [*zip(rec(spread), rec(one), strict=True), *zip(rec(resharded), rec(one)[3:], strict=True)]:
        assert a[0] == b[0] and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a[1:], b[1:])), (a, b)
    names = [f"{i + 2}.mlp.router.e_score_correction_bias" for i in (1, 2, 3)]
    runs = ("one", "again", "resharded", "spread")
    biases = {run: [open_source(tmp_path / run).full(n) for n in names] for run in runs}
    assert any(bool(b.any()) for b in biases["one"])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(biases[run], biases["one"])), run


def _partition_worker(raw):
    """Build ``raw``'s engine, train one step; this rank's ZeRO partitions by group kind, beside the
    dense and expert parameters it holds."""
    from mt3d.bench.common import build_engine, train_step
    from mt3d.ds.experts import is_expert

    _, layout, rt, engine, data, cfg = build_engine(raw)
    train_step(engine, layout, rt, data, layout.micro_batch, 0)
    opt = engine.optimizer
    parts = {"dense": 0, "experts": 0}
    for flat, moe in zip(opt.single_partition_of_fp32_groups, opt.is_moe_param_group, strict=True):
        parts["experts" if moe else "dense"] += flat.numel()
    held = {"dense": 0, "experts": 0}
    for p in engine.module.parameters():
        held["experts" if is_expert(p) else "dense"] += p.numel()
    moments = sum(t.numel() for s in opt.optimizer.state.values() for t in s.values() if t.numel() > 1)
    return {"parts": parts, "held": held, "moments": moments, "cfg": cfg.to_dict(),
            "groups": (rt.state.dense.size, rt.state.edp.size)}  # fmt: skip


def test_zero_partitions_dense_states_over_every_data_rank_and_experts_over_theirs():
    """ep 2 x dp 2, ZeRO-1: each rank's fp32 master weights (and Adam's two moments of them) hold half
    the dense parameters (dp x cp = 2 ranks; before, ep = dp left them whole on every rank) and all
    of its own experts (dp / ep x cp = 1 rank holds them), as the planner counts them."""
    from mt3d.model.config import ModelConfig
    from mt3d.planner.layout import Layout, stage_expert_params, stage_params

    from helpers import tiny_config

    raw = tiny_config("/tmp/unused", model={"preset": "tiny-mixtral"}, zero=1)
    raw["mt3d"]["parallel"].update(expert=2)
    results = spawn(_partition_worker, 2, raw, timeout=300)
    for r in results:
        assert r["groups"] == (2, 1)
        dense, experts = r["held"]["dense"], r["held"]["experts"]
        assert dense // 2 <= r["parts"]["dense"] <= dense // 2 + 8  # DeepSpeed aligns partitions
        assert r["parts"]["experts"] == experts
        assert r["moments"] == 2 * (r["parts"]["dense"] + r["parts"]["experts"])
    cfg = ModelConfig.from_dict(results[0]["cfg"])
    lay = Layout(tp=1, pp=1, dp=2, micro_batch=2, grad_accum=2, zero_stage=1, recompute=False,
                 sequence_parallel=False, ep=2)  # fmt: skip
    planned = lay.partitioned(stage_params(cfg, 512, 1, 1, 2), stage_expert_params(cfg, 1, 1, 2))
    measured = sum(results[0]["parts"].values())
    assert abs(planned - measured) <= 0.02 * measured, (planned, measured)
    assert stage_expert_params(cfg, 1, 1, 2) == results[0]["held"]["experts"]
