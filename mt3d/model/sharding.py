"""How every model parameter is split over tensor-parallel ranks, by name (no model needed).

The layers mark their own parameters (``tensor_model_parallel``, ``partition_dim``,
``partition_parts``); this table says the same from the ModelConfig alone, for code that works on
files rather than modules: HF import/export, checkpoint resharding, DeepSpeed's universal
checkpoint patterns. A test checks that the two always agree.

Global names follow the PipelineModule: ``<layer index>.<local name>``, with the tied embedding
under ``tied_modules.embed.<local name>``. Layer indices: 0 word embedding, 1 positions/dropout,
2 .. layers+1 transformer blocks, layers+2 final norm, layers+3 LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.layers import pad_vocab
from .config import ModelConfig

TIED_PREFIX = "tied_modules.embed."


@dataclass(frozen=True)
class ParamLayout:
    """dim: TP split dimension (None: replicated); parts: fused sub-tensor sizes along dim;
    vocab: real rows of a vocabulary-padded tensor (None otherwise)."""

    dim: int | None = None
    parts: tuple[int, ...] | None = None
    vocab: int | None = None


def role_of(cfg: ModelConfig, layer: int) -> str:
    """'embed', 'pos', 'block', 'final_norm' or 'head' for a layer index."""
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
    raise ValueError(f"layer index {layer} is outside a {cfg.layers}-block model")


def split_name(name: str) -> tuple[int, str]:
    """Global parameter name -> (layer index, name inside the layer)."""
    if name.startswith(TIED_PREFIX):
        return 0, name[len(TIED_PREFIX) :]
    head, _, rest = name.partition(".")
    if not head.isdigit():
        raise ValueError(f"not an mt3d parameter name: {name!r}")
    return int(head), rest


def param_layout(cfg: ModelConfig, layer: int, local: str, vocab: int) -> ParamLayout:
    """The TP layout of parameter ``local`` of layer ``layer``."""
    role = role_of(cfg, layer)
    if role in ("embed", "head"):
        return ParamLayout(dim=0, vocab=vocab)
    if role != "block":
        return ParamLayout()
    if local.startswith("attn.qkv."):
        return ParamLayout(dim=0, parts=(cfg.q_size, cfg.kv_size, cfg.kv_size))
    if local == "attn.out.weight" or local == "mlp.down.weight":
        return ParamLayout(dim=1)
    if local.startswith("mlp.up."):
        return ParamLayout(dim=0, parts=(cfg.ffn, cfg.ffn) if cfg.mlp == "swiglu" else None)
    return ParamLayout()


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


def global_names(cfg: ModelConfig) -> list[str]:
    """Every parameter's global name in a model of this config (tied head not repeated)."""
    block = [
        "norm1.weight",
        "attn.qkv.weight",
        "attn.out.weight",
        "norm2.weight",
        "mlp.up.weight",
        "mlp.down.weight",
    ]
    if cfg.norm == "layernorm":
        block += ["norm1.bias", "norm2.bias"]
    if cfg.bias:
        block += ["attn.qkv.bias", "attn.out.bias", "mlp.up.bias", "mlp.down.bias"]
    names = [TIED_PREFIX + "embed.weight" if cfg.tie_embeddings else "0.embed.weight"]
    if cfg.position == "learned":
        names.append("1.pos")
    for i in range(cfg.layers):
        names += [f"{i + 2}.{b}" for b in sorted(block)]
    names.append(f"{cfg.layers + 2}.norm.weight")
    if cfg.norm == "layernorm":
        names.append(f"{cfg.layers + 2}.norm.bias")
    if not cfg.tie_embeddings:
        names.append(f"{cfg.layers + 3}.weight")
    return names


def universal_info(cfg: ModelConfig, tp: int, vocab: int) -> dict:
    """DeepSpeed universal-checkpoint patterns for this model saved at tensor-parallel size ``tp``.

    Stored with every checkpoint so ``ds_to_universal`` can merge TP shards: vocabulary tensors
    (padding stripped, re-added on load), replicated tensors, row-parallel tensors (dim 1), fused
    QKV / gate-up tensors whose shards are per-part slices of unequal parts (GQA), and the tied
    embedding shared by the first and last pipeline stage. Unlisted tensors are column-parallel.
    Every pattern listed matches some parameter (DeepSpeed's strict mode requires it).
    """
    L = cfg.layers
    head = rf"{L + 3}\.weight$"
    embed = r"tied_modules\.embed\.embed\.weight$" if cfg.tie_embeddings else r"0\.embed\.weight$"
    replicated = [r"\d+\.norm1\.weight$", r"\d+\.norm2\.weight$", r"\d+\.norm\.weight$"]
    if cfg.norm == "layernorm":
        replicated += [r"\d+\.norm1\.bias$", r"\d+\.norm2\.bias$", r"\d+\.norm\.bias$"]
    if cfg.bias:
        replicated += [r"\d+\.attn\.out\.bias$", r"\d+\.mlp\.down\.bias$"]
    if cfg.position == "learned":
        replicated.append(r"1\.pos$")

    def widths(sizes):
        return [[s // tp] * tp for s in sizes]

    qkv = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    fused = [(r"\d+\.attn\.qkv\.weight$", qkv, True), (r"\d+\.attn\.qkv\.bias$", qkv, False)]
    if cfg.mlp == "swiglu":
        fused += [
            (r"\d+\.mlp\.up\.weight$", (cfg.ffn, cfg.ffn), True),
            (r"\d+\.mlp\.up\.bias$", (cfg.ffn, cfg.ffn), False),
        ]
    if not cfg.bias:
        fused = [f for f in fused if f[2]]
    return {
        "universal_checkpoint_version": 0.4,
        "original_vocab_size": vocab,
        "vocabulary_parameter_patterns": [embed] + ([] if cfg.tie_embeddings else [head]),
        "pipeline_replicated_parameter_patterns": [r"tied_modules\."] if cfg.tie_embeddings else [],
        "tp_replicated_parameter_patterns": replicated,
        "parameter_with_row_parallelism_patterns": [r"\d+\.attn\.out\.weight$", r"\d+\.mlp\.down\.weight$"],
        "parameter_with_sub_params": [
            {"patterns": [p], "shape": (sizes, -1) if matrix else (sizes,), "partition_dim": 0}
            for p, sizes, matrix in fused
        ],
        "sub_param_shard_widths": {p: widths(sizes) for p, sizes, _ in fused},
    }
