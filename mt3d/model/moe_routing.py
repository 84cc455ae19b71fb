"""Where a mixture-of-experts layer's tokens go, apart from the layer (``mt3d.model.moe``): the hops of
its expert dispatch over the ep group's ranks and hosts, and capacity's "first come" in one
process's token order when several ranks route parts of the same sequences."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from ..parallel.mappings import all_to_all_counts, start_gather
from ..parallel.state import AxisGroup


def hops(ep: AxisGroup, hosts: tuple | None, experts: int) -> list[tuple[AxisGroup, list[int]]]:
    """The dispatch's hops from the ep group, each (group, the member each expert's rows go to): one
    over ``ep`` itself, or with ``hosts`` = (the ep ranks at this rank's place on each host, the ep
    ranks on this host, the host block of each ep rank in ep order) two: once to each host, to the
    rank at this rank's place there, then within the host to the expert's rank (DeepEP's inter-node
    route: a token crosses to each host at most once)."""
    local = experts // ep.size
    owner = [e // local for e in range(experts)]  # the ep rank holding each expert
    if hosts is None:
        return [(ep, owner)]
    rail, node, blocks = hosts
    place = [blocks[:d].count(blocks[d]) for d in range(ep.size)]  # each ep rank's place on its host
    if len(blocks) != ep.size or len(set(blocks)) != rail.size or blocks.count(blocks[0]) != node.size:
        raise ValueError(f"host blocks {blocks} do not match ep {ep.size} = {rail.size} hosts x {node.size}")
    return [(rail, [blocks[d] for d in owner]), (node, [place[d] for d in owner])]


def earlier_in_sequence(flat: torch.Tensor, order: torch.Tensor, samples: int, experts: int, top_k: int,
                        cp: AxisGroup | None, tpo: AxisGroup | None) -> torch.Tensor:  # fmt: skip
    """For each expert-sorted assignment (``flat[order]``), how many assignments to its expert the
    single process would have counted before it that this rank did not: capacity's "first come" in
    global token order when several ranks route parts of the same ``samples`` sequences. Under cp,
    rank q holds chunks q and 2cp-1-q of each; with experts split over fewer ranks than tp, TP
    rank u of ``tpo`` routes the u-th of its n segments of that (its etp group's gathered shards
    with SP, its share without). A rank's part of a sample is then one or two runs of consecutive
    positions (split where chunk q ends); each run is counted per expert, the counts gathered over
    tpo and cp (samples x 2 x E integers per rank), and an assignment moves by the count before its
    run in (sample, position) order less the local count before it."""
    e, k, groups = experts, top_k, (tpo, cp)
    cp, q = (cp.size, cp.rank) if cp is not None else (1, 0)
    n, u = (tpo.size, tpo.rank) if tpo is not None else (1, 0)
    seg = flat.numel() // k // samples  # this rank's tokens of one sample
    half = seg * n // 2 if cp > 1 else seg * n  # where chunk q ends in the cp rank's local sequence

    def runs(q: int, u: int) -> list[tuple[int, int]]:  # member (q, u)'s runs: (global start, local end)
        a, b = u * seg, (u + 1) * seg
        first = (q * half + a, min(b, half)) if a < half else (cp * 2 * half, a)  # empty: counts nothing
        return [first, ((2 * cp - 1 - q) * half + max(a, half) - half, b)]

    ends = torch.tensor([end - u * seg for _, end in runs(q, u)], device=flat.device)
    token = torch.arange(flat.numel(), device=flat.device) // k
    block = token // seg * 2 + (token % seg >= ends[0]).long()  # sample * 2 + run
    local = torch.bincount(block * e + flat, minlength=samples * 2 * e).view(samples, 2, e)
    gathered = local.unsqueeze(0)
    for g in groups:  # [cp, n, samples, 2, E]
        if g is not None:
            gathered = start_gather(gathered.unsqueeze(0), g, 0)()
    gathered = gathered.view(cp * n, samples, 2, e).permute(1, 0, 2, 3).reshape(samples, cp * n * 2, e)
    starts = torch.tensor([s for qq in range(cp) for uu in range(n) for s, _ in runs(qq, uu)])
    mine = torch.tensor([s for s, _ in runs(q, u)])
    earlier = (starts[None, :] < mine[:, None]).to(flat.device)  # [my 2 runs, every run]
    totals = gathered.sum(1)  # [samples, E]
    same_sample = (earlier[None, :, :, None] * gathered[:, None]).sum(2)  # [samples, 2, E]
    g_before = (totals.cumsum(0) - totals)[:, None] + same_sample
    l_before = (local.flatten(0, 1).cumsum(0) - local.flatten(0, 1)).view(samples, 2, e)
    shift = g_before - l_before  # [samples, 2, E]
    sb = block[order]
    return shift[sb // 2, sb % 2, flat[order]]


class Routes(NamedTuple):
    """One hop of a deduplicated dispatch (``moe_exchange.exchange``), cut into chunks of rows: the
    pairs (member, row) are sorted by chunk, then member, then row."""

    src: torch.Tensor
    """The row each pair sends."""
    meta: torch.Tensor
    """[pairs, 2k] fp32: each pair's k slots' weights (0: another member's) and global experts (-1)."""
    starts: list[int]
    """Where each chunk's pairs begin (and, last, their count)."""
    send: list[list[int]]
    """[chunk][member]: the pairs this rank sends."""
    recv: list[list[int]]
    """[chunk][member]: the pairs each member sends this rank."""
    onward: tuple | None = None
    """With a next hop (``routes``' ``then``): ([chunk][member], [chunk][member]) the pairs this rank, as
    a relay, sends and receives on it."""


def routes(w: torch.Tensor, ids: torch.Tensor, target: torch.Tensor, group: AxisGroup, chunks: int,
           then: tuple | None = None, counts: tuple | None = None) -> Routes:  # fmt: skip
    """Rows whose slots name experts ``ids`` [R, k] (-1: none) with weights ``w``, going to the members
    ``target`` [experts] of ``group``, cut into ``chunks`` runs of consecutive rows: each row once to
    each member holding any of its experts; one counts exchange for every chunk (chunks x members
    integers a rank). ``then`` = (the next hop's member of each expert, its group): the sender also
    counts each row's pairs there per (chunk, member here, member there), which travel with this hop's
    counts, and one exchange over the next hop's group follows, so a relay knows the next hop's counts
    of every chunk before any row reaches it (DeepEP's notify step). ``counts`` = ([send], [recv]) of a
    one-chunk hop known already (a relay's ``onward``): no exchange."""
    r, k = ids.shape
    row, slot = (ids >= 0).nonzero(as_tuple=True)
    expert = ids[row, slot]
    key = target[expert] * r + row  # (chunk, member, row) in one integer
    if chunks > 1:  # chunk c: rows [c r / chunks, (c + 1) r / chunks)
        key = key + row * chunks // max(r, 1) * (group.size * r)
    pairs, which = torch.unique(key, return_inverse=True)  # sorted: by chunk, member, then row
    onward = None
    with torch.no_grad():
        names = torch.full((pairs.numel(), k), -1.0, device=ids.device)
        names[which, slot] = expert.float()
        send = torch.bincount(pairs // r, minlength=chunks * group.size).view(chunks, group.size)
        sent = send.tolist()
        if counts is not None:
            if sent != counts[0]:
                raise RuntimeError(f"a relay got other rows than announced: {sent} vs {counts[0]}")
            recv = counts[1]
        else:
            message = send.t().unsqueeze(-1)  # [member, chunk, 1 (+ the next hop's members)]
            if then is not None:
                nxt, next_group = then
                q = next_group.size
                ahead = torch.unique((key // r * q + nxt[expert]) * r + row) // r
                ahead = torch.bincount(ahead, minlength=chunks * group.size * q).view(chunks, group.size, q)
                message = torch.cat([message, ahead.transpose(0, 1)], dim=-1)
            got = all_to_all_counts(message.reshape(group.size, -1).contiguous(), group)
            got = got.view(group.size, chunks, -1)
            recv = got[:, :, 0].t().tolist()
            if then is not None:
                relay = got[:, :, 1:].sum(0)  # [chunk, next member]: what this rank passes on
                onward = (relay.tolist(), all_to_all_counts(relay.t().contiguous(), next_group).t().tolist())
    ws = torch.zeros(pairs.numel(), k, dtype=torch.float32, device=ids.device)
    ws = ws.index_put((which, slot), w[row, slot].float())
    starts = [0, *itertools.accumulate(sum(c) for c in sent)]
    return Routes(pairs % r, torch.cat([ws, names], dim=1), starts, sent, recv, onward)
