"""Fixed-length training samples packed from documents; splits; weighted blending.

``PackedSamples`` turns a subset of an indexed dataset's documents into an endless, deterministic
sequence of samples of ``seq_len + 1`` tokens. Epoch ``e`` shuffles the documents with
(seed, e), concatenates them, cuts consecutive samples, and shuffles the samples with (seed, e).
Each epoch's index is built once and cached on disk, and depends only on (data, documents,
seq_len, seed, epoch): never on how many steps a run asks for, so sample ``i`` is the same in every
run and after every resume.

``BlendedSamples`` interleaves several sample sources by weight with the greedy rule "give the next
sample to the source furthest below its share", so every prefix of the sequence matches the
weights to within one sample per source.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..errors import UserError
from .indexed import IndexedDataset


class DataError(UserError):
    """Data that cannot make the requested samples (too few tokens, bad split or blend weights)."""


def _tmp_name(path: Path, suffix: str) -> Path:
    """A temporary name beside ``path`` unique to this process on this host (shared filesystems)."""
    return path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp{suffix}")


SPLIT_SEED = 0x5EED  # the train/valid/test split depends on the data only, not on the run's seed


def split_documents(num_docs: int, weights: list[float]) -> list[np.ndarray]:
    """Partition document ids into len(weights) disjoint sets (a fixed shuffle, then by weight)."""
    if num_docs == 0:
        raise DataError("the dataset has no documents")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise DataError(f"split weights must be non-negative and not all zero, got {weights}")
    perm = np.random.default_rng(SPLIT_SEED).permutation(num_docs)
    bounds = np.round(np.cumsum(w) / w.sum() * num_docs).astype(np.int64)
    bounds[-1] = num_docs
    parts, start = [], 0
    for b in bounds:
        parts.append(np.sort(perm[start:b]))
        start = b
    # a non-empty requested split gets at least one document when there are enough
    for i, p in enumerate(parts):
        if p.size == 0 and w[i] > 0 and num_docs >= len(weights):
            donor = int(np.argmax([q.size for q in parts]))
            parts[i], parts[donor] = parts[donor][-1:], parts[donor][:-1]
    return parts


class PackedSamples:
    """Endless samples of ``seq_len + 1`` tokens from documents ``doc_ids`` of ``dataset``."""

    def __init__(
        self,
        dataset: IndexedDataset,
        doc_ids: np.ndarray,
        seq_len: int,
        seed: int,
        cache_dir: str | Path | None = None,
    ) -> None:
        self.ds, self.doc_ids, self.seq_len, self.seed = dataset, np.asarray(doc_ids, np.int64), seq_len, seed
        lengths = dataset.doc_lengths()[self.doc_ids]
        self.tokens_per_epoch = int(lengths.sum())
        self.per_epoch = (self.tokens_per_epoch - 1) // seq_len
        if self.per_epoch <= 0:
            raise DataError(
                f"{dataset.prefix}: {self.tokens_per_epoch} tokens cannot fill one sample of {seq_len + 1}; "
                "use a shorter seq_len or more data"
            )
        self._lengths = lengths
        self.cache_dir = Path(cache_dir) if cache_dir else None
        key = hashlib.sha256()
        key.update(str(Path(dataset.prefix).resolve()).encode())
        key.update(np.asarray(dataset.offsets[-1:]).tobytes())
        key.update(dataset.tag)  # a re-preprocessed file with the same size gets new indices
        key.update(self.doc_ids.tobytes())
        key.update(f"{seq_len}|{seed}".encode())
        self.key = key.hexdigest()[:20]
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        """Samples in one epoch (the sequence itself is endless)."""
        return self.per_epoch

    def _build_epoch(self, epoch: int):
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(self.doc_ids.size)
        docs = self.doc_ids[order]
        cum = np.concatenate([[0], np.cumsum(self._lengths[order])])
        starts = np.arange(self.per_epoch, dtype=np.int64) * self.seq_len
        small = np.int32 if max(self.per_epoch, docs.size) < 2**31 else np.int64  # halves the index
        first = (np.searchsorted(cum, starts, side="right") - 1).astype(small)
        del starts
        shuffle = rng.permutation(self.per_epoch).astype(small)
        return docs, cum, first, shuffle

    def _epoch(self, epoch: int):
        if epoch in self._epochs:
            return self._epochs[epoch]
        path = self.cache_dir / f"samples-{self.key}-e{epoch}.npz" if self.cache_dir else None
        if path is not None and path.is_file():
            with np.load(path) as z:
                built = (z["docs"], z["cum"], z["first"], z["shuffle"])
        else:
            built = self._build_epoch(epoch)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = _tmp_name(path, ".npz")
                np.savez(tmp, docs=built[0], cum=built[1], first=built[2], shuffle=built[3])
                os.replace(tmp, path)
        if len(self._epochs) > 2:  # keep memory bounded on very long runs
            self._epochs.pop(min(self._epochs))
        self._epochs[epoch] = built
        return built

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` (any non-negative integer): ``seq_len + 1`` token ids as int64."""
        epoch, j = divmod(int(i), self.per_epoch)
        docs, cum, first, shuffle = self._epoch(epoch)
        s = int(shuffle[j])
        start, stop = s * self.seq_len, s * self.seq_len + self.seq_len + 1
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        d, filled = int(first[s]), 0
        pos = start - int(cum[d])
        offsets = self.ds.offsets
        while filled < out.size:
            doc = int(docs[d])
            begin, end = int(offsets[doc]), int(offsets[doc + 1])
            take = min(end - begin - pos, stop - start - filled)
            out[filled : filled + take] = self.ds.read(begin + pos, begin + pos + take)
            filled += take
            d, pos = d + 1, 0
        return out


class BlendedSamples:
    """Interleave sample sources by weight (greedy: the source furthest below its share goes next).

    The assignment is computed in blocks of ``BLOCK`` samples; only the last few blocks stay in
    memory. The rule is sequential, so block ``b`` needs the per-source counts at its start: those
    are kept for every block boundary reached (a few bytes each) and, with ``cache_dir``, saved on
    disk, so resuming at sample 10^9 does not replay the rule from 0.
    """

    BLOCK = 65536
    KEEP_BLOCKS = 4

    def __init__(self, sources: list, weights: list[float], cache_dir: str | Path | None = None) -> None:
        if len(sources) != len(weights) or not sources:
            raise DataError("blending needs one weight per source")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise DataError(f"blend weights must be non-negative and not all zero, got {weights}")
        self.sources, self.weights = sources, w / w.sum()
        self.seq_len = sources[0].seq_len
        self._blocks: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._path = None
        if cache_dir is not None:  # the sequence depends on the normalised weights only
            key = hashlib.sha256(self.weights.tobytes() + str(self.BLOCK).encode()).hexdigest()[:20]
            self._path = Path(cache_dir) / f"blend-{key}.npy"
        self._counts = self._load_counts()  # row b: counts before block b
        self._saved_rows = len(self._counts)

    def _load_counts(self) -> np.ndarray:
        if self._path is not None and self._path.is_file():
            try:
                counts = np.load(self._path)
                if counts.ndim == 2 and counts.shape[1] == len(self.sources) and len(counts) >= 1:
                    return counts.astype(np.int64)
            except (OSError, ValueError):
                pass  # unreadable cache: rebuild it
        return np.zeros((1, len(self.sources)), dtype=np.int64)

    def _save_counts(self) -> None:
        if self._path is None or len(self._counts) < self._saved_rows + 64:  # batch small updates
            return
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            tmp = _tmp_name(self._path, ".npy")
            np.save(tmp, self._counts)
            os.replace(tmp, self._path)
            self._saved_rows = len(self._counts)
        except OSError:
            pass  # a cache only

    def _run(self, b: int) -> tuple[list[int], list[int], list[int]]:
        """Apply the rule over block ``b`` from its start counts: (which, index, end counts)."""
        counts = self._counts[b].tolist()
        w = self.weights.tolist()
        which, index = [0] * self.BLOCK, [0] * self.BLOCK
        rest = range(1, len(w))
        n0 = b * self.BLOCK + 1
        for t in range(self.BLOCK):  # plain Python: ~6x faster than numpy for a handful of sources
            n = n0 + t
            best, top = 0, w[0] * n - counts[0]
            for k in rest:
                v = w[k] * n - counts[k]
                if v > top:  # ties go to the lowest source, like argmax
                    best, top = k, v
            which[t], index[t] = best, counts[best]
            counts[best] += 1
        return which, index, counts

    def _block(self, b: int):
        if b in self._blocks:
            self._blocks.move_to_end(b)
            return self._blocks[b]
        while len(self._counts) <= b:  # boundaries not reached yet: replay the rule up to b
            _, _, end = self._run(len(self._counts) - 1)
            self._counts = np.vstack([self._counts, np.asarray(end, dtype=np.int64)[None]])
        which, index, end = self._run(b)
        if len(self._counts) == b + 1:
            self._counts = np.vstack([self._counts, np.asarray(end, dtype=np.int64)[None]])
        self._save_counts()
        block = (np.asarray(which, dtype=np.int64), np.asarray(index, dtype=np.int64))
        self._blocks[b] = block
        if len(self._blocks) > self.KEEP_BLOCKS:
            self._blocks.popitem(last=False)
        return block

    def source_of(self, i: int) -> tuple[int, int]:
        """(source, index within that source) of blended sample ``i``."""
        which, index = self._block(i // self.BLOCK)
        return int(which[i % self.BLOCK]), int(index[i % self.BLOCK])

    def __getitem__(self, i: int) -> np.ndarray:
        """Blended sample ``i``."""
        k, j = self.source_of(i)
        return self.sources[k][j]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)
