"""Bytes one rank sends per training step along each parallel axis (FORMULAS.md).

The one home of the communication volumes: the planner divides them by link bandwidths for its
step time (``costs.step_time``), and ``mt3d topo`` multiplies them by the group edges that join
two hosts for its cross-host estimate (``cross_host_bytes``). A ring collective over n ranks moves
2(n-1)/n of its buffer over every edge of the ring, which is also what each rank sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..parallel.topology import Placement, TopologyError


def ring_factor(n: int) -> float:
    """Share of the buffer a ring all-reduce sends per rank (and per ring edge): 2(n-1)/n."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def tp_bytes(blocks: float, micro_batches: int, act_bytes: float, t: int, *, recompute: bool = False,
             regathers: float = 0.0, mlps: float = 1.0) -> float:  # fmt: skip
    """Megatron TP: per block and micro-batch 2 all-reduces forward and 2 backward of b*s*h (with
    sequence parallelism all-gather + reduce-scatter pairs, the same bytes): one of each for the
    attention's TP region and for each of the block's ``mlps`` (on average: a sparse block with a
    shared expert has two, ``mt3d.model.moe``). Full ``recompute`` runs the forward's again;
    ``regathers``: with SP, how many column-parallel linears per block (2 in a dense block) all-gather
    their saved input shard again in the backward, half an all-reduce each."""
    regions = 1 + mlps
    per_block = regions * (2 + (1 if recompute else 0)) + regathers / 2
    return per_block * blocks * micro_batches * ring_factor(t) * act_bytes


def cp_layer_elements(
    kind: str, cp: int, b: int, s: int, q: int, kv: int, head_dim: int, history: int
) -> float:
    """Elements one rank sends per layer and micro-batch (forward + backward) for one context-parallel
    exchange; b samples of s tokens, ``q`` and ``kv`` heads per TP rank, f = (cp-1)/cp:

    * all-to-all (Ulysses): q, k, v and the output once each way, keeping 1/cp of this rank's
      b s/cp tokens' heads: 2 f (b s/cp)(2q + 2kv') d, kv' = cp when fewer key/value heads than
      cp are repeated up to cp;
    * all-gather: K and V gathered forward, their gradients reduce-scattered backward: 4 f b s kv d;
    * halo: the ``history`` = W d - 1 keys and values before each chunk from its neighbour, and
      their gradients back: 2 (cp-1) sends of each over cp ranks, 8 f b history kv d per rank on
      average, whatever s is.

    ``python -m mt3d.bench comm --cp 2,4`` measures each against this."""
    if cp <= 1:
        return 0.0
    f = (cp - 1) / cp
    if kind == "alltoall":
        return 2 * f * b * s / cp * (2 * q + 2 * (cp if kv < cp else kv)) * head_dim
    if kind == "allgather":
        return 4 * f * b * s * kv * head_dim
    if kind == "halo":
        return 8 * f * b * history * kv * head_dim
    raise ValueError(f"unknown context-parallel exchange {kind!r}")


def cp_gdn_elements(cp: int, b: int, spec, tp: int = 1) -> float:
    """Elements one rank sends per Gated DeltaNet layer and micro-batch (forward + backward) under
    context parallelism (``mt3d.model.gdn_context``), f = (cp-1)/cp: every chunk's state map (M, N),
    key_head_dim x (key_head_dim + value_head_dim) per value head, all-gathered over the 2 cp chunks and
    reduce-scattered back, 4 f cp b (vh / tp) dk (dk + dv); and the convolution's halo of conv_kernel -
    1 tokens of its channels before each chunk, and its gradient back, 4 f b (k - 1)(2 kd + vd) / tp.
    Neither grows with the sequence."""
    if cp <= 1:
        return 0.0
    f = (cp - 1) / cp
    dk, dv = spec.key_head_dim, spec.value_head_dim
    maps = 4 * f * cp * b * spec.value_heads / tp * dk * (dk + dv)
    return maps + 4 * f * b * (spec.conv_kernel - 1) * (2 * spec.key_dim + spec.value_dim) / tp


def ep_ranks_per_token(ep: int, experts: int, top_k: int, groups: int = 1, topk_group: int = 1) -> float:
    """The distinct ep ranks (or hosts: any ``ep`` equal bins of consecutive experts) a token's
    top-``top_k`` experts live on, in expectation over routings that choose every k-subset of the
    ``experts`` alike (E / ep experts per rank): ep (1 - C(E - E/ep, k) / C(E, k)), k at most (every
    expert on another rank), 1 when ep divides into whole ranks of k. With group-limited routing
    (DeepSeek-V3: the experts of ``topk_group`` of ``groups`` equal groups) and ranks no coarser than
    groups, the same over the chosen groups' ranks and experts: a token reaches at most
    ``topk_group`` x ep / groups ranks (with the groups on hosts: at most topk_group hosts). Ranks
    coarser than groups are counted as without the limit (an upper bound)."""
    if ep <= 1:
        return 1.0
    if 1 < groups and topk_group < groups and ep % groups == 0:
        ep, experts = topk_group * ep // groups, topk_group * experts // groups
    miss = math.comb(experts - experts // ep, top_k) / math.comb(experts, top_k)
    return ep * (1.0 - miss)


def ep_node_traffic(hosts: int, per_host: int, tokens: int, top_k: int, hidden: int, experts: int,
                    groups: int = 1, topk_group: int = 1) -> tuple[tuple, tuple]:  # fmt: skip
    """``parallel.expert_dispatch`` "node" (``model.moe_exchange``): the elements one rank
    sends per MoE layer and micro-batch as (across hosts, within the host), each like
    ``ep_layer_traffic``'s (rows, metadata, counts). Across: one row per token and other host holding
    any of its experts (``ep_layer_traffic`` with the hosts as the ranks). Within: the rows a rank
    relays, T D_h on average (as many as it sends), each to the D_r / D_h ranks of the host holding
    its experts there, (m-1)/m of them another rank: T D_r (m-1)/m rows, D_r the distinct ranks
    per token (``ep_ranks_per_token``)."""
    across = ep_layer_traffic(hosts, tokens, top_k, hidden, experts, True, groups, topk_group)
    d_r = ep_ranks_per_token(hosts * per_host, experts, top_k, groups, topk_group)
    rows = tokens * d_r * (per_host - 1) / per_host
    within = (rows * 4 * hidden, rows * 4 * top_k, per_host - 1)
    return across, within


def ep_layer_traffic(ep: int, tokens: int, top_k: int, hidden: int, experts: int, dedup: bool = True,
                     groups: int = 1, topk_group: int = 1) -> tuple[float, float, float]:  # fmt: skip
    """Elements one rank sends per MoE layer and micro-batch (forward + backward) under expert
    parallelism, as (hidden rows, fp32 routing metadata, int64 counts), the experts' load balanced
    (f = (ep-1)/ep of what a rank sends goes to another rank).

    ``dedup`` (mt3d's dispatch, ``mt3d.model.moe.SparseMoE._dispatch_once``): one row per token and
    rank holding any of its experts (D = ``ep_ranks_per_token`` rows per token), each with its k
    weights and k local expert indices; the rows there, one combined row back, and both again in the
    backward: f D T (4 h) row elements, f D T (4 k) metadata, and ep counts (f ep). Without: one row
    per assignment, f (4 T k h) and E counts (f E). ``groups``, ``topk_group``: group-limited routing
    (``ep_ranks_per_token``)."""
    if ep <= 1:
        return 0.0, 0.0, 0.0
    f = (ep - 1) / ep
    if not dedup:
        return f * 4 * tokens * top_k * hidden, 0.0, f * experts
    rows = f * tokens * ep_ranks_per_token(ep, experts, top_k, groups, topk_group)
    return rows * 4 * hidden, rows * 4 * top_k, f * ep


def ep_layer_elements(ep: int, tokens: int, top_k: int, hidden: int, experts: int,
                      dedup: bool = True) -> float:  # fmt: skip
    """All the elements of ``ep_layer_traffic``. ``python -m mt3d.bench comm --ep 2,4`` measures it."""
    return sum(ep_layer_traffic(ep, tokens, top_k, hidden, experts, dedup))


def cp_bytes(cfg, seq_len: int, b: int, tp: int, cp: int, micro_batches: int, elem_bytes: int, blocks: float,
             exchange: str = "auto", recompute: bool = False) -> float:  # fmt: skip
    """Bytes one rank sends per step over the cp group: the exchange of each layer as the model
    chooses it (``parallel.context.exchange_for``: the halo for local layers whose W d - 1 keys fit
    in a chunk), averaged over the layers, for the stage's ``blocks`` and each micro-batch; recompute
    repeats the forward half."""
    from ..parallel.context import exchange_for

    if cp <= 1:
        return 0.0
    if cfg.mla is not None:  # the latent gathered forward, its gradient reduce-scattered (mt3d.model.mla)
        m = cfg.mla_spec
        per_layer = 2 * (cp - 1) / cp * b * seq_len * (m.kv_lora_rank + m.qk_rope_head_dim)
        return per_layer * blocks * micro_batches * elem_bytes * (1.5 if recompute else 1.0)
    q, kv, chunk = cfg.heads // tp, cfg.kv_heads // tp, seq_len // (2 * cp)
    total = 0.0
    for layer, pattern in enumerate(cfg.patterns):
        if cfg.is_linear(layer):  # a Gated DeltaNet layer: its chunks' state maps and convolution halo
            total += cp_gdn_elements(cp, b, cfg.gdn_spec, tp)
            continue
        kind = exchange_for(exchange, pattern, chunk, q, kv, cp)
        history = pattern.history() if kind == "halo" else 0
        total += cp_layer_elements(kind, cp, b, seq_len, q, kv, cfg.head_dim, history)
    per_layer = total / cfg.layers
    return per_layer * blocks * micro_batches * elem_bytes * (1.5 if recompute else 1.0)


def pp_bytes(micro_batches: int, act_bytes: float, virtual_stages: int = 1) -> float:
    """Over each stage boundary: b*s*h forward and back per micro-batch, once per chunk."""
    return 2 * virtual_stages * micro_batches * act_bytes


def dp_bytes(stage_params: float, param_bytes: int, grad_bytes: int, d: int, zero_stage: int,
             gathers: int = 2) -> float:  # fmt: skip
    """Bytes each rank sends for the data-parallel reduction of its model slice, (d-1)/d of a ring
    per pass: the gradients all-reduced (ZeRO 0: twice), or reduce-scattered then the parameters
    all-gathered (ZeRO 1/2). ZeRO-3 all-gathers the parameters for every pass that uses them (forward
    and backward: ``gathers`` 2; 3 with recompute) and reduce-scatters the gradients once."""
    half_ring = ring_factor(d) / 2
    if zero_stage == 0:
        return 2 * half_ring * stage_params * grad_bytes
    gathered = gathers if zero_stage == 3 else 1
    return half_ring * stage_params * (gathered * param_bytes + grad_bytes)


@dataclass(frozen=True)
class TrafficModel:
    """Per-step communication sizes of a transformer, for the cross-host estimate of ``mt3d topo``."""

    layers: int
    hidden: int
    seq_len: int
    micro_batch: int
    micro_batches: int
    params: int
    bytes_per_element: int = 2
    zero_stage: int = 1

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq_len", "micro_batch", "micro_batches", "bytes_per_element"):
            if getattr(self, name) <= 0:
                label = "micro-batches per step (--grad-accum)" if name == "micro_batches" else name
                raise TopologyError(f"{label} must be positive, got {getattr(self, name)}")


def per_rank_bytes(pl: Placement, model: TrafficModel) -> dict[str, float]:
    """Bytes one rank sends per step along each axis with a volume model (every axis a group of one
    rank sends nothing along is 0)."""
    e = model.bytes_per_element
    act = model.micro_batch * model.seq_len * model.hidden * e
    return {
        "tp": tp_bytes(model.layers / pl.pp, model.micro_batches, act, pl.tp),
        "dp": dp_bytes(model.params / (pl.tp * pl.pp), e, e, pl.dp, model.zero_stage),
        "pp": pp_bytes(model.micro_batches, act),
    }


RING = {"tp": True, "dp": True, "pp": False}
"""Whether an axis's collective goes round a ring (its last rank talks to its first)."""


def cross_host_bytes(topo, model: TrafficModel) -> dict[str, float]:
    """Estimated bytes per training step that cross host boundaries, per axis and in total: each
    axis's per-rank volume times the edges of its groups (rings for TP and DP) that join two hosts.
    ``topo``: a ``Placement`` or a ``MappedTopology``."""
    pl: Placement = getattr(topo, "placement", topo)
    per_edge = per_rank_bytes(pl, model)
    out = {ax: per_edge[ax] * pl.crossing_edges(ax, ring=RING[ax]) for ax in per_edge}
    out["total"] = sum(out.values())
    return out
