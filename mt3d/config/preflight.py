"""What the machine must offer a run before any process group exists: its files and directories
(data, tokenizer, resume checkpoint, writable run and cache directories) and its device (fp16)."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError
from .schema import DataConfig, TrainConfig


def writable_dir(path: str | Path, what: str) -> None:
    """``path`` is, or can become, a directory this process can write (probed with a real file)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{what} {p} exists and is not a directory")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {p}: {existing} is not a directory")
    probe = existing / f".mt3d-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{what} {p} is not writable ({e.strerror} in {existing}); choose another"
        ) from None


def check_inputs(train: TrainConfig, data: DataConfig, hf_path: str | None = None) -> None:
    """The files a run reads exist and can make its samples: the resume checkpoint, indexed data and
    its tokenizer (``data.tokenizer``, else the one the data were made with or the ``from_hf``
    model's ``hf_path``: filled in), each split it reads (``check_datasets``)."""
    if train.resume not in ("none", "auto") and not Path(train.resume).exists():
        raise ConfigError(f"mt3d.train.resume: checkpoint not found: {train.resume}")
    ref = train.dpo.reference_model if train.dpo is not None else None
    if ref is not None and not Path(ref).exists():
        raise ConfigError(
            f"mt3d.train.dpo.reference_model: not found: {ref} (an HF directory or mt3d checkpoint)"
        )
    if data.corpus != "indexed" and train.objective == "dpo":
        raise ConfigError(
            f"mt3d.data.corpus {data.corpus!r} holds no preference pairs: train.objective 'dpo' reads "
            "corpus 'indexed' made by mt3d preprocess --format preference"
        )
    if data.corpus != "indexed":
        return
    if not data.prefixes:
        raise ConfigError("mt3d.data.prefixes is empty: corpus 'indexed' needs .bin/.idx prefixes")
    for pre in data.prefixes:
        for ext in (".bin", ".idx"):
            if not Path(pre + ext).is_file():
                raise ConfigError(f"mt3d.data.prefixes: {pre + ext} not found (run 'mt3d preprocess' first)")
    if data.tokenizer is None:
        data.tokenizer = recorded_tokenizer(data.prefixes, hf_path)
    if not Path(data.tokenizer).is_dir():
        raise ConfigError(f"mt3d.data.tokenizer: tokenizer directory not found: {data.tokenizer}")
    check_datasets(data, evaluates=train.eval_batches > 0, pairs=train.objective == "dpo")


def recorded_tokenizer(prefixes: list[str], hf_path: str | None) -> str:
    """The tokenizer of a run that names none: the one ``mt3d preprocess`` recorded in the prefixes'
    ``P.meta.json`` (all the same), else the ``from_hf`` model directory's own."""
    from ..data.indexed import read_meta

    recorded = {read_meta(pre).get("tokenizer") for pre in prefixes} - {None}
    if len(recorded) > 1:
        raise ConfigError(
            f"mt3d.data.tokenizer is not set and the prefixes were made with {len(recorded)} tokenizers "
            f"({', '.join(sorted(recorded))}): set mt3d.data.tokenizer"
        )
    if recorded and Path(next(iter(recorded))).is_dir():
        return next(iter(recorded))
    if hf_path and (Path(hf_path) / "tokenizer.json").is_file():
        return hf_path
    where = f"the recorded {next(iter(recorded))} is gone" if recorded else "none is recorded with the data"
    raise ConfigError(f"mt3d.data.tokenizer is not set and {where}: set mt3d.data.tokenizer to the tokenizer "
                      "directory the data were preprocessed with")  # fmt: skip


SPLITS = ("train", "validation", "test")


def check_datasets(data: DataConfig, evaluates: bool, pairs: bool = False) -> None:
    """Each split a run reads (train; validation when it evaluates) of every indexed prefix can make
    a sample, and a dataset with loss masks supervises some token: one line naming the prefix, the
    split and the fix, before any process group (every rank finds the same). ``pairs``: DPO's data,
    one preference dataset."""
    from ..data.indexed import IndexedDataset
    from ..data.packing import all_too_long, packs
    from ..data.preference import pair_data_conflict
    from ..data.samples import split_documents

    why = pair_data_conflict(data.prefixes, data.seq_len) if pairs else None
    if why:
        raise ConfigError(f"mt3d.data.prefixes: {why}")
    datasets = [IndexedDataset(pre) for pre in data.prefixes]
    packed = packs(data, datasets)
    for pre, ds in zip(data.prefixes, datasets, strict=True):
        if ds.has_mask and not supervises(pre, ds):
            raise ConfigError(f"mt3d.data.prefixes: {pre} has no supervised token (its loss mask is all "
                              "0), so there is nothing to train on: preprocess it again with a chat template "
                              "that marks the replies")  # fmt: skip
        lengths = ds.doc_lengths()
        if packed:
            why = all_too_long(pre, lengths, data.seq_len)
            if why:
                raise ConfigError(f"mt3d.data.prefixes: {why.replace('data.seq_len', 'mt3d.data.seq_len')}")
        for i, part in enumerate(split_documents(len(ds), data.split)[: 2 if evaluates else 1]):
            why = _split_short(lengths[part], data.seq_len, packed)
            if why:
                fix = "shorten mt3d.data.seq_len or add data"
                if i == 1:
                    fix = (f"raise mt3d.data.split[1], {fix}, or evaluate nothing "
                           "(mt3d.train.eval_batches=0, and split [w, 0, 0])")  # fmt: skip
                raise ConfigError(f"mt3d.data.prefixes: {pre}'s {SPLITS[i]} split (split {data.split}) "
                                  f"{why}: {fix}")  # fmt: skip


def _split_short(lengths, seq_len: int, packed: bool) -> str | None:
    """Why documents of these lengths cannot make one sample (None: they can)."""
    if lengths.size == 0:
        return "holds no document"
    if packed and not (lengths <= seq_len).any():
        return f"holds {lengths.size} documents, none of at most seq_len {seq_len} tokens"
    if not packed and int(lengths.sum()) - 1 < seq_len:
        return f"holds {lengths.size} documents, {int(lengths.sum())} tokens: not one sample of {seq_len + 1}"
    return None


def supervises(prefix: str, ds, block: int = 1 << 24) -> bool:
    """Whether a dataset's loss mask has a 1: the count ``mt3d preprocess`` recorded, else a scan
    that stops at the first supervised token (the first block, for any real dataset)."""
    from ..data.indexed import read_meta

    recorded = read_meta(prefix).get("supervised_tokens")
    if isinstance(recorded, int):
        return recorded > 0
    return any(ds.read_mask(a, min(a + block, ds.num_tokens)).any() for a in range(0, ds.num_tokens, block))


def check_outputs(train: TrainConfig, data: DataConfig) -> None:
    """Where the run writes must be writable, and a fresh run does not mix into another run's record."""
    writable_dir(train.save_dir, "mt3d.train.save_dir")
    if data.cache_dir:
        writable_dir(data.cache_dir, "mt3d.data.cache_dir")
    found = previous_run(train.save_dir) if train.resume in ("none", "auto") and not train.overwrite else None
    if found and train.resume == "none":
        raise ConfigError(
            f"mt3d.train.save_dir {train.save_dir} holds another run ({found}): continue it with "
            "mt3d.train.resume=auto, start afresh there with mt3d.train.overwrite=true (its files are moved "
            "to replaced/, not deleted), or choose another save_dir"
        )
    if found and not _resumable(train.save_dir):  # resume auto would start afresh into the old record
        raise ConfigError(
            f"mt3d.train.save_dir {train.save_dir} holds another run ({found}) but no complete checkpoint to "
            "resume (superseded or incomplete ones only): resume one by its path, start afresh with "
            "mt3d.train.overwrite=true (its files are moved to replaced/), or choose another save_dir"
        )


def _resumable(save_dir: str | Path) -> bool:
    """Whether ``save_dir`` holds a complete checkpoint (one with its ``manifest.json``: the mark
    ``mt3d.checkpoint.manifest`` writes last) that ``resume: auto`` would continue."""
    return any((d / "manifest.json").is_file() for d in (Path(save_dir) / "checkpoints").glob("step_*"))


def previous_run(save_dir: str | Path) -> str | None:
    """What of an earlier run ``save_dir`` holds (checkpoints, metrics), or None when nothing."""
    d = Path(save_dir)
    found = []
    ckpts = d / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step_") or p.name == "superseded" for p in ckpts.iterdir()):
        found.append("checkpoints")
    metrics = d / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return " and ".join(found) or None


def fp16_supported() -> bool:
    """Whether DeepSpeed can train in fp16 here (any CUDA GPU, or a CPU with fp16 support in oneDNN)."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def check_device(precision: str, fp8: bool = False) -> None:
    """The device can train in ``precision`` (and run FP8 GEMMs, with ``fp8``)."""
    if precision == "fp16" and not fp16_supported():
        raise ConfigError(
            "fp16 is not supported on this device (DeepSpeed's CPU accelerator needs AVX512-FP16/AMX); "
            "use bf16.enabled or fp32, or run on a GPU"
        )
    if fp8:
        import torch

        from ..parallel.fp8 import fp8_support

        why = fp8_support(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        if why:
            raise ConfigError(f"mt3d.train.fp8: {why}; remove mt3d.train.fp8 to train in bf16")


ACCELERATE_KEYS = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": ("zero_stage", "zero_optimization.stage", lambda ds: ds.zero_stage),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": (
        "offload_optimizer_device",
        "zero_optimization.offload_optimizer.device",
        lambda ds: ds.offload.optimizer,
    ),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": (
        "offload_param_device",
        "zero_optimization.offload_param.device",
        lambda ds: ds.offload.param,
    ),
}
"""DeepSpeed settings an accelerate yaml can carry (accelerate passes them to the ranks as variables):
mt3d reads DeepSpeed's settings from its --config alone, so a yaml that says otherwise is refused."""


def check_accelerate(ds) -> None:
    """Refuse DeepSpeed settings in an accelerate yaml that differ from the run config's (``ds``: its
    ``DeepSpeedSection``); equal ones are fine."""
    for var, (yaml_key, key, ours) in ACCELERATE_KEYS.items():
        given = (os.environ.get(var) or "").strip().lower()
        mine = str(ours(ds)).lower()
        if given and given != mine:
            raise ConfigError(
                f"the accelerate config sets {yaml_key}: {given} but the run config has {key} {mine}: "
                f"mt3d takes DeepSpeed's settings from --config only; drop {yaml_key} from the accelerate "
                "yaml or make them agree"
            )
