"""From a DataConfig to the micro-batches one rank reads at one step.

The global batch of step ``k`` is samples ``[k*B, (k+1)*B)`` of the sample sequence, cut into
``B / micro_batch`` micro-batches; data-parallel rank ``r`` reads micro-batches
``r*m ... r*m + m - 1`` (``m`` = gradient accumulation steps). So step ``k`` sees the same samples
whatever (tp, pp, dp), each DP rank reads only its own samples, and resuming at step ``k`` needs
nothing but ``k``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .corpora import builtin_corpus, cache_root, synthetic_corpus
from .indexed import IndexedDataset
from .packing import IGNORE, Packed, PackedDocuments, packed_batch, packs, pairs_in, supervised_and_real
from .samples import BlendedSamples, DataError, PackedSamples, split_documents
from .tokenizer import Tokenizer, load_tokenizer


@dataclass
class DataBundle:
    """The train and validation sample sequences, the tokenizer and facts about the corpus."""

    train: object
    valid: object
    tokenizer: Tokenizer
    info: dict


def build_data(cfg, seed: int, pairs: bool = False) -> DataBundle:
    """Build (or load from cache) the corpus and its sample sequences for a ``DataConfig``; ``pairs``:
    preference pairs for DPO (every dataset made by ``mt3d preprocess --format preference``), split
    and packed a pair at a time."""
    cache = cache_root(cfg.cache_dir)
    seed = cfg.seed if cfg.seed is not None else seed
    if cfg.corpus == "builtin":
        corpus = builtin_corpus(cfg.vocab_size, cfg.cache_dir, tokenizer_dir=cfg.tokenizer)
        prefixes, tok_dir, info = [corpus.prefix], corpus.tokenizer_dir, dict(corpus.info)
    elif cfg.corpus == "synthetic":
        corpus = synthetic_corpus(cfg.vocab_size, cache_dir=cfg.cache_dir)
        prefixes, tok_dir, info = [corpus.prefix], corpus.tokenizer_dir, dict(corpus.info)
    else:
        prefixes, tok_dir, info = list(cfg.prefixes), cfg.tokenizer, {"name": "indexed"}
    tokenizer = load_tokenizer(tok_dir)
    datasets = [IndexedDataset(p) for p in prefixes]
    too_big = [str(d.prefix) for d in datasets if d.max_id >= tokenizer.vocab_size]
    if too_big:
        raise DataError(
            f"{too_big[0]} holds ids outside the tokenizer's {tokenizer.vocab_size}-id vocabulary"
        )
    for d in datasets:  # the header's max id is only as good as the file: every read checks its ids
        d.vocab_limit = tokenizer.vocab_size
    if pairs:
        from .preference import pair_data_conflict

        why = pair_data_conflict(prefixes, cfg.seq_len)
        if why:
            raise DataError(why)
    splits = [split_documents(len(d) // 2 if pairs else len(d), cfg.split) for d in datasets]
    index_dir = cache / "indices"
    packed = pairs or packs(cfg, datasets)
    if packed:  # several documents per sample unless data.packing is false (one each, padded)
        source = functools.partial(PackedDocuments, pack=cfg.packing is not False, pairs=pairs)
    else:
        source = PackedSamples
    train = [source(d, s[0], cfg.seq_len, seed, index_dir) for d, s in zip(datasets, splits)]
    # a run that evaluates nothing may give the validation split no weight (split [w, 0, 0])
    valid = [source(d, s[1], cfg.seq_len, seed + 1, index_dir) if s[1].size else None
             for d, s in zip(datasets, splits)]  # fmt: skip
    weights = cfg.weights or [float(t.tokens_per_epoch) for t in train]
    info.update(
        prefixes=[str(p) for p in prefixes],
        tags=[d.tag.hex() for d in datasets],
        documents=[len(d) for d in datasets],
        tokens=[d.num_tokens for d in datasets],
        train_samples_per_epoch=[len(t) for t in train],
        valid_samples_per_epoch=[len(v) if v is not None else 0 for v in valid],
        packed=packed,
    )
    if packed:
        truncated = [t.truncated + getattr(v, "truncated", 0) for t, v in zip(train, valid, strict=True)]
        info.update(packing_efficiency=[round(t.efficiency, 4) for t in train], truncated_documents=truncated)
    if pairs:
        info.update(pairs=True, dropped_pairs=[t.dropped_pairs for t in train])
    if len(train) == 1:
        return DataBundle(train[0], valid[0], tokenizer, info)
    blend_dir = index_dir / "blends"
    blended_valid = BlendedSamples(valid, weights, blend_dir) if None not in valid else None
    return DataBundle(BlendedSamples(train, weights, blend_dir), blended_valid, tokenizer, info)


def micro_batch_ids(
    step: int, micro: int, *, global_batch: int, micro_batch: int, grad_accum: int, dp_rank: int
):
    """Sample ids of micro-batch ``micro`` of data-parallel rank ``dp_rank`` at ``step``."""
    first = step * global_batch + (dp_rank * grad_accum + micro) * micro_batch
    return range(first, first + micro_batch)


def to_batch(samples: list) -> tuple:
    """Stack samples of seq_len + 1 tokens into (inputs, labels), each [b, seq_len] int64; packed
    documents into ((inputs, document ids), labels) (``packing.packed_batch``)."""
    if samples and isinstance(samples[0], Packed):
        return packed_batch(samples)
    arr = torch.from_numpy(np.stack(samples))
    return arr[:, :-1].contiguous(), arr[:, 1:].contiguous()


def mtp_batch(ids: torch.Tensor, labels: torch.Tensor, documents, depths: int):
    """(ids [b, s, D], labels [b, s, D]) of multi-token prediction's D depths (``mt3d.model.mtp``) for a
    batch of whole sequences: depth k's input at position i is token i + k and its target label i + k
    (token i + k + 1), where position i + k is in the sequence and in i's document (``documents`` [b, s]
    of packed samples; None: one stream); elsewhere id 0 and the ignored label."""
    b, s = ids.shape
    out_ids = ids.new_zeros(b, s, depths)
    out_labels = labels.new_full((b, s, depths), IGNORE)
    for k in range(1, depths + 1):
        if k >= s:
            break
        keep = torch.ones(b, s - k, dtype=torch.bool)
        if documents is not None:
            keep = documents[:, k:] == documents[:, :-k]
        out_ids[:, : s - k, k - 1] = torch.where(keep, ids[:, k:], 0)
        out_labels[:, : s - k, k - 1] = torch.where(keep, labels[:, k:], IGNORE)
    return out_ids, out_labels


def step_targets(samples, step: int, global_batch: int) -> tuple[int, int, int]:
    """(supervised targets, real tokens, preference pairs) of the whole global batch of ``step`` (every
    rank reads it: the loss of packed data is normalised by the first, DPO's by the third,
    ``LossFn.step_weight``; the second is the packing efficiency's numerator)."""
    batch = [samples[i] for i in range(step * global_batch, (step + 1) * global_batch)]
    pairs = pairs_in(batch) if batch and batch[0].source is not None else 0
    return (*supervised_and_real(batch), pairs)


class StepBatches:
    """Iterator over one rank's micro-batches of consecutive steps, starting at ``start_step``.

    Yields ``(inputs, labels)`` for DeepSpeed's ``train_batch`` / ``eval_batch``. ``step`` is the
    step whose micro-batches come next, so the data position is saved and restored as one integer.
    With a context-parallel group ``cp`` every cp rank reads the same samples and keeps its two
    chunks of each (``parallel.context.split_sequence``).
    """

    def __init__(
        self,
        samples,
        *,
        global_batch: int,
        micro_batch: int,
        grad_accum: int,
        dp_rank: int,
        start_step: int = 0,
        device: str | torch.device = "cpu",
        cp=None,
        mtp: int = 0,
    ) -> None:
        self.samples = samples
        self.mtp = mtp  # model.mtp's depths: their ids and labels go with the labels (``mtp_batch``)
        self.kw = dict(
            global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum, dp_rank=dp_rank
        )
        self.step, self.micro = start_step, 0
        self.device = device
        self.cp = cp  # context parallelism: this rank keeps its chunks of every sample

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = micro_batch_ids(self.step, self.micro, **self.kw)
        self.micro += 1
        if self.micro == self.kw["grad_accum"]:
            self.step, self.micro = self.step + 1, 0
        x, y = to_batch([self.samples[i] for i in ids])
        docs = None
        if isinstance(x, tuple):  # packed documents: the ids of the whole sequence go with every chunk
            x, docs = x
        y = (y, *mtp_batch(x, y, docs, self.mtp)) if self.mtp else (y,)
        if self.cp is not None and self.cp.size > 1:
            from ..parallel.context import split_sequence

            x, y = split_sequence(x, self.cp), tuple(split_sequence(t, self.cp) for t in y)
        x, y = _to(x, self.device), tuple(_to(t, self.device) for t in y)
        return ((x, _to(docs, self.device)) if docs is not None else x), (y if self.mtp else y[0])


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU through pinned memory without blocking: a copy from pageable
    memory waits for the stream, so the host would sit idle until the last step's work is done
    instead of queueing the next micro-batch's."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
