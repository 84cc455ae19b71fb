"""Attention kernels: the one home for attention masks (the patterns themselves, which keys a query
sees, are ``mt3d.model.patterns``, re-exported here).

A layer attends either globally (causal) or locally with a ``LocalPattern`` (window W, stride s,
dilation d: sliding, strided, blocked and dilated neighbourhood attention as one family, after
NATTEN's causal ``na1d`` and the GNA paper). ``LocalPattern.allowed`` is *the* definition of which
keys a query sees; every kernel below is tested against a dense mask built from it. Kernels,
chosen by ``attend`` (``kernel`` in the attention spec overrides the automatic choice):

* **sdpa**: global layers without logit soft-capping (FlashAttention on GPUs, the fused flash
  kernel on CPUs).
* **block-local** (every device): local layers whose window is shorter than the sequence. The
  dilation groups are permuted into separate sequences; queries are cut into tiles of ``block``
  rows; a tile only needs the keys from ``span`` positions before its first row up to its last
  row, so keys and values are gathered per tile (a strided view, then one copy) and attention runs
  on [tile x (span + tile)] blocks with the pattern's mask (causal blocks of blocked attention run
  unmasked through SDPA's causal kernel). The last, incomplete stride group (whose leader is
  clipped to the last token) is computed separately. Compute and memory grow with
  ``n * (span + tile)``, not ``n^2``, forward and backward (torch 2.13's FlexAttention has no CPU
  backward).
* **flex** (CUDA): FlexAttention with a block mask built once per (pattern, length, device) from
  ``allowed`` and ``torch.compile``d; soft-capping is its score modifier. Visits only the tiles the
  pattern needs (the speed-of-light model of ``mt3d.planner.sparsity``).
* **dense**: scores, soft-cap, the pattern's full mask, softmax in fp32: soft-capped global layers
  off CUDA, decoding steps with a KV cache, and the reference the others are tested against.

Soft-capping (Gemma 2) is ``cap * tanh(scores / cap)`` on the scaled scores, before the mask.

Attention sinks (gpt-oss): a learned logit per query head joins every query's softmax once, as a key
every query sees whose value is zero, so the weights of the real keys sum to less than one. SDPA and
the block-local tiles take it as one extra key: the query gains a column holding sink / scale and
the keys a zero column (``_with_sink``), and the sink key is the unit vector on that column; a whole
causal sequence puts it first and a dummy first query before the others, so SDPA's causal kernels
still apply; the sink's gradient flows through the query column. FlexAttention instead scales its
output by sigmoid(log-sum-exp - sink), the softmax share the real keys keep. Sinks and soft-capping
are not combined (no family has both).

Grouped-query attention never copies key/value heads: query heads are grouped under the key/value
head they share (HF's ``repeat_kv`` order: query head i uses key/value head i // group).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .logit_max import max_logits
from .patterns import (  # noqa: F401 - re-exported: the patterns are part of this module's interface
    ATTENTION_KEYS,
    FULL,
    KERNELS,
    SLIDING,
    AttentionConfigError,
    LocalPattern,
    keys_per_query,
    layer_patterns,
)


# --- kernels ------------------------------------------------------------------------------------
def choose_block(pattern: LocalPattern, head_dim: int, n: int) -> int:
    """Query rows per block-local tile.

    A tile costs (span + tile) key columns per query row and copies nothing, but small tiles run
    SDPA's fused kernel less efficiently: tile = sqrt(W * head_dim) as a power of two in [16, 512]
    measured best for sliding windows on CPUs. With a stride the tile is a multiple of it, or the
    stride itself up to 1024 (blocked attention: tile = W, span 0, each tile one causal block), so
    that a tile's queries share one window start.
    """
    target = 2 ** round(math.log2(max(math.sqrt(pattern.window * head_dim), 1)))
    target = max(16, min(target, 512))
    s = pattern.stride
    if s >= target:
        target = s if s <= 1024 else next(b for b in range(1024, 0, -1) if s % b == 0)
    elif s > 1:
        target = s * max(1, round(target / s))
    return max(1, min(target, 2 ** math.ceil(math.log2(max(n, 1)))))


def _span(pattern: LocalPattern, block: int) -> int:
    """Keys before a tile's first query that some query of the tile sees (no stride group cut short):
    the largest tile start - window start, over one period of the tile and stride grid."""
    s, w = pattern.stride, pattern.window
    i = torch.arange(block * s // math.gcd(block, s) + block)
    lead = (i // s) * s + (s - 1)
    return max(0, int(((i // block) * block - (lead - w + 1)).max()))


_MASKS: dict = {}


def local_tile_mask(
    pattern: LocalPattern, n: int, block: int, span: int, device
) -> tuple[torch.Tensor, bool]:
    """[blocks, block, span + block] mask of the block-local tiles of an n-token sequence whose stride
    groups are all complete (cached), and whether every tile is exactly causal (blocked attention).

    Row r of tile t is query t*block + r; column c is key t*block - span + c. Keys before the
    sequence (left padding) are masked; keys after it are only ever seen by padding queries.
    """
    key = (pattern, n, block, span, str(device))
    if key not in _MASKS:
        blocks = -(-n // block)
        start = torch.arange(blocks, device=device)[:, None, None] * block
        q = start + torch.arange(block, device=device)[None, :, None]
        k = start - span + torch.arange(span + block, device=device)[None, None, :]
        mask = pattern.allowed(q, k) & (k >= 0)
        causal = span == 0 and bool((mask == torch.ones(block, block, device=device).tril().bool()).all())
        if len(_MASKS) > 64:
            _MASKS.clear()
        _MASKS[key] = (mask, causal)
    return _MASKS[key]


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _math_attention(q, k, v, mask, scale, softcap, dropout):
    """softmax(cap(q k^T * scale) masked) v, the softmax in fp32 (fp64 for fp64); q/k/v share leading dims."""
    scores = _softcapped(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    low = scores.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32 if low else scores.dtype).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, dropout, True)
    return torch.matmul(probs, v)


def _tile_attention(q, k, v, mask, scale, softcap, dropout, causal=False):
    """Attention on tiles with a mask: SDPA when no soft-cap (fused kernels), else the math path."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, is_causal=causal
        )
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return _math_attention(q, k, v, mask, scale, softcap, dropout)


_SINK_PAD = 8
"""Columns added to q/k/v for an attention sink (the first carries it; 8 keeps head_dim's alignment)."""


def _with_sink(q, k, v, sinks: torch.Tensor, scale: float):
    """q [b, hq, s, d], k/v [b, hk, t, d] with the sink columns: q's first holds sinks[h] / scale (so
    its product with the sink key, scaled, is the sink logit), k's and v's are zero (no real key sees
    the sink column; the sink's value is zero)."""
    col = (sinks.to(q.dtype) / scale).view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    q = torch.cat([q, col, q.new_zeros(*q.shape[:-1], _SINK_PAD - 1)], dim=-1)
    k, v = (F.pad(x, (0, _SINK_PAD)) for x in (k, v))
    return q, k, v


def _sink_first(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v [..., t, d + pad] (``_with_sink``'s) with the sink key first along the keys (dim -2): the unit
    vector on the sink column, its value zero."""
    k, v = (torch.cat([x.new_zeros(*x.shape[:-2], 1, x.shape[-1]), x], dim=-2) for x in (k, v))
    k[..., 0, -_SINK_PAD] = 1.0
    return k, v


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[..., hq, s, d] -> [..., hk, g*s, d]: the query heads of each key/value head stacked along s."""
    *lead, hq, s, d = q.shape
    return q.reshape(*lead, kv_heads, (hq // kv_heads) * s, d)


def dense_attention(q, k, v, mask, *, scale, softcap=None, dropout=0.0, sink=False):
    """q [..., hq, s, d], k/v [..., hk, t, d], mask [s, t] or [..., 1, s, t] bool (True: attend) or None;
    ``sink``: q/k/v carry the sink column (``_with_sink``): the sink key joins first, seen by all."""
    if sink:
        k, v = _sink_first(k, v)
        if mask is not None:
            mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    hq, s, d = q.shape[-3:]
    hk = k.shape[-3]
    if mask is not None and hq != hk:  # rows follow the grouped query layout
        mask = mask.repeat(*([1] * (mask.dim() - 2)), hq // hk, 1)
    out = _tile_attention(_grouped(q, hk), k, v, mask, scale, softcap, dropout)
    return out.reshape(q.shape)


def _to_groups(x: torch.Tensor, d: int) -> torch.Tensor:
    """[b, h, n, hd] -> [b*d, h, ceil(n/d), hd]: dilation group g of sequence b at batch b*d + g."""
    if d == 1:
        return x
    b, h, n, hd = x.shape
    m = -(-n // d)
    x = _pad_seq(x, 0, m * d - n).view(b, h, m, d, hd)
    return x.permute(0, 3, 1, 2, 4).reshape(b * d, h, m, hd)


def _pad_seq(x: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """Zero rows before and after along the sequence (dim 2); no copy when there are none."""
    return x if before == after == 0 else F.pad(x, (0, 0, before, after))


def _from_groups(x: torch.Tensor, d: int, n: int) -> torch.Tensor:
    """Inverse of ``_to_groups``."""
    if d == 1:
        return x
    bd, h, m, hd = x.shape
    return x.view(bd // d, d, h, m, hd).permute(0, 2, 3, 1, 4).reshape(bd // d, h, m * d, hd)[:, :, :n]


def _tiles(q, k, v, pattern: LocalPattern, scale, softcap, dropout, block, sink=False):
    """Block-local attention of whole sequences (no dilation, no stride group cut short).

    Laid out for SDPA's fused kernels as 4-D [batch x kv head, tile, rows, head_dim]: tile t's keys
    are a strided view of the (left-padded) keys, [t*block - span, t*block + block), with no copy;
    the query heads sharing a key/value head are stacked in each tile's rows. ``sink``: q/k/v carry
    the sink column (``_with_sink``) and every tile gets the sink key first (a copy of the tiles).
    """
    b, hq, n, hd = q.shape
    hk = k.shape[1]
    g = hq // hk
    span = _span(pattern, block)
    blocks = -(-n // block)
    pad = blocks * block - n
    qt = _pad_seq(q, 0, pad).reshape(b * hk, g, blocks, block, hd)
    qt = qt.squeeze(1) if g == 1 else qt.transpose(1, 2).reshape(b * hk, blocks, g * block, hd)

    def tiles(x):  # [b, hk, n, hd] -> [b*hk, blocks, span + block, hd], a view of the padded keys
        xp = _pad_seq(x, span, pad)
        return xp.unfold(2, span + block, block).transpose(-1, -2).reshape(b * hk, blocks, span + block, hd)

    mask, causal = local_tile_mask(pattern, n, block, span, q.device)  # [blocks, block, span + block]
    kt, vt = tiles(k), tiles(v)
    if sink:  # the sink key (and its zero value) first in every tile, seen by every row
        kt, vt = _sink_first(kt, vt)
        mask, causal = torch.cat([mask.new_ones(blocks, block, 1), mask], dim=2), False
    if causal and g == 1:  # blocked attention: every tile is one causal block
        out = _tile_attention(qt, kt, vt, None, scale, softcap, dropout, causal=True)
    else:
        rows = mask if g == 1 else mask.repeat(1, g, 1)
        out = _tile_attention(qt, kt, vt, rows[None], scale, softcap, dropout)
    if g > 1:
        out = out.view(b * hk, blocks, g, block, hd).transpose(1, 2)
    return out.reshape(b, hq, blocks * block, hd)[:, :, :n]


def _tail(q, k, v, pattern: LocalPattern, start: int, sizes: list[int], scale, softcap, dropout, sink=False):
    """Queries from ``start`` on (group units) of every dilation group, whose stride group the
    sequence cuts short: dense attention over the keys they can reach, masked per group length."""
    m = q.shape[2]
    k0 = max(0, start - pattern.window + 1)
    qpos = torch.arange(start, m, device=q.device)[:, None]
    kpos = torch.arange(k0, m, device=q.device)[None, :]
    masks = []
    for n_g in sizes:  # one per dilation group; padding queries (past n_g) see only themselves
        mask = pattern.grouped().allowed(qpos, kpos, n_g)
        masks.append(torch.where(qpos < n_g, mask, kpos == qpos))
    mask = torch.stack(masks).repeat(q.shape[0] // len(sizes), 1, 1)[:, None]  # [b*d, 1, s, t]
    return dense_attention(
        q[:, :, start:], k[:, :, k0:], v[:, :, k0:], mask, scale=scale, softcap=softcap, dropout=dropout,
        sink=sink,
    )  # fmt: skip


def block_local_attention(q, k, v, pattern: LocalPattern, *, scale, softcap=None, dropout=0.0, block=None,
                          sink=False):  # fmt: skip
    """Exact local attention for a whole causal sequence (q [b, hq, n, hd], k/v [b, hk, n, hd]) with
    compute and memory proportional to n * (span + block); ``sink``: q/k/v carry the sink column."""
    n, d, s = q.shape[2], pattern.dilation, pattern.stride
    sizes = [-(-(n - g) // d) for g in range(min(d, n))]
    qg, kg, vg = (_to_groups(x, d) for x in (q, k, v))
    m = qg.shape[2]
    if len(sizes) < d:  # fewer tokens than dilation groups: the missing groups are all padding
        sizes += [0] * (d - len(sizes))
    body = m if s == 1 else (min(sizes) // s) * s  # queries whose stride group is complete everywhere
    grouped = pattern.grouped()
    block = block or choose_block(pattern, q.shape[-1], body)
    parts = []
    if body > 0:
        parts.append(_tiles(qg[:, :, :body], kg[:, :, :body], vg[:, :, :body], grouped, scale, softcap,
                            dropout, block, sink))  # fmt: skip
    if body < m:
        parts.append(_tail(qg, kg, vg, pattern, body, sizes, scale, softcap, dropout, sink))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return _from_groups(out, d, n)


_FLEX: dict = {}


def flex_local_attention(q, k, v, pattern: LocalPattern | None, *, scale, softcap=None, compiled=True,
                         sinks=None):  # fmt: skip
    """FlexAttention (no dropout) with the pattern's block mask, built once per (pattern, length,
    device); soft-capping as its score modifier. Global causal when ``pattern`` is None. ``sinks``
    [hq]: the kernel also returns each row's log-sum-exp L, and the output is scaled by
    sigmoid(L - sink) = e^L / (e^L + e^sink), the share of the softmax the real keys keep (L's
    gradient flows through FlexAttention's backward). On an H200 (64/8 heads of 64, 4096 tokens, window
    128) a score modifier reading the sinks ran 219x slower (it captures a tensor that needs its
    gradient) and a sink key 3.8x slower (one more key block per tile, head_dim padded)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    n = q.shape[2]
    sink = sinks is not None
    key = (pattern, n, str(q.device))
    if key not in _FLEX:

        def mask_mod(b, h, qi, kv):
            return kv <= qi if pattern is None else pattern.allowed(qi, kv, n)

        if len(_FLEX) > 32:
            _FLEX.clear()
        _FLEX[key] = create_block_mask(mask_mod, None, None, n, n, device=q.device)
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, qi, kv):
            return softcap * torch.tanh(score / softcap)

    fn = _compiled_flex() if compiled else flex_attention
    gqa = q.shape[1] != k.shape[1]
    out = fn(
        q, k, v, score_mod=score_mod, block_mask=_FLEX[key], scale=scale, enable_gqa=gqa, return_lse=sink
    )
    if not sink:
        return out
    out, lse = out
    keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))  # [b, hq, n]
    return (out.float() * keep[..., None]).to(out.dtype)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def choose_kernel(requested: str, pattern, device: torch.device, softcap, dropout: float) -> str:
    """The kernel for one call: ``requested`` unless 'auto'; auto picks flex on CUDA for local and
    soft-capped layers (no dropout), block-local for local layers elsewhere, SDPA for plain global."""
    if requested != "auto":
        return requested
    cuda = device.type == "cuda" and dropout == 0
    if pattern is None:
        return "sdpa" if softcap is None else ("flex" if cuda else "dense")
    return "flex" if cuda else "block-local"


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
    kernel: str = "auto",
    n: int | None = None,
    documents: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    record=None,
) -> torch.Tensor:
    """Causal attention of queries at positions ``q_start + i`` over keys at ``k_start + j`` in a
    sequence of ``n`` tokens (default: it ends with the last query).

    q: [b, hq, s, d]; k, v: [b, hk, t, d] (hq a multiple of hk). Returns [b, hq, s, d].
    ``documents`` [b, n]: the document index of every position of the whole sequence (packed samples,
    ``mt3d.data.packing``): attention then stays inside each document (``attend_documents``).
    ``sinks`` [hq]: each query head's sink logit, joining every query's softmax once.
    ``record``: called with each query head's largest logit of this call (``logit_max``: QK-clip).
    """
    if sinks is not None and softcap is not None:
        raise AttentionConfigError("attention sinks with soft-capped scores are not supported")
    if documents is not None:
        from .documents import attend_documents

        return attend_documents(attend, q, k, v, documents, pattern=pattern, scale=scale, softcap=softcap,
                                dropout=dropout, q_start=q_start, k_start=k_start, block=block,
                                kernel=kernel, sinks=sinks, record=record)  # fmt: skip
    d = q.shape[-1]
    s, t = q.shape[2], k.shape[2]
    n = q_start + s if n is None else n
    if record is not None:
        record(max_logits(q, k, pattern=pattern, scale=scale, q_start=q_start, k_start=k_start, n=n))
    whole = q_start == 0 and k_start == 0 and s == t == n
    if whole and pattern is not None and pattern.dilation == 1 and pattern.window >= s:
        pattern = None  # every window reaches the first token: global attention
    name = choose_kernel(kernel, pattern, q.device, softcap, dropout) if whole else "dense"
    if name == "flex":
        if dropout > 0 or (q.device.type != "cuda" and torch.is_grad_enabled()):
            raise AttentionConfigError(
                "attention kernel 'flex' needs CUDA and no attention dropout for training "
                "(torch 2.13's FlexAttention has no CPU backward); use 'block-local'"
            )
        return flex_local_attention(q, k, v, pattern, scale=scale, softcap=softcap, sinks=sinks)
    sink = sinks is not None
    if sink:  # the sink column on q, k and v; outputs are cut back to d
        q, k, v = _with_sink(q, k, v, sinks, scale)
    if name == "block-local" and pattern is not None:
        out = block_local_attention(
            q, k, v, pattern, scale=scale, softcap=softcap, dropout=dropout, block=block, sink=sink
        )
        return out[..., :d]
    if pattern is None and softcap is None and name != "dense":
        if sink:  # the sink key first, and a dummy first query (seeing only it): causal still fits
            k, v = _sink_first(k, v)
            q = F.pad(q, (0, 0, 1, 0))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=dropout,
            is_causal=s > 1 or sink,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out[:, :, 1:, :d] if sink else out
    qpos = torch.arange(q_start, q_start + s, device=q.device)[:, None]
    kpos = torch.arange(k_start, k_start + t, device=q.device)[None, :]
    mask = (kpos <= qpos) if pattern is None else pattern.allowed(qpos, kpos, n)
    if bool(mask.all()):
        mask = None  # e.g. one decoding step over a cache that holds just its window
    return dense_attention(q, k, v, mask, scale=scale, softcap=softcap, dropout=dropout, sink=sink)[..., :d]


def reference_attention(q, k, v, pattern: LocalPattern | None, *, scale, softcap=None, sinks=None):
    """Brute force: the full [n, n] mask from ``LocalPattern.allowed`` (tests compare kernels to it);
    ``sinks`` [hq] as a logit column beside the scores, dropped after the softmax (transformers' way)."""
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    if pattern is None:
        mask = pos[None, :] <= pos[:, None]
    else:
        mask = pattern.allowed(pos[:, None], pos[None, :], n)
    hk = k.shape[1]
    g = q.shape[1] // hk
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if sinks is None:
        return _math_attention(q, k, v, mask, scale, softcap, 0.0)
    scores = _softcapped(torch.matmul(q, k.transpose(-1, -2)) * scale, softcap).masked_fill(
        ~mask, float("-inf")
    )
    col = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    low = scores.dtype in (torch.float16, torch.bfloat16)
    probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1, dtype=torch.float32 if low else None)
    probs = probs[..., :-1].to(q.dtype)
    return torch.matmul(probs, v)
