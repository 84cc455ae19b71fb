"""Mixture-of-experts MLPs: a softmax top-k router, routed experts, an optional gated shared expert.

One implementation that the MoE families map onto (Mixtral, Qwen2-MoE, Qwen3-MoE), with
transformers' semantics: the router's logits are computed in the model dtype, the softmax in fp32,
the k largest probabilities are the expert weights (renormalised to sum to 1 with
``norm_topk_prob``), each token's output is the weighted sum of its experts' gated MLPs, plus
``sigmoid(shared_gate(x)) * shared_mlp(x)`` where there is a shared expert (Qwen2-MoE). Routing is
dropless unless ``capacity_factor`` is set: then each expert takes at most
``ceil(capacity_factor * tokens * top_k / experts)`` of the (token, slot) assignments, first come in
token order, and the rest are dropped (counted).

Tensor parallelism: each expert's inner dimension is split over TP (gate/up column-, down
row-parallel, as a dense MLP), so every TP rank holds a slice of every expert and an expert's
weights never cross ranks. Experts stay whole per TP group rather than whole per rank because mt3d
places TP inside an NVLink island: splitting every expert keeps the per-rank expert memory at
1/tp with no extra all-to-all, and the load of a skewed router lands evenly on the TP ranks. The
router (replicated, tiny) runs on the residual stream outside the TP region (on the sequence shard
under SP); its top-k weights and indices enter the region with the hidden states.

The auxiliary load-balancing loss is transformers' ``load_balancing_loss_func``: with C_e the
top-k assignments to expert e and P_e the sum of its router probabilities, both summed over every
sparse layer of the model and every token of the micro-batch (R tokens, L sparse layers),
``aux = E * sum_e (C_e / (R L)) * (P_e / (R L))``. It couples all layers, which live on different
pipeline stages, so the sums travel with the hidden states: a sparse model's residual stream is the
tuple ``(hidden, stats_f, stats_i)`` (``start_stats``); ``stats_f`` = [P_1..P_E, sum of z^2]
(differentiable: the router gradient of the aux loss flows back through DeepSpeed's pipeline like the
hidden states' own), ``stats_i`` = [C_1..C_E, dropped] (integers: no gradient). The head returns them
in a ``Routed`` and ``LossFn`` adds ``aux_loss_coef * aux + z_loss_coef * z`` during training.

DeepSpeed's AutoEP router (``deepspeed.moe``) is not used: it scores experts inside its own
``MoE`` layer that owns the expert weights, with its own gate and capacity rules (its top-k
gating's capacity, noise and load-balancing loss are Switch/GShard-style per layer), while mt3d must
reproduce transformers' routing and cross-layer aux loss exactly, split experts over TP and carry
the aux statistics through the pipeline; the few lines of routing above are mt3d's own for that
reason.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, local_linear
from ..parallel.mappings import (
    all_reduce,
    all_to_all_counts,
    all_to_all_rows,
    copy_to_tp,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from ..parallel.marks import mark_tp_partial_grad
from ..parallel.random import recomputing
from .grouped import grouped_gemm_works, grouped_linear
from .moe_exchange import exchange
from .moe_routing import earlier_in_sequence, hops
from .moe_spec import EXPERT_NAME, MoEConfigError, MoESpec, expert_index  # noqa: F401 - re-exported


class Routed(NamedTuple):
    """What the head of a sparse model returns: its usual output and the router statistics."""

    out: object
    stats_f: torch.Tensor
    stats_i: torch.Tensor


def start_stats(spec: MoESpec, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed router statistics for the start of a sparse model's residual stream.

    ``stats_f`` is a leaf that requires grad (while grad is on) so that a pipeline stage without a
    sparse layer still returns a differentiable tensor DeepSpeed can backpropagate into.
    """
    f = torch.zeros(spec.experts + 1, dtype=torch.float32, device=like.device)
    if torch.is_grad_enabled():
        f.requires_grad_()
    return f, torch.zeros(spec.experts + 1, dtype=torch.int64, device=like.device)


def router_losses(spec: MoESpec, routed: Routed, tokens: int, sparse_layers: int) -> tuple:
    """(aux, z) of a micro-batch of ``tokens`` tokens from its statistics (transformers' aux loss)."""
    rows = float(tokens * sparse_layers)
    e = spec.experts
    frac = routed.stats_i[:e].float() / rows
    prob = routed.stats_f[:e] / rows
    return e * (frac * prob).sum(), routed.stats_f[e] / rows


class Router(ReplicatedLinear):
    """The replicated [experts, hidden] scoring matrix, and its bias where the family has one; with
    ``correction`` the selection-only bias of aux-loss-free balancing (``e_score_correction_bias``,
    fp32, outside the gradient: ``balance_experts`` moves it), and the load it counts for that."""

    def __init__(self, cfg, ctx, layer: int, rows: int, name: str, bias: bool = False,
                 correction: bool = False) -> None:  # fmt: skip
        init = ctx.init(layer, name, cfg.init_std)
        super().__init__(cfg.hidden, rows, tp=ctx.tp, bias=bias, sequence_parallel=ctx.sp, init=init,
                         dtype=ctx.dtype, device=ctx.device)  # fmt: skip
        self.e_score_correction_bias = None
        if correction:
            b = torch.zeros(rows, dtype=torch.float32, device=ctx.device)
            self.e_score_correction_bias = nn.Parameter(b, requires_grad=False)
            self.e_score_correction_bias.mt3d_balance = True  # trained outside the gradient
        self.load = None  # assignments per expert counted since the last balancing step
        self.rate = cfg.moe_spec.bias_update_rate if correction else 0.0


class Expert(nn.Module):
    """One routed expert: a gated MLP (fused gate/up, down), its inner dimension split over TP. With
    ``expert_bias`` the gate/up bias splits with its rows; the down bias is added by TP rank 0 alone
    (the ranks' partial outputs are summed after the experts combine): the others add it times 0, so
    that every rank has its gradient (zero) for the sum over TP that gives every rank the same one."""

    def __init__(self, cfg, ctx, layer: int, index: int, ffn: int) -> None:
        super().__init__()
        bias = cfg.moe_spec.expert_bias
        common = dict(tp=ctx.tp, bias=bias, dtype=ctx.dtype, device=ctx.device)
        name = f"mlp.experts.{index}"
        self.up = ColumnParallelLinear(
            cfg.hidden, 2 * ffn, parts=(ffn, ffn), init=ctx.init(layer, f"{name}.up", cfg.init_std), **common
        )
        std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.down = RowParallelLinear(ffn, cfg.hidden, init=ctx.init(layer, f"{name}.down", std), **common)
        self.bias_share = 1.0 if ctx.tp.rank == 0 else 0.0
        self.gemms = ctx.expert_gemms(layer)  # train.fp8.experts: the recipe's tiled GEMMs
        if bias:
            mark_tp_partial_grad(self.down.bias, ctx.tp)
            self.down.bias.tp_copy = ctx.tp.rank > 0  # the same on every TP rank: norms count rank 0's
        for p in self.parameters():
            p.mt3d_expert = True  # reduced over the expert-data-parallel ranks only (mt3d.ds.experts)

    def forward(self, x: torch.Tensor, glu) -> torch.Tensor:
        """[n, h] rows (already inside the TP region) -> this rank's partial [n, h] output; ``glu`` maps
        the fused [gate | up] to the gated activation. ``local_linear``: ``F.linear``, or under a split
        backward a linear whose weight gradient waits for W."""
        y = local_linear(glu(local_linear(x, self.up.weight, self.up.bias, self.gemms)), self.down.weight,
                         gemms=self.gemms)  # fmt: skip
        return y if self.down.bias is None else y + self.down.bias * self.bias_share


def gated(y: torch.Tensor, act, limit: float | None = None, alpha: float = 1.0) -> torch.Tensor:
    """The gated activation of a fused [gate | up]: act(gate) * up, or with ``limit`` gpt-oss's clamped
    SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""
    gate, up = y.chunk(2, dim=-1)
    if limit is None:
        return act(gate) * up
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


class SparseMoE(nn.Module):
    """The MLP of a sparse block: router, routed experts, optional gated shared expert."""

    def __init__(self, cfg, ctx, layer: int) -> None:
        super().__init__()
        from .mlp import MLP

        spec = cfg.moe_spec
        self.spec, self.tp, self.sp = spec, ctx.tp, ctx.sp
        self.etp = ctx.etp if ctx.etp is not None else ctx.tp
        """The ranks that split each expert's inner dimension (the TP group unless folded)."""
        self.tpo = ctx.tpo if ctx.tpo is not None and ctx.tpo.size > 1 else None
        """Without SP and with etp below tp: the TP ranks holding the same tokens that share them out."""
        act = F.silu if cfg.mlp == "swiglu" else _gelu_tanh
        self.glu = functools.partial(gated, act=act, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
        self.router = Router(cfg, ctx, layer, spec.experts, "mlp.router", bias=spec.router_bias,
                             correction=spec.correction_bias)  # fmt: skip
        self.ep = ctx.ep if ctx.ep is not None and ctx.ep.size > 1 else None
        self.codec = ctx.dispatch_codec(layer)
        """The dispatch's rows in FP8 (``train.fp8.dispatch``: ``fp8.DispatchRows``), or None."""
        self.dedup = spec.dispatch_once and ctx.dispatch_once
        """Under ep, send each token once per rank that holds any of its experts (``_dispatch_once``);
        False: once per (token, expert) assignment (``_run``: at top-1, where the two send the same rows
        (``MoESpec.dispatch_once``), with ``parallel.expert_dispatch`` "assignment", and in the dispatch
        benchmark's comparison)."""
        self.chunks, self.pipelined = ctx.dispatch_chunks, True
        """``moe_exchange.exchange``'s chunks (``train.overlap.dispatch_chunks``), pipelined or (the
        benchmark's serial baseline) not."""
        self.cp = ctx.cp if ctx.cp_size > 1 else None
        ep, r = (self.ep.size, self.ep.rank) if self.ep else (1, 0)
        if spec.experts % ep:
            raise MoEConfigError(f"model.moe.experts ({spec.experts}) is not divisible by ep={ep}")
        self.local = range(r * spec.experts // ep, (r + 1) * spec.experts // ep)
        """The experts this rank holds (all of them without expert parallelism)."""
        self.hops = hops(self.ep, ctx.ep_hosts, spec.experts) if self.ep is not None else []
        """The dispatch's hops, each (group, the member of it each expert's rows go to): over the ep
        group, or with ``parallel.expert_dispatch`` "node" across hosts over the ep ranks at this
        rank's place on each host, then within the host (``moe_exchange``)."""
        self._targets: dict = {}
        self.experts = nn.ModuleDict(
            {
                str(j): Expert(cfg, dataclasses.replace(ctx, tp=self.etp), layer, j, spec.expert_ffn)
                for j in self.local
            }  # fmt: skip
        )
        self.shared = self.shared_gate = None
        if spec.shared_ffn:
            self.shared = MLP(cfg, ctx, layer, ffn=spec.shared_ffn, name="mlp.shared")
            if spec.shared_gate:
                self.shared_gate = Router(cfg, ctx, layer, 1, "mlp.shared_gate")

    def forward(self, x: torch.Tensor, stats: tuple | None = None):
        """x [b, s, h] (SP: the sequence shard) -> (output like x, updated ``stats`` or None)."""
        logits = self.router(x)
        probs = logits.float().softmax(dim=-1)
        weights, index = self._route(logits, probs)
        etp, routed = self.etp, index
        if self.sp:  # enter the expert-TP region with the etp group's sequence shards
            xs, weights = gather_from_sequence(x, etp), gather_from_sequence(weights, etp)
            with torch.no_grad():
                index = gather_from_sequence(index, etp)
        else:
            xs = x
            if self.tpo is not None:  # the same tokens on every TP rank: each routes its share
                xs, weights = scatter_to_sequence(x, self.tpo), scatter_to_sequence(weights, self.tpo)
                index = index.chunk(self.tpo.size, dim=1)[self.tpo.rank]
            xs, weights = copy_to_tp(xs, etp), copy_to_tp(weights, etp)
        b, s, h = xs.shape
        rows = (xs.reshape(b * s, h), index.reshape(b * s, -1), weights.reshape(b * s, -1))
        y, shared, dropped = self._experts(*rows, b, during=self._shared_expert(x))
        y = y.view(b, s, h)
        y = reduce_scatter_to_sequence(y, etp) if self.sp else reduce_from_tp(y, etp)
        if self.tpo is not None and not self.sp:
            y = gather_from_sequence(y, self.tpo, grad_is_partial=False)
        if shared is not None:
            y = y + shared
        if stats is not None:
            if self.sp and etp.size < self.tp.size:  # each TP rank routed its own shard: sum the counts
                counts = all_reduce(torch.bincount(routed.flatten(), minlength=self.spec.experts), self.tp)
            else:  # every token's experts are here (without SP, or gathered over the whole TP group)
                counts = torch.bincount((index if self.sp else routed).flatten(), minlength=self.spec.experts)
            stats = self._stats(stats, logits, probs, counts, dropped)
        return y, stats

    def _shared_expert(self, x: torch.Tensor):
        """The call that computes the (gated) shared expert of ``x``, or None without one: the routed
        experts' dispatch runs it while their rows travel."""
        if self.shared is None:
            return None
        if self.shared_gate is None:
            return lambda: self.shared(x)
        return lambda: torch.sigmoid(self.shared_gate(x)) * self.shared(x)

    def _route(self, logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts) [..., k] of each token: its top-k experts by score (plus the correction
        bias, within its best groups where routing is group-limited), weighted by their scores
        (renormalised with ``norm_topk_prob``, times ``routed_scaling``)."""
        spec = self.spec
        scores = probs if spec.scoring == "softmax" else logits.float().sigmoid()
        choice = scores
        if self.router.e_score_correction_bias is not None:
            choice = scores + self.router.e_score_correction_bias
        if spec.n_group > 1:  # keep each token's topk_group groups (by the sum of their two best)
            grouped = choice.unflatten(-1, (spec.n_group, -1))
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
                -1, best.topk(spec.topk_group, -1).indices, True
            )
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        if choice is scores:
            weights, index = scores.topk(spec.top_k, dim=-1)
        else:
            index = choice.topk(spec.top_k, dim=-1).indices
            weights = scores.gather(-1, index)
        if spec.norm_topk_prob:
            eps = 1e-20 if spec.scoring == "sigmoid" else 0.0  # transformers' DeepSeek-V3 adds it
            weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        if self.training and self.router.e_score_correction_bias is not None and not recomputing():
            counts = torch.bincount(index.flatten(), minlength=spec.experts)
            self.router.load = counts if self.router.load is None else self.router.load + counts
        return (weights * spec.routed_scaling if spec.routed_scaling != 1.0 else weights), index

    def _stats(self, stats, logits, probs, counts, dropped):
        """Add this layer's probability sums, z^2 sum, assignment counts and drops to ``stats``. Without
        gradient when neither router loss uses them (both coefficients 0: metrics only); ``stats``'s
        own graph stays, so a pipeline stage still returns a differentiable ``stats_f``."""
        spec = self.spec
        used = bool(spec.aux_loss_coef or spec.z_loss_coef)
        with torch.set_grad_enabled(torch.is_grad_enabled() and used):
            z = torch.logsumexp(logits.float(), dim=-1).pow(2).sum()
            local = torch.cat([probs.sum(dim=(0, 1)), z[None]])
            if self.sp:  # each TP rank scored its own sequence shard
                local = reduce_from_tp(local, self.tp)
        return stats[0] + local, stats[1] + torch.cat([counts, dropped.view(1)])

    def _experts(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, samples: int = 1,
                 during=None):  # fmt: skip
        """Dispatch rows to their experts, run each expert on its rows at once, combine weighted;
        returns (output, what ``during`` returned, assignments dropped): ``during`` is called once, while
        the dispatch travels where there is one.

        x [T, h], index / weights [T, k] (``samples`` sequences of T / samples rows). Assignments are
        sorted by expert (stably: token order within an expert), so the experts run over contiguous
        blocks of rows (``_run_local``: grouped GEMMs or a loop over experts, never over tokens).
        """
        t, k = index.shape
        e = self.spec.experts
        flat = index.flatten()
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        parts = (self.cp.size if self.cp is not None else 1) * (self.tpo.size if self.tpo is not None else 1)
        # evaluation is dropless (transformers); ``parts``: the ranks routing disjoint parts of these samples
        cap = self.spec.capacity(t * parts) if self.training else None
        once = self.ep is not None and (self.dedup or self.chunks > 1)
        if once and cap is None:  # every slot travels as routed: nothing to sort or count here
            return (*exchange(self, x, weights, index, during, self.chunks), dropped)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e)
        if cap is not None:  # position of each sorted assignment inside its expert; keep the first cap
            starts = counts.cumsum(0) - counts
            pos = torch.arange(t * k, device=x.device) - starts[flat[order]]
            if parts > 1:
                pos = pos + earlier_in_sequence(flat, order, samples, e, k, self.cp, self.tpo)
            keep = pos < cap
            dropped = (~keep).sum()
            order = order[keep]
            counts = torch.bincount(flat[order], minlength=e)
            if self.tpo is not None:  # each segment's drops once (an etp group's ranks drop alike)
                dropped = all_reduce(dropped, self.tpo)
        if once:
            return (*self._dispatch_once(x, flat, order, weights, during), dropped)
        rows = order // k
        ys = self._run(x[rows], counts) * weights.flatten()[order].unsqueeze(-1)
        side = during() if during is not None else None
        return torch.zeros_like(x).index_add(0, rows, ys.to(x.dtype)), side, dropped

    def _dispatch_once(self, x: torch.Tensor, flat: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                       during=None):  # fmt: skip
        """Expert parallelism with each token sent at most once to each rank (with ``self.hops`` of two:
        once to each host, then once to each rank there) that holds any of its kept assignments
        (``order`` into ``flat``, the [T k] experts): ``moe_exchange.exchange`` from the token's k slots, the
        dropped ones -1. Returns (output, what ``during`` returned)."""
        t, k = weights.shape
        ids = torch.full((t * k,), -1, dtype=torch.long, device=x.device)
        ids[order] = flat[order]
        return exchange(self, x, weights, ids.view(t, k), during, self.chunks)

    def target(self, hop: int, device: torch.device) -> torch.Tensor:
        """Hop ``hop``'s member for each expert, on ``device`` (made once per device)."""
        key = (hop, device)
        if key not in self._targets:
            self._targets[key] = torch.tensor(self.hops[hop][1], dtype=torch.long, device=device)
        return self._targets[key]

    def at_experts(self, xr: torch.Tensor, wr: torch.Tensor, idr: torch.Tensor) -> torch.Tensor:
        """The rows that reached their experts' rank: every local expert a row names (``idr``, -1 none)
        runs on it, and the row's output is their sum weighted by ``wr``."""
        row, slot = (idr >= 0).nonzero(as_tuple=True)
        lexp = idr[row, slot] - self.local.start
        perm = torch.argsort(lexp, stable=True)
        row, slot = row[perm], slot[perm]
        ye = self._run_local(xr[row], torch.bincount(lexp, minlength=len(self.local)).tolist())
        ye = (ye * wr[row, slot].unsqueeze(-1)).to(xr.dtype)
        return torch.zeros_like(xr).index_add(0, row, ye)

    def _run_local(self, xs: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """Rows grouped by local expert (``counts`` each) -> their outputs, in the same order: one
        grouped GEMM per projection over all local experts where the device has torch's grouped
        matmul (``grouped_gemm_works``), else one matmul per expert. An expert without rows still runs
        (on none): every rank then has a (zero) gradient for every expert it holds, so data-parallel
        reductions line up across ranks. ``counts`` on the device (no expert parallelism) stay there on
        the grouped path: the host never waits for the router."""
        experts = [self.experts[str(j)] for j in self.local]
        inner = experts[0].down.weight.shape[1]
        aligned = all(n * xs.element_size() % 16 == 0 for n in (xs.shape[-1], inner))
        plain = experts[0].gemms.fp8 is None  # FP8 experts: one tiled-FP8 GEMM each (no grouped kernel)
        if plain and aligned and xs.shape[0] > 0 and grouped_gemm_works(xs.device, xs.dtype):
            n = torch.as_tensor(counts, device=xs.device)
            offs = n.cumsum(0).to(torch.int32)
            # [experts, in, out] views of the stacked weights (a copy per call; its backward scatters
            # the gradients back to each expert's parameters)
            up = torch.stack([e.up.weight for e in experts]).transpose(1, 2)
            down = torch.stack([e.down.weight for e in experts]).transpose(1, 2)
            y = grouped_linear(xs, up, offs)
            if experts[0].up.bias is not None:  # each row's expert's biases
                which = torch.repeat_interleave(torch.arange(len(experts), device=xs.device), n,
                                                output_size=xs.shape[0])  # fmt: skip
                y = y + torch.stack([e.up.bias for e in experts])[which]
            y = grouped_linear(self.glu(y), down, offs)
            if experts[0].down.bias is not None:
                y = y + torch.stack([e.down.bias for e in experts])[which] * experts[0].bias_share
            return y
        outs, start = [], 0
        for expert, rows in zip(experts, torch.as_tensor(counts).tolist(), strict=True):
            outs.append(expert(xs[start : start + rows], self.glu))
            start += rows
        return torch.cat(outs)

    def _run(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (``counts`` [E] each) -> expert outputs in the same order. With expert
        parallelism the rows of each ep rank's experts travel there and back with one all-to-all each
        way (the counts first, so every rank knows what it receives); the received rows, ordered by
        source then expert, are regrouped by expert for one matmul per expert and put back."""
        if self.ep is None:
            return self._run_local(xs, counts)
        ep, local = self.ep.size, len(self.local)
        sent = counts.view(ep, local)  # row i: rows for each of rank i's experts
        got = all_to_all_counts(sent, self.ep)  # row i: rows rank i sends for each of my experts
        send, recv = sent.sum(1).tolist(), got.sum(1).tolist()
        xr = all_to_all_rows(xs, send, recv, self.ep, self.codec)
        expert_of_row = torch.arange(local, device=xs.device).repeat(ep).repeat_interleave(got.flatten())
        perm = torch.argsort(expert_of_row, stable=True)
        ye = self._run_local(xr[perm], got.sum(0).tolist())
        yr = torch.empty_like(ye).index_copy(0, perm, ye)  # back to (source, expert) order
        return all_to_all_rows(yr, recv, send, self.ep)


@torch.no_grad()
def balance_experts(model: nn.Module, tokens, tp, update: bool = True) -> float | None:
    """Aux-loss-free balancing (DeepSeek-V3), after an optimizer step: every router with a correction
    bias moves it by ``bias_update_rate`` against the sign of each expert's load error, the load being
    the assignments of the step's tokens on every rank (summed over ``tokens``, the ranks that route
    other tokens: dp x ep x cp, and over ``tp`` with sequence parallelism, where each TP rank routes
    its own shard), the error its difference from the mean. One all-reduce for all the stage's layers.
    The counts restart; ``update`` False (a skipped step) drops them. Returns the largest max/mean
    load over the layers (None: no such router)."""
    from ..parallel.mappings import all_reduce

    routers = [m for m in model.modules() if isinstance(m, Router) and m.e_score_correction_bias is not None]
    if not routers:
        return None
    counts = torch.stack([
        r.load if r.load is not None else torch.zeros_like(r.e_score_correction_bias, dtype=torch.int64)
        for r in routers
    ]).float()  # fmt: skip
    all_reduce(counts, tokens)
    if routers[0].sequence_parallel:
        all_reduce(counts, tp)
    for r, load in zip(routers, counts, strict=True):
        r.load = None
        if update and r.rate > 0:
            r.e_score_correction_bias.add_(torch.sign(load.mean() - load), alpha=r.rate)
    return float((counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).max())


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


__all__ = [
    "EXPERT_NAME",
    "MoEConfigError",
    "MoESpec",
    "Routed",
    "SparseMoE",
    "balance_experts",
    "expert_index",
    "router_losses",
    "start_stats",
]
