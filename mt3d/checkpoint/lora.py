"""LoRA adapters outside training: read from a LoRA run's checkpoint or a PEFT directory, merged into
their base's weights (``WeightSource.adapters``), or written as a PEFT directory (``export-hf
--adapter-only``).

A LoRA checkpoint holds the adapters (and their optimizer states) only; its manifest's
``meta["lora"]`` names the base HF directory and its fingerprint (``mt3d.model.peft.fingerprint``),
checked before the base is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.schema import LoraConfig
from ..model.lora import LoraError, Target, resolve
from ..model.peft import check_rank, read_adapter, read_config, same_base, settings, write_adapter
from ..model.sharding import from_shards, layout_of, to_shard
from ..parallel.lora import LoraSpec


@dataclass
class AdapterSet:
    """Unsharded adapters of a model: A and B by the targets' global names."""

    spec: LoraSpec
    targets: list[Target]
    tensors: dict[str, torch.Tensor]
    target_modules: object

    def delta(self, cfg, vocab: int, name: str) -> torch.Tensor | None:
        """The full ``s B A`` to add to base weight ``name`` (None: not adapted)."""
        mine = [t for t in self.targets if t.module + ".weight" == name]
        if not mine:
            return None
        t0 = mine[0]
        out = torch.zeros(sum(t0.base_parts), t0.in_features, dtype=torch.float64)
        for t in mine:
            a, b = (self.tensors[n].double() for n in t.names)
            start = sum(t.base_parts[: t.first])
            out[start : start + t.out_features] += b @ a * self.spec.scale
        return out

    def merged_shard(self, cfg, vocab: int, name: str, base: torch.Tensor, rank: int, world: int):
        """``base`` (TP rank ``rank`` of ``world``'s shard of ``name``) with its adapters merged in."""
        d = self.delta(cfg, vocab, name)
        if d is None:
            return base
        return (base.double() + to_shard(d, layout_of(cfg, vocab, name), rank, world)).to(base.dtype)


def _spec_of(saved: dict, where: str) -> tuple[LoraSpec, object]:
    keys = ("r", "alpha", "dropout", "rslora", "target_modules")
    return settings(LoraConfig(**{k: saved.get(k) for k in keys}), None, where)


def from_checkpoint(reader) -> AdapterSet:
    """The adapters of a LoRA checkpoint (``CheckpointReader``), unsharded from its TP ranks' files."""
    saved = reader.meta["lora"]
    spec, target_modules = _spec_of(saved, f"{reader.dir}/manifest.json lora")
    targets = resolve(reader.cfg, reader.vocab, target_modules)
    tensors = {}
    for t in targets:
        for name, layout in zip(t.names, (t.a_layout, t.b_layout), strict=True):
            tensors[name] = from_shards([reader._local(name, r) for r in range(reader.tp)], layout).float()
    return AdapterSet(spec, targets, tensors, target_modules)


def from_peft(adapter_dir: str | Path, cfg, vocab: int) -> AdapterSet:
    """A PEFT LoRA adapter directory for model ``cfg`` (refused in one line when made for another base)."""
    config = read_config(adapter_dir)
    spec, target_modules = settings(LoraConfig(from_adapter=str(adapter_dir)), config, "--adapter")
    targets = resolve(cfg, vocab, target_modules)
    check_rank(spec.r, targets, f"{adapter_dir}: r")
    return AdapterSet(spec, targets, read_adapter(adapter_dir, targets, spec), target_modules)


def checked_base(reader) -> Path:
    """The base HF directory a LoRA checkpoint references, refused unless its fingerprint matches."""
    saved = reader.meta["lora"]
    base = saved.get("base")
    if not base:
        raise LoraError(f"{reader.dir}: this LoRA run trained on a preset model (no HF base directory): "
                        "export its adapter with --adapter-only")  # fmt: skip
    if not Path(base).is_dir():
        raise LoraError(f"{reader.dir}: its base model {base} is missing: LoRA checkpoints hold the adapters "
                        "only, the base is read from there")  # fmt: skip
    if not same_base(saved.get("fingerprint"), base):
        raise LoraError(f"{reader.dir}: the base model at {base} is not the one its adapters were trained on "
                        "(fingerprint changed)")  # fmt: skip
    return Path(base)


def export_adapter(reader, out_dir: str | Path) -> Path:
    """``export-hf --adapter-only``: a LoRA checkpoint's adapters as a PEFT directory."""
    if "lora" not in reader.meta:
        raise LoraError(f"{reader.dir} is not a LoRA run's checkpoint: --adapter-only exports adapters")
    adapters = from_checkpoint(reader)
    base = reader.meta["lora"].get("base")
    return write_adapter(out_dir, adapters.targets, adapters.tensors, adapters.spec, adapters.target_modules,
                         base, reader.meta["lora"].get("fingerprint"))  # fmt: skip
