"""Mixture-of-experts families: Mixtral (``MixtralForCausalLM``), Qwen2-MoE (``Qwen2MoeForCausalLM``)
and Qwen3-MoE (``Qwen3MoeForCausalLM``), on mt3d's one MoE block (``mt3d.model.moe``).

Each is its dense relative (Mistral, Qwen2, Qwen3) with the MLP of its sparse layers replaced by a
router and experts; the HF checkpoints hold one tensor per expert projection
(``experts.{j}.w1/w3/w2`` in Mixtral, ``experts.{j}.gate_proj/up_proj/down_proj`` in Qwen), which map
one to one onto mt3d's per-expert parameters (``mlp.experts.{j}.up`` fuses gate and up). The
router's load-balancing loss is trained with ``router_aux_loss_coef`` when the config's
``output_router_logits`` is on, as transformers does.
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch

from .base import HFError, Piece, get, positive, register
from .keys import COMMON, LLAMA_LIKE, WINDOWED, read, refused
from .llama import LlamaLike, mixed_windows, window_of
from .qwen2 import Qwen2, windowed_layers_from_hf, windowed_layers_to_hf

_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


def _without_moe_refusals(table: dict) -> dict:
    """A dense family's key table with its refusals of expert keys lifted (a MoE family reads its own
    and ignores the ones its modeling code does not read, as transformers does)."""
    return {k: v for k, v in table.items() if v.note != COMMON["num_experts"].note}


MOE_KEYS = {
    "num_experts_per_tok": read("int+"),
    "router_aux_loss_coef": read("num0+"),
    "output_router_logits": read("bool"),
}
"""Keys every MoE family reads."""


class MoEFamily(LlamaLike):
    """Llama-named families whose sparse layers route over experts."""

    experts_keys: ClassVar[tuple[str, ...]] = ("num_experts",)
    """The config keys holding the number of routed experts (transformers' attribute_map aliases; the
    first is written)."""
    expert_modules: ClassVar[dict[str, tuple[str, ...]]] = {}
    """mt3d module of a sparse layer ({j}: the expert) -> its HF modules under model.layers.{i}."""
    one_window: ClassVar[bool] = True
    """Whether its ``sliding_window`` applies to every layer (no per-layer ``layer_types``)."""

    def limits(self, cfg):
        """A router is required; what the family's format cannot hold is refused (mixed local and
        global layers where one window covers every layer, ``moe_limits``)."""
        spec = cfg.moe_spec
        if spec is None:
            return "a mixture-of-experts family needs model.moe"
        return (mixed_windows(cfg) if self.one_window else None) or self.moe_limits(spec)

    def moe_limits(self, spec) -> str | None:
        """MoE options this family's config cannot express (None: all can)."""
        return None

    def read_moe(self, hf: dict, where: str, expert_ffn: int, **extra) -> dict:
        """model.moe from the family's config keys."""
        coef = get(hf, "router_aux_loss_coef", 0.001) if get(hf, "output_router_logits", False) else 0.0
        given = {key: hf[key] for key in self.experts_keys if hf.get(key) is not None}
        if len(set(map(repr, given.values()))) > 1:
            raise HFError(f"{where}: {' and '.join(given)} disagree ({list(given.values())})")
        key, experts = next(iter(given.items()), (self.experts_keys[0], None))
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 2:
            raise HFError(f"{where}: {key} must be an integer >= 2, got {experts!r}")
        k = positive(hf, "num_experts_per_tok", where, 2, integer=True)
        if k > experts:
            raise HFError(f"{where}: num_experts_per_tok {k} exceeds {key} {experts}")
        return dict(experts=experts, top_k=k, expert_ffn=expert_ffn, aux_loss_coef=float(coef), **extra)

    def write_moe(self, cfg) -> dict:
        """The keys every MoE family writes."""
        spec = cfg.moe_spec
        out = {self.experts_keys[0]: spec.experts, "num_experts_per_tok": spec.top_k,
               "output_router_logits": spec.aux_loss_coef > 0}  # fmt: skip
        if spec.aux_loss_coef > 0:
            out["router_aux_loss_coef"] = spec.aux_loss_coef
        return out

    def in_memory(self, cfg, state):
        """Per-expert file tensors -> transformers 5's in-memory ``mlp.experts.gate_up_proj`` [E, 2f, h]
        (gate rows then up rows) and ``mlp.experts.down_proj`` [E, h, f], the router as ``mlp.gate``."""
        state = dict(state)
        spec = cfg.moe_spec
        for i in (i for i in range(cfg.layers) if spec.sparse(i)):
            prefix = f"model.layers.{i}."
            for ours, theirs in (("up", "gate_up_proj"), ("down", "down_proj")):
                names = self.expert_modules[f"mlp.experts.{{j}}.{ours}"]
                state[f"{prefix}mlp.experts.{theirs}"] = torch.stack([
                    torch.cat([state.pop(f"{prefix}{n.format(j=j)}.weight") for n in names])
                    for j in range(spec.experts)
                ])  # fmt: skip
            (router,) = self.expert_modules["mlp.router"]
            state[f"{prefix}mlp.gate.weight"] = state.pop(f"{prefix}{router}.weight")
        return state

    def pieces(self, cfg, role, block, local):
        """Expert tensors by index; everything else as the dense family."""
        module, _, leaf = local.rpartition(".")
        if role == "block":
            m = _EXPERT.match(module)
            key = _EXPERT.sub("mlp.experts.{j}.", module) if m else module
            if key in self.expert_modules:
                j = int(m.group(1)) if m else None
                return [
                    Piece(f"model.layers.{block}.{name.format(j=j)}.{leaf}")
                    for name in self.expert_modules[key]
                ]
        return super().pieces(cfg, role, block, local)


@register
class Mixtral(MoEFamily):
    """Mixtral 8x7B / 8x22B: Mistral's attention, every layer sparse, no shared expert."""

    name = "mixtral"
    architecture = "MixtralForCausalLM"
    model_types = ("mixtral",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False, norm_eps=1e-5
    )
    variable = frozenset({"attention", "tie_embeddings", "moe"})
    hf_defaults = {
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
    }
    transformers_module = "mixtral"
    experts_keys = ("num_local_experts", "num_experts")
    expert_modules = {
        "mlp.router": ("block_sparse_moe.gate",),
        "mlp.experts.{j}.up": ("block_sparse_moe.experts.{j}.w1", "block_sparse_moe.experts.{j}.w3"),
        "mlp.experts.{j}.down": ("block_sparse_moe.experts.{j}.w2",),
    }
    hf_keys = {
        **_without_moe_refusals(COMMON),
        **LLAMA_LIKE,
        **WINDOWED,
        **MOE_KEYS,
        "num_local_experts": read("int+"),
        "num_experts": read("int+"),
        "router_jitter_noise": refused("router jitter noise (noise on the router input)", None, 0, 0.0),
    }
    # fmt: skip

    def moe_limits(self, spec):
        """Every layer sparse, renormalised top-k, no shared expert."""
        if spec.shared_ffn or spec.sparse_step != 1 or spec.dense_layers or not spec.norm_topk_prob:
            return "Mixtral has every layer sparse, renormalised top-k weights and no shared expert"
        return None

    def options_from_hf(self, hf, where, layers):
        """sliding_window (every layer) and the experts (intermediate_size is each expert's)."""
        w = positive(hf, "sliding_window", where, None, integer=True)
        moe = self.read_moe(hf, where, hf["intermediate_size"], norm_topk_prob=True)
        return dict(attention=None if w is None else {"window": w}, moe=moe)

    def options_to_hf(self, cfg):
        """sliding_window and the experts."""
        return dict(sliding_window=window_of(cfg), **self.write_moe(cfg))

    def hf_config(self, cfg, vocab):
        """intermediate_size is the experts' inner size; head_dim null when it is hidden / heads (what
        MixtralConfig writes, and transformers reads null as that)."""
        out = {**super().hf_config(cfg, vocab), "intermediate_size": cfg.moe_spec.expert_ffn}
        if cfg.head_dim * cfg.heads == cfg.hidden:
            out["head_dim"] = None
        return out


_QWEN_EXPERTS = {
    "mlp.router": ("mlp.gate",),
    "mlp.experts.{j}.up": ("mlp.experts.{j}.gate_proj", "mlp.experts.{j}.up_proj"),
    "mlp.experts.{j}.down": ("mlp.experts.{j}.down_proj",),
}
_QWEN_MOE_KEYS = {
    **MOE_KEYS,
    "num_experts": read("int+"),
    "moe_intermediate_size": read("int+"),
    "norm_topk_prob": read("bool"),
    "decoder_sparse_step": read("int+"),
    "mlp_only_layers": read("list"),
}


class QwenMoE(MoEFamily):
    """What Qwen2-MoE and Qwen3-MoE share: the sparse-layer rule and the expert keys."""

    def qwen_moe(self, hf: dict, where: str, layers: int, **extra) -> dict:
        """num_experts, moe_intermediate_size, norm_topk_prob, decoder_sparse_step, mlp_only_layers."""
        ffn = positive(hf, "moe_intermediate_size", where, None, integer=True)
        if ffn is None:
            raise HFError(f"{where}: config.json has no 'moe_intermediate_size'")
        dense = get(hf, "mlp_only_layers", [])
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in dense):
            raise HFError(f"{where}: mlp_only_layers must list block indices below {layers}, got {dense!r}")
        return self.read_moe(
            hf, where, ffn, norm_topk_prob=bool(get(hf, "norm_topk_prob", False)),  # transformers' default
            sparse_step=get(hf, "decoder_sparse_step", 1), dense_layers=sorted(set(dense)), **extra,
        )  # fmt: skip

    def write_qwen_moe(self, cfg) -> dict:
        """The Qwen MoE keys of ``cfg``."""
        spec = cfg.moe_spec
        return dict(
            **self.write_moe(cfg), moe_intermediate_size=spec.expert_ffn, norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=spec.sparse_step, mlp_only_layers=list(spec.dense_layers),
        )  # fmt: skip


@register
class Qwen2Moe(QwenMoE):
    """Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases), a sigmoid-gated shared expert."""

    name = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    model_types = ("qwen2_moe",)
    defaults = {**Qwen2.defaults}
    variable = frozenset({"attention", "tie_embeddings", "moe", "qkv_bias"})
    hf_defaults = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    transformers_module = "qwen2_moe"
    one_window = False  # layer_types marks the local layers
    expert_modules = {
        **_QWEN_EXPERTS,
        "mlp.shared.up": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
        "mlp.shared.down": ("mlp.shared_expert.down_proj",),
        "mlp.shared_gate": ("mlp.shared_expert_gate",),
    }
    hf_keys = {**_without_moe_refusals(Qwen2.hf_keys), **_QWEN_MOE_KEYS, "qkv_bias": read("bool"),
               "sliding_window": read("int0+"),  # transformers writes 0 when use_sliding_window is off
               "shared_expert_intermediate_size": read("int0+")}  # fmt: skip

    def options_from_hf(self, hf, where, layers):
        """Sliding-window layers, q/k/v biases and the experts."""
        shared = get(hf, "shared_expert_intermediate_size", 5632)
        return dict(
            attention=windowed_layers_from_hf(hf, where, layers),
            qkv_bias=bool(get(hf, "qkv_bias", True)),
            moe=self.qwen_moe(hf, where, layers, shared_ffn=shared),
        )

    def options_to_hf(self, cfg):
        """Sliding-window layers, q/k/v biases and the experts."""
        return dict(**windowed_layers_to_hf(cfg), qkv_bias=cfg.qkv_bias, **self.write_qwen_moe(cfg),
                    shared_expert_intermediate_size=cfg.moe_spec.shared_ffn)  # fmt: skip

    def check_unused(self, unused, shape_of, cfg, where):
        """A config with ``shared_expert_intermediate_size: 0`` over a trained shared expert: transformers
        refuses the size mismatch ([0, h] against the stored rows); so does mt3d, saying which size."""
        if cfg.moe_spec.shared_ffn:
            return
        for name in unused:
            if name.endswith(("mlp.shared_expert.up_proj.weight", "mlp.shared_expert.gate_proj.weight")):
                shape = tuple(shape_of(name))
                if shape and shape[0] > 0:
                    raise HFError(
                        f"{where}: config.json sets shared_expert_intermediate_size 0 but the weights hold a "
                        f"trained shared expert ({name} {shape}); transformers refuses these sizes: set "
                        f"shared_expert_intermediate_size to {shape[0]}"
                    )


@register
class Qwen3Moe(QwenMoE):
    """Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (q/k norms), no shared expert."""

    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_types = ("qwen3_moe",)
    defaults = dict(
        position="rope", norm="rmsnorm", mlp="swiglu", bias=False, mlp_bias=False, qk_norm=True,
        tie_embeddings=False, norm_eps=1e-6,
    )  # fmt: skip
    variable = frozenset({"attention", "bias", "tie_embeddings", "moe"})
    hf_defaults = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    transformers_module = "qwen3_moe"
    expert_modules = _QWEN_EXPERTS
    experts_keys = ("num_local_experts", "num_experts")
    hf_keys = {**_without_moe_refusals(COMMON), **LLAMA_LIKE, **WINDOWED, **_QWEN_MOE_KEYS,
               "num_local_experts": read("int+"), "attention_bias": read("bool"),
               "use_sliding_window": read("bool"), "max_window_layers": read("int0+")}  # fmt: skip

    def moe_limits(self, spec):
        """No shared expert."""
        return "Qwen3-MoE has no shared expert" if spec.shared_ffn else None

    def options_from_hf(self, hf, where, layers):
        """attention_bias, the window (every layer, with use_sliding_window) and the experts."""
        bias = bool(get(hf, "attention_bias", False))
        w = (
            positive(hf, "sliding_window", where, None, integer=True)
            if get(hf, "use_sliding_window", False)
            else None
        )
        return dict(bias=bias, qkv_bias=bias, attention=None if w is None else {"window": w},
                    moe=self.qwen_moe(hf, where, layers))  # fmt: skip

    def options_to_hf(self, cfg):
        """attention_bias, the window and the experts."""
        w = window_of(cfg)
        return dict(attention_bias=cfg.bias, use_sliding_window=w is not None, sliding_window=w,
                    **self.write_qwen_moe(cfg))  # fmt: skip


__all__ = ["MoEFamily", "Mixtral", "Qwen2Moe", "Qwen3Moe"]
