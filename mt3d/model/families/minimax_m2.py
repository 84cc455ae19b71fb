"""MiniMax-M2 (``MiniMaxM2ForCausalLM``, model_type ``minimax_m2``): grouped-query attention whose q/k
RMSNorms span all the heads at once (one weight per dimension of q and of k: ``ModelConfig.qk_norm``
"all"; under TP the ranks' sums of squares are added), RoPE over part of each head (``rotary_dim`` or
``partial_rotary_factor``), and a MoE routed by sigmoid scores with a selection-only correction bias
(``e_score_correction_bias``), renormalised top-k weights, every block sparse, no shared expert.

The files name the MoE as Mixtral does (``block_sparse_moe.experts.{j}.w1/w3/w2``,
``block_sparse_moe.gate``), the correction bias beside the router (``block_sparse_moe.
e_score_correction_bias``). Multi-token-prediction modules of MiniMax's own checkpoints are not built
(reported as unused tensors, as transformers ignores them).

transformers' load-balancing loss for this model scores a softmax top-k that routing does not use, so
``output_router_logits`` true is refused; mt3d's own (``model.moe.aux_loss_coef``, over the experts
routing chooses) or aux-loss-free balancing (``bias_update_rate``) train, and are not written to config.json.
"""

from __future__ import annotations

from .base import HFError, Piece, get, positive, register
from .keys import COMMON, LLAMA_LIKE, read, refused
from .llama import LLAMA_BLOCK
from .moe import MOE_KEYS, Mixtral, MoEFamily, _without_moe_refusals

_CORRECTION = "mlp.router.e_score_correction_bias"


@register
class MiniMaxM2(MoEFamily):
    """MiniMax-M2 / M2.1 (229B, 10B active)."""

    name = "minimax_m2"
    architecture = "MiniMaxM2ForCausalLM"
    model_types = ("minimax_m2",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, mlp_bias=False,
        qk_norm="all", tie_embeddings=False, norm_eps=1e-6,
    )  # fmt: skip
    variable = frozenset({"rotary_fraction", "tie_embeddings", "moe"})
    hf_defaults = {"max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "head_dim": 128}  # fmt: skip
    transformers_module = "minimax_m2"
    experts_keys = Mixtral.experts_keys
    block_modules = LLAMA_BLOCK
    expert_modules = Mixtral.expert_modules
    hf_keys = {
        **_without_moe_refusals(COMMON),
        **LLAMA_LIKE,
        **MOE_KEYS,
        "num_local_experts": read("int+"),
        "num_experts": read("int+"),
        "partial_rotary_factor": read("num+"),
        "rotary_dim": read("int+"),
        "output_router_logits": refused(
            "transformers' load-balancing loss for MiniMax-M2 (a softmax top-k that routing does not use); "
            "use model.moe.bias_update_rate"
        ),
        "router_jitter_noise": Mixtral.hf_keys["router_jitter_noise"],
        # keys of MiniMax's own configs that transformers' modeling code does not read: refused where
        # they describe another model than the one transformers builds
        "use_qk_norm": refused("MiniMax-M2 without its q/k norms", None, True),
        "qk_norm_type": refused("q/k norms per head in a MiniMax-M2 config", None, "per_layer"),
        "scoring_func": refused("softmax expert scores in a MiniMax-M2 config", None, "sigmoid"),
        "use_routing_bias": refused("routing without the correction bias", None, True),
        "shared_intermediate_size": refused("a shared expert in a MiniMax-M2 config"),
        "use_mtp": read("bool"),  # MTP modules: reported as unused tensors, skipped
        "num_mtp_modules": read("int0+"),
    }  # fmt: skip
    partial_rotary = True

    def moe_limits(self, spec):
        """Sigmoid scores with a correction bias, renormalised, every block sparse, nothing else."""
        if (
            spec.scoring != "sigmoid" or not spec.correction_bias or not spec.norm_topk_prob
            or spec.shared_ffn or spec.router_bias or spec.expert_bias or spec.n_group != 1
            or spec.routed_scaling != 1.0 or spec.sparse_step != 1 or spec.dense_layers
            or spec.swiglu_limit is not None
        ):  # fmt: skip
            return ("MiniMax-M2 routes every block by sigmoid scores with a correction bias, renormalised, "
                    "without groups, scaling or a shared expert")  # fmt: skip
        return None

    def options_from_hf(self, hf, where, layers):
        """The rotary share (``rotary_dim`` where the config gives no ``partial_rotary_factor``, as
        transformers reads it) and the MoE (intermediate_size is each expert's)."""
        params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        out = {}
        if hf.get("rotary_dim") is not None and "partial_rotary_factor" not in {**hf, **params}:
            head_dim = get(hf, "head_dim", 128)
            if hf["rotary_dim"] > head_dim or hf["rotary_dim"] % 2:
                raise HFError(f"{where}: rotary_dim {hf['rotary_dim']} must be even and at most head_dim "
                              f"{head_dim}")  # fmt: skip
            out["rotary_fraction"] = hf["rotary_dim"] / head_dim
        ffn = positive(hf, "intermediate_size", where, 1536, integer=True)
        moe = self.read_moe(hf, where, ffn, scoring="sigmoid", correction_bias=True, norm_topk_prob=True)
        return dict(out, moe=moe)

    def options_to_hf(self, cfg):
        """The experts (the rotary share is written by ``rope_to_hf``); mt3d's load-balancing loss, a
        training choice, is not written (transformers' for this model is another loss)."""
        out = self.write_moe(cfg)
        out.pop("router_aux_loss_coef", None)
        return {**out, "output_router_logits": False}

    def hf_config(self, cfg, vocab):
        """intermediate_size is the experts' inner size."""
        return {**super().hf_config(cfg, vocab), "intermediate_size": cfg.moe_spec.expert_ffn}

    def in_memory(self, cfg, state):
        """Mixtral's fused experts and router; the correction bias as ``mlp.e_score_correction_bias``."""
        state = super().in_memory(cfg, state)
        for i in range(cfg.layers):
            state[f"model.layers.{i}.mlp.e_score_correction_bias"] = state.pop(
                f"model.layers.{i}.block_sparse_moe.e_score_correction_bias"
            )
        return state

    def pieces(self, cfg, role, block, local):
        """The correction bias beside the router, not under it; the rest as Mixtral's names."""
        if role == "block" and local == _CORRECTION:
            return [Piece(f"model.layers.{block}.block_sparse_moe.e_score_correction_bias")]
        return super().pieces(cfg, role, block, local)
