"""Muon for mt3d's sharded weights (``"optimizer": {"type": "Muon"}``): the update of a split matrix is
the update of the whole matrix.

Muon (Keller Jordan, 2024; the optimizer of Kimi K2, GLM-4.5 and Moonlight) replaces Adam's update of a
2-D weight by the orthogonalised momentum: the buffer ``M <- beta M + (1 - beta) G`` and Nesterov's
look-ahead ``U = (1 - beta) G + beta M`` (DeepSpeed's ``muon_update``), then the step is
``W <- W (1 - lr wd) - lr s(W) NS5(U)``, where ``NS5`` is five Newton-Schulz quintic iterations
(coefficients 3.4445, -4.7750, 2.0315) that push ``U``'s singular values towards 1, and ``s`` is
``max(1, rows / cols) ** 0.5`` (DeepSpeed's) or Moonlight's ``0.2 max(rows, cols) ** 0.5``
(``train.muon.scale: "match_rms"``, which makes AdamW's learning rate and weight decay reusable).

Which parameters take it is decided here, by module: every 2-D weight inside a transformer block
(attention and latent projections, MLP and expert matrices, shared experts, LoRA's A and B) except the
routers and the shared-expert gate; the embedding, the LM head, norms, biases, sinks and correction
biases take AdamW (``adam_update``). Each HF matrix is orthogonalised on its own: a fused q/k/v or
gate/up weight is split into its parts (``partition_parts``) and every expert is its own module.

Sharding: momentum is linear, so each rank keeps the momentum of its own shard (partitioned like the
Adam states it replaces) and only ``NS5`` needs the whole matrix: the look-ahead shards are all-gathered
over the group that split the weight (tp, or etp for experts; ``marks.mark_tp``'s split dimension and
parts, reassembled by ``sharding.from_shards``), every rank of the group orthogonalises the whole
matrix and keeps its shard. Pipeline stages own their matrices; ep ranks their experts; data and
context ranks hold replicas whose gradients DeepSpeed reduced before the step. Under ZeRO 1-2 and
DeepSpeed's bf16 optimizer the client steps one flat partition per group: the partitions' look-aheads
are all-gathered over the group's data-parallel ranks and each rank orthogonalises the weights its
partition overlaps (``_flat_update``; ``mt3d.ds.muon`` says where they sit), so the work is spread over
the data-parallel ranks. ZeRO-3 and offloaded optimizers are refused (``rules.muon_conflict``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model.sharding import ParamLayout, from_shards, to_shard
from ..parallel.state import AxisGroup

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``train.muon.ns_dtype`` (``config.optimizer_rules.NS_DTYPES``) as torch dtypes."""


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, method: str = "gram",
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """The orthogonalisation of a 2-D ``g``: its singular values pushed towards 1 by ``steps`` quintic
    iterations on ``g / ||g||_F`` (tall matrices transposed first), computed in ``dtype``."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    if method == "standard" or x.shape[0] == x.shape[1]:
        for _ in range(steps):
            s = x @ x.mT
            x = a * x + (b * s + c * s @ s) @ x
    else:  # X_k = Q_k X_0 with Q_{k+1} = P_k Q_k, P_k = a + b R_k + c R_k^2, R_{k+1} = P_k R_k P_k;
        # restarted once (X = Q X, R = X X^T) as DeepSpeed's: R's rounding compounds otherwise
        eye = torch.eye(x.shape[0], dtype=dtype, device=x.device)
        r, q = x @ x.mT, eye
        for i in range(steps):
            if i == 2:
                x, q = q @ x, eye
                r = x @ x.mT
            p = a * eye + b * r + c * r @ r
            q = p @ q
            r = p @ r @ p
        x = q @ x
    return x.mT if tall else x


def scale_of(rows: int, cols: int, rule: str) -> float:
    """The factor of one matrix's orthogonalised update: DeepSpeed's ``max(1, rows / cols) ** 0.5`` or
    Moonlight's ``0.2 max(rows, cols) ** 0.5`` (``match_rms``: the update's RMS near AdamW's)."""
    if rule == "match_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(rows / cols) if rows > cols else 1.0


@dataclass(frozen=True)
class Matrix:
    """How a Muon parameter is whole: the group that split it (None: it is whole here), its split
    dimension and its fused parts (each an HF matrix of its own, unless ``one``)."""

    group: AxisGroup | None
    layout: ParamLayout
    one: bool = False
    """The parts split over TP but make one HF matrix (``one_matrix``: Qwen3.5's ``in_proj_qkv``)."""

    def whole(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole weight from this rank's shard (all-gathered over the group)."""
        if self.group is None or self.group.size == 1 or self.layout.dim is None:
            return shard
        shards = [torch.empty_like(shard) for _ in range(self.group.size)]
        dist.all_gather(shards, shard.contiguous(), group=self.group.group)
        return from_shards(shards, self.layout)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole weight."""
        if self.group is None or self.group.size == 1 or self.layout.dim is None:
            return full
        return to_shard(full, self.layout, self.group.rank, self.group.size)

    def pieces(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The HF matrices of the whole weight."""
        if self.layout.parts and not self.one:
            return list(full.split(list(self.layout.parts), dim=self.layout.dim))
        return [full]


def muon_matrices(model: torch.nn.Module, tp: AxisGroup, etp: AxisGroup | None = None) -> dict[int, Matrix]:
    """``id(parameter)`` -> ``Matrix`` for every trainable parameter that takes Muon (module docstring):
    the 2-D weights inside transformer blocks, less the routers' and the shared-expert gate's."""
    from ..model.blocks import TransformerBlock
    from ..model.moe import expert_index
    from ..model.sharding import orthogonalized

    out: dict[int, Matrix] = {}
    for block in (m for m in model.modules() if isinstance(m, TransformerBlock)):
        for name, p in block.named_parameters():
            if not p.requires_grad or not orthogonalized(name, p.ndim):
                continue
            split = getattr(p, "tensor_model_parallel", False)
            expert = etp is not None and expert_index(name) is not None
            group = (etp if expert else tp) if split else None
            layout = ParamLayout(p.partition_dim, p.partition_parts) if split else ParamLayout()
            out[id(p)] = Matrix(group, layout, getattr(p, "one_matrix", False))
    return out


def adam_update(p, grad, state, lr, betas, eps, weight_decay) -> None:
    """AdamW (decoupled decay, bias-corrected moments) on one parameter, states named as Adam's."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
    state["step"] += 1
    g = grad.float()
    state["exp_avg"].lerp_(g, 1 - betas[0])
    state["exp_avg_sq"].mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
    step = state["step"]
    denom = (state["exp_avg_sq"] / (1 - betas[1] ** step)).sqrt_().add_(eps)
    update = state["exp_avg"] / (1 - betas[0] ** step) / denom
    p.mul_(1 - lr * weight_decay)
    p.add_(update.to(p.dtype), alpha=-lr)


class Muon(torch.optim.Optimizer):
    """Muon on the block matrices, AdamW on the rest (``muon_matrices``), as one optimizer with
    DeepSpeed's ``MuonWithAuxAdam`` groups (``use_muon``) and keys. A group's ``lr`` is what the
    learning-rate scheduler sets; ``lr_scale`` (``muon_lr`` or ``adam_lr`` over ``lr``) keeps each
    half's own rate through any scheduler."""

    def __init__(self, groups: list[dict], matrices: dict[int, Matrix], decays: dict[int, float],
                 scale: str = "deepspeed", ns_dtype: str = "fp32") -> None:  # fmt: skip
        super().__init__(groups, {})
        self._groups = len(self.param_groups)
        self.matrices, self.scale, self.ns_dtype = matrices, scale, NS_DTYPES[ns_dtype]
        self.decays = decays
        """``id(weight)`` -> its weight decay (its parameter group's in ``training.engine.param_groups``)."""
        self._flat_decays: dict[int, torch.Tensor] = {}
        self.flat: dict[int, object] = {}
        """Under ZeRO 1-2 or DeepSpeed's bf16 optimizer: ``id`` of each flat partition it steps ->
        its ``mt3d.ds.muon.FlatLayout`` (set by ``mt3d.ds.muon.attach``)."""
        self.clip = None
        """QK-clip (``mt3d.training.qk_clip.QKClip``; None: off): applied to each weight as it is stepped."""
        self._clip_rows: dict[int, torch.Tensor] = {}
        self._groups_left = 0
        """Groups still to step in this optimizer step: ZeRO steps one group a call, the others all."""

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group: Muon's or AdamW's."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.clip is not None:  # the step's maxima, once (a collective: the same count on every rank)
            if self._groups_left <= 0:
                self._clip_rows, self._groups_left = self.clip.row_scales(), self._groups
            self._groups_left -= len(self.param_groups)
        for group in self.param_groups:
            lr = group["lr"] * group.get("lr_scale", 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["use_muon"]:
                    self._muon(p, group, lr)
                else:
                    adam_update(p, p.grad, self.state[p], lr, group["betas"], group["eps"], self._decay(p))
                if self._clip_rows:
                    self._clip(p)
        return loss

    def _clip(self, p: torch.Tensor) -> None:
        """QK-clip's row factors (``_clip_rows``) on the weights stepped as ``p``: ``p`` itself, or
        their elements inside this flat partition."""
        rows = self._clip_rows
        if id(p) not in self.flat:
            if id(p) in rows:
                p.mul_(rows[id(p)].view(-1, *[1] * (p.dim() - 1)).to(p.dtype))
            return
        flat = self.flat[id(p)]
        lo, hi = flat.rank * flat.partition, (flat.rank + 1) * flat.partition
        for param, start in flat.params:
            a, b = max(start, lo), min(start + param.numel(), hi)
            if id(param) not in rows or a >= b:
                continue
            row = torch.arange(a - start, b - start, device=p.device) // (param.numel() // param.shape[0])
            p[a - lo : b - lo].mul_(rows[id(param)].to(p.device)[row].to(p.dtype))

    def _decay(self, p: torch.Tensor):
        """The weight decay of ``p``: its own, or per element of a flat partition (``FlatLayout``)."""
        if id(p) not in self.flat:
            return self.decays[id(p)]
        if id(p) not in self._flat_decays:
            flat = self.flat[id(p)]
            lo, hi = flat.rank * flat.partition, (flat.rank + 1) * flat.partition
            vec = torch.zeros(flat.partition, dtype=torch.float32, device=p.device)
            for param, start in flat.params:
                a, b = max(start, lo), min(start + param.numel(), hi)
                if a < b:
                    vec[a - lo : b - lo] = self.decays[id(param)]
            self._flat_decays[id(p)] = vec
        return self._flat_decays[id(p)]

    def state_dict(self) -> dict:
        """torch's, with each Muon weight's momentum saved as Adam's ``exp_avg`` beside a zero
        ``exp_avg_sq``: DeepSpeed's universal converter (the reshard path) reads those two keys of every
        group's state and nothing else. ``_muon`` takes the momentum back, from a plain load or a
        universal one alike."""
        sd = super().state_dict()
        for group, saved in zip(self.param_groups, sd["param_groups"], strict=True):
            for i in saved["params"] if group["use_muon"] else ():
                st = sd["state"].get(i)
                if st is not None and "momentum_buffer" in st:
                    m = st["momentum_buffer"]
                    sd["state"][i] = {"exp_avg": m, "exp_avg_sq": torch.zeros_like(m)}
        return sd

    def _muon(self, p: torch.nn.Parameter, group: dict, lr: float) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:  # momentum is linear: each rank keeps its shard's (or flat
            saved = state.pop("exp_avg", None)  # partition's); as saved by ``state_dict``
            state.clear()
            state["momentum_buffer"] = (
                saved.float() if saved is not None else torch.zeros_like(p, dtype=torch.float32)
            )
        beta, buf, g = group["momentum"], state["momentum_buffer"], p.grad.float()
        buf.lerp_(g, 1 - beta)
        lookahead = g.lerp(buf, beta)
        if id(p) in self.flat:
            update = self._flat_update(lookahead, self.flat[id(p)], group["ns_method"])
        else:
            update = self._orthogonal(lookahead, self.matrices[id(p)], group["ns_method"])
        p.mul_(1 - lr * self._decay(p))
        p.add_(update.to(p.dtype), alpha=-lr)

    def _orthogonal(self, shard: torch.Tensor, how: Matrix, method: str) -> torch.Tensor:
        """This rank's shard of the update of the whole matrix whose shard is ``shard``: each HF
        matrix of it orthogonalised and scaled on its own."""
        pieces = [newton_schulz(m, NS_STEPS, method, self.ns_dtype).float() * scale_of(*m.shape, self.scale)
                  for m in how.pieces(how.whole(shard))]  # fmt: skip
        return how.shard(torch.cat(pieces, dim=how.layout.dim) if len(pieces) > 1 else pieces[0])

    def _flat_update(self, lookahead: torch.Tensor, flat, method: str) -> torch.Tensor:
        """The update of a flat partition: the partitions' look-aheads all-gathered over the
        data-parallel group, and each weight that overlaps this partition orthogonalised whole (so
        the ranks share the work: a weight is computed by the ranks whose partitions it spans)."""
        parts = [torch.empty_like(lookahead) for _ in range(flat.world)]
        dist.all_gather(parts, lookahead.contiguous(), group=flat.group)
        full = torch.cat(parts)
        lo, hi = flat.rank * flat.partition, (flat.rank + 1) * flat.partition
        update = torch.zeros_like(lookahead)
        for param, start in flat.params:
            end = start + param.numel()
            if end <= lo or start >= hi:
                continue
            whole = self._orthogonal(full[start:end].view(param.shape), self.matrices[id(param)], method)
            a, b = max(start, lo), min(end, hi)
            update[a - lo : b - lo] = whole.reshape(-1)[a - start : b - start]
        return update


def build(params: dict, param_groups: list[dict], model: torch.nn.Module, tp: AxisGroup,
          etp: AxisGroup | None, scale: str = "deepspeed", ns_dtype: str = "fp32",
          clip=None) -> Muon:  # fmt: skip
    """The optimizer of ``"optimizer": {"type": "Muon", "params": params}`` over mt3d's parameter groups
    (``training.engine.param_groups``, with ``mt3d.ds.experts``' expert groups under ep with ZeRO).
    Keys as DeepSpeed's: the shared ``lr``, ``weight_decay``; Muon's ``momentum`` (0.95), ``ns_method``
    ("gram"), ``muon_lr``; AdamW's ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``adam_lr``.

    Two groups per expert class (dense, experts): Muon's and AdamW's, each weight keeping the weight
    decay of the group it came from (``Muon.decays``). Not one half per incoming group: DeepSpeed's
    ZeRO computes the gradient norm group by group with a collective each, so every pipeline stage
    needs the same groups, and a stage without a 2-D AdamW weight (no embedding, head or router: the
    middle of a pipeline, ZB-V's second rank) would have one group fewer and hang the others.
    ``clip``: QK-clip's ``QKClip`` (None: off)."""
    lr = float(params.get("lr", 1e-3))
    shared = float(params.get("weight_decay", 0.0))
    halves = {
        True: {"momentum": float(params.get("momentum", 0.95)), "ns_method": params.get("ns_method", "gram"),
               "lr_scale": float(params.get("muon_lr", lr)) / lr},
        False: {"betas": tuple(params.get("betas", (0.9, 0.999))), "eps": float(params.get("eps", 1e-8)),
                "lr_scale": float(params.get("adam_lr", lr)) / lr},
    }  # fmt: skip
    matrices = muon_matrices(model, tp, etp)
    classes: dict[tuple, dict] = {}  # (moe, name) -> {use_muon: [params]}, the groups' own marks
    decays: dict[int, float] = {}
    for group in param_groups:
        marks = {k: group[k] for k in ("moe", "name") if k in group}
        halves_of = classes.setdefault(tuple(marks.items()), {True: [], False: []})
        for p in group["params"]:
            halves_of[id(p) in matrices].append(p)
            decays[id(p)] = float(group.get("weight_decay", shared))
    base = {"lr": lr, "weight_decay": shared}
    groups = [{"params": ps, "use_muon": use_muon, **base, **halves[use_muon], **dict(marks)}
              for marks, by in classes.items() for use_muon, ps in by.items() if ps]  # fmt: skip
    muon = Muon(groups, matrices, decays, scale, ns_dtype)
    muon.clip = clip
    return muon
