"""Attention patterns and their kernels: the one home for attention masks.

A layer attends either globally (causal) or locally with a ``LocalPattern``. ``LocalPattern.allowed``
is *the* definition of which keys a query sees; every kernel below is tested against a dense mask
built from it. Kernels, picked by ``attend``:

* **SDPA causal**: global layers without logit soft-capping (FlashAttention on GPUs, the fused
  flash kernel on CPUs).
* **block-local**: local layers whose window is shorter than the sequence. Queries are cut into
  blocks of ``block`` rows; a query block only needs the keys from ``span`` positions before its
  first row up to its last row, so keys and values are gathered per block (a strided view, then
  one copy) and attention runs on [query block x key span] tiles with the pattern's mask. Compute
  and memory grow with ``n * (window + block)``, not ``n^2``, forward and backward, on every device
  (torch 2.13's FlexAttention has no CPU backward).
* **dense masked**: everything else (soft-capped global layers, decoding steps with a KV cache):
  scores, soft-cap, the pattern's mask, softmax in fp32.

Soft-capping (Gemma 2) is ``cap * tanh(scores / cap)`` on the scaled scores, before the mask.
Grouped-query attention never copies key/value heads: query heads are grouped under the key/value
head they share (HF's ``repeat_kv`` order: query head i uses key/value head i // group).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError


class AttentionConfigError(UserError):
    """An attention pattern that cannot be built; the message names the key."""


FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types names


@dataclass(frozen=True)
class LocalPattern:
    """Causal local attention: query i sees keys j with ``i - window < j <= i`` (exactly ``window``
    keys including itself once i >= window - 1; transformers' ``kv_idx > q_idx - sliding_window``)."""

    window: int

    def allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Boolean mask of which key positions ``k`` each query position ``q`` sees (broadcasting)."""
        return (k <= q) & (k > q - self.window)

    def history(self) -> int:
        """Past keys a future query can still see: what a generation cache must keep."""
        return self.window - 1


def _positive_int(value, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AttentionConfigError(f"model.attention.{key} must be a positive integer, got {value!r}")
    return value


ATTENTION_KEYS = {
    "window": "keys each query of a local layer sees, itself included",
    "layer_types": f"per layer '{SLIDING}' (local) or '{FULL}' (global), as in HF configs",
    "global_every": "every k-th layer (the k-th, 2k-th, ...) is global, the others local",
    "block": "query rows per tile of the block-local kernel (default: chosen from window and head size)",
}


def layer_patterns(spec: dict | None, layers: int) -> list[LocalPattern | None]:
    """One entry per layer: its LocalPattern, or None for global causal attention.

    ``spec`` is ``ModelConfig.attention``: ``{"window": W}`` (every layer local), with
    ``"layer_types": [...]`` (HF names, one per layer) or ``"global_every": k`` to mix in global
    layers. None: every layer global.
    """
    if spec is None:
        return [None] * layers
    if not isinstance(spec, dict):
        raise AttentionConfigError(f"model.attention must be an object like {{'window': 256}}, got {spec!r}")
    unknown = sorted(set(spec) - set(ATTENTION_KEYS))
    if unknown:
        raise AttentionConfigError(
            f"unknown key model.attention.{unknown[0]} (valid: {', '.join(ATTENTION_KEYS)})"
        )
    if "window" not in spec:
        raise AttentionConfigError("model.attention needs 'window' (keys each local query sees)")
    local = LocalPattern(_positive_int(spec["window"], "window"))
    if "block" in spec:
        _positive_int(spec["block"], "block")
    if "layer_types" in spec and "global_every" in spec:
        raise AttentionConfigError("model.attention: give layer_types or global_every, not both")
    if "global_every" in spec:
        k = _positive_int(spec["global_every"], "global_every")
        return [None if (i + 1) % k == 0 else local for i in range(layers)]
    types = spec.get("layer_types")
    if types is None:
        return [local] * layers
    if not isinstance(types, list) or len(types) != layers:
        got = len(types) if isinstance(types, list) else repr(types)
        raise AttentionConfigError(f"model.attention.layer_types must list {layers} layers, got {got}")
    bad = [t for t in types if t not in (FULL, SLIDING)]
    if bad:
        raise AttentionConfigError(
            f"model.attention.layer_types: unknown type {bad[0]!r} (use {SLIDING!r} or {FULL!r})"
        )
    return [local if t == SLIDING else None for t in types]


def keys_per_query(pattern: LocalPattern | None, seq_len: int) -> int:
    """Keys a query attends to in a ``seq_len`` sequence, as counted for model FLOPs: ``seq_len`` for
    global layers (the Narayanan et al. convention) and the window for local ones."""
    return seq_len if pattern is None else min(pattern.window, seq_len)


def choose_block(window: int, head_dim: int, n: int) -> int:
    """Query rows per block-local tile: about sqrt(window * head_dim), a power of two in [16, 512].

    Larger blocks waste more masked scores (a tile spans window + block keys), smaller ones copy
    keys and values more often (once per block): the product is smallest near sqrt(window * d).
    """
    target = math.sqrt(window * head_dim)
    block = 2 ** round(math.log2(max(target, 1)))
    return max(16, min(block, 512, 2 ** math.ceil(math.log2(max(n, 1)))))


_MASKS: dict = {}


def local_tile_mask(pattern: LocalPattern, n: int, block: int, span: int, device) -> torch.Tensor:
    """[blocks, block, span + block] mask of the block-local tiles (cached per shape and device).

    Row r of block j is query j*block + r; column c is key j*block - span + c. Keys before the
    sequence (left padding) are masked; keys after it are only ever seen by padding queries.
    """
    key = (pattern, n, block, span, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        blocks = -(-n // block)
        start = torch.arange(blocks, device=device)[:, None, None] * block
        q = start + torch.arange(block, device=device)[None, :, None]
        k = start - span + torch.arange(span + block, device=device)[None, None, :]
        mask = pattern.allowed(q, k) & (k >= 0)
        if len(_MASKS) > 64:
            _MASKS.clear()
        _MASKS[key] = mask
    return mask


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _math_attention(q, k, v, mask, scale, softcap, dropout):
    """softmax(cap(q k^T * scale) masked) v, in fp32 for the softmax; q/k/v share leading dims."""
    scores = _softcapped(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    low = scores.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if low else scores.dtype).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, dropout, True)
    return torch.matmul(probs, v)


def _tile_attention(q, k, v, mask, scale, softcap, dropout):
    """Attention on tiles with a mask: SDPA when no soft-cap (fused kernels), else the math path."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return _math_attention(q, k, v, mask, scale, softcap, dropout)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, hq, s, d] -> [b, hk, g*s, d]: the query heads of each key/value head stacked along s."""
    b, hq, s, d = q.shape
    return q.reshape(b, kv_heads, (hq // kv_heads) * s, d)


def dense_attention(q, k, v, mask, *, scale, softcap=None, dropout=0.0):
    """q [b, hq, s, d], k/v [b, hk, t, d], mask [s, t] bool (True: attend) or None."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    if mask is not None and hq != hk:
        mask = mask.repeat(hq // hk, 1)  # rows follow the grouped query layout
    out = _tile_attention(_grouped(q, hk), k, v, mask, scale, softcap, dropout)
    return out.reshape(b, hq, s, d)


def block_local_attention(q, k, v, pattern: LocalPattern, *, scale, softcap=None, dropout=0.0, block=None):
    """Exact local attention for a whole causal sequence (q, k, v all [b, h, n, d]) in O(n * window)."""
    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    block = block or choose_block(pattern.window, d, n)
    blocks = -(-n // block)
    span = -(-pattern.history() // block) * block  # keys before a block's first query it may need
    pad = blocks * block - n
    # queries: [b, hq, n, d] -> [b, blocks, hk, g*block, d] (the group's heads stacked per tile)
    qp = F.pad(q, (0, 0, 0, pad)).view(b, hk, g, blocks, block, d)
    qt = qp.permute(0, 3, 1, 2, 4, 5).reshape(b, blocks, hk, g * block, d)

    def tiles(x):  # [b, hk, n, d] -> [b, blocks, hk, span + block, d]
        xp = F.pad(x, (0, 0, span, pad))
        return xp.unfold(2, span + block, block).permute(0, 2, 1, 4, 3)

    mask = local_tile_mask(pattern, n, block, span, q.device)  # [blocks, block, span + block]
    mask = mask[:, None].expand(blocks, g, block, span + block).reshape(blocks, 1, g * block, span + block)
    out = _tile_attention(qt, tiles(k), tiles(v), mask, scale, softcap, dropout)
    out = out.view(b, blocks, hk, g, block, d).permute(0, 2, 3, 1, 4, 5).reshape(b, hq, blocks * block, d)
    return out[:, :, :n]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    pattern: LocalPattern | None,
    scale: float,
    softcap: float | None = None,
    dropout: float = 0.0,
    q_start: int = 0,
    k_start: int = 0,
    block: int | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions ``q_start + i`` over keys at ``k_start + j``.

    q: [b, hq, s, d]; k, v: [b, hk, t, d] (hq a multiple of hk). Returns [b, hq, s, d].
    """
    s, t = q.shape[2], k.shape[2]
    whole = q_start == 0 and k_start == 0 and s == t
    if whole and (pattern is None or pattern.window >= s):
        if softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=s > 1, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        pattern = None  # a window covering the whole sequence is global attention
    elif whole:
        return block_local_attention(
            q, k, v, pattern, scale=scale, softcap=softcap, dropout=dropout, block=block
        )
    qpos = torch.arange(q_start, q_start + s, device=q.device)[:, None]
    kpos = torch.arange(k_start, k_start + t, device=q.device)[None, :]
    mask = (kpos <= qpos) if pattern is None else pattern.allowed(qpos, kpos)
    if bool(mask.all()):
        mask = None  # e.g. one decoding step over a cache that holds just its window
    return dense_attention(q, k, v, mask, scale=scale, softcap=softcap, dropout=dropout)


def reference_attention(q, k, v, pattern: LocalPattern | None, *, scale, softcap=None):
    """Brute force: the full [n, n] mask from ``LocalPattern.allowed`` (tests compare kernels to it)."""
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    mask = pos[None, :] <= pos[:, None] if pattern is None else pattern.allowed(pos[:, None], pos[None, :])
    hk = k.shape[1]
    g = q.shape[1] // hk
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _math_attention(q, k, v, mask, scale, softcap, 0.0)
