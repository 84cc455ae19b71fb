"""Inference with a loaded model: full logits at any tp x pp, text evaluation, generation with a KV cache.

Pipeline stages are run one after the other (no micro-batch overlap is needed without a
backward pass), passing the hidden state with point-to-point sends; TP ranks gather the
vocabulary slices of the logits. Generation runs at pp = 1 with any tp.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel.cross_entropy import IGNORE_INDEX
from ..parallel.mappings import gather_from_tp
from ..parallel.state import ParallelState
from .blocks import Attention, PositionsAndDropout, TransformerBlock, split_stream


def _neighbour(state: ParallelState, stage: int) -> int:
    coord = state.topology.coord(state.global_rank)
    return state.topology.rank_of(**{**coord, "pp": stage})


@torch.no_grad()
def logits(model, ids, state: ParallelState, hidden: int) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] on the last stage (every TP rank of it); None elsewhere.
    ``ids``: [b, s], or packed documents' (ids, document ids [b, n]) (``mt3d.data.packing``)."""
    ids, documents = ids if isinstance(ids, tuple) else (ids, None)
    pp = state.pp
    if pp.size == 1 or state.is_first_stage:
        x = model(ids if documents is None else (ids, documents))
    else:
        dtype = next(model.parameters()).dtype
        x = torch.empty(ids.shape[0], ids.shape[1], hidden, dtype=dtype, device=ids.device)
        dist.recv(x, src=_neighbour(state, pp.rank - 1))
        x = model(x if documents is None else (x, documents))  # every stage has the document ids
    if pp.size > 1:
        x, _, _ = split_stream(x)  # a sparse model's router statistics are for training only
        if not state.is_last_stage:
            dist.send(x.contiguous(), dst=_neighbour(state, pp.rank + 1))
            return None
    return gather_from_tp(x, state.tp)[..., : model.vocab_size]


def windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) windows over n tokens: each token is scored once, with up to
    seq_len - stride tokens of context from the previous window (HF's sliding-window perplexity)."""
    out, prev_end = [], 0
    for begin in range(0, max(1, n - 1), stride):
        end = min(begin + seq_len, n)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end == n:
            break
    return out


def _window_batch(tokens, begin: int, end: int, scored: int, cp) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, next-token targets, targets scored) of one window: position p predicts token p + 1,
    scored when that token is in the window's ``scored`` tail. With context parallelism padded to a
    multiple of 2 cp (padding at the end changes no earlier position under causal attention) and cut
    into this rank's chunks."""
    ids = tokens[begin:end].unsqueeze(0)
    target = torch.full_like(ids, IGNORE_INDEX)
    target[:, :-1] = ids[:, 1:]
    target[:, : max(0, ids.shape[1] - scored - 1)] = IGNORE_INDEX
    count = int((target != IGNORE_INDEX).sum())
    if cp.size > 1:
        from ..parallel.context import split_sequence

        pad = -ids.shape[1] % (2 * cp.size)
        ids = F.pad(ids, (0, pad), value=0)
        target = F.pad(target, (0, pad), value=IGNORE_INDEX)
        ids, target = split_sequence(ids, cp), split_sequence(target, cp)
    return ids, target, count


@torch.no_grad()
def evaluate_tokens(model, tokens: torch.Tensor, state: ParallelState, seq_len: int, stride: int) -> dict:
    """Loss and perplexity of a 1-D token tensor (identical on every rank); with context parallelism
    each window is cut over the cp ranks and their sums added."""
    if stride <= 0 or stride > seq_len:
        raise ValueError(f"stride must be in 1..seq_len ({seq_len}), got {stride}")
    nll, count = torch.zeros((), dtype=torch.float64, device=tokens.device), 0
    hidden = model.config.hidden
    for begin, end, scored in windows(tokens.numel(), seq_len, stride):
        ids, target, scored_here = _window_batch(tokens, begin, end, scored, state.cp)
        out = logits(model, ids, state, hidden)
        if out is not None:
            loss = F.cross_entropy(
                out.float().reshape(-1, out.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
                reduction="sum",
            )  # fmt: skip
            nll += loss.double()
        count += scored_here
    return _summed(nll, count, state)


def _summed(nll: torch.Tensor, count: int, state: ParallelState) -> dict:
    """Loss and perplexity from this rank's sum of token losses (a cp rank's chunks; the last stage's
    sum with pp) and the number of tokens scored."""
    if state.cp.size > 1:
        dist.all_reduce(nll, group=state.cp.group)
    if state.pp.size > 1:  # the last stage has the sum: share it with every stage
        dist.broadcast(nll, src=_neighbour(state, state.pp.size - 1), group=state.pp.group)
    loss = nll.item() / max(count, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}


@torch.no_grad()
def evaluate_documents(model, packed, state: ParallelState, batch: int = 4) -> dict:
    """Loss and perplexity of the supervised tokens (the loss mask; every token but a document's first
    for plain text) of ``packed`` (``mt3d.data.packing.PackedDocuments``: documents packed into
    samples with document masking, each scored as if run alone). Also the documents, those truncated
    to the sample length and the packing efficiency."""
    from ..data.packing import IGNORE, packed_batch

    nll, count = torch.zeros((), dtype=torch.float64), 0
    device = next(model.parameters()).device
    for begin in range(0, len(packed), batch):
        samples = [packed[i] for i in range(begin, min(begin + batch, len(packed)))]
        (ids, documents), target = packed_batch(samples)
        count += int((target != IGNORE).sum())
        if state.cp.size > 1:
            from ..parallel.context import split_sequence

            ids, target = split_sequence(ids, state.cp), split_sequence(target, state.cp)
        out = logits(model, (ids.to(device), documents.to(device)), state, model.config.hidden)
        if out is not None:
            flat = out.float().flatten(0, 1)
            loss = F.cross_entropy(flat, target.to(device).flatten(), ignore_index=IGNORE, reduction="sum")
            nll += loss.double().cpu()
    res = _summed(nll.to(device), count, state)
    res.update(documents=int(packed.doc_ids.size), truncated=packed.truncated,
               packing_efficiency=round(packed.efficiency, 4))  # fmt: skip
    return res


@torch.no_grad()
def document_logps(model, packed, state: ParallelState, batch: int = 4) -> torch.Tensor:
    """float64 [documents of ``packed``'s dataset]: each document's log-probability summed over its
    supervised tokens (a completion's, for preference pairs packed whole: ``PackedDocuments(pairs=True)``;
    documents ``packed`` leaves out stay 0), the same on every rank. Only the last stage has logits:
    its TP, ep and dp rank 0 sum its positions (a cp rank its chunks'), then one all-reduce over the
    world."""
    from ..data.packing import packed_batch

    device = next(model.parameters()).device
    out = torch.zeros(len(packed.ds), dtype=torch.float64, device=device)
    for begin in range(0, len(packed), batch):
        samples = [packed[i] for i in range(begin, min(begin + batch, len(packed)))]
        (ids, documents), labels = packed_batch(samples)
        scored = _target_logps(model, state, ids, documents, labels[..., 0], labels[..., 2])
        if scored is not None:
            lp, source = scored
            out.index_add_(0, source, lp)
    _sum_over_world(out)
    return out


def _target_logps(model, state: ParallelState, ids, documents, target, where):
    """(log-probability of every scored target, its ``where``) of one packed batch (``where``: any
    per-position index), on the one rank per replica that counts them: the last stage's TP, ep and dp
    rank 0 (a cp rank its chunks'); None elsewhere. Every rank must call it (the pipeline's sends)."""
    from ..data.packing import IGNORE

    device = next(model.parameters()).device
    if state.cp.size > 1:
        from ..parallel.context import split_sequence

        ids, target, where = (split_sequence(t, state.cp) for t in (ids, target, where))
    got = logits(model, (ids.to(device), documents.to(device)), state, model.config.hidden)
    holds = state.is_last_stage and state.tp.rank == 0 and state.ep.rank == 0 and state.dp.rank == 0
    if got is None or not holds:
        return None
    target, where = target.to(device), where.to(device)
    scored = target != IGNORE
    lp = got.double().log_softmax(-1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
    return lp[scored], where[scored]


def _sum_over_world(*tensors: torch.Tensor) -> None:
    """Sum each tensor over every rank of the run, in place (one holder per value: the rest hold 0)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in tensors:
            dist.all_reduce(t)


@torch.no_grad()
def token_logps(model, packed, state: ParallelState, batch: int = 4) -> torch.Tensor:
    """float64 [tokens of ``packed``'s dataset]: each token's log-probability given the tokens before it
    in its document, NaN where none is computed (a document's first token, tokens past the sample
    length of a truncated one, documents ``packed`` leaves out); the same on every rank. ``packed``:
    ``PackedDocuments(sources=True)``, so each position names its document. The last stage's TP, ep
    and dp rank 0 score its positions (a cp rank its chunks'), then one all-reduce over the world."""
    import numpy as np

    from ..data.packing import IGNORE

    device = next(model.parameters()).device
    ds = packed.ds
    out = torch.zeros(ds.num_tokens, dtype=torch.float64, device=device)
    seen = torch.zeros(ds.num_tokens, dtype=torch.float64, device=device)
    offsets = np.asarray(ds.offsets, dtype=np.int64)
    for begin in range(0, len(packed), batch):
        samples = [packed[i] for i in range(begin, min(begin + batch, len(packed)))]
        tokens, doc = np.stack([s.tokens for s in samples]), np.stack([s.doc for s in samples])
        source = np.stack([s.source for s in samples])
        place = np.zeros_like(source)  # each position's index in the dataset's token stream
        for row in range(len(samples)):
            for k in np.unique(doc[row][doc[row] >= 0]):
                at = np.nonzero(doc[row] == k)[0]
                place[row, at] = offsets[source[row, at[0]]] + np.arange(at.size)
        same = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0)
        target = torch.from_numpy(np.where(same, tokens[:, 1:], IGNORE))
        ids, where = torch.from_numpy(tokens[:, :-1].copy()), torch.from_numpy(place[:, 1:].copy())
        documents = torch.from_numpy(doc[:, :-1].astype(np.int64))
        scored = _target_logps(model, state, ids, documents, target, where)
        if scored is not None:
            lp, at = scored
            out.index_put_((at,), lp)
            seen.index_put_((at,), torch.ones_like(lp))
    _sum_over_world(out, seen)
    return torch.where(seen > 0, out, torch.full_like(out, math.nan))


class KVCache:
    """Past keys and values of every attention layer, for one generation.

    A local layer keeps only the keys a future query can still see (``pattern.history()``: the
    last window - 1), so its memory does not grow with the generated length; global layers keep all.
    """

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.length = 0
        self.recurrent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """A Gated DeltaNet layer's (by id) convolution tail [b, taps - 1, channels] and state [b, value
        heads, dk, dv] after the tokens so far (``mt3d.model.gdn``): constant in the generated length."""

    def update(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, pattern=None):
        """Add the new keys/values of ``layer``; returns (keys, values, position of the first key)
        covering everything the new queries may see."""
        key = id(layer)
        start = self.length
        if key in self.kv:
            pk, pv, start = self.kv[key]
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        keep = k.shape[2] if pattern is None else min(k.shape[2], pattern.history())
        drop = k.shape[2] - keep
        self.kv[key] = (k[:, :, drop:], v[:, :, drop:], start + drop)
        return k, v, start

    def step(self, layer, run) -> torch.Tensor:
        """``run(tail, state)`` of a Gated DeltaNet layer from its cached tail and state (None at first);
        it returns (outputs, new tail, new state), which are kept."""
        out, tail, state = run(*self.recurrent.get(id(layer), (None, None)))
        self.recurrent[id(layer)] = (tail, state)
        return out

    def keys_held(self) -> dict[int, int]:
        """Keys held per layer (by layer id): what the cache costs."""
        return {key: kv[0].shape[2] for key, kv in self.kv.items()}


@torch.no_grad()
def step_logits(model, ids: torch.Tensor, cache: KVCache, state: ParallelState) -> torch.Tensor:
    """Logits of the last position after feeding ``ids`` (new tokens only) through a pp = 1 model."""
    x = ids
    *body, head = model.forward_funcs
    for f in body:
        if isinstance(f, TransformerBlock):
            x = f(x, cache)
        elif isinstance(f, PositionsAndDropout):
            x = f(x, offset=cache.length)
        else:
            x = f(x)
    cache.length += ids.shape[1]
    x, _, _ = split_stream(x)  # a sparse model's router statistics are for training only
    return gather_from_tp(head(x[:, -1:]), state.tp)[:, -1, : model.vocab_size].float()


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, generator
) -> torch.Tensor:
    """Next token ids [b] from [b, V] logits: greedy when temperature == 0."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    prompt: torch.Tensor,
    state: ParallelState,
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Continue ``prompt`` [b, s]; each new token costs one position thanks to the KV cache.

    Every TP rank samples with the same seeded generator from the same gathered logits, so all
    ranks produce the same tokens.
    """
    if state.pp.size != 1:
        raise ValueError("generation runs at pipeline = 1 (use tp for large models)")
    limit = model.config.position_limit
    gen = torch.Generator(device=prompt.device).manual_seed(seed)
    cache = KVCache()
    out = prompt
    next_logits = step_logits(model, prompt, cache, state)
    for _ in range(max_new_tokens):
        if limit is not None and cache.length >= limit:
            break
        tok = sample_next(next_logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        out = torch.cat([out, tok[:, None]], dim=1)
        if eos_id is not None and bool((tok == eos_id).all()):
            break
        next_logits = step_logits(model, tok[:, None], cache, state)
    return out
