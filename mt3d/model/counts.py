"""Training FLOPs per token of a model config (``ModelConfig.flops_per_token``), the planner's and the
metrics' one count."""

from __future__ import annotations

from .options import GATED_MLPS


def flops_per_token(cfg, seq_len: int, vocab: int | None = None, attended: float | None = None,
                    adapters: int | None = None) -> float:  # fmt: skip
    """Training FLOPs per token without recompute (Narayanan et al. 2021, FORMULAS.md).

    ``adapters``: the LoRA adapter parameters of a run whose other weights are frozen: their
    weight-gradient GEMMs are never computed (each weight GEMM counts its forward and input
    gradient, 2 of its 3), the attention core counts 3 as before, the adapters 6 per parameter.

    72 * s * l * h^2 * (1 + s/(6h) + V/(12 l h)) per sequence for GPT-style blocks, with
    the dense terms taken from the actual attention/MLP shapes (GQA, gated MLPs) so that the
    GPT-2 case reduces exactly to the closed form. Local-attention layers count the keys
    they attend to (the window), not s. ``attended`` overrides the keys per query averaged over
    layers (the planner passes what a tiled kernel executes).
    """
    v = vocab or cfg.vocab_size or 0
    h = cfg.hidden
    # forward matmul FLOPs per token per layer: 2 * (weights) + attention scores/values 4*keys*q
    dense = 2 * (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h)
    core = cfg.q_size  # per key: q.k over head_dim and p.v over head_dim, per head
    if cfg.mla is not None:
        dense = 2 * cfg.mla_spec.matmul_params(h, cfg.heads)
        core = cfg.heads * (cfg.head_dim + cfg.mla_spec.v_head_dim) / 2
    if cfg.attn_output_gate:
        dense += 2 * h * cfg.q_size
    keys = cfg.attended_keys(seq_len) if attended is None else attended
    logits = 2 * h * v
    linear = cfg.linear_blocks  # Gated DeltaNet blocks instead
    full = cfg.layers - linear
    dense_all = full * dense + (linear and linear * cfg.gdn_spec.weight_flops(h))
    core_all = full * 2 * 2 * keys * core + (linear and linear * cfg.gdn_spec.core_flops())
    mlp = mlps_flops(cfg, range(cfg.layers))
    if cfg.mtp is not None:  # each depth: eh_proj, a full-attention block over the sequence, the head
        depths = cfg.mtp_spec.layers
        dense_all += depths * (dense + 2 * 2 * h * h)
        core_all += depths * 2 * 2 * (seq_len if attended is None else attended) * core
        mlp += mlps_flops(cfg, range(cfg.layers, cfg.layers + depths))
        logits *= 1 + depths
    if adapters is not None:
        return 2.0 * (dense_all + mlp + logits) + 3.0 * core_all + 6.0 * adapters
    return 3.0 * (dense_all + core_all + mlp + logits)


def mlp_flops(cfg, layer: int) -> float:
    """Forward FLOPs per token of block ``layer``'s MLP: dense, or the router, the k experts a token
    visits and the shared expert (with its gate)."""
    return mlps_flops(cfg, (layer,))


def mlps_flops(cfg, layers) -> float:
    """``mlp_flops`` summed over ``layers``, the options parsed once (the planner counts every layout)."""
    h, mats = cfg.hidden, 3 if cfg.mlp in GATED_MLPS else 2
    dense, spec = 2 * mats * h * cfg.ffn, cfg.moe_spec
    if spec is None:
        return float(dense * len(layers))
    sparse = 2 * h * (spec.experts + mats * (spec.top_k * spec.expert_ffn + spec.shared_ffn)
                      + bool(spec.shared_ffn and spec.shared_gate))  # fmt: skip
    return float(sum(sparse if spec.sparse(i) else dense for i in layers))
