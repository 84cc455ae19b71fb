"""Whole documents packed into fixed-length samples, with their boundaries and loss masks kept.

``PackedDocuments`` turns a subset of an indexed dataset's documents into an endless, deterministic
sequence of samples: epoch ``e`` shuffles the documents with (seed, e) and puts each, in that order,
into the first of the open samples it fits in (first-fit over a window of the most recently opened
samples, which bounds the work per document), then shuffles the samples. A sample holds
``seq_len`` token positions (plus one padding position, so inputs and labels are both ``seq_len``
long): whole documents, then padding. A document longer than ``seq_len`` keeps its first
``seq_len`` tokens and is counted (``truncated``); a corpus of nothing but such documents is refused.

Each sample is a ``Packed`` triple: tokens, the loss mask (1 where the token is a supervised target:
``mt3d.data.sft``'s convention; all ones for plain text) and the document index of every position
(-1 for padding). ``packed_batch`` turns samples into model inputs ``(ids, documents)`` and labels:
position t's label is token t + 1 when it belongs to the same document and is supervised, else
ignored, so no document predicts the next one's first token and padding is never a target. The
model restarts positions at every document and never attends across a boundary
(``mt3d.model.attention``), which makes a packed sample compute what its documents would one at a
time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .indexed import IndexedDataset
from .samples import DataError, _tmp_name

IGNORE = -100
"""The label of a position that is not a target (``mt3d.parallel.cross_entropy``'s ignore index)."""
WINDOW = 64
"""Open samples first-fit looks at, the most recently opened first-to-last (bounds the work per
document: plain first-fit over every sample is quadratic in the corpus)."""


def packs(cfg, datasets: list[IndexedDataset]) -> bool:
    """Whether a ``DataConfig``'s samples are whole documents with document masking: datasets with a
    loss mask, plain text with ``document_mask`` (or ``packing: true``). Plain text otherwise is one
    stream cut into samples (``samples.PackedSamples``)."""
    return bool(cfg.packing) or cfg.document_mask or any(d.has_mask for d in datasets)


def all_too_long(prefix, lengths: np.ndarray, seq_len: int) -> str | None:
    """Why documents of these ``lengths`` cannot be packed into ``seq_len`` samples (None: they can;
    a few longer ones are truncated and counted)."""
    if lengths.size and (lengths > seq_len).all():
        return (
            f"{prefix}: every one of its {lengths.size} documents is longer than seq_len {seq_len} (the "
            f"shortest has {int(lengths.min())} tokens): raise data.seq_len"
        )
    return None


class Packed(NamedTuple):
    """One packed sample: ``seq_len + 1`` positions of tokens (int64), loss mask (uint8) and document
    index (int32, -1 for padding); preference pairs also the dataset's index of every position's
    document (``source``, int64, -1 for padding)."""

    tokens: np.ndarray
    mask: np.ndarray
    doc: np.ndarray
    source: np.ndarray | None = None


class PackedDocuments:
    """Endless packed samples of documents ``doc_ids`` of ``dataset`` (module docstring); with
    ``pack`` false, one document per sample, padded (``data.packing: false``). With ``pairs`` the ids
    are preference pairs (``mt3d.data.preference``: documents 2p and 2p + 1), each packed whole, chosen
    then rejected, into one sample; a pair longer than ``seq_len`` is left out and counted
    (``dropped_pairs``: truncating would cut the completions whose log-probabilities DPO compares).
    With ``sources`` (implied by ``pairs``) each sample also names every position's dataset document."""

    def __init__(self, dataset: IndexedDataset, doc_ids: np.ndarray, seq_len: int, seed: int,
                 cache_dir: str | Path | None = None, pack: bool = True, pairs: bool = False,
                 sources: bool = False) -> None:  # fmt: skip
        self.ds, self.doc_ids, self.seq_len, self.seed = dataset, np.asarray(doc_ids, np.int64), seq_len, seed
        self.pack, self.pairs, self.sources = pack, pairs, pairs or sources
        lengths = dataset.doc_lengths()
        ids = self.doc_ids
        lengths = lengths[2 * ids] + lengths[2 * ids + 1] if pairs else lengths[ids]
        if lengths.size == 0:
            raise DataError(f"{dataset.prefix}: no documents to pack")
        why = all_too_long(dataset.prefix, lengths, seq_len)
        if why:
            raise DataError(why.replace("documents", "pairs (chosen and rejected)") if pairs else why)
        self.truncated = 0 if pairs else int((lengths > seq_len).sum())
        self.dropped_pairs = int((lengths > seq_len).sum()) if pairs else 0
        if pairs:
            self.doc_ids, lengths = self.doc_ids[lengths <= seq_len], lengths[lengths <= seq_len]
        self._lengths = np.minimum(lengths, seq_len)
        self.tokens_per_epoch = int(self._lengths.sum())
        self.cache_dir = Path(cache_dir) if cache_dir else None
        key = hashlib.sha256()
        key.update(str(Path(dataset.prefix).resolve()).encode())
        key.update(dataset.tag)
        key.update(self.doc_ids.tobytes())
        key.update(f"packed|{seq_len}|{seed}|{WINDOW if pack else 0}{'|pairs' if pairs else ''}".encode())
        self.key = key.hexdigest()[:20]
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._counts: list[int] = []  # samples of epochs 0, 1, ... (each packs differently)
        self.per_epoch = self._count(0)

    def __len__(self) -> int:
        """Samples in epoch 0 (the sequence itself is endless)."""
        return self.per_epoch

    @property
    def efficiency(self) -> float:
        """Real tokens over the token positions of epoch 0's samples."""
        return self.tokens_per_epoch / (self.per_epoch * self.seq_len)

    def _build_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents in sample order, start of each sample's documents): first-fit, then shuffled."""
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.doc_ids.size)
        bins: list[list[int]] = []
        room: list[int] = []
        for d in order.tolist():
            n = int(self._lengths[d])
            lo = max(0, len(bins) - WINDOW) if self.pack else len(bins)  # unpacked: a sample each
            for b in range(lo, len(bins)):
                if room[b] >= n:
                    bins[b].append(d)
                    room[b] -= n
                    break
            else:
                bins.append([d])
                room.append(self.seq_len - n)
        shuffle = rng.permutation(len(bins))
        docs = np.asarray([d for b in shuffle for d in bins[b]], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum([len(bins[b]) for b in shuffle])]).astype(np.int64)
        return docs, starts

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch in self._epochs:
            return self._epochs[epoch]
        path = self.cache_dir / f"packed-{self.key}-e{epoch}.npz" if self.cache_dir else None
        if path is not None and path.is_file():
            with np.load(path) as z:
                built = (z["docs"], z["starts"])
        else:
            built = self._build_epoch(epoch)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = _tmp_name(path, ".npz")
                np.savez(tmp, docs=built[0], starts=built[1])
                os.replace(tmp, path)
        if len(self._epochs) > 2:
            self._epochs.pop(min(self._epochs))
        self._epochs[epoch] = built
        return built

    def _count(self, epoch: int) -> int:
        while len(self._counts) <= epoch:
            self._counts.append(len(self._epoch(len(self._counts))[1]) - 1)
        return self._counts[epoch]

    def __getitem__(self, i: int) -> Packed:
        """Sample ``i`` (any non-negative integer)."""
        i, epoch = int(i), 0
        while i >= self._count(epoch):
            i -= self._count(epoch)
            epoch += 1
        docs, starts = self._epoch(epoch)
        size = self.seq_len + 1
        tokens = np.zeros(size, dtype=np.int64)
        mask = np.zeros(size, dtype=np.uint8)
        doc = np.full(size, -1, dtype=np.int32)
        source = np.full(size, -1, dtype=np.int64) if self.sources else None
        at, k = 0, 0
        for d in docs[starts[i] : starts[i + 1]].tolist():
            unit = int(self.doc_ids[d])
            for real in (2 * unit, 2 * unit + 1) if self.pairs else (unit,):
                begin = int(self.ds.offsets[real])
                n = min(int(self.ds.offsets[real + 1]) - begin, self.seq_len)
                tokens[at : at + n] = self.ds.read(begin, begin + n)
                mask[at : at + n] = self.ds.read_mask(begin, begin + n)
                doc[at : at + n] = k
                if source is not None:
                    source[at : at + n] = real
                at, k = at + n, k + 1
        return Packed(tokens, mask, doc, source)


def packed_batch(samples: list[Packed]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``((ids, documents), labels)``, each [b, seq_len]: label t is token t + 1 where that token is a
    supervised target of the same document, else ``IGNORE`` (module docstring). Preference pairs:
    labels [b, seq_len, 3], each position's label, its document's index in the sample and in the dataset
    (``pair_labels``: what the DPO loss sums log-probabilities by)."""
    tokens = np.stack([s.tokens for s in samples])
    mask = np.stack([s.mask for s in samples])
    doc = np.stack([s.doc for s in samples])
    same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0) & (mask[:, 1:] > 0)
    labels = np.where(same, tokens[:, 1:], IGNORE)
    if samples[0].source is not None:
        source = np.stack([s.source for s in samples])[:, :-1]
        labels = np.stack([labels, doc[:, :-1].astype(np.int64), source], axis=-1)
    return (
        torch.from_numpy(tokens[:, :-1].copy()),
        torch.from_numpy(doc[:, :-1].astype(np.int64)),
    ), torch.from_numpy(labels)


def target_labels(labels: torch.Tensor) -> torch.Tensor:
    """The token labels [b, s] of a batch's labels (preference pairs': the first of their three)."""
    return labels[..., 0] if labels.dim() == 3 else labels


def supervised_and_real(samples: list[Packed]) -> tuple[int, int]:
    """(supervised targets, real token positions) of packed samples (the step's loss normaliser and
    its packing efficiency)."""
    _, labels = packed_batch(samples)
    real = sum(int((s.doc[:-1] >= 0).sum()) for s in samples)
    return int((target_labels(labels) != IGNORE).sum()), real


def pairs_in(samples: list[Packed]) -> int:
    """Preference pairs in these samples (each lies whole in one)."""
    return sum(len(np.unique(s.source[s.source >= 0])) // 2 for s in samples)
