"""LoRA on an mt3d model by HF module names: which mt3d linears (and which of their fused parts) a
PEFT ``target_modules`` list names, adapters attached to them on every rank, the base frozen.

Targets are resolved from the config alone (the model built on the meta device, its linears' HF
names read from the family's tensor table, ``families.*.pieces``), so bad input is refused in one
line before any weight is read. A name matches as PEFT matches it: the HF module's full name equals
the target or ends with ``.target``; a string target is a regular expression over full names, and
``"all-linear"`` is every linear of the transformer blocks (the output layer excluded, as PEFT).
Routed experts and routers have HF names but no adapters: targeting them is refused by name.

Adapter parameters are named ``<linear>.lora.<hf leaf>.A`` / ``.B`` (e.g. ``3.attn.qkv.lora.q_proj.A``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.lora import Adapter, LoraSpec, is_adapter_param
from ..parallel.state import AxisGroup
from .config import ModelConfig
from .sharding import ParamLayout, cache_key, role_of, split_name

ALL_LINEAR = "all-linear"
ROUTER = "a router (its scores choose experts; LoRA is not built for it)"
REPLICATED = "a replicated latent down-projection of latent attention (LoRA is not built for it)"


class LoraError(UserError):
    """A LoRA config or adapter mt3d cannot use; one line naming the key, module or file."""


@dataclass(frozen=True)
class Target:
    """One HF module's adapter: on mt3d linear ``module`` (global name), covering its fused parts
    ``first .. first + len(parts) - 1``."""

    module: str
    key: str
    hf: str
    column: bool
    in_features: int
    out_features: int
    parts: tuple[int, ...]
    first: int
    base_parts: tuple[int, ...]
    transposed: bool

    @property
    def a_layout(self) -> ParamLayout:
        """A's TP split: whole on a column base, split by input on a row base."""
        return ParamLayout() if self.column else ParamLayout(1)

    @property
    def b_layout(self) -> ParamLayout:
        """B's TP split: by output (per part) on a column base, whole on a row base."""
        return ParamLayout(0, self.parts if len(self.parts) > 1 else None) if self.column else ParamLayout()

    def local_offset(self, tp: int) -> int:
        """Where its output starts among this rank's output columns of the base."""
        return sum(p // tp for p in self.base_parts[: self.first])

    @property
    def names(self) -> tuple[str, str]:
        """Global names of its A and B."""
        return f"{self.module}.lora.{self.key}.A", f"{self.module}.lora.{self.key}.B"


@dataclass(frozen=True)
class Catalog:
    """Every HF module of a model's blocks: the adaptable ones and, by name, the ones that are not."""

    linears: tuple[Target, ...]
    refused: dict  # hf full name -> why it has no adapter


@functools.lru_cache(maxsize=16)
def _catalog(key: str, vocab: int) -> Catalog:
    from ..model.moe import Router, expert_index
    from ..parallel.layers import ReplicatedLinear
    from .blocks import BuildContext
    from .hf import pieces
    from .pipeline import StackedModel, layer_specs

    cfg = ModelConfig.from_dict(json.loads(key))
    ctx = BuildContext(tp=AxisGroup.alone("tp"), skip_init=True)
    with torch.device("meta"):
        model = StackedModel(layer_specs(cfg, ctx, vocab))
    linears, refused = [], {}
    for name, m in model.named_modules():
        head = name.split(".", 1)[0]
        if not head.isdigit() or role_of(cfg, int(head)) != "block":
            continue
        if isinstance(m, ReplicatedLinear):  # routers; latent attention's down projections
            why = ROUTER if isinstance(m, Router) else REPLICATED
            for p in pieces(cfg, name + ".weight"):
                refused[p.name.rsplit(".", 1)[0]] = why
            continue
        if not isinstance(m, ColumnParallelLinear | RowParallelLinear):
            continue
        got = pieces(cfg, name + ".weight")
        base_parts = m.parts if isinstance(m, ColumnParallelLinear) else (m.out_features,)
        if len(got) == 1 < len(base_parts):  # one HF tensor holding every part (Qwen3.5's in_proj_qkv)
            got = got * len(base_parts)
        if expert_index(name) is not None:
            for p in got:
                refused[p.name.rsplit(".", 1)[0]] = "a routed expert (LoRA on routed experts is not built)"
            continue
        column = isinstance(m, ColumnParallelLinear)
        if len(got) != len(base_parts):
            raise LoraError(f"{name}: {len(got)} HF tensors for {len(base_parts)} fused parts")
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(got):
            groups.setdefault(p.name.rsplit(".", 1)[0], []).append(i)
        for hf, idx in groups.items():
            parts = tuple(base_parts[i] for i in idx)
            linears.append(Target(name, hf.rsplit(".", 1)[1], hf, column, m.in_features, sum(parts), parts,
                                  idx[0], tuple(base_parts), got[idx[0]].transpose))  # fmt: skip
    return Catalog(tuple(linears), refused)


def catalog(cfg: ModelConfig, vocab: int) -> Catalog:
    """Every HF module of ``cfg``'s blocks, adaptable or not (built once per config, on the meta device)."""
    return _catalog(cache_key(cfg), vocab)


def _matches(hf: str, target) -> bool:
    if isinstance(target, str):
        return target == ALL_LINEAR or re.fullmatch(target, hf) is not None
    return any(hf == t or hf.endswith("." + t) for t in target)


def resolve(cfg: ModelConfig, vocab: int, target_modules) -> list[Target]:
    """The adapters ``target_modules`` (PEFT's list, regex string or "all-linear") asks for on ``cfg``;
    refuses, in one line, names the family does not have, names of modules without adapters and a
    selection that matches nothing."""
    cat = catalog(cfg, vocab)
    family = f"family {cfg.family!r}"
    if isinstance(target_modules, list):
        if not target_modules:
            raise LoraError("mt3d.lora.target_modules is empty: name HF modules to adapt, or 'all-linear'")
        leaves = {t.key for t in cat.linears} | {h.rsplit(".", 1)[1] for h in cat.refused}
        known = sorted({t.key for t in cat.linears})
        for t in target_modules:
            bad = [h for h in cat.refused if h == t or h.endswith("." + t)]
            if bad and not any(x.hf == t or x.hf.endswith("." + t) for x in cat.linears):
                raise LoraError(f"mt3d.lora.target_modules: {t!r} ({bad[0]}) is {cat.refused[bad[0]]}")
            if not any(x.hf == t or x.hf.endswith("." + t) for x in cat.linears):
                hint = "" if t in leaves else f"; its linear modules: {', '.join(known)}"
                raise LoraError(f"mt3d.lora.target_modules: {t!r} is not a linear module of {family}{hint}")
    elif target_modules != ALL_LINEAR:
        try:
            re.compile(target_modules)
        except re.error as e:
            why = f"mt3d.lora.target_modules: {target_modules!r} is not a regular expression ({e})"
            raise LoraError(why) from None
        bad = [h for h in cat.refused if re.fullmatch(target_modules, h)]
        if bad:
            why = cat.refused[bad[0]]
            raise LoraError(f"mt3d.lora.target_modules: {target_modules!r} matches {bad[0]}, {why}")
    chosen = [t for t in cat.linears if _matches(t.hf, target_modules)]
    if not chosen:
        raise LoraError(f"mt3d.lora.target_modules {target_modules!r} matches no linear module of {family}")
    return chosen


def attach(model: nn.Module, targets: list[Target], spec: LoraSpec, tp: AxisGroup, *, seed: int,
           tracker=None, init: bool = True) -> int:  # fmt: skip
    """Add the adapters of ``targets`` that live on this rank (its pipeline stage) to ``model``'s
    linears and freeze every other parameter; returns the number of adapters added. A's init depends
    on (seed, target) only, so every layout starts from the same adapters."""
    from .blocks import BuildContext

    modules = dict(model.named_modules())
    ctx = BuildContext(tp=tp, seed=seed, skip_init=not init)
    fork = tracker.fork if tracker is not None else None
    added = 0
    for t in targets:
        m = modules.get(t.module)
        if m is None:  # another pipeline stage's
            continue
        p = next(m.parameters())
        layer = split_name(t.module + ".x")[0]
        std = (3 * t.in_features) ** -0.5
        init = ctx.init(layer, f"lora.{t.hf}", std)
        m.lora[t.key] = Adapter(spec, column=t.column, in_features=t.in_features, parts=t.parts,
                                offset=t.local_offset(tp.size), tp=tp, init=init, dtype=torch.float32,
                                device=p.device, tracker_fork=fork)  # fmt: skip
        added += 1
    for p in model.parameters():
        p.requires_grad_(is_adapter_param(p))
    return added


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run ``model`` as its frozen base: every linear's adapters set aside for the block (DPO's
    reference with LoRA, as PEFT's ``disable_adapter``)."""
    held = [(m, m.lora) for m in model.modules() if isinstance(getattr(m, "lora", None), nn.ModuleDict)]
    held = [(m, adapters) for m, adapters in held if len(adapters)]
    try:
        for m, _ in held:
            m.lora = nn.ModuleDict()
        yield
    finally:
        for m, adapters in held:
            m.lora = adapters


def universal_patterns(info: dict, targets: list[Target], tp: int) -> dict:
    """DeepSpeed universal-checkpoint patterns (``sharding.universal_info``'s ``info``) of a LoRA run:
    the adapters' splits only (DeepSpeed's strict conversion refuses patterns that match no trained
    parameter, and the frozen base is not in the checkpoint): column A and row B replicated, row A
    split by input (dim 1), column B by output per fused part (the default split, or sub-parameters
    when it covers several parts)."""
    out = {k: ([] if isinstance(v, list) else {} if isinstance(v, dict) else v) for k, v in info.items()}
    for t in targets:
        a, b = (re.escape(n) + "$" for n in t.names)
        out["tp_replicated_parameter_patterns"].append(a if t.column else b)
        if not t.column:
            out["parameter_with_row_parallelism_patterns"].append(a)
        elif len(t.parts) > 1:
            out["parameter_with_sub_params"].append(
                {"patterns": [b], "shape": (t.parts, -1), "partition_dim": 0}
            )
            out["sub_param_shard_widths"][b] = [[size // tp] * tp for size in t.parts]
    return out


def trainable_count(targets: list[Target], spec: LoraSpec) -> int:
    """Adapter parameters of the whole model (what ``peft``'s ``get_peft_model`` reports trainable)."""
    return sum(spec.r * (t.in_features + t.out_features) for t in targets)
