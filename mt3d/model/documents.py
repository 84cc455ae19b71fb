"""Packed samples inside the model: every document sees only itself (``mt3d.data.packing``).

A packed micro-batch carries, beside its token ids, the document index of every position of the
whole sequence ([b, n], -1 for padding; whole even under context parallelism, where every cp rank
reads the same samples, so no exchange ever needs to send it). From it, positions restart at every
document (``relative_positions``: RoPE and learned tables see what they would for the document
alone), and attention runs document by document (``attend_documents``).
"""

from __future__ import annotations

import torch

_last_spans: tuple = (None, None)
"""(documents tensor, its spans): every attention layer of a stage gets the same tensor object, so the
spans (a host copy: a device sync on GPUs) are read once per micro-batch, not once per layer."""


def document_spans(documents: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Per sample, the (start, end, document index) of each run of equal document index, in order
    (padding, -1, is a run of its own)."""
    global _last_spans
    if _last_spans[0] is documents:
        return _last_spans[1]
    out = []
    for row in documents.tolist():
        spans, start = [], 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                spans.append((start, i, row[start]))
                start = i
        out.append(spans)
    _last_spans = (documents, out)
    return out


def relative_positions(documents: torch.Tensor) -> torch.Tensor:
    """[b, n]: each position's offset from the start of its document."""
    n = documents.shape[1]
    idx = torch.arange(n, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def attend_documents(attend, q, k, v, documents: torch.Tensor, *, pattern, scale, softcap=None,
                     dropout=0.0, q_start: int = 0, k_start: int = 0, block=None,
                     kernel: str = "auto", n: int | None = None, sinks=None,
                     record=None) -> torch.Tensor:  # fmt: skip
    """``attend`` (``mt3d.model.attention.attend``) inside each document: for every sample and
    document, that document's queries see only its keys, at positions counted from the document's
    start (so local patterns, strides included, stop at a document's start as at a sequence's). Each
    piece runs ``attend`` itself: a whole document takes the fast kernels (SDPA, block-local; on GPUs
    block-local rather than FlexAttention, which compiles per shape), a piece of one (context-parallel
    chunks and halos) the dense path over that document's keys only. No mask over the whole sequence
    is built and no work is spent across documents, or on padding (its output is zero). ``n`` (the
    sequence's length, given by context parallelism's callers) is ``documents.shape[1]``.

    q [b, hq, s, d] at positions ``q_start ...``, k/v [b, hk, t, d] at ``k_start ...`` (contiguous
    ranges of the whole sequence); ``documents`` [b, n] for every position of the sequence; ``sinks``: as
    ``attend``'s (each document's queries see the sink once); ``record``: as ``attend``'s (each piece
    notes its own maxima)."""
    if kernel == "auto" and pattern is not None and q.device.type == "cuda":
        kernel = "block-local"
    kw = dict(pattern=pattern, scale=scale, softcap=softcap, dropout=dropout, block=block, kernel=kernel,
              sinks=sinks, record=record)  # fmt: skip
    # pieces by split, not slicing: a slice's backward writes a zero tensor of the whole input
    rows = []
    for spans, qi, ki, vi in zip(document_spans(documents), q.split(1), k.split(1), v.split(1), strict=True):
        where, kps, vps = _cut(ki, vi, k_start, spans)
        keys = {w[-1]: (w[0], kp, vp) for w, kp, vp in zip(where, kps, vps, strict=True)}
        pieces = []
        for (qa, qe, a, e, doc), qp in zip(*_cut(qi, None, q_start, spans), strict=True):
            if doc < 0:  # padding: no target reads it and no real token sees it, so it attends to nothing
                pieces.append(qp.new_zeros(*qp.shape[:3], v.shape[3]))
                continue
            ka, kp, vp = keys[doc]
            if ka + kp.shape[2] > qe:  # keys past this chunk's last query (none of them sees those)
                kp, vp = kp.narrow(2, 0, qe - ka), vp.narrow(2, 0, qe - ka)
            pieces.append(attend(qp, kp, vp, q_start=qa - a, k_start=ka - a, n=e - a, **kw))
        rows.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def _cut(x: torch.Tensor, y: torch.Tensor | None, start: int, spans) -> tuple:
    """The pieces of ``x`` (and ``y``) [1, h, m, d], which hold positions ``start ... start + m``, one
    per document span they meet: ((lo, hi, span start, span end, document) of each, x's pieces, y's
    pieces)."""
    m = x.shape[2]
    where = [
        (max(a, start), min(e, start + m), a, e, doc) for a, e, doc in spans if a < start + m and e > start
    ]
    sizes = [w[1] - w[0] for w in where]
    return (where, x.split(sizes, dim=2)) + ((y.split(sizes, dim=2),) if y is not None else ())
