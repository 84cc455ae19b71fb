"""What every model family provides, and the HF-config reading helpers they share.

A family (GPT-2, Llama, Mistral, ...) is one ``Family`` subclass in its own module. It alone knows
its HF ``model_type`` and architecture, which ``ModelConfig`` block options it fixes and which its
HF config may set, how ``config.json`` maps onto ``ModelConfig`` (both ways), and which HF tensors
make up each mt3d parameter. Everything else (loading, export, sharding, checkpoints, the planner)
goes through the registry in ``families/__init__.py`` and never names a family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import UserError
from ..attention import FULL, SLIDING
from ..options import BLOCK_OPTIONS, ModelConfigError
from .keys import COMMON, Key, check_keys

if TYPE_CHECKING:
    from ..config import ModelConfig


class HFError(UserError):
    """An HF directory or config mt3d cannot use; the message names the file, key or field."""


@dataclass(frozen=True)
class Piece:
    """Rows ``start, start + step, ...`` (``size`` of them; mt3d orientation) of HF tensor ``name``;
    all its rows when size is None.

    ``transpose``: the HF tensor is stored [in, out] (GPT-2's Conv1D), mt3d's is [out, in].
    ``index``: the tensor stacks one matrix per expert ([E, ...], gpt-oss); the piece is in matrix
    ``index``. ``step`` 2 reads interleaved rows (gpt-oss's gate and up columns alternate).
    """

    name: str
    transpose: bool = False
    start: int = 0
    size: int | None = None
    index: int | None = None
    step: int = 1


SUPPORTED_ROPE = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _default_of(cfg, name: str) -> Any:
    """The default of ``cfg``'s field ``name`` (read off its dataclass: no import of the config)."""
    f = {f.name: f for f in dataclasses.fields(type(cfg))}[name]
    return f.default


_REGISTRY: dict[str, Family] = {}
"""Every family by name (``register``); the package's ``__init__`` fills it by importing each module."""


def register(cls: type[Family]) -> type[Family]:
    """Class decorator: make a family known under its ``name``."""
    _REGISTRY[cls.name] = cls()
    return cls


class Family:
    """One model family. Subclasses set the class attributes and implement the HF mappings."""

    name: ClassVar[str]
    """Registry key, stored in ``ModelConfig.family`` and checkpoints."""
    architecture: ClassVar[str]
    """The transformers class exported to (``architectures`` in config.json)."""
    model_types: ClassVar[tuple[str, ...]]
    """HF ``model_type`` values read as this family (the first is written on export)."""
    defaults: ClassVar[dict[str, Any]] = {}
    """ModelConfig block options (and norm_eps etc.) this family starts from."""
    variable: ClassVar[frozenset[str]] = frozenset()
    """Block options its HF config can change; every other option must keep its default."""
    hf_defaults: ClassVar[dict[str, Any]] = {}
    """Values transformers assumes for keys a config.json omits (checked against transformers)."""
    any_pattern: ClassVar[bool] = False
    """Whether its format holds any local-attention pattern; HF configs hold plain sliding windows
    (no stride or dilation)."""
    infer_rank: ClassVar[int] = 50
    """Order in which ``infer_family`` tries families for configs that name none (configs saved
    before ``ModelConfig.family`` existed are GPT-2 or Llama, tried first)."""
    hf_keys: ClassVar[dict[str, Key]] = COMMON
    """Every key of its HF config that transformers' modeling code reads: read, inert or refused
    (``keys.py``; tests/test_hf.py checks the table against transformers' source)."""
    transformers_module: ClassVar[str | None] = None
    """The transformers model package whose modeling file the table is checked against."""
    mtp_format: ClassVar[str | None] = None
    """Where its checkpoints keep multi-token-prediction layers (``model.mtp``): "nextn" (DeepSeek-V3's
    ``model.layers.{layers + k}`` with enorm / hnorm / eh_proj / shared_head), "qwen" (Qwen3-Next's
    ``mtp.*``: one depth), "any" (no HF form); None: the family has none."""
    mtp_count_keys: ClassVar[tuple[str, ...]] = ()
    """Its HF config keys saying how many MTP layers a checkpoint holds (the first is written)."""

    def reads(self, hf: dict) -> bool:
        """Whether this family reads the HF config ``hf`` (by its ``model_type``)."""
        return hf.get("model_type") in self.model_types

    def check_unused(self, unused: list[str], shape_of, cfg, where: str) -> None:
        """Refuse stored tensors the config leaves unused where transformers would refuse them
        (``shape_of(name)``: a stored tensor's shape); by default unused tensors are only reported."""

    def check_hf_keys(self, hf: dict, where: str) -> None:
        """Refuse, by name, a key that switches on what mt3d lacks or holds a value of the wrong type."""
        check_keys(hf, self.hf_keys, where, HFError)

    # --- consistency ------------------------------------------------------------------------
    def check(self, cfg: ModelConfig) -> None:
        """Raise ModelConfigError when ``cfg`` uses an option this family's HF format cannot express."""
        for opt in BLOCK_OPTIONS:
            if opt in self.variable:
                continue
            want = self.defaults.get(opt, _default_of(cfg, opt))
            if opt in ("qkv_bias", "mlp_bias") and want is None:
                want = cfg.bias
            if getattr(cfg, opt) != want:
                raise ModelConfigError(
                    f"model.{opt}={getattr(cfg, opt)!r} cannot be expressed by family {self.name!r} "
                    f"({self.architecture}, which has {want!r}); drop 'family' or choose another"
                )
        plain = all(p is None or (p.stride, p.dilation) == (1, 1) for p in cfg.patterns)
        if "attention" in self.variable and not (plain or self.any_pattern):
            raise ModelConfigError(
                f"model.attention stride/dilation cannot be expressed by family {self.name!r} "
                f"({self.architecture} has plain sliding windows); drop 'family' (the model is then "
                "'custom': trained, not exported)"
            )
        why = self.limits(cfg) or self.mtp_limits(cfg)
        if why:
            raise ModelConfigError(f"family {self.name!r} ({self.architecture}): {why}")

    def limits(self, cfg: ModelConfig) -> str | None:
        """Family-specific constraints between options (None: none violated)."""
        return None

    def mtp_limits(self, cfg: ModelConfig) -> str | None:
        """Why ``model.mtp`` does not fit this family's format (None: it does, or it is off)."""
        if cfg.mtp is None or cfg.mtp_spec is None:  # (parsing raises on bad values)
            return None
        if self.mtp_format is None:
            return ("has no multi-token-prediction layers (deepseek_v3, glm4_moe, qwen3_next, qwen3_5 and "
                    "qwen3_5_moe have); drop model.mtp")  # fmt: skip
        if self.mtp_format == "qwen" and cfg.mtp_spec.layers != 1:
            return f"its checkpoints hold one MTP module (mtp.*), model.mtp.layers is {cfg.mtp_spec.layers}"
        return None

    def mtp_count(self, hf: dict) -> int:
        """How many MTP layers the HF config ``hf`` says its checkpoint holds."""
        return max([int(hf.get(key) or 0) for key in self.mtp_count_keys] or [0])

    def mtp_pieces(self, cfg: ModelConfig, local: str) -> list[Piece]:
        """The HF tensors of an MTP parameter (``depth.{k}.<name>`` inside ``mt3d.model.mtp.MtpLayers``)."""
        _, k, name = local.split(".", 2)
        k = int(k)
        if self.mtp_format == "nextn":
            at = f"model.layers.{cfg.layers + k}."
            own = {m: at + m for m in ("enorm", "hnorm", "eh_proj")} | {"norm": at + "shared_head.norm"}
        elif self.mtp_format == "qwen":
            at = f"mtp.layers.{k}."
            own = {"enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden",
                   "eh_proj": "mtp.fc", "norm": "mtp.norm"}  # fmt: skip
        else:
            raise HFError(f"{self.architecture} has no checkpoint form for MTP parameter {local!r}")
        module, _, leaf = name.rpartition(".")
        if module in own:
            return [Piece(f"{own[module]}.{leaf}")]
        if not name.startswith("block."):
            raise HFError(f"{self.architecture} has no tensor for MTP parameter {local!r}")
        ps = self.pieces(cfg, "block", cfg.layers + k, name[len("block.") :])
        main = f"model.layers.{cfg.layers + k}."
        return [dataclasses.replace(p, name=at + p.name[len(main) :]) for p in ps]

    def mtp_copies(self, cfg: ModelConfig, state: dict) -> dict:
        """The HF tensors a checkpoint keeps beside the MTP layers' own: DeepSeek-V3's format stores each
        depth's copies of the embedding and the head (``embed_tokens``, ``shared_head.head``)."""
        if self.mtp_format != "nextn" or cfg.mtp is None:
            return {}
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        out = {}
        for k in range(cfg.mtp_spec.layers):
            out[f"model.layers.{cfg.layers + k}.embed_tokens.weight"] = state[
                "model.embed_tokens.weight"
            ].clone()
            out[f"model.layers.{cfg.layers + k}.shared_head.head.weight"] = head.clone()
        return out

    # --- HF config <-> ModelConfig -------------------------------------------------------------
    def config_kwargs(self, hf: dict, where: str) -> dict:
        """ModelConfig keyword arguments read from an HF config dict (``where`` names it in errors)."""
        raise NotImplementedError

    def hf_config(self, cfg: ModelConfig, vocab: int) -> dict:
        """config.json contents (without token ids) describing ``cfg``."""
        raise NotImplementedError

    def in_memory(self, cfg: ModelConfig, state: dict) -> dict:
        """HF tensors as the checkpoint files name them -> as the transformers model holds them in memory
        (the same for dense families; transformers 5 fuses MoE experts in memory and splits them again
        when it saves)."""
        return state

    # --- tensor names ----------------------------------------------------------------------------
    def pieces(self, cfg: ModelConfig, role: str, block: int, local: str) -> list[Piece]:
        """The HF tensors making up an mt3d parameter: ``role`` is embed/pos/block/final_norm/head,
        ``block`` the block index (blocks only), ``local`` the name inside the mt3d layer."""
        raise NotImplementedError


# --- helpers for reading HF configs -------------------------------------------------------------------
def need(hf: dict, key: str, where: str) -> Any:
    """A required key of an HF config."""
    if key not in hf or hf[key] is None:
        raise HFError(f"{where}: config.json has no {key!r}")
    return hf[key]


def get(hf: dict, key: str, default: Any) -> Any:
    """An optional key (missing or null: ``default``)."""
    v = hf.get(key)
    return default if v is None else v


def positive(hf: dict, key: str, where: str, default: Any = None, *, integer: bool = False) -> Any:
    """An optional positive number (None allowed when the default is None)."""
    v = hf.get(key, default)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or v <= 0:
        kind = "integer" if integer else "number"
        raise HFError(f"{where}: {key} must be a positive {kind} or null, got {v!r}")
    return v


def rope_from_hf(hf: dict, where: str, partial: bool = False) -> tuple[float, dict | None]:
    """(theta, scaling) from transformers 5's ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``;
    ``partial``: the family reads ``partial_rotary_factor`` itself (``rotary_fraction_from_hf``)."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(key) or {}
    if not isinstance(params, dict):
        raise HFError(f"{where}: {key} must be an object, got {params!r}")
    params = dict(params)
    if partial:
        params.pop("partial_rotary_factor", None)
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE:
        raise HFError(
            f"{where}: {key}.rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE)})"
        )
    if isinstance(theta, bool) or not isinstance(theta, int | float) or theta <= 0:
        raise HFError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    for name in ROPE_NEEDS.get(kind, ()):
        v = params.get(name)
        if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
            raise HFError(f"{where}: {key} of type {kind!r} needs {name} as a positive number, got {v!r}")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise HFError(f"{where}: {key}.high_freq_factor must be larger than low_freq_factor")
    if kind in ("yarn", "longrope"):  # as transformers fills it: the config's own key first
        old = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = old or hf.get("max_position_embeddings")
        if not isinstance(params["original_max_position_embeddings"], int):
            raise HFError(f"{where}: {key} of type {kind!r} needs original_max_position_embeddings")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFError(f"{where}: {key}.partial_rotary_factor {params['partial_rotary_factor']} is not "
                      "supported (RoPE over the whole head only)")  # fmt: skip
    for name in ("short_factor", "long_factor") if kind == "longrope" else ():
        v = params.get(name)
        if not isinstance(v, list) or not v or not all(isinstance(x, int | float) and x > 0 for x in v):
            raise HFError(f"{where}: {key} of type 'longrope' needs {name} as a list of positive numbers")
    return float(theta), (None if kind == "default" else params)


ROPE_NEEDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
"""The numbers each RoPE scaling type needs (missing or not positive: refused, not NaN)."""


def rope_to_hf(cfg: ModelConfig) -> dict:
    """RoPE keys for config.json: transformers 5's rope_parameters and the 4.x keys beside them (and the
    partial rotary factor in both places, where RoPE covers part of each head)."""
    rope = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
    partial = {"partial_rotary_factor": cfg.rotary_fraction} if cfg.rotary_fraction != 1 else {}
    return {
        "rope_parameters": {**rope, **partial},
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        **partial,
    }


def rotary_fraction_from_hf(hf: dict, where: str) -> float:
    """``partial_rotary_factor`` (in ``rope_parameters`` or at the top, as transformers accepts it): the
    share of each head RoPE rotates (``ModelConfig.rotary_fraction``; 1.0 when absent)."""
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    f = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f <= 1:
        raise HFError(f"{where}: partial_rotary_factor must be a number in (0, 1], got {f!r}")
    return float(f)


def attention_from_hf(hf: dict, where: str, layers: int, window: int | None) -> dict | None:
    """ModelConfig.attention from a window and the config's ``layer_types`` (None: all global)."""
    types = hf.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            n = len(types) if isinstance(types, list) else repr(types)
            raise HFError(f"{where}: layer_types must list num_hidden_layers={layers} entries, got {n}")
        bad = [t for t in types if t not in (FULL, SLIDING)]
        if bad:
            raise HFError(f"{where}: layer_types entry {bad[0]!r} is not supported ({SLIDING!r}, {FULL!r})")
    if window is None:
        if types and SLIDING in types:
            raise HFError(f"{where}: layer_types has sliding layers but sliding_window is null")
        return None
    if types is None or all(t == SLIDING for t in types):
        return {"window": window}
    if all(t == FULL for t in types):
        return None
    return {"window": window, "layer_types": list(types)}


def attention_to_hf(cfg: ModelConfig) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types) describing ``cfg.attention`` in HF terms."""
    patterns = cfg.patterns
    windows = {p.window for p in patterns if p is not None}
    if len(windows) > 1:
        raise HFError(f"HF configs have one sliding_window; this model uses {sorted(windows)}")
    types = [FULL if p is None else SLIDING for p in patterns]
    return (windows.pop() if windows else None), types


def common_kwargs(hf: dict, where: str, defaults: dict) -> dict:
    """Sizes shared by every family's HF config (after the family's key renames)."""
    heads = need(hf, "num_attention_heads", where)
    hidden = need(hf, "hidden_size", where)
    return dict(
        hidden=hidden,
        layers=need(hf, "num_hidden_layers", where),
        heads=heads,
        kv_heads=get(hf, "num_key_value_heads", heads),
        head_dim=get(hf, "head_dim", defaults.get("head_dim") or hidden // max(heads, 1)),
        vocab_size=need(hf, "vocab_size", where),
        ffn=need(hf, "intermediate_size", where),
        max_seq_len=get(hf, "max_position_embeddings", defaults["max_position_embeddings"]),
        norm_eps=get(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        tie_embeddings=get(hf, "tie_word_embeddings", defaults["tie_word_embeddings"]),
        attention_dropout=get(hf, "attention_dropout", 0.0),
        init_std=get(hf, "initializer_range", 0.02),
    )


def source_name(path: str | Path) -> str:
    """ModelConfig.name of a model read from ``path``."""
    return f"hf:{Path(path).name}"
