"""GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, tanh-GELU MLP, biases everywhere.

HF stores the linear weights as Conv1D ([in, out], transposed from mt3d's [out, in]) and q/k/v as
one fused ``c_attn`` tensor, whose row ranges are mt3d's q, k and v parts.
"""

from __future__ import annotations

from .base import Family, HFError, Piece, get, need, register
from .keys import COMMON, inert, read, refused

_MODULES = {
    "norm1": "ln_1",
    "norm2": "ln_2",
    "attn.out": "attn.c_proj",
    "mlp.up": "mlp.c_fc",
    "mlp.down": "mlp.c_proj",
}
_NORMS = ("norm1", "norm2")


@register
class GPT2(Family):
    """GPT-2 and GPT-3-shaped models."""

    name = "gpt2"
    architecture = "GPT2LMHeadModel"
    model_types = ("gpt2",)
    infer_rank = 0
    defaults = dict(position="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
    variable = frozenset({"tie_embeddings"})
    hf_defaults = {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
    transformers_module = "gpt2"
    hf_keys = {
        **COMMON,
        **dict.fromkeys(("n_embd", "n_layer", "n_head", "n_positions", "n_inner"), read("int+")),
        # GPT2Config's aliases of the four above
        **dict.fromkeys(
            ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"),
            read("int+"),
        ),
        "activation_function": read("str"),
        "layer_norm_epsilon": read("num+"),
        **dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), read("num0+")),
        "hidden_dropout": inert("used by the classification head, not by the causal language model"),
        **dict.fromkeys(
            (
                "summary_type",
                "summary_use_proj",
                "summary_activation",
                "summary_proj_to_labels",
                "summary_first_dropout",
                "summary_last_dropout",
            ),
            inert("the multiple-choice head of GPT2DoubleHeadsModel"),
        ),  # fmt: skip
        "reorder_and_upcast_attn": inert(
            "the same scores, computed in fp32 (mt3d's softmax is fp32 already)"
        ),
        "scale_attn_weights": refused("attention scores without the 1/sqrt(head_dim) scale", True, None),
        "scale_attn_by_inverse_layer_idx": refused("attention scores scaled by 1/(layer index + 1)"),
        "n_ctx": inert("not read by the model (n_positions sizes the position table)"),
    }

    def limits(self, cfg):
        """c_attn splits into three hidden-wide parts: q, k and v must each be ``hidden`` wide."""
        if cfg.q_size != cfg.hidden or cfg.kv_heads != cfg.heads:
            return "needs heads * head_dim == hidden and kv_heads == heads"
        return None

    def config_kwargs(self, hf, where):
        """ModelConfig fields of a GPT2Config."""
        self.check_hf_keys(hf, where)
        act = get(hf, "activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HFError(f"{where}: activation_function {act!r} is not supported (gelu_new)")
        resid, embd = get(hf, "resid_pdrop", 0.0), get(hf, "embd_pdrop", get(hf, "resid_pdrop", 0.0))
        if embd != resid:
            raise HFError(
                f"{where}: embd_pdrop {embd} differs from resid_pdrop {resid}; mt3d has one dropout for the "
                "embedding and the residual branches: make them equal"
            )
        h = need(hf, "n_embd", where)
        return dict(
            hidden=h,
            layers=need(hf, "n_layer", where),
            heads=need(hf, "n_head", where),
            vocab_size=need(hf, "vocab_size", where),
            ffn=get(hf, "n_inner", 4 * h),
            max_seq_len=get(hf, "n_positions", self.hf_defaults["n_positions"]),
            tie_embeddings=get(hf, "tie_word_embeddings", True),
            norm_eps=get(hf, "layer_norm_epsilon", 1e-5),
            hidden_dropout=get(hf, "resid_pdrop", 0.0),
            attention_dropout=get(hf, "attn_pdrop", 0.0),
            init_std=get(hf, "initializer_range", 0.02),
        )

    def hf_config(self, cfg, vocab):
        """A GPT2Config dict."""
        return dict(
            n_embd=cfg.hidden,
            n_layer=cfg.layers,
            n_head=cfg.heads,
            n_inner=cfg.ffn,
            n_positions=cfg.max_seq_len,
            vocab_size=vocab,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            resid_pdrop=cfg.hidden_dropout,
            embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout,
        )

    def pieces(self, cfg, role, block, local):
        """transformer.* names; Conv1D weights transposed; c_attn cut into q, k, v row ranges."""
        leaf = local.rsplit(".", 1)[-1]
        if role == "embed":
            return [Piece("transformer.wte.weight")]
        if role == "pos":
            return [Piece("transformer.wpe.weight")]
        if role == "final_norm":
            return [Piece(f"transformer.ln_f.{leaf}")]
        if role == "head":
            return [Piece("lm_head.weight")]
        p = f"transformer.h.{block}."
        module = local.rsplit(".", 1)[0]
        if module == "attn.qkv":
            h = cfg.hidden
            return [Piece(p + "attn.c_attn." + leaf, leaf == "weight", i * h, h) for i in range(3)]
        if module not in _MODULES:
            raise HFError(f"GPT-2 has no tensor for mt3d parameter {local!r}")
        return [Piece(p + _MODULES[module] + "." + leaf, leaf == "weight" and module not in _NORMS)]
