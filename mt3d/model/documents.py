"""Packed samples inside the model: every document sees only itself (``mt3d.data.packing``).

A packed micro-batch carries, beside its token ids, the document index of every position of the
whole sequence ([b, n], -1 for padding; whole even under context parallelism, where every cp rank
reads the same samples, so no exchange ever needs to send it). From it, positions restart at every
document (``relative_positions``: RoPE and learned tables see what they would for the document
alone), and attention runs document by document (``attend_documents``).
"""

from __future__ import annotations

import torch


def document_spans(documents: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per sample, the (start, end) of each run of equal document index, in order (padding, -1, is a
    run of its own)."""
    out = []
    for row in documents.tolist():
        spans, start = [], 0
        for i in range(1, len(row) + 1):
            if i == len(row) or row[i] != row[start]:
                spans.append((start, i))
                start = i
        out.append(spans)
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
                     kernel: str = "auto", n: int | None = None) -> torch.Tensor:  # fmt: skip
    """``attend`` (``mt3d.model.attention.attend``) inside each document: for every sample and
    document, that document's queries see only its keys, at positions counted from the document's
    start (so local patterns, strides included, stop at a document's start as at a sequence's). Each
    piece runs ``attend`` itself: a whole document takes the fast kernels (SDPA, block-local; on GPUs
    block-local rather than FlexAttention, which compiles per shape), a piece of one (context-parallel
    chunks and halos) the dense path over that document's keys only. No mask over the whole sequence
    is built and no work is spent across documents. ``n`` (the sequence's length, given by context
    parallelism's callers) is ``documents.shape[1]``.

    q [b, hq, s, d] at positions ``q_start ...``, k/v [b, hk, t, d] at ``k_start ...`` (contiguous
    ranges of the whole sequence); ``documents`` [b, n] for every position of the sequence."""
    s, t = q.shape[2], k.shape[2]
    if kernel == "auto" and pattern is not None and q.device.type == "cuda":
        kernel = "block-local"
    rows = []
    for i, spans in enumerate(document_spans(documents)):
        pieces = []
        for a, e in spans:
            qa, qe = max(a, q_start), min(e, q_start + s)
            if qa >= qe:
                continue
            ka, ke = max(a, k_start), min(e, k_start + t, qe)  # its keys up to its last query here
            qs, ks = slice(qa - q_start, qe - q_start), slice(ka - k_start, ke - k_start)
            pieces.append(
                attend(
                    q[i : i + 1, :, qs],
                    k[i : i + 1, :, ks],
                    v[i : i + 1, :, ks],
                    pattern=pattern,
                    scale=scale,
                    softcap=softcap,
                    dropout=dropout,
                    q_start=qa - a,
                    k_start=ka - a,
                    block=block,
                    kernel=kernel,
                    n=e - a,
                )  # fmt: skip
            )
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)
