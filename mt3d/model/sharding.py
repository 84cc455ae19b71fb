"""How every model parameter is split over tensor-parallel ranks, by name, read off the layers.

The layers mark their own parameters (``tensor_model_parallel``, ``partition_dim``,
``partition_parts``, ``vocab_rows``): that is the one declaration. ``sharding_table`` builds the
model for a config on the meta device (no memory, no init) and reads those marks into a name
table for code that works on files rather than modules: HF import/export, checkpoint reading and
resharding, and DeepSpeed's universal-checkpoint patterns (``universal_info``).

Global names follow the PipelineModule: ``<layer index>.<local name>``, with the tied embedding
under ``tied_modules.embed.<local name>``. Layer indices: 0 word embedding, 1 positions/dropout,
2 .. layers+1 transformer blocks, layers+2 final norm, layers+3 LM head; with ``model.mtp``, layers+4
the tied embedding again and layers+5 the depths (``mt3d.model.mtp``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

import torch

from ..parallel.layers import pad_vocab
from .config import ModelConfig
from .moe import expert_index

TIED_PREFIX = "tied_modules.embed."


@dataclass(frozen=True)
class ParamLayout:
    """dim: TP split dimension (None: replicated); parts: fused sub-tensor sizes along dim;
    vocab: real rows of a vocabulary-padded tensor (None otherwise)."""

    dim: int | None = None
    parts: tuple[int, ...] | None = None
    vocab: int | None = None


ROUTERS = (".router.", ".shared_gate.")
"""Where a block's routing weights sit in its parameter names (``moe.Router`` modules)."""


def orthogonalized(local_name: str, ndim: int) -> bool:
    """Whether a transformer block's parameter (name inside the block) takes Muon's orthogonalised
    update (``mt3d.training.muon``; the planner's ``planner.muon``): a 2-D weight that is not a
    router's or the shared-expert gate's."""
    return ndim == 2 and not any(r in "." + local_name for r in ROUTERS)


def role_of(cfg: ModelConfig, layer: int) -> str:
    """'embed', 'pos', 'block', 'final_norm', 'head' or 'mtp' (``model.mtp``'s depths) for a layer index."""
    if layer == 0:
        return "embed"
    if layer == 1:
        return "pos"
    if layer < cfg.layers + 2:
        return "block"
    if layer == cfg.layers + 2:
        return "final_norm"
    if layer == cfg.layers + 3:
        return "head"
    if layer == cfg.layers + 5 and cfg.mtp is not None:
        return "mtp"
    raise ValueError(f"layer index {layer} is outside a {cfg.layers}-block model")


def split_name(name: str) -> tuple[int, str]:
    """Global parameter name -> (layer index, name inside the layer)."""
    if name.startswith(TIED_PREFIX):
        return 0, name[len(TIED_PREFIX) :]
    head, _, rest = name.partition(".")
    if not head.isdigit():
        raise ValueError(f"not an mt3d parameter name: {name!r}")
    return int(head), rest


def shared_embedding(cfg: ModelConfig) -> bool:
    """Whether the word embedding is a tied module, copied on the first and the last stage: the head is
    tied to it, or multi-token prediction's depths embed with it."""
    return cfg.tie_embeddings or cfg.mtp is not None


def named_as(cfg: ModelConfig, name: str) -> str:
    """``name`` as ``cfg``'s model calls it: the word embedding is the tied module when the head or
    multi-token prediction's depths share it (``tied_modules.embed.``), else layer 0; the same weight
    under either name (a run with ``model.mtp`` read by a model without it)."""
    layer, local = split_name(name)
    if layer != 0:
        return name
    return (TIED_PREFIX if shared_embedding(cfg) else "0.") + local


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the unsharded model: its TP layout and full shape."""

    layout: ParamLayout
    shape: tuple[int, ...]
    optimized: bool = True
    """Whether the optimizer trains it (False: a router's correction bias, moved by aux-loss-free
    balancing outside the gradient: not in the optimizer's states, nor in DeepSpeed's universal
    format, which is made from them)."""


def cache_key(cfg: ModelConfig) -> str:
    """``cfg`` as a hashable key of what shapes its parameters (name and provenance left out): the key
    of the tables built from a config on the meta device (this one, ``model.lora.catalog``)."""
    d = cfg.to_dict()
    d.pop("extra", None), d.pop("name", None)
    return json.dumps(d, sort_keys=True, default=str)


@functools.lru_cache(maxsize=32)
def _table(key: str, vocab: int) -> dict[str, ParamSpec]:
    from ..parallel.state import AxisGroup
    from .blocks import BuildContext
    from .pipeline import StackedModel, layer_specs

    cfg = ModelConfig.from_dict(json.loads(key))
    ctx = BuildContext(tp=AxisGroup.alone("tp"), skip_init=True)
    with torch.device("meta"):
        model = StackedModel(layer_specs(cfg, ctx, vocab))
    table = {}
    for name, p in model.named_parameters():
        layout = ParamLayout()
        if getattr(p, "tensor_model_parallel", False):
            layout = ParamLayout(p.partition_dim, p.partition_parts, getattr(p, "vocab_rows", None))
        shape = tuple(p.shape)
        if layout.vocab is not None:
            shape = (layout.vocab, *shape[1:])  # the real rows; padding depends on tp
        table[name] = ParamSpec(layout, shape, not getattr(p, "mt3d_balance", False))
    return table


def sharding_table(cfg: ModelConfig, vocab: int) -> dict[str, ParamSpec]:
    """Every parameter of the model (global name -> layout and unsharded shape), in model order."""
    return _table(cache_key(cfg), vocab)


def layout_of(cfg: ModelConfig, vocab: int, name: str) -> ParamLayout:
    """The TP layout of global parameter ``name``."""
    table = sharding_table(cfg, vocab)
    if name not in table:
        raise KeyError(f"{name!r} is not a parameter of this model")
    return table[name].layout


def to_shard(full: torch.Tensor, layout: ParamLayout, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of an unsharded tensor (vocab tensors are padded for ``world`` first)."""
    if layout.dim is None:
        return full
    if layout.vocab is not None:
        padded = pad_vocab(layout.vocab, world)
        per = padded // world
        out = torch.zeros((per, *full.shape[1:]), dtype=full.dtype)
        lo, hi = rank * per, min((rank + 1) * per, layout.vocab)
        if hi > lo:
            out[: hi - lo] = full[lo:hi]
        return out
    pieces = full.split(list(layout.parts), dim=layout.dim) if layout.parts else [full]
    return torch.cat([p.chunk(world, dim=layout.dim)[rank] for p in pieces], dim=layout.dim)


def from_shards(shards: list[torch.Tensor], layout: ParamLayout) -> torch.Tensor:
    """The unsharded tensor from every TP rank's shard (in rank order); vocab padding removed."""
    if layout.dim is None:
        return shards[0]
    world = len(shards)
    if layout.vocab is not None:
        return torch.cat(shards, dim=0)[: layout.vocab]
    if not layout.parts:
        return torch.cat(shards, dim=layout.dim)
    local_parts = [p // world for p in layout.parts]
    split = [s.split(local_parts, dim=layout.dim) for s in shards]
    return torch.cat(
        [torch.cat([split[r][i] for r in range(world)], dim=layout.dim) for i in range(len(layout.parts))],
        dim=layout.dim,
    )


def shard_shape(shape: tuple[int, ...], layout: ParamLayout, world: int) -> tuple[int, ...]:
    """The shape of one TP rank's shard of a parameter of unsharded ``shape`` (``to_shard``'s, from the
    sizes alone)."""
    if layout.dim is None:
        return tuple(shape)
    out = list(shape)
    if layout.vocab is not None:
        out[layout.dim] = pad_vocab(layout.vocab, world) // world
    else:
        out[layout.dim] = sum(p // world for p in (layout.parts or (shape[layout.dim],)))
    return tuple(out)


def global_names(cfg: ModelConfig, vocab: int | None = None) -> list[str]:
    """Every parameter's global name in a model of this config (tied head not repeated)."""
    return list(sharding_table(cfg, vocab or cfg.vocab_size or 1))


def _patterns(names: list[str], table: dict[str, ParamSpec]) -> list[str]:
    """Regexes (DeepSpeed applies ``re.match``) matching exactly ``names``: one per local name with the
    layer index generalised when every layer holding that local name has the same layout."""
    layouts: dict[str, set] = {}
    for n, spec in table.items():
        if not n.startswith(TIED_PREFIX):
            layouts.setdefault(split_name(n)[1], set()).add(spec)
    out = []
    for name in names:
        local = None if name.startswith(TIED_PREFIX) else split_name(name)[1]
        if local is not None and len(layouts[local]) == 1:
            pattern = r"\d+\." + re.escape(local) + "$"
        else:
            pattern = re.escape(name) + "$"
        if pattern not in out:
            out.append(pattern)
    return out


def universal_info(cfg: ModelConfig, tp: int, vocab: int, etp: int | None = None) -> dict:
    """DeepSpeed universal-checkpoint patterns for this model saved at tensor-parallel size ``tp``, its
    routed experts split over ``etp`` (None: tp; ``parallel.expert_layout``).

    Derived from the layers' marks (``sharding_table``): vocabulary tensors (padding stripped,
    re-added on load), replicated tensors, row-parallel tensors (dim 1), fused tensors whose shards
    are per-part slices of unequal parts (QKV with GQA, gate/up), and the tied embedding shared by
    the first and last pipeline stage. Column-parallel tensors are left unlisted (DeepSpeed's
    default). Every pattern matches some parameter (DeepSpeed's strict mode requires it); parameters the
    optimizer does not train are left out (``ParamSpec.optimized``; ``restore_unoptimized`` reads them).
    """
    table = {n: spec for n, spec in sharding_table(cfg, vocab).items() if spec.optimized}

    def select(keep):
        return _patterns([n for n, spec in table.items() if keep(spec.layout)], table)

    fused = [n for n, spec in table.items() if spec.layout.parts]
    sub_params, widths = [], {}
    for pattern in _patterns(fused, table):
        name = next(n for n in fused if re.match(pattern, n))
        spec = table[name]
        parts = tuple(spec.layout.parts)  # DeepSpeed recognises the split dimension by its tuple
        shape = (parts, -1) if len(spec.shape) >= 2 else (parts,)  # 3-D: a convolution's [c, 1, taps]
        sub_params.append({"patterns": [pattern], "shape": shape, "partition_dim": spec.layout.dim})
        split = etp if etp is not None and expert_index(name) is not None else tp
        widths[pattern] = [[size // split] * split for size in parts]
    return {
        "universal_checkpoint_version": 0.4,
        "original_vocab_size": vocab,
        "vocabulary_parameter_patterns": select(lambda lay: lay.vocab is not None),
        # the tied embedding's copies on the first and last stage (a tied head, or MTP's embedding)
        "pipeline_replicated_parameter_patterns": [re.escape(TIED_PREFIX)] if shared_embedding(cfg) else [],
        "tp_replicated_parameter_patterns": select(lambda lay: lay.dim is None),
        "parameter_with_row_parallelism_patterns": select(lambda lay: lay.dim == 1),
        "parameter_with_sub_params": sub_params,
        "sub_param_shard_widths": widths,
    }
