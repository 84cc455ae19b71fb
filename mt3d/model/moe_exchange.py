"""The expert dispatch's transfers (``moe.SparseMoE._dispatch_once``), apart from the layer: each row
travels once to each member of a hop's group holding any of its experts, over one hop (the ep group)
or two (``parallel.expert_dispatch`` "node": across hosts, then within the host), and one combined row
comes back per row sent; with ``train.overlap.dispatch_chunks`` the rows go in chunks, pipelined.

Each chunk is a generator (``_flow``) that yields right after posting a transfer
(``mappings.start_all_to_all_rows``) and waits for it when advanced again; the driver (``exchange``)
starts chunk r in round r and then advances each older chunk one step, the youngest first, so that
each round computes one chunk's experts while the other chunks' transfers travel. Every rank runs
the same rounds, so every rank issues the same collectives in the same order on each group."""

from __future__ import annotations

import torch

from ..parallel.mappings import start_all_to_all_rows
from .moe_routing import Routes, routes


def exchange(layer, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, during=None, chunks: int = 1):
    """Rows x [R, h] whose slots name experts ``ids`` [R, k] (-1: none) with weights ``w``, through
    ``layer``'s hops (``SparseMoE.hops``) to its experts and back, in ``chunks`` runs of rows (the
    counts of every chunk, on both hops where there are two, exchanged before any row leaves): returns
    (combined rows like x, what ``during`` returned). ``during`` (the shared expert) runs while the
    first chunk's rows travel. ``layer.pipelined`` False: the chunks one after another, each transfer
    waited for at once (the benchmark's serial baseline). Elements per off-rank row of one hop: 4 h +
    4 k over the forward and backward (``planner.traffic.ep_layer_elements``)."""
    then = (layer.target(1, x.device), layer.hops[1][0]) if len(layer.hops) > 1 else None
    way = routes(w, ids, layer.target(0, x.device), layer.hops[0][0], chunks, then)
    flows = [_flow(layer, x, way, c, 0) for c in range(chunks)]
    done, live, side = [], [], None
    for r, flow in enumerate(flows):
        live.append(flow)
        _advance(live, flow, done)  # chunk r's rows posted
        if r == 0 and during is not None:
            side = during()
        if not layer.pipelined:
            while flow in live:
                _advance(live, flow, done)
            continue
        for older in reversed(live[:-1]):
            _advance(live, older, done)
    while live:  # the last chunks' remaining steps, the youngest first each round
        for flow in reversed(list(live)):
            _advance(live, flow, done)
    out = torch.zeros_like(x)
    for src, rows in done:
        out = out.index_add(0, src, rows)
    return out, side


def _advance(live: list, flow, done: list) -> None:
    """One step of ``flow``; when it finishes, its (rows sent, combined rows) go to ``done``."""
    try:
        next(flow)
    except StopIteration as end:
        live.remove(flow)
        done.append(end.value)


def _flow(layer, x: torch.Tensor, way: Routes, c: int, hop: int):
    """Chunk ``c`` of ``way`` over hop ``hop``: its rows and their metadata posted (one transfer when
    fp32 rows carry the metadata as columns); there the next hop takes them on (a one-chunk ``routes``
    over its group, with the counts the first hop's exchange gave) or the rank runs its experts
    (``SparseMoE.at_experts``); the combined rows posted back. Yields after each post; returns (the
    rows it sent, their combined rows)."""
    group, k = layer.hops[hop][0], way.meta.shape[1] // 2
    part, send, recv = slice(way.starts[c], way.starts[c + 1]), way.send[c], way.recv[c]
    src, meta = way.src[part], way.meta[part]
    if x.dtype == torch.float32 and layer.codec is None:
        posted = [start_all_to_all_rows(torch.cat([x[src], meta], dim=1), send, recv, group)]
    else:
        posted = [start_all_to_all_rows(x[src], send, recv, group, layer.codec),
                  start_all_to_all_rows(meta, send, recv, group)]  # fmt: skip
    yield
    got = [wait() for wait in posted]
    xr, meta = got[0].split([x.shape[1], 2 * k], dim=1) if len(got) == 1 else got
    wr, idr = meta[:, :k], meta[:, k:].detach().long()
    if hop + 1 == len(layer.hops):
        yr = layer.at_experts(xr, wr, idr)
    else:
        counts = ([way.onward[0][c]], [way.onward[1][c]])  # known since the first hop's counts
        inner = routes(wr, idr, layer.target(hop + 1, x.device), layer.hops[hop + 1][0], 1, counts=counts)
        sent, rows = yield from _flow(layer, xr, inner, 0, hop + 1)
        yr = torch.zeros_like(xr).index_add(0, sent, rows)
    back = start_all_to_all_rows(yr, recv, send, group)
    yield
    return src, back()
