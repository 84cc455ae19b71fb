"""The full weights of a running model, in HF names, without a checkpoint on disk: what a rollout
engine (an RL trainer's generator) pulls from the training layout after each update.

``hf_weights(module, cfg, state, vocab)`` is a collective over every rank of the run: each parameter,
in the sharding table's order (the same on every rank), is all-gathered over the group that splits it
(the TP group; a routed expert's, the expert-TP group), put together by its TP marks (fused parts,
vocabulary padding removed: ``model.sharding.from_shards``), and the lowest global rank holding it
sends it to rank 0 (one all-reduce elects that rank: stages, ep ranks and replicas hold different
parameters). Rank 0 returns ``{HF name: tensor}`` as the family's files name them (``export-hf``'s
mapping), every other rank None. ``module``: the engine's (``engine.module``) or an inference model
(``checkpoint.loading.from_pretrained``). ZeRO-3 (parameters partitioned by DeepSpeed) is refused.

Usage, inside the training processes (every rank calls it)::

    from mt3d.checkpoint.live import hf_weights
    weights = hf_weights(engine.module, model_cfg, rt.state, vocab)  # rank 0: {name: tensor}
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import UserError
from ..model.hf import hf_state_dict
from ..model.moe import expert_index
from ..model.sharding import from_shards, sharding_table


def _by_global_name(module) -> dict[str, torch.Tensor]:
    """This rank's parameters by global name (``<layer>.<local>``, ``tied_modules.embed.<local>``)."""
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_tensor"):
            raise UserError(
                "hf_weights reads a module's own parameters; under ZeRO-3 DeepSpeed partitions them"
            )
        out.setdefault(name, p)
    return out


@torch.no_grad()
def hf_weights(module, cfg, state, vocab: int) -> dict[str, torch.Tensor] | None:
    """Rank 0: the running model's full weights in HF names (module docstring); None elsewhere."""
    local = _by_global_name(module)
    table = sharding_table(cfg, vocab)
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = next(iter(local.values())).device
    dtype = next(iter(local.values())).dtype
    full: dict[str, torch.Tensor] = {}
    for name, spec in table.items():
        p = local.get(name)
        whole = None
        if p is not None:
            whole = p.detach()
            if spec.layout.dim is not None:
                group = state.etp if expert_index(name) is not None else state.tp
                shards = [torch.empty_like(whole) for _ in range(group.size)]
                if group.size > 1:
                    dist.all_gather(shards, whole.contiguous(), group=group.group)
                else:
                    shards = [whole]
                whole = from_shards(shards, spec.layout)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            full[name] = whole
            continue
        sender = torch.tensor([rank if p is not None else 1 << 30], device=device)
        dist.all_reduce(sender, op=dist.ReduceOp.MIN)
        src = int(sender)
        if src == 1 << 30:
            raise UserError(f"no rank holds parameter {name!r}: is this module the whole run's?")
        if rank == 0 and src != 0:
            whole = torch.empty(spec.shape, dtype=dtype, device=device)
            dist.recv(whole, src=src)
        elif rank == src and src != 0:
            dist.send(whole.to(dtype).contiguous(), dst=0)
        if rank == 0:
            full[name] = whole.cpu()
    return hf_state_dict(cfg, vocab, full) if rank == 0 else None
