"""``mt3d export-hf``: an HF transformers directory from an mt3d checkpoint of any layout.

The checkpoint's shards are gathered into unsharded tensors (``CheckpointReader``), renamed and
split into the family's HF tensors (``hf.hf_state_dict``), loaded into the transformers model on
the meta device (so a missing or extra tensor is an error before anything is written), and saved
with the tokenizer into a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..model.families import get_family
from ..model.hf import HFError, hf_config_dict, hf_state_dict
from ..model.sharding import global_names
from .loading import open_source


def _checkpoint_dir(path: str | Path) -> Path:
    """A ``step_XXXXXXXX`` directory, or a run directory's newest complete checkpoint."""
    from .manager import newest_complete

    p = Path(path)
    if (p / "manifest.json").is_file():
        return p
    found = newest_complete(p) if p.is_dir() else None
    if found is None:
        raise HFError(f"{p} is not an mt3d checkpoint or a run directory with one")
    return found


MTP_FILE = "model-mtp.safetensors"
"""Where an export keeps the multi-token-prediction layers (``model.mtp``), listed in the index beside
transformers' files: transformers' models have no such modules, so their ``save_pretrained`` cannot
write them (vLLM and SGLang read them from the index's files)."""


def mtp_tensor_names(cfg, vocab: int) -> list[str]:
    """The HF names of the MTP layers' tensors (none without ``model.mtp``)."""
    from ..model.hf import pieces
    from ..model.sharding import role_of, split_name

    names = [n for n in global_names(cfg, vocab) if role_of(cfg, split_name(n)[0]) == "mtp"]
    return list(dict.fromkeys(p.name for n in names for p in pieces(cfg, n)))


def add_tensors(out: Path, tensors: dict, file_name: str) -> None:
    """Write ``tensors`` to ``out / file_name`` and list them in the safetensors index (made when
    ``save_pretrained`` wrote one file)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / file_name), metadata={"format": "pt"}
    )
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
    else:
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            data = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    data["weight_map"].update(dict.fromkeys(tensors, file_name))
    index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def export_hf(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "5GB",
              adapter_only: bool = False) -> Path:  # fmt: skip
    """Write an HF directory (config.json, safetensors, tokenizer) from an mt3d checkpoint of any layout;
    a LoRA run's merged into its base, or with ``adapter_only`` its adapters as a PEFT directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise HFError(f"{out} exists and is not empty; choose a new directory (nothing was written)")
    if adapter_only:
        from .lora import export_adapter
        from .reader import CheckpointReader

        return export_adapter(CheckpointReader(_checkpoint_dir(checkpoint)), out)
    source = open_source(checkpoint)
    if source.kind != "checkpoint" and source.lora_checkpoint is None:
        raise HFError(f"{checkpoint} is not an mt3d checkpoint (export-hf converts mt3d checkpoints)")
    cfg, vocab = source.cfg, source.vocab
    eos = None
    if source.tokenizer_dir and Path(source.tokenizer_dir).is_dir():
        from ..data.tokenizer import load_tokenizer

        eos = load_tokenizer(source.tokenizer_dir).eos_id
    cfg_dict = hf_config_dict(cfg, vocab, eos)  # refuses a family with no HF form before any read
    full = {name: source.full(name) for name in global_names(cfg, vocab)}
    family = get_family(cfg.family)
    state = family.in_memory(cfg, hf_state_dict(cfg, vocab, full))
    mtp = {name: state.pop(name) for name in mtp_tensor_names(cfg, vocab)}  # not in transformers' model
    mtp.update(family.mtp_copies(cfg, state))
    kind = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(kind, **{k: v for k, v in cfg_dict.items() if k != "transformers_version"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise HFError(f"export mapping mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    if cfg.tie_embeddings:
        model.tie_weights()
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        if mtp:
            add_tensors(tmp, mtp, MTP_FILE)
        if source.tokenizer_dir and Path(source.tokenizer_dir).is_dir():
            from ..data.tokenizer import copy_tokenizer

            copy_tokenizer(source.tokenizer_dir, tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left behind
        raise
    return out
