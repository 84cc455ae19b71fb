"""The ``model.moe`` option, parsed and checked (``MoESpec``): a leaf the model config reads without
importing the layers that build it (``mt3d.model.moe``)."""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from .options import ModelConfigError, option_fields


class MoEConfigError(ModelConfigError):
    """A ``model.moe`` option that cannot be built."""


@functools.lru_cache(maxsize=64)
def _sparse_blocks(step: int, dense: tuple[int, ...], layers: int) -> tuple[bool, ...]:
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


@dataclass(frozen=True)
class MoESpec:
    """The ``model.moe`` option, parsed."""

    experts: int
    """Routed experts E."""
    top_k: int
    """Experts per token k."""
    expert_ffn: int
    """Inner size of each routed expert's gated MLP."""
    norm_topk_prob: bool = True
    """Renormalise the k weights to sum to 1 (Mixtral always; Qwen per config)."""
    shared_ffn: int = 0
    """Inner size of the shared expert (0: none); its output is gated by sigmoid(x . w) (Qwen2-MoE)."""
    sparse_step: int = 1
    """Block i is sparse when (i + 1) % sparse_step == 0 (transformers' decoder_sparse_step)."""
    dense_layers: tuple[int, ...] = ()
    """Blocks kept dense whatever the step (transformers' mlp_only_layers)."""
    aux_loss_coef: float = 0.0
    """Weight of the load-balancing loss in the training loss (transformers' router_aux_loss_coef,
    applied when output_router_logits is on)."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss: mean over tokens and sparse layers of logsumexp(router logits)^2."""
    scoring: str = "softmax"
    """Expert scores: 'softmax' over the router logits, or 'sigmoid' of each (DeepSeek-V3)."""
    n_group: int = 1
    """Group-limited routing (DeepSeek-V3): the experts form n_group groups, each scored by the sum of
    its two best scores, and a token's experts come from its topk_group best groups only."""
    topk_group: int = 1
    """The groups a token's experts may come from."""
    routed_scaling: float = 1.0
    """Factor on the routed experts' weights (DeepSeek's routed_scaling_factor)."""
    correction_bias: bool = False
    """A per-expert bias added to the scores for choosing the experts only, not to their weights
    (DeepSeek-V3's e_score_correction_bias): trained by aux-loss-free balancing, not by gradients."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing: after every optimizer step each expert's correction bias moves by this
    rate against the sign of its load error (load over the step's tokens minus the mean load)."""
    shared_gate: bool = True
    """Whether the shared expert's output is gated by sigmoid(x . w) (Qwen2-MoE; DeepSeek: no gate)."""
    router_bias: bool = False
    """A bias on the router's logits (gpt-oss)."""
    expert_bias: bool = False
    """Biases on the routed experts' gate/up and down projections (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU in the routed experts: gate clamped to <= limit, up to [-limit, limit],
    out = (up + 1) * gate * sigmoid(swiglu_alpha * gate). None: the model's plain gated activation."""
    swiglu_alpha: float = 1.0
    """The sigmoid's gain in the clamped SwiGLU (gpt-oss: 1.702)."""
    capacity_factor: float | None = None
    """None: dropless (transformers). Else, in training, each expert takes at most
    ceil(cf * tokens * k / E) assignments per micro-batch and the rest are dropped (counted in the
    metrics); evaluation and generation stay dropless."""

    @classmethod
    def parse(cls, d: dict) -> MoESpec:
        """From the ``model.moe`` dict; one-line errors naming the key."""
        if isinstance(d, MoESpec):
            return d
        kw = option_fields(cls, d, "moe", ("experts", "top_k", "expert_ffn"), MoEConfigError)
        kw["dense_layers"] = tuple(kw.get("dense_layers") or ())
        spec = cls(**kw)
        spec.check()
        return spec

    def check(self) -> None:
        """Values in range (the layer list is checked against the model by ``check_layers``)."""

        def whole(key, low):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise MoEConfigError(f"model.moe.{key} must be an integer >= {low}, got {v!r}")

        whole("experts", 2), whole("top_k", 1), whole("expert_ffn", 1), whole("shared_ffn", 0)
        whole("sparse_step", 1)
        if self.top_k > self.experts:
            raise MoEConfigError(f"model.moe.top_k {self.top_k} exceeds the {self.experts} experts")
        for key in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise MoEConfigError(f"model.moe.{key} must be a non-negative number, got {v!r}")
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool) or not isinstance(cf, int | float) or not cf > 0 or not math.isfinite(cf)
        ):
            raise MoEConfigError(
                f"model.moe.capacity_factor must be a finite positive number or null (dropless), got {cf!r}"
            )
        if self.scoring not in ("softmax", "sigmoid"):
            raise MoEConfigError(f"model.moe.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        whole("n_group", 1), whole("topk_group", 1)
        if self.experts % self.n_group or self.topk_group > self.n_group:
            raise MoEConfigError(
                f"model.moe: {self.experts} experts do not form n_group {self.n_group} groups with "
                f"topk_group {self.topk_group} <= n_group"
            )
        if self.n_group > 1 and self.top_k > self.topk_group * self.experts // self.n_group:
            raise MoEConfigError(
                f"model.moe.top_k {self.top_k} exceeds the experts of {self.topk_group} groups"
            )
        for key in ("routed_scaling", "bias_update_rate"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise MoEConfigError(f"model.moe.{key} must be a non-negative number, got {v!r}")
        if self.bias_update_rate > 0 and not self.correction_bias:
            raise MoEConfigError("model.moe.bias_update_rate needs correction_bias (the bias it moves)")
        for key in ("router_bias", "expert_bias", "correction_bias", "shared_gate"):
            if not isinstance(getattr(self, key), bool):
                raise MoEConfigError(f"model.moe.{key} must be true or false, got {getattr(self, key)!r}")
        for key in ("swiglu_limit", "swiglu_alpha"):
            v = getattr(self, key)
            if (v is not None or key == "swiglu_alpha") and (
                isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or not math.isfinite(v)
            ):
                raise MoEConfigError(f"model.moe.{key} must be a finite positive number, got {v!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise MoEConfigError(
                f"model.moe.norm_topk_prob must be true or false, got {self.norm_topk_prob!r}"
            )

    def check_layers(self, layers: int) -> None:
        """The dense-layer list names blocks of the model, and some block is sparse."""
        bad = [
            i
            for i in self.dense_layers
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
        ]
        if bad:
            raise MoEConfigError(
                f"model.moe.dense_layers entry {bad[0]!r} is not a block index (0..{layers - 1})"
            )
        if not any(self.sparse(i) for i in range(layers)):
            raise MoEConfigError(
                "model.moe leaves every block dense (sparse_step / dense_layers): drop 'moe'"
            )

    def sparse(self, layer: int) -> bool:
        """Whether block ``layer`` routes over experts."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def sparse_blocks(self, layers: int) -> tuple[bool, ...]:
        """``sparse`` of each of ``layers`` blocks, computed once per count (the planner asks for every
        layout it weighs)."""
        return _sparse_blocks(self.sparse_step, self.dense_layers, layers)

    @property
    def dispatch_once(self) -> bool:
        """Whether expert parallelism sends each token once per rank holding any of its experts (with
        its routing metadata) rather than once per assignment: at top-1 the two send the same rows, and
        the per-assignment dispatch needs no metadata (``moe.SparseMoE._dispatch_once``; the planner's
        ``timing.ep_bytes`` counts what runs)."""
        return self.top_k > 1

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert takes from ``tokens`` tokens (None: dropless)."""
        if self.capacity_factor is None:
            return None
        if self.capacity_factor * self.top_k >= self.experts:  # no expert can receive more than every token
            return tokens
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.experts)


EXPERT_NAME = re.compile(r"(?:^|\.)experts\.(\d+)\.")
"""A routed expert's global index in a parameter name (``3.mlp.experts.5.up.weight``): experts are
named by global index on every ep rank, so names are unique across a checkpoint's ep ranks."""


def expert_index(name: str) -> int | None:
    """The global expert index ``name`` belongs to (None: not a routed expert's parameter)."""
    m = EXPERT_NAME.search(name)
    return int(m.group(1)) if m else None
