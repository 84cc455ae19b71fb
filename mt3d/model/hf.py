"""HF transformers directories: configs, tensor names, per-rank sharded reading.

Which families exist and how each one's config.json and tensor names map onto mt3d is the
family modules' business (``mt3d.model.families``); this module is what they share: finding the
family of a directory, reading safetensors slice by slice, and turning mt3d parameters into HF
tensors and back. Every mt3d parameter is described as a list of *pieces* of HF tensors (row
ranges, transposed for GPT-2's Conv1D), so a rank reads from the safetensors files only the slices
it holds: the QKV / gate-up fusions and the TP split are applied piece by piece, and no rank ever
materialises the full model. Writing HF directories is ``export.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..inputs import entry_inside
from .config import ModelConfig
from .families import HFError, Piece, family_for_hf, get_family
from .families.base import source_name
from .sharding import ParamLayout, layout_of, role_of, split_name

__all__ = ["HFError", "HFReader", "Piece", "config_from_hf", "hf_config_dict", "pieces", "read_shard"]


# --- configs -------------------------------------------------------------------------------------
def read_hf_config(path: str | Path) -> dict:
    """config.json of an HF model directory, checked to be a JSON object of a supported family."""
    d = Path(path)
    f = d / "config.json"
    if not d.is_dir():
        raise HFError(f"HF model directory not found: {d}")
    if not f.is_file():
        raise HFError(f"{f} not found: not an HF model directory")
    try:
        cfg = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise HFError(f"{f} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise HFError(f"{f} must hold a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config")
    if isinstance(text, dict) and not _readable(cfg) and _readable(text):
        # a vision-language checkpoint (Qwen3.5's): its language model's config, as a text model's
        cfg = {**text, "tie_word_embeddings": cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))}
    family_for_hf(cfg, str(d))
    return cfg


def _readable(hf: dict) -> bool:
    from .families import families

    return any(f.reads(hf) for f in families())


def config_from_hf(path: str | Path) -> ModelConfig:
    """The mt3d ModelConfig of an HF directory (any registered family)."""
    hf = read_hf_config(path)
    family = family_for_hf(hf, str(path))
    kwargs = family.config_kwargs(hf, str(path))
    return ModelConfig.from_dict(
        {
            **kwargs,
            "family": family.name,
            "name": source_name(path),
            "extra": {"hf_config": hf, "hf_path": str(path)},
        }
    )


def hf_config_dict(cfg: ModelConfig, vocab: int, eos_id: int | None) -> dict:
    """config.json contents for exporting ``cfg`` (over the original HF config when there is one)."""
    family = get_family(cfg.family)
    base = dict(cfg.extra.get("hf_config") or {})
    new = {
        "model_type": family.model_types[0] if family.model_types else None,
        "architectures": [family.architecture],
        **family.hf_config(cfg, vocab),
    }
    out = {**base, **new}
    if family.mtp_count_keys:  # the MTP layers the export holds
        for key in family.mtp_count_keys[1:]:
            out.pop(key, None)
        out[family.mtp_count_keys[0]] = cfg.mtp_spec.layers if cfg.mtp is not None else 0
    if eos_id is not None and not base:
        out.update(bos_token_id=eos_id, eos_token_id=eos_id)
    out.setdefault("dtype", "float32")
    return out


# --- names and pieces ------------------------------------------------------------------------------
def pieces(cfg: ModelConfig, name: str) -> list[Piece]:
    """The HF tensors (and row ranges) that make up mt3d parameter ``name``."""
    layer, local = split_name(name)
    role = role_of(cfg, layer)
    if role == "mtp":
        return get_family(cfg.family).mtp_pieces(cfg, local)
    return get_family(cfg.family).pieces(cfg, role, layer - 2, local)


# --- reading --------------------------------------------------------------------------------------
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _check_header(path: Path, header: dict, data_bytes: int) -> None:
    """Every tensor's dtype, shape and byte extent agree, and the extents tile the data exactly
    (safetensors' own rules): a wrong dtype or shape in the header is refused, not reinterpreted."""
    spans = []
    for name, e in header.items():
        if e["dtype"] not in _ST_DTYPES:
            raise HFError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
        shape, (begin, end) = e["shape"], e["data_offsets"]
        if not all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end)) or begin > end:
            raise HFError(
                f"{path}: tensor {name} has an invalid shape {shape} or offsets {e['data_offsets']}"
            )
        if end > data_bytes:
            raise HFError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
        numel = 1
        for x in shape:
            numel *= x
        want = numel * torch.tensor([], dtype=_ST_DTYPES[e["dtype"]]).element_size()
        if end - begin != want:
            raise HFError(
                f"{path}: tensor {name} is declared {e['dtype']} {shape} ({want} bytes) but spans "
                f"{end - begin} bytes: the header is wrong (wrong dtype or shape)"
            )
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise HFError(f"{path}: tensor {name} starts at byte {begin}, expected {at} (overlap or gap)")
        at = end
    if at != data_bytes:
        raise HFError(f"{path}: the tensors cover {at} of the file's {data_bytes} data bytes")


class SafetensorsFile:
    """A safetensors file read with ``pread``: only the requested rows are read, nothing is mapped.

    (safetensors' own reader memory-maps the file, so every page a rank touches counts in its
    resident memory; plain reads keep a rank's footprint to what it keeps.)
    """

    def __init__(self, path: Path) -> None:
        import os
        import struct

        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(self.fd).st_size
            (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(os.pread(self.fd, n, 8))
            header.pop("__metadata__", None)
            _check_header(path, header, size - 8 - n)
        except (struct.error, ValueError, KeyError, TypeError, IndexError) as e:
            self.close()
            raise HFError(f"{path} is not a valid safetensors file ({e})") from None
        except BaseException:
            self.close()
            raise
        self.base = 8 + n
        self.entries = header

    def close(self) -> None:
        """Release the file descriptor."""
        import os

        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()

    def shape(self, name: str) -> list[int]:
        """Shape of a tensor."""
        return list(self.entries[name]["shape"])

    def region(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None,
               index: int | None = None) -> torch.Tensor:  # fmt: skip
        """Rows x columns of a 1-D or 2-D tensor (of matrix ``index`` of a stacked 2-D or 3-D one), or rows
        of a 3-D one (an unstacked convolution weight), read straight into the result (no extra copy).

        Full-width rows are one read; a column range is one read per row (its part of the row).
        """
        import os

        e = self.entries[name]
        dtype = _ST_DTYPES[e["dtype"]]
        shape = e["shape"]
        item = torch.tensor([], dtype=dtype).element_size()
        begin = self.base + e["data_offsets"][0]
        if index is not None:  # one matrix of a stack: its bytes are contiguous
            shape = shape[1:]
            begin += index * math.prod(shape) * item
        width = math.prod(shape[1:])  # a 3-D tensor's rows are its trailing dims (a convolution's [c, 1, k])
        c0, c1 = cols or (0, width)
        nrows = rows[1] - rows[0]
        out = torch.empty((nrows, c1 - c0) if len(shape) >= 2 else (nrows,), dtype=dtype)
        raw = out.view(torch.uint8).view(nrows, -1) if nrows else None
        if nrows and (c0, c1) == (0, width):
            got = os.preadv(self.fd, [raw.numpy()], begin + rows[0] * width * item)
            if got != raw.numel():
                raise HFError(f"{self.path}: short read in {name} (truncated file?)")
        else:
            for i in range(nrows):
                off = begin + ((rows[0] + i) * width + c0) * item
                if os.preadv(self.fd, [raw[i].numpy()], off) != raw.shape[1]:
                    raise HFError(f"{self.path}: short read in {name} (truncated file?)")
        return out.view(nrows, *shape[1:]) if len(shape) > 2 and cols is None else out


LANGUAGE_MODEL = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}  # fmt: skip
"""Where vision-language checkpoints keep their language model's tensors -> where a text model keeps them:
Qwen3.5's (and transformers 5's saves) under ``model.language_model``, Gemma 3's published ones under
``language_model.model`` (and ``language_model.lm_head``); the vision tower's are left unused."""


class HFReader:
    """Slice-wise access to the safetensors files of an HF directory (rows read with pread)."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {v: entry_inside(self.dir, v, str(index), HFError) for v in set(weight_map.values())}
                self.where = {k: files[v] for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                if isinstance(e, HFError):
                    raise
                raise HFError(f"{index} is not a valid safetensors index ({e!r})") from None
        elif (self.dir / "model.safetensors").is_file():
            f = self.dir / "model.safetensors"
            header_only = SafetensorsFile(f)
            self.where = dict.fromkeys(header_only.entries, f)
            header_only.close()
        else:
            raise HFError(
                f"{self.dir}: no model.safetensors(.index.json); save the model with safe_serialization"
            )
        self.stored = {name: name for name in self.where}
        """Tensor name as the families name it -> as the files store it."""
        if not any(k.startswith("model.layers.") for k in self.where):  # a vision-language checkpoint keeps
            for k in list(self.where):  # its language model apart
                prefix = next((p for p in LANGUAGE_MODEL if k.startswith(p)), None)
                if prefix is not None:
                    alias = LANGUAGE_MODEL[prefix] + k[len(prefix) :]
                    self.where[alias], self.stored[alias] = self.where.pop(k), self.stored.pop(k)
        self._open: dict[Path, SafetensorsFile] = {}

    def close(self) -> None:
        """Close every open file."""
        for f in self._open.values():
            f.close()
        self._open.clear()

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self.where:
            raise HFError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        f = self.where[name]
        if f not in self._open:
            if not f.is_file():
                raise HFError(f"{f} is listed in the index but missing")
            self._open[f] = SafetensorsFile(f)
        return self._open[f]

    def _stored(self, piece: Piece) -> list[int]:
        """The stored shape of the piece's tensor (of one matrix of a stacked one)."""
        shape = self._file(piece.name).shape(self.stored[piece.name])
        if piece.index is not None:
            if not shape or not 0 <= piece.index < shape[0]:
                raise HFError(f"{self.dir}: tensor {piece.name} {tuple(shape)} has no entry {piece.index}")
            shape = shape[1:]
        return shape

    def shape(self, piece: Piece) -> list[int]:
        """Shape of a piece in mt3d orientation."""
        shape = self._stored(piece)
        if piece.transpose:
            shape = shape[::-1]
        if piece.size is not None:
            shape[0] = piece.size
        elif piece.step > 1:
            shape[0] = -(-(shape[0] - piece.start) // piece.step)
        return shape

    def read(self, piece: Piece, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """The piece (mt3d orientation), restricted to ``rows`` / ``cols`` ranges; reads only those bytes
        (of an interleaved piece: the span of its rows, then every ``step``-th)."""
        f, name = self._file(piece.name), self.stored[piece.name]
        stored = self._stored(piece)
        r0, r1 = rows or (0, self.shape(piece)[0])
        a, step = piece.start + r0 * piece.step, piece.step
        rows = (a, a + (r1 - r0 - 1) * step + 1) if r1 > r0 else (a, a)
        if len(stored) == 1:
            return f.region(name, rows, index=piece.index)[::step]
        if piece.transpose:  # mt3d rows are the stored columns
            out = f.region(name, cols or (0, stored[0]), rows, index=piece.index)[:, ::step]
            return out.t()  # copied into place by the caller
        return f.region(name, rows, cols, index=piece.index)[::step]


def read_shard(
    reader: HFReader, cfg: ModelConfig, name: str, rank: int, world: int, vocab: int
) -> torch.Tensor:
    """This TP rank's shard of mt3d parameter ``name``, read slice by slice from the HF files."""
    layout: ParamLayout = layout_of(cfg, vocab, name)
    ps = pieces(cfg, name)
    if layout.dim is None:
        return torch.cat([reader.read(p) for p in ps]) if len(ps) > 1 else reader.read(ps[0])
    if layout.vocab is not None:
        from ..parallel.layers import pad_vocab

        shape = reader.shape(ps[0])
        if shape[0] != layout.vocab:
            raise HFError(f"{ps[0].name}: {shape[0]} vocabulary rows, config says {layout.vocab}")
        per = pad_vocab(layout.vocab, world) // world
        lo, hi = rank * per, min((rank + 1) * per, layout.vocab)
        out = torch.zeros((per, *shape[1:]), dtype=reader.read(ps[0], rows=(0, 1)).dtype)
        if hi > lo:
            out[: hi - lo] = reader.read(ps[0], rows=(lo, hi))
        return out
    if layout.dim == 0:
        # each fused part splits on its own: one HF tensor per part, or one HF tensor holding them all
        # (a convolution over [q, k, v] channels)
        spans = [(p, 0, reader.shape(p)[0]) for p in ps]
        if len(ps) == 1 and layout.parts and len(layout.parts) > 1:
            starts = [sum(layout.parts[:i]) for i in range(len(layout.parts))]
            spans = [(ps[0], a, n) for a, n in zip(starts, layout.parts, strict=True)]
        return torch.cat([reader.read(p, rows=(a + rank * n // world, a + (rank + 1) * n // world))
                          for p, a, n in spans])  # fmt: skip
    (p,) = ps
    n = reader.shape(p)[1]
    return reader.read(p, cols=(rank * n // world, (rank + 1) * n // world))


def hf_state_dict(cfg: ModelConfig, vocab: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors from unsharded mt3d tensors (by global name): fused tensors split or re-joined,
    interleaved rows put back in place, one matrix per ``index`` stacked."""
    grouped: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for name, tensor in full.items():
        ps = pieces(cfg, name)
        if len(ps) == 1:
            sizes = [tensor.shape[0]]
        elif all(p.size is not None for p in ps):
            sizes = [p.size for p in ps]
        else:  # separate HF tensors (q/k/v, gate/up): the layout's parts
            sizes = list(layout_of(cfg, vocab, name).parts)
        for p, chunk in zip(ps, tensor.split(sizes)):
            grouped.setdefault(p.name, []).append((p, chunk))
    result = {}
    for hf_name, chunks in grouped.items():
        matrices = {}
        for index in sorted({p.index for p, _ in chunks}, key=lambda i: -1 if i is None else i):
            mine = sorted(((p, c) for p, c in chunks if p.index == index), key=lambda pc: pc[0].start)
            if all(p.step == 1 for p, _ in mine):
                t = torch.cat([c for _, c in mine])
            else:  # interleaved: each piece's rows at start, start + step, ...
                t = mine[0][1].new_empty((sum(c.shape[0] for _, c in mine), *mine[0][1].shape[1:]))
                for p, c in mine:
                    t[p.start :: p.step] = c
            matrices[index] = t.t() if mine[0][0].transpose else t
        t = torch.stack(list(matrices.values())) if None not in matrices else matrices[None]
        result[hf_name] = t.contiguous()
    return result


_CONFIG_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}


def check_weights(reader: HFReader, cfg: ModelConfig, vocab: int, where: str) -> list[str]:
    """The HF files agree with the config before anything is allocated (headers only): every tensor an
    mt3d parameter needs exists with the shape the config implies, the stored dtype is the one the
    config names, and a tied model holds no separately trained ``lm_head``. Returns the names of the
    tensors no parameter uses (a layer the config does not have, say)."""
    from .sharding import sharding_table

    used: set[str] = set()
    for name, spec in sharding_table(cfg, vocab).items():
        ps = pieces(cfg, name)
        used.update(p.name for p in ps)
        shapes = [reader.shape(p) for p in ps]
        rows = sum(s[0] for s in shapes)
        got = (rows, *shapes[0][1:])
        if any(list(s[1:]) != list(shapes[0][1:]) for s in shapes) or tuple(got) != tuple(spec.shape):
            detail = ", ".join(f"{p.name} {tuple(s)}" for p, s in zip(ps, shapes))
            raise HFError(
                f"{where}: config.json implies {name} of shape {tuple(spec.shape)} but the weights hold "
                f"{detail}; the config does not describe these weights"
            )
    _check_dtype(reader, cfg, where)
    used |= _check_tied_head(reader, cfg, where)
    unused = sorted(set(reader.where) - used)
    if cfg.family:
        stored = lambda name: reader._file(name).shape(reader.stored[name])  # noqa: E731 - its stored shape
        get_family(cfg.family).check_unused(unused, stored, cfg, where)
    return unused


def _check_dtype(reader: HFReader, cfg: ModelConfig, where: str) -> None:
    """A config naming one 16-bit type over weights stored as the other is ambiguous (the bytes of one
    read as the other give wrong numbers without an error): refused."""
    hf = cfg.extra.get("hf_config") or {}
    named = _CONFIG_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype"))
    stored = {reader._file(n).entries[reader.stored[n]]["dtype"] for n in reader.where}
    floats = stored & set(_CONFIG_DTYPES.values())
    if named in ("F16", "BF16") and floats and named not in floats and floats <= {"F16", "BF16"}:
        raise HFError(
            f"{where}: config.json says {hf.get('dtype') or hf.get('torch_dtype')} but the weights are "
            f"stored as {', '.join(sorted(floats))}: the two 16-bit formats cannot be told apart from their "
            "bytes; fix the config's dtype or re-save the weights"
        )


def _check_tied_head(reader: HFReader, cfg: ModelConfig, where: str) -> set[str]:
    """transformers keeps a stored ``lm_head.weight`` even when the config ties it to the embedding;
    mt3d would tie them: refused unless the stored head is the embedding. Returns the stored head's
    name when it is such a copy (it is then used, as the embedding)."""
    if not cfg.tie_embeddings:
        return set()
    family = get_family(cfg.family)
    embed = family.pieces(cfg, "embed", -1, "embed.weight")[0]
    head = family.pieces(cfg, "head", -1, "weight")[0]
    if head.name == embed.name or head.name not in reader.where:
        return set()
    rows = reader.shape(embed)[0]
    for lo in range(0, rows, 4096):
        span = (lo, min(rows, lo + 4096))
        if not torch.equal(reader.read(embed, rows=span), reader.read(head, rows=span)):
            raise HFError(
                f"{where}: config.json ties the output layer to the embedding (tie_word_embeddings) but the "
                f"weights hold a different {head.name}, which transformers uses: set tie_word_embeddings to "
                "false in config.json"
            )
    return {head.name}
