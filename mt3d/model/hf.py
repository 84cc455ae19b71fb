"""HF transformers <-> mt3d: configs, tensor names, fused-tensor splits, per-rank sharded loading.

Supported: ``GPT2LMHeadModel`` (model_type gpt2) and ``LlamaForCausalLM`` (model_type llama: GQA,
RoPE scaling, tied or untied embeddings, biases on or off). Every mt3d parameter is described as a
list of *pieces* of HF tensors (row ranges, transposed for GPT-2's Conv1D), so a rank reads from
the memory-mapped safetensors files only the slices it holds: the QKV / gate-up fusions and the TP
split are applied piece by piece, and no rank ever materialises the full model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from .config import ModelConfig
from .sharding import ParamLayout, param_layout, role_of, split_name

SUPPORTED = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}


class HFError(UserError):
    """An HF directory mt3d cannot use; the message names the file, key or field."""


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + size)`` (mt3d orientation) of HF tensor ``name``; whole when size is None."""

    name: str
    transpose: bool = False
    start: int = 0
    size: int | None = None


# --- configs -------------------------------------------------------------------------------------
def read_hf_config(path: str | Path) -> dict:
    """config.json of an HF model directory, checked for a supported architecture."""
    d = Path(path)
    f = d / "config.json"
    if not d.is_dir():
        raise HFError(f"HF model directory not found: {d}")
    if not f.is_file():
        raise HFError(f"{f} not found: not an HF model directory")
    cfg = json.loads(f.read_text())
    kind = cfg.get("model_type")
    if kind not in SUPPORTED:
        arch = ", ".join(cfg.get("architectures") or []) or kind
        names = ", ".join(f"{v} ({k})" for k, v in SUPPORTED.items())
        raise HFError(f"{d}: unsupported architecture {arch!r}; supported: {names}")
    return cfg


def _rope(hf: dict) -> tuple[float, dict | None]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind not in ("linear", "dynamic", "llama3"):
        raise HFError(f"RoPE scaling type {kind!r} is not supported (linear, dynamic, llama3)")
    return theta, params


def config_from_hf(path: str | Path) -> ModelConfig:
    """The mt3d ModelConfig of an HF GPT-2 or Llama directory."""
    hf = read_hf_config(path)
    kind = hf["model_type"]
    extra = {"hf_config": hf, "hf_path": str(path)}
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise HFError(f"{path}: GPT-2 activation {act!r} is not supported (gelu_new)")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("add_cross_attention"):
            raise HFError(f"{path}: scale_attn_by_inverse_layer_idx / cross attention are not supported")
        h = hf["n_embd"]
        return ModelConfig(
            hidden=h,
            layers=hf["n_layer"],
            heads=hf["n_head"],
            vocab_size=hf["vocab_size"],
            ffn=hf.get("n_inner") or 4 * h,
            max_seq_len=hf.get("n_positions", 1024),
            position="learned",
            norm="layernorm",
            mlp="gelu",
            bias=True,
            tie_embeddings=hf.get("tie_word_embeddings", True),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            hidden_dropout=hf.get("resid_pdrop", 0.0),
            attention_dropout=hf.get("attn_pdrop", 0.0),
            init_std=hf.get("initializer_range", 0.02),
            name=f"hf:{Path(path).name}",
            extra=extra,
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"{path}: Llama activation {hf.get('hidden_act')!r} is not supported (silu)")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise HFError(f"{path}: attention_bias and mlp_bias must be equal for mt3d")
    theta, scaling = _rope(hf)
    heads = hf["num_attention_heads"]
    return ModelConfig(
        hidden=hf["hidden_size"],
        layers=hf["num_hidden_layers"],
        heads=heads,
        kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"],
        ffn=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        position="rope",
        norm="rmsnorm",
        mlp="swiglu",
        bias=bool(hf.get("attention_bias", False)),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        attention_dropout=hf.get("attention_dropout", 0.0),
        init_std=hf.get("initializer_range", 0.02),
        name=f"hf:{Path(path).name}",
        extra=extra,
    )


def hf_family(cfg: ModelConfig) -> str:
    """'gpt2' or 'llama': the transformers architecture an mt3d config exports to."""
    if (cfg.position, cfg.norm, cfg.mlp) == ("learned", "layernorm", "gelu") and cfg.bias:
        return "gpt2"
    if (cfg.position, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu"):
        return "llama"
    raise HFError(
        f"no transformers architecture matches position={cfg.position}, norm={cfg.norm}, mlp={cfg.mlp}, "
        f"bias={cfg.bias} (GPT-2: learned/layernorm/gelu/bias; Llama: rope/rmsnorm/swiglu)"
    )


def hf_config_dict(cfg: ModelConfig, vocab: int, eos_id: int | None) -> dict:
    """config.json contents for exporting ``cfg`` (the original HF config when there is one)."""
    kind = hf_family(cfg)
    base = dict(cfg.extra.get("hf_config") or {})
    if kind == "gpt2":
        new = dict(
            model_type="gpt2",
            architectures=["GPT2LMHeadModel"],
            n_embd=cfg.hidden,
            n_layer=cfg.layers,
            n_head=cfg.heads,
            n_inner=cfg.ffn,
            n_positions=cfg.max_seq_len,
            vocab_size=vocab,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            resid_pdrop=cfg.hidden_dropout,
            embd_pdrop=cfg.hidden_dropout,
            attn_pdrop=cfg.attention_dropout,
        )
    else:
        rope = {"rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {"rope_type": "default"})}
        new = dict(
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.ffn,
            max_position_embeddings=cfg.max_seq_len,
            vocab_size=vocab,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            attention_bias=cfg.bias,
            mlp_bias=cfg.bias,
            hidden_act="silu",
            rope_parameters=rope,
            # the same, in the keys transformers 4.x reads (5.x folds them into rope_parameters)
            rope_theta=cfg.rope_theta,
            rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
            attention_dropout=cfg.attention_dropout,
        )
    out = {**base, **new}
    if eos_id is not None and not base:
        out.update(bos_token_id=eos_id, eos_token_id=eos_id)
    out.setdefault("dtype", "float32")
    return out


# --- names and pieces ------------------------------------------------------------------------------
def pieces(cfg: ModelConfig, name: str) -> list[Piece]:
    """The HF tensors (and row ranges) that make up mt3d parameter ``name``."""
    layer, local = split_name(name)
    role = role_of(cfg, layer)
    kind = hf_family(cfg)
    gpt = kind == "gpt2"
    if role == "embed":
        return [Piece("transformer.wte.weight" if gpt else "model.embed_tokens.weight")]
    if role == "pos":
        return [Piece("transformer.wpe.weight")]
    if role == "final_norm":
        return [Piece(("transformer.ln_f." if gpt else "model.norm.") + local.split(".")[-1])]
    if role == "head":
        return [Piece("lm_head.weight")]
    j = layer - 2
    leaf = local.split(".")[-1]
    if gpt:
        p = f"transformer.h.{j}."
        simple = {
            "norm1": "ln_1",
            "norm2": "ln_2",
            "attn.out": "attn.c_proj",
            "mlp.up": "mlp.c_fc",
            "mlp.down": "mlp.c_proj",
        }
        module = local.rsplit(".", 1)[0]
        if module == "attn.qkv":
            h = cfg.hidden
            return [Piece(p + "attn.c_attn." + leaf, leaf == "weight", i * h, h) for i in range(3)]
        return [
            Piece(
                p + simple[module] + "." + leaf, leaf == "weight" and module != "norm1" and module != "norm2"
            )
        ]
    p = f"model.layers.{j}."
    module = local.rsplit(".", 1)[0]
    if module == "attn.qkv":
        return [Piece(p + f"self_attn.{x}_proj.{leaf}") for x in ("q", "k", "v")]
    if module == "mlp.up":
        return [Piece(p + f"mlp.{x}_proj.{leaf}") for x in ("gate", "up")]
    simple = {
        "norm1": "input_layernorm",
        "norm2": "post_attention_layernorm",
        "attn.out": "self_attn.o_proj",
        "mlp.down": "mlp.down_proj",
    }
    return [Piece(p + simple[module] + "." + leaf)]


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
            for name, e in header.items():
                if e["dtype"] not in _ST_DTYPES:
                    raise HFError(f"{path}: tensor {name} has unsupported dtype {e['dtype']}")
                if 8 + n + e["data_offsets"][1] > size:
                    raise HFError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
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

    def region(self, name: str, rows: tuple[int, int], cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows x columns of a 1-D or 2-D tensor, read straight into the result (no extra copy).

        Full-width rows are one read; a column range is one read per row (its part of the row).
        """
        import os

        e = self.entries[name]
        dtype = _ST_DTYPES[e["dtype"]]
        shape = e["shape"]
        item = torch.tensor([], dtype=dtype).element_size()
        width = shape[1] if len(shape) == 2 else 1
        c0, c1 = cols or (0, width)
        nrows = rows[1] - rows[0]
        out = torch.empty((nrows, c1 - c0) if len(shape) == 2 else (nrows,), dtype=dtype)
        raw = out.view(torch.uint8).view(nrows, -1) if nrows else None
        begin = self.base + e["data_offsets"][0]
        if nrows and (c0, c1) == (0, width):
            got = os.preadv(self.fd, [raw.numpy()], begin + rows[0] * width * item)
            if got != raw.numel():
                raise HFError(f"{self.path}: short read in {name} (truncated file?)")
        else:
            for i in range(nrows):
                off = begin + ((rows[0] + i) * width + c0) * item
                if os.preadv(self.fd, [raw[i].numpy()], off) != raw.shape[1]:
                    raise HFError(f"{self.path}: short read in {name} (truncated file?)")
        return out


class HFReader:
    """Slice-wise access to the safetensors files of an HF directory (rows read with pread)."""

    def __init__(self, path: str | Path) -> None:
        self.dir = Path(path)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.where = {k: self.dir / v for k, v in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as e:
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

    def shape(self, piece: Piece) -> list[int]:
        """Shape of a piece in mt3d orientation."""
        shape = self._file(piece.name).shape(piece.name)
        if piece.transpose:
            shape = shape[::-1]
        if piece.size is not None:
            shape[0] = piece.size
        return shape

    def read(self, piece: Piece, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """The piece (mt3d orientation), restricted to ``rows`` / ``cols`` ranges; reads only those bytes."""
        f = self._file(piece.name)
        stored = f.shape(piece.name)
        nrows = piece.size if piece.size is not None else (stored[1] if piece.transpose else stored[0])
        r0, r1 = rows or (0, nrows)
        rows = (r0 + piece.start, r1 + piece.start)
        if len(stored) == 1:
            return f.region(piece.name, rows)
        if piece.transpose:  # mt3d rows are the stored columns
            return f.region(piece.name, cols or (0, stored[0]), rows).t()  # copied into place by the caller
        return f.region(piece.name, rows, cols)


def read_shard(
    reader: HFReader, cfg: ModelConfig, name: str, rank: int, world: int, vocab: int
) -> torch.Tensor:
    """This TP rank's shard of mt3d parameter ``name``, read slice by slice from the HF files."""
    layer, local = split_name(name)
    layout: ParamLayout = param_layout(cfg, layer, local, vocab)
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
        chunks = []
        for p in ps:
            n = reader.shape(p)[0]
            chunks.append(reader.read(p, rows=(rank * n // world, (rank + 1) * n // world)))
        return torch.cat(chunks)
    (p,) = ps
    n = reader.shape(p)[1]
    return reader.read(p, cols=(rank * n // world, (rank + 1) * n // world))


def hf_state_dict(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors from unsharded mt3d tensors (by global name): fused tensors split or re-joined."""
    grouped: dict[str, list[tuple[int, torch.Tensor, bool]]] = {}
    for name, tensor in full.items():
        ps = pieces(cfg, name)
        if len(ps) == 1:
            sizes = [tensor.shape[0]]
        elif all(p.size is not None for p in ps):
            sizes = [p.size for p in ps]
        else:  # separate HF tensors (q/k/v, gate/up): the layout's parts
            layer, local = split_name(name)
            sizes = list(param_layout(cfg, layer, local, 0).parts)
        for p, chunk in zip(ps, tensor.split(sizes)):
            grouped.setdefault(p.name, []).append((p.start, chunk, p.transpose))
    result = {}
    for hf_name, chunks in grouped.items():
        chunks.sort(key=lambda c: c[0])
        t = torch.cat([c[1] for c in chunks])
        result[hf_name] = (t.t() if chunks[0][2] else t).contiguous()
    return result


def export_hf(checkpoint: str | Path, out_dir: str | Path, max_shard_size: str = "5GB") -> Path:
    """Write an HF directory (config.json, safetensors, tokenizer) from an mt3d checkpoint of any layout."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from .loading import open_source
    from .sharding import global_names

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise HFError(f"{out} exists and is not empty; choose a new directory (nothing was written)")
    source = open_source(checkpoint)
    if source.kind != "checkpoint":
        raise HFError(f"{checkpoint} is not an mt3d checkpoint (export-hf converts mt3d checkpoints)")
    cfg, vocab, reader = source.cfg, source.vocab, source._reader
    eos = None
    if source.tokenizer_dir and Path(source.tokenizer_dir).is_dir():
        from ..data.tokenizer import load_tokenizer

        eos = load_tokenizer(source.tokenizer_dir).eos_id
    full = {name: reader.full(name) for name in global_names(cfg)}
    state = hf_state_dict(cfg, full)
    cfg_dict = hf_config_dict(cfg, vocab, eos)
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
    model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
    if source.tokenizer_dir and Path(source.tokenizer_dir).is_dir():
        from ..data.tokenizer import copy_tokenizer

        copy_tokenizer(source.tokenizer_dir, tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out
