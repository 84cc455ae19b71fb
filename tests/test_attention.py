"""Attention patterns and kernels against the brute-force mask, forward and backward; bad specs."""

import pytest
import torch

from mt3d.model.attention import (
    AttentionConfigError,
    LocalPattern,
    attend,
    block_local_attention,
    flex_local_attention,
    layer_patterns,
    reference_attention,
)
from mt3d.model.inference import KVCache
from mt3d.parallel.spawn import spawn

from helpers import TINY_GPT, step_records, tiny_config, train_worker


def qkv(n, hq=4, hk=2, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(2, h, n, d, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(hq), make(hk), make(hk)


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


def natten_keys(i, n, window, stride, dilation):
    """The keys query i sees, written out from NATTEN's causal na1d definition (not from mt3d)."""
    g = i % dilation
    group = list(range(g, n, dilation))  # the dilation group, in order
    pos = group.index(i)
    leader = min(pos // stride * stride + stride - 1, len(group) - 1)
    return {group[j] for j in range(len(group)) if j <= pos and leader - j < window}


PATTERNS = [(w, s, d) for w in (1, 3, 16) for s in (1, 2, 4, w) for d in (1, 2) if s <= w]
PATTERNS = sorted(set(PATTERNS))


@pytest.mark.parametrize("window, stride, dilation", PATTERNS)
def test_allowed_is_natten_causal_na1d(window, stride, dilation):
    for n in (1, 5, 37):
        pos = torch.arange(n)
        mask = LocalPattern(window, stride, dilation).allowed(pos[:, None], pos[None, :], n)
        for i in range(n):
            assert set(torch.nonzero(mask[i]).flatten().tolist()) == natten_keys(
                i, n, window, stride, dilation
            )


def test_strided_windows_by_hand():
    """n = 10, W = 4, s = 3: stride groups {0,1,2} {3,4,5} {6,7,8} {9}; leaders 2, 5, 8 and 9 (cut short)."""
    pos = torch.arange(10)
    mask = LocalPattern(4, 3).allowed(pos[:, None], pos[None, :], 10)
    keys = {i: torch.nonzero(mask[i]).flatten().tolist() for i in (0, 3, 5, 9)}
    assert keys == {0: [0], 3: [2, 3], 5: [2, 3, 4, 5], 9: [6, 7, 8, 9]}
    blocked = LocalPattern(4, 4).allowed(pos[:, None], pos[None, :], 10)
    assert torch.nonzero(blocked[6]).flatten().tolist() == [4, 5, 6]  # its own block of 4, causally


def sink_logits(hq=4, seed=2):
    """Per-head sink logits around the scores' size (some above, some below)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, generator=g, dtype=torch.float64) * 2).requires_grad_()


@pytest.mark.parametrize("softcap, sink", [(None, False), (2.0, False), (None, True)])
@pytest.mark.parametrize("window, stride, dilation", PATTERNS + [(None, None, None)])
def test_kernels_equal_the_brute_force_mask(window, stride, dilation, softcap, sink):
    """n = 37 is a multiple of no window, stride or tile; GQA with 2 query heads per KV head; global
    attention (window None) too. Attention sinks against transformers' way (a logit column)."""
    n = 37
    pattern = None if window is None else LocalPattern(window, stride, dilation)
    q, k, v = qkv(n)
    sinks = sink_logits() if sink else None
    inputs = (q, k, v, sinks) if sink else (q, k, v)
    ref = reference_attention(q, k, v, pattern, scale=0.3, softcap=softcap, sinks=sinks)
    ref_grads = grads(ref, inputs)
    runs = [("block-local", b) for b in (None, 4, 16, 64)] + [("dense", None), ("auto", None)]
    for kernel, block in runs:  # tiles auto, shorter than, equal to and longer than the window
        out = attend(
            q, k, v, pattern=pattern, scale=0.3, softcap=softcap, block=block, kernel=kernel, sinks=sinks
        )
        assert (out - ref).abs().max() < 1e-10, (kernel, block)
        for a, b in zip(grads(out, inputs), ref_grads):
            assert (a - b).abs().max() < 1e-10, (kernel, block)
    with torch.no_grad():  # FlexAttention (the GPU kernel) runs forward on CPUs, uncompiled
        q32, k32, v32 = (x.detach().float() for x in (q, k, v))
        s32 = sinks.detach().float() if sink else None
        flex = flex_local_attention(
            q32, k32, v32, pattern, scale=0.3, softcap=softcap, compiled=False, sinks=s32
        )
        assert (flex - ref.float()).abs().max() < 1e-5


def test_sinks_join_each_query_once_in_pieces_documents_and_decoding():
    """Queries attended in pieces (as context parallelism's chunks: q_start, keys up to their end), packed
    documents (each document's queries see the sink once) and one decoding step at a time all equal
    the whole sequence's attention with sinks; without the sink the result differs."""
    n, pattern = 24, LocalPattern(5)
    q, k, v = qkv(n)
    sinks = sink_logits()
    for pat in (None, pattern):
        ref = reference_attention(q, k, v, pat, scale=0.3, sinks=sinks)
        pieces = [attend(q[:, :, a:e], k[:, :, :e], v[:, :, :e], pattern=pat, scale=0.3, q_start=a, n=n,
                         sinks=sinks) for a, e in ((0, 6), (6, 18), (18, 24))]  # fmt: skip
        assert (torch.cat(pieces, dim=2) - ref).abs().max() < 1e-10
        steps = [attend(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], pattern=pat, scale=0.3,
                        q_start=i, sinks=sinks) for i in range(n)]  # fmt: skip
        assert (torch.cat(steps, dim=2) - ref).abs().max() < 1e-10
        assert (attend(q, k, v, pattern=pat, scale=0.3) - ref).abs().max() > 1e-2
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    out = attend(q, k, v, pattern=pattern, scale=0.3, documents=docs, sinks=sinks)
    first = reference_attention(q[:1, :, :10], k[:1, :, :10], v[:1, :, :10], pattern, scale=0.3, sinks=sinks)
    second = reference_attention(q[:1, :, 10:], k[:1, :, 10:], v[:1, :, 10:], pattern, scale=0.3, sinks=sinks)
    assert (out[:1] - torch.cat([first, second], dim=2)).abs().max() < 1e-10
    assert (
        out[1:] - reference_attention(q[1:], k[1:], v[1:], pattern, scale=0.3, sinks=sinks)
    ).abs().max() < 1e-10


def test_window_blind_attention_differs():
    """The tests above can fail: global attention is not a window of 16 on 37 positions."""
    q, k, v = qkv(37)
    local = reference_attention(q, k, v, LocalPattern(16), scale=0.3)
    assert (attend(q, k, v, pattern=None, scale=0.3) - local).abs().max() > 1e-2
    wider = block_local_attention(q, k, v, LocalPattern(17), scale=0.3)
    assert (wider - local).abs().max() > 1e-3  # W+1 keys is a different model
    strided = block_local_attention(q, k, v, LocalPattern(16, 4), scale=0.3)
    assert (strided - local).abs().max() > 1e-3
    with torch.no_grad():
        flex = flex_local_attention(
            *(x.detach().float() for x in (q, k, v)), LocalPattern(17), scale=0.3, compiled=False
        )
        assert (flex - local.float()).abs().max() > 1e-3


def test_local_pattern_sees_exactly_window_keys():
    pos = torch.arange(50)
    mask = LocalPattern(7).allowed(pos[:, None], pos[None, :])
    assert mask.sum(1).tolist() == [min(i + 1, 7) for i in range(50)]
    assert bool(mask[20, 14]) and not bool(mask[20, 13]) and not bool(mask[20, 21])


@pytest.mark.parametrize("window", [None, 5])
def test_decoding_with_a_rolling_cache_equals_full_attention(window):
    """Prefill 9 tokens, then one at a time: each step's output equals the full-sequence rows, and a
    local layer's cache never holds more than window - 1 keys."""
    n = 20
    q, k, v = qkv(n, dtype=torch.float32)
    pattern = None if window is None else LocalPattern(window)
    with torch.no_grad():
        full = attend(q, k, v, pattern=pattern, scale=0.3, softcap=3.0)
        cache, layer = KVCache(), object()
        pieces, held = [], []
        for start, stop in [(0, 9)] + [(i, i + 1) for i in range(9, n)]:
            kk, vv, k_start = cache.update(layer, k[:, :, start:stop], v[:, :, start:stop], pattern)
            pieces.append(
                attend(q[:, :, start:stop], kk, vv, pattern=pattern, scale=0.3, softcap=3.0,
                       q_start=start, k_start=k_start)
            )  # fmt: skip
            cache.length = stop
            held.append(cache.keys_held()[id(layer)])
    assert (torch.cat(pieces, dim=2) - full).abs().max() < 1e-5
    assert max(held) == (n if window is None else window - 1)


@pytest.mark.parametrize("window, stride, dilation", [(5, 2, 1), (4, 4, 1), (3, 1, 2), (4, 2, 3)])
def test_decoding_strided_and_dilated_patterns(window, stride, dilation):
    """Each decoding step attends as the newest token of a sequence of that length (NATTEN's
    definition at that length: the last stride group's leader is the newest token), from a cache
    of the last window * dilation - 1 positions."""
    n = 23
    q, k, v = qkv(n, dtype=torch.float32)
    pattern = LocalPattern(window, stride, dilation)
    with torch.no_grad():
        cache, layer, held = KVCache(), object(), []
        for t in range(n):
            kk, vv, k_start = cache.update(layer, k[:, :, t : t + 1], v[:, :, t : t + 1], pattern)
            got = attend(q[:, :, t : t + 1], kk, vv, pattern=pattern, scale=0.3, q_start=t, k_start=k_start)
            want = reference_attention(
                q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pattern, scale=0.3
            )
            assert (got - want[:, :, -1:]).abs().max() < 1e-5, t
            cache.length = t + 1
            held.append(cache.keys_held()[id(layer)])
    assert max(held) == window * dilation - 1


def test_layer_patterns_from_specs():
    w = LocalPattern(8)
    assert layer_patterns(None, 3) == [None] * 3
    assert layer_patterns({"window": 8}, 3) == [w] * 3
    assert layer_patterns({"window": 8, "global_every": 2}, 4) == [w, None, w, None]
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    assert layer_patterns({"window": 8, "layer_types": types}, 3) == [None, w, w]


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"window": 0}, "model.attention.window must be a positive integer, got 0"),
        ({"window": -3}, "model.attention.window must be a positive integer"),
        ({"window": 2.5}, "model.attention.window must be a positive integer"),
        ({"widow": 4}, "unknown key model.attention.widow"),
        ({"window": 4, "layer_types": ["sliding_attention"]}, "layer_types must list 3 layers, got 1"),
        ({"window": 4, "layer_types": ["local"] * 3}, "unknown type 'local'"),
        ({"window": 4, "global_every": 0}, "global_every must be a positive integer"),
        ({"layer_types": ["full_attention"] * 3}, "needs 'window'"),
        ({"window": 4, "stride": 5}, "stride 5 is larger than the window 4"),
        ({"window": 4, "stride": 0}, "model.attention.stride must be a positive integer, got 0"),
        ({"window": 4, "dilation": -2}, "model.attention.dilation must be a positive integer, got -2"),
        ({"window": 4, "kernel": "triton"}, "model.attention.kernel must be one of"),
    ],
)
def test_bad_attention_specs(spec, message):
    with pytest.raises(AttentionConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layer_patterns(spec, 3)


STRIDED_GPT = {**TINY_GPT, "attention": {"window": 6, "stride": 3, "dilation": 2, "global_every": 4}}


def test_strided_dilated_training_matches_one_process_under_tp_sp_and_pp(tmp_path):
    """Windows of 6 with stride 3 and dilation 2 on 32 tokens (the last stride group of each dilation
    group cut short): tp 2 with and without SP, and pp 2 with recompute, give the losses and gradient
    norms of one process within 1e-5 for 5 steps."""

    def run(name, tp=1, pp=1, sp=False, **train):
        raw = tiny_config(tmp_path / name, model=STRIDED_GPT, tp=tp, pp=pp, **train)
        raw["mt3d"]["parallel"]["sequence_parallel"] = sp
        return step_records(spawn(train_worker, tp * pp, raw, timeout=300)[0])

    ref = run("ref")
    assert len(ref) == 5 and ref[-1]["loss"] < ref[0]["loss"]
    for name, got in (
        ("tp2", run("tp2", tp=2)),
        ("tp2-sp", run("tp2sp", tp=2, sp=True)),
        ("pp2-recompute", run("pp2rc", pp=2, recompute={"interval": 1})),
    ):
        for a, b in zip(got, ref, strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (
                    f"{name} step {a['step']} {key}: {a} vs {b}"
                )
