"""Memory-mapped indexed token files: ``P.bin`` (token ids) + ``P.idx`` (document offsets).

``P.idx`` layout (little endian)::

    magic     8 bytes  b"MT3DIDX\\0"
    version   u32      1
    dtype     u8       1 = uint8, 2 = uint16, 4 = uint32 (bytes per token)
    pad       3 bytes
    docs      u64      number of documents
    tokens    u64      number of tokens (= P.bin size / bytes per token)
    max_id    u64      largest token id in P.bin (checked against the tokenizer's vocabulary)
    bin_tag   16 bytes blake2b of the first and last 64 KiB of P.bin (pairs .idx with its .bin)
    offsets   u64[docs + 1]  token offset of each document; offsets[-1] == tokens

Version 2 (supervised data: chat and prompt/completion) adds, after ``bin_tag``, ``flags u8`` (bit 0:
a loss mask exists), 7 pad bytes and ``mask_tag`` (16 bytes, the same fingerprint of ``P.mask``), then
the offsets. ``P.mask`` holds one byte per token: 1 where the token is a supervised target (predicted
from the tokens before it in its own document), 0 elsewhere. Plain text stays version 1.

Readers memory-map the offsets and read tokens with ``pread``: a sample costs one small read, and a
corpus larger than RAM (or than the process's address-space limit) is never mapped or loaded.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import UserError

MAGIC = b"MT3DIDX\0"
VERSION = 1
MASKED_VERSION = 2
_HEADER = struct.Struct("<8sIB3xQQQ16s")
_MASKED = struct.Struct("<B7x16s")
"""What version 2 adds after the version 1 header: flags and the loss mask file's tag."""
DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_TAG_SPAN = 64 * 1024


class IndexedDataError(UserError):
    """A missing, corrupt or mismatched .bin/.idx pair; the message names the file."""


def dtype_for_vocab(vocab_size: int) -> type:
    """Smallest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    for code in (1, 2, 4):
        if vocab_size - 1 <= np.iinfo(DTYPES[code]).max:
            return DTYPES[code]
    raise IndexedDataError(f"vocabulary of {vocab_size} does not fit in 32 bits")


def bin_tag(path: Path) -> bytes:
    """Fingerprint of a .bin file: its size plus its first and last 64 KiB."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        h.update(f.read(_TAG_SPAN))
        if size > _TAG_SPAN:
            f.seek(max(_TAG_SPAN, size - _TAG_SPAN))
            h.update(f.read(_TAG_SPAN))
    return h.digest()


class IndexedWriter:
    """Streams documents into ``P.bin.tmp`` / ``P.idx.tmp``; ``close()`` renames them into place.

    Nothing is visible under the final names until ``close`` succeeds (the .bin first, the .idx
    last); ``abort`` removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: type, with_mask: bool = False) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype.itemsize not in DTYPES:
            raise IndexedDataError(f"unsupported token dtype {self.dtype}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._idx_tmp = Path(f"{self.prefix}.idx.tmp")
        self._mask_tmp = Path(f"{self.prefix}.mask.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._mask = open(self._mask_tmp, "wb") if with_mask else None
        self._offsets = [0]
        self.max_id = np.iinfo(self.dtype).max
        self.largest = 0

    def add(self, ids, mask=None) -> None:
        """Append one document (a sequence of token ids; with a loss mask, its 0/1 per token)."""
        arr = np.asarray(ids)
        if (mask is None) != (self._mask is None):
            raise IndexedDataError("a loss mask goes with every document of a masked dataset, and only there")
        if mask is not None:
            m = np.asarray(mask, dtype=np.uint8)
            if m.shape != arr.shape or (m.size and m.max() > 1):
                raise IndexedDataError(f"loss mask of shape {m.shape} (values 0/1) for {arr.size} tokens")
            self._mask.write(m.tobytes())
        if arr.size and (arr.min() < 0 or arr.max() > self.max_id):
            raise IndexedDataError(
                f"token id {int(arr.max())} does not fit in {self.dtype} (max {self.max_id}); "
                "use a wider dtype or a smaller vocabulary"
            )
        if arr.size:
            self.largest = max(self.largest, int(arr.max()))
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)

    @property
    def docs(self) -> int:
        """Documents written so far."""
        return len(self._offsets) - 1

    def close(self) -> None:
        """Finish both files, fsync them and move them to their final names."""
        for f in (self._bin, self._mask):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        offsets = np.asarray(self._offsets, dtype=np.uint64)
        version = VERSION if self._mask is None else MASKED_VERSION
        header = _HEADER.pack(
            MAGIC,
            version,
            self.dtype.itemsize,
            self.docs,
            int(offsets[-1]),
            self.largest,
            bin_tag(self._bin_tmp),
        )
        if self._mask is not None:
            header += _MASKED.pack(1, bin_tag(self._mask_tmp))
        with open(self._idx_tmp, "wb") as f:
            f.write(header)
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        if self._mask is not None:
            os.replace(self._mask_tmp, f"{self.prefix}.mask")
        os.replace(self._idx_tmp, f"{self.prefix}.idx")

    def abort(self) -> None:
        """Drop the temporary files (nothing under the final names is touched)."""
        for f in (self._bin, self._mask):
            if f is not None and not f.closed:
                f.close()
        for p in (self._bin_tmp, self._idx_tmp, self._mask_tmp):
            p.unlink(missing_ok=True)


def _check_mask(path: Path, tokens: int, tag: bytes, check_tag: bool) -> Path:
    """The loss mask file of a version 2 index: one byte per token, the fingerprint the index holds."""
    if not path.is_file():
        raise IndexedDataError(
            f"{path} not found: the index says its documents carry a loss mask; re-run 'mt3d preprocess'"
        )
    if path.stat().st_size != tokens:
        raise IndexedDataError(
            f"{path}: {path.stat().st_size} bytes for {tokens} tokens; re-run 'mt3d preprocess'"
        )
    if check_tag and bin_tag(path) != tag:
        raise IndexedDataError(
            f"{path} does not belong to its index (contents differ); re-run 'mt3d preprocess'"
        )
    return path


def _pread(fd: int, path: Path, dtype: np.dtype, start: int, n: int) -> np.ndarray:
    """Items ``[start, start + n)`` of the file open as ``fd`` (one ``pread``); a short read (the file
    changed while in use) is an error naming ``path``."""
    raw = os.pread(fd, n * dtype.itemsize, start * dtype.itemsize)
    if len(raw) != n * dtype.itemsize:
        raise IndexedDataError(f"{path}: short read at token {start} (file changed while in use?)")
    return np.frombuffer(raw, dtype=dtype)


def _check_offsets(idx: Path, offsets: np.ndarray, tokens: int, block: int = 1 << 22) -> None:
    """Document offsets start at 0, never decrease and end at the token count (read in blocks)."""
    if int(offsets[0]) != 0 or int(offsets[-1]) != tokens:
        raise IndexedDataError(
            f"{idx}: document offsets run from {int(offsets[0])} to {int(offsets[-1])}, expected 0 to the "
            f"{tokens} tokens of the .bin; re-run 'mt3d preprocess'"
        )
    for lo in range(0, len(offsets) - 1, block):
        part = np.asarray(offsets[lo : lo + block + 1], dtype=np.int64)
        bad = np.nonzero(np.diff(part) < 0)[0]
        if len(bad):
            doc = lo + int(bad[0])
            raise IndexedDataError(
                f"{idx}: document {doc} ends before it starts (offsets {part[bad[0]]} then "
                f"{part[bad[0] + 1]}); the index is corrupt: re-run 'mt3d preprocess'"
            )


class IndexedDataset:
    """Read-only, memory-mapped view of one ``P.bin`` / ``P.idx`` pair."""

    def __init__(self, prefix: str | Path, check_tag: bool = True) -> None:
        self.prefix = Path(prefix)
        idx, binf = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for p in (idx, binf):
            if not p.is_file():
                raise IndexedDataError(f"{p} not found (run 'mt3d preprocess' to create it)")
        with open(idx, "rb") as f:  # the header only: the offsets table can be GBs
            raw = f.read(_HEADER.size)
        if len(raw) < _HEADER.size:
            raise IndexedDataError(f"{idx}: truncated header")
        magic, version, code, docs, tokens, max_id, tag = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise IndexedDataError(f"{idx}: not an mt3d index file (bad magic)")
        if version not in (VERSION, MASKED_VERSION):
            raise IndexedDataError(
                f"{idx}: unsupported version {version} (expected {VERSION} or {MASKED_VERSION})"
            )
        header = _HEADER.size
        self.has_mask, self._mask_path = False, None
        if version == MASKED_VERSION:
            with open(idx, "rb") as f:
                f.seek(header)
                extra = f.read(_MASKED.size)
            if len(extra) < _MASKED.size:
                raise IndexedDataError(f"{idx}: truncated header")
            flags, mask_tag = _MASKED.unpack(extra)
            header += _MASKED.size
            self.has_mask = bool(flags & 1)
            if self.has_mask:
                self._mask_path = _check_mask(Path(f"{prefix}.mask"), tokens, mask_tag, check_tag)
        if code not in DTYPES:
            raise IndexedDataError(f"{idx}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        want = tokens * self.dtype.itemsize
        have = binf.stat().st_size
        if have != want:
            kind = "truncated" if have < want else "too long"
            raise IndexedDataError(
                f"{binf} is {kind}: {have} bytes, index expects {want}; re-run 'mt3d preprocess'"
            )
        if idx.stat().st_size != header + 8 * (docs + 1):
            raise IndexedDataError(f"{idx}: truncated offsets table")
        self._header = header
        if check_tag and bin_tag(binf) != tag:
            raise IndexedDataError(
                f"{binf} does not belong to {idx} (contents differ); re-run 'mt3d preprocess'"
            )
        self.offsets = np.memmap(idx, dtype=np.uint64, mode="r", offset=header, shape=(docs + 1,))
        _check_offsets(idx, self.offsets, tokens)
        self._bin_path = binf
        self.vocab_limit: int | None = None  # set by the loader: ids at or above it are refused on read
        self._open()
        self.num_docs, self.num_tokens, self.max_id = int(docs), int(tokens), int(max_id)
        self.tag = bytes(tag)  # identifies the contents (cache keys of derived indices)

    def _open(self) -> None:
        """The descriptors every read uses: the tokens', and the loss mask's when there is one."""
        self._fd = os.open(self._bin_path, os.O_RDONLY)
        self._mask_fd = os.open(self._mask_path, os.O_RDONLY) if self._mask_path is not None else None

    def __del__(self):
        for fd in (getattr(self, "_fd", None), getattr(self, "_mask_fd", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_fd", "_mask_fd", "offsets"):
            state.pop(k, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()
        size = self.num_docs + 1
        self.offsets = np.memmap(
            f"{self.prefix}.idx", dtype=np.uint64, mode="r", offset=self._header, shape=(size,)
        )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated stream (one ``pread``)."""
        n = max(0, stop - start)
        out = _pread(self._fd, self._bin_path, self.dtype, start, n)
        if self.vocab_limit is not None and n and int(out.max()) >= self.vocab_limit:
            at = start + int(np.argmax(out >= self.vocab_limit))
            raise IndexedDataError(
                f"{self._bin_path}: token id {int(out[at - start])} at token offset {at} is outside the "
                f"tokenizer's {self.vocab_limit}-id vocabulary (corrupt file, or another tokenizer's data)"
            )
        return out

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of tokens ``[start, stop)`` (uint8 0/1; all ones for data without a mask)."""
        n = max(0, stop - start)
        if not self.has_mask:
            return np.ones(n, dtype=np.uint8)
        return _pread(self._mask_fd, self._mask_path, np.dtype(np.uint8), start, n)

    def doc_mask(self, i: int) -> np.ndarray:
        """The loss mask of document ``i``."""
        return self.read_mask(int(self.offsets[i]), int(self.offsets[i + 1]))

    def __len__(self) -> int:
        return self.num_docs

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document ``i``."""
        return self.read(int(self.offsets[i]), int(self.offsets[i + 1]))

    def doc_lengths(self) -> np.ndarray:
        """Length of every document."""
        return np.diff(np.asarray(self.offsets, dtype=np.int64))


def read_meta(prefix: str | Path) -> dict:
    """``P.meta.json`` ({} for datasets written before it existed)."""
    from ..inputs import read_json

    f = Path(f"{prefix}.meta.json")
    return read_json(f, "dataset metadata") if f.is_file() else {}
