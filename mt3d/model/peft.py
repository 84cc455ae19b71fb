"""PEFT's LoRA adapter directories, in and out, and the fingerprint that ties adapters to their base.

A PEFT LoRA adapter is ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``lora_dropout``, ``target_modules``, ``use_rslora``, ``fan_in_fan_out`` for GPT-2's Conv1D) and
``adapter_model.safetensors`` with ``base_model.model.<HF module>.lora_A.weight`` [r, in] and
``.lora_B.weight`` [out, r] per adapted module (unsharded, HF orientation; fused mt3d linears hold
one adapter per HF module, so the names map one to one).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from pathlib import Path

import torch

from ..parallel.lora import LoraSpec
from .lora import ALL_LINEAR, LoraError, Target, resolve

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
DEFAULTS = {"r": 8, "dropout": 0.0, "rslora": False}


FULL = "sha256:"
"""The prefix of a fingerprint over whole files (``fingerprint``); one without it is the sampled
fingerprint checkpoints recorded before (``sampled_fingerprint``)."""


def fingerprint(hf_dir: str | Path) -> str:
    """The identity of an HF model's weights: sha256 over each safetensors file's name and the sha256
    of its whole content, so any byte changed anywhere is another base. Each file is read once per
    version (``inputs.cached_digest``: cached by path, size, inode and mtime; the ranks of a host
    share the work): a 70B base costs a minute or so the first time, nothing after."""
    from ..data.corpora import cache_root
    from ..inputs import cached_digest

    h = hashlib.sha256()
    for f in _weight_files(hf_dir):
        h.update(f"{f.name}:{cached_digest(f, cache_root())}|".encode())
    return FULL + h.hexdigest()


def sampled_fingerprint(hf_dir: str | Path) -> str:
    """The fingerprint of checkpoints made before ``FULL``: sha256 over each safetensors file's name,
    size, header and first and last MiB of data (a change in between went unseen)."""
    h = hashlib.sha256()
    for f in _weight_files(hf_dir):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = fh.read(n)
            head = fh.read(1 << 20)
            fh.seek(max(8 + n, size - (1 << 20)))
            tail = fh.read()
        h.update(f"{f.name}:{size}:".encode() + header + head + tail)
    return h.hexdigest()


def same_base(recorded: str | None, hf_dir: str | Path) -> bool:
    """Whether ``hf_dir`` holds the weights a checkpoint recorded the ``fingerprint`` of (either kind)."""
    if not recorded:
        return False
    return recorded == (fingerprint(hf_dir) if recorded.startswith(FULL) else sampled_fingerprint(hf_dir))


def _weight_files(hf_dir: str | Path) -> list[Path]:
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise LoraError(f"{hf_dir}: no *.safetensors files to fingerprint the base model by")
    return files


def read_config(adapter_dir: str | Path) -> dict:
    """A PEFT LoRA adapter's config (checked: LORA, the files present, no bias or modules_to_save)."""
    d = Path(adapter_dir)
    for name in (CONFIG, WEIGHTS):
        if not (d / name).is_file():
            raise LoraError(f"{d}: no {name} (a PEFT adapter directory holds {CONFIG} and {WEIGHTS})")
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{d / CONFIG}: not readable JSON ({e})") from None
    if cfg.get("peft_type") != "LORA":
        raise LoraError(f"{d / CONFIG}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, off in (("bias", "none"), ("modules_to_save", None), ("use_dora", False)):
        if cfg.get(key, off) not in (off, [], False):
            raise LoraError(f"{d / CONFIG}: {key}={cfg[key]!r} is not supported by mt3d's LoRA ({off!r})")
    for key in ("layers_to_transform", "rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraError(f"{d / CONFIG}: {key} is not supported by mt3d's LoRA (one r and alpha for all)")
    return cfg


def settings(lora, adapter: dict | None, where: str = "mt3d.lora") -> tuple[LoraSpec, object]:
    """(LoraSpec, target_modules) from the config section ``lora`` (``LoraConfig``) and, with
    ``from_adapter``, that adapter's config: keys set in both must agree."""
    mine = {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "rslora": lora.rslora,
            "target_modules": lora.target_modules}  # fmt: skip
    if adapter is not None:
        theirs = {"r": adapter.get("r"), "alpha": adapter.get("lora_alpha"),
                  "dropout": adapter.get("lora_dropout"), "rslora": adapter.get("use_rslora"),
                  "target_modules": adapter.get("target_modules")}  # fmt: skip
        for k, v in theirs.items():
            if v is None:
                continue
            if mine[k] is not None and mine[k] != v and not (k == "target_modules" and _same_set(mine[k], v)):
                raise LoraError(f"{where}.{k}={mine[k]!r} differs from the adapter's {v!r} "
                                f"({lora.from_adapter}): drop the key or make them agree")  # fmt: skip
            mine[k] = v
    r = DEFAULTS["r"] if mine["r"] is None else mine["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraError(f"{where}.r must be a positive integer, got {r!r}")
    alpha = r if mine["alpha"] is None else mine["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        raise LoraError(f"{where}.alpha must be a positive finite number, got {alpha!r}")
    dropout = DEFAULTS["dropout"] if mine["dropout"] is None else mine["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise LoraError(f"{where}.dropout must be in [0, 1), got {dropout!r}")
    targets = mine["target_modules"]
    if targets is None:
        raise LoraError(f"{where}.target_modules is required: HF module names such as "
                        '["q_proj", "v_proj"], or "all-linear"')  # fmt: skip
    if isinstance(targets, list) and not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{where}.target_modules must be a list of module names or a string, got {targets!r}")
    return LoraSpec(r, float(alpha), float(dropout), bool(mine["rslora"] or False)), targets


def _shape_cause(got, want: tuple[int, int], which: str, r: int) -> str:
    """Why an adapter tensor has another shape: a rank other than its own config's ``r`` (the base's
    dimension matches), or another base model."""
    rank_dim = 0 if which == "A" else 1
    if len(got) == 2 and got[1 - rank_dim] == want[1 - rank_dim] and got[rank_dim] != r:
        return (f"its rank is {got[rank_dim]} but its {CONFIG} says r {r}: the adapter's config does not "
                "match its own weights (fix r there)")  # fmt: skip
    return "the adapter was made for another base model"


def _same_set(a, b) -> bool:
    return isinstance(a, list) and isinstance(b, list) and set(a) == set(b)


def read_adapter(adapter_dir: str | Path, targets: list[Target], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The unsharded A and B of every target (by the targets' global names) from a PEFT adapter;
    refuses an adapter for another base: modules the model does not have, shapes that differ."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    try:
        tensors = load_file(str(d / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{d / WEIGHTS}: not a readable safetensors file ({e})") from None
    tensors = {k.replace(".default.", "."): v for k, v in tensors.items()}
    out, used = {}, set()
    for t in targets:
        a_name, b_name = t.names
        want = (("A", a_name, (spec.r, t.in_features)), ("B", b_name, (t.out_features, spec.r)))
        for which, name, shape in want:
            key = f"{PREFIX}{t.hf}.lora_{which}.weight"
            if key not in tensors:
                raise LoraError(f"{d}: no {key}: the adapter was made for another base or other targets")
            v = tensors[key]
            if tuple(v.shape) != shape:
                raise LoraError(f"{d}: {key} has shape {tuple(v.shape)}, this base needs {shape}: "
                                + _shape_cause(v.shape, shape, which, spec.r))  # fmt: skip
            if not v.is_floating_point() or not torch.isfinite(v).all():
                raise LoraError(f"{d}: {key} holds non-finite or non-float values")
            out[name] = v.float()
            used.add(key)
    extra = sorted(set(tensors) - used)
    if extra:
        raise LoraError(f"{d}: {len(extra)} tensor(s) this base has no module for (e.g. {extra[0]}): "
                        "the adapter was made for another base model or other target modules")  # fmt: skip
    return out


def write_adapter(out_dir: str | Path, targets: list[Target], full: dict[str, torch.Tensor], spec: LoraSpec,
                  target_modules, base: str | None, fp: str | None = None) -> Path:  # fmt: skip
    """Write a PEFT adapter directory (nothing left half-written: a temporary directory renamed into
    place). ``full``: unsharded A and B by the targets' global names."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise LoraError(f"{out} exists and is not empty; choose a new directory (nothing was written)")
    if target_modules == ALL_LINEAR:  # written out, as PEFT does
        target_modules = sorted({t.key for t in targets})
    tensors = {}
    for t in targets:
        a_name, b_name = t.names
        tensors[f"{PREFIX}{t.hf}.lora_A.weight"] = full[a_name].contiguous()
        tensors[f"{PREFIX}{t.hf}.lora_B.weight"] = full[b_name].contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "use_rslora": spec.rslora,
        "target_modules": target_modules,
        "fan_in_fan_out": any(t.transposed for t in targets),
        "bias": "none",
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    tmp = out.with_name(out.name + ".tmp-adapter")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", **({"mt3d_base": fp} if fp else {})})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def plan(lora, cfg, vocab: int) -> tuple[LoraSpec, list[Target]]:
    """The spec and targets of config section ``lora`` on model ``cfg``: every check that needs no
    weight (the adapter's config read, its tensors not yet)."""
    adapter = read_config(lora.from_adapter) if lora.from_adapter else None
    spec, target_modules = settings(lora, adapter)
    targets = resolve(cfg, vocab, target_modules)
    check_rank(spec.r, targets, "mt3d.lora.r")
    return spec, targets


def check_rank(r: int, targets: list[Target], where: str) -> None:
    """Refuse a rank above min(in, out) of the smallest adapted linear before any adapter is made:
    its update's rank cannot exceed that, and a mistyped r (1e9) would allocate until memory ends."""
    small = min(targets, key=lambda t: min(t.in_features, t.out_features))
    most = min(small.in_features, small.out_features)
    if r > most:
        shape = f"{small.hf}: {small.in_features} -> {small.out_features}"
        raise LoraError(f"{where} {r} is above min(in, out) = {most} of the smallest adapted linear "
                        f"({shape}): use r <= {most}")  # fmt: skip
