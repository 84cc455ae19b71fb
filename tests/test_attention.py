"""Attention patterns and kernels against the brute-force mask, forward and backward; bad specs."""

import pytest
import torch

from mt3d.model.attention import (
    AttentionConfigError,
    LocalPattern,
    attend,
    block_local_attention,
    layer_patterns,
    reference_attention,
)
from mt3d.model.inference import KVCache


def qkv(n, hq=4, hk=2, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(2, h, n, d, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(hq), make(hk), make(hk)


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("window", [1, 2, 3, 16, 37])
def test_kernels_equal_the_brute_force_mask(window, softcap):
    """n = 37 is a multiple of neither the window nor any block size; GQA with 2 query heads per KV head."""
    n = 37
    q, k, v = qkv(n)
    ref = reference_attention(q, k, v, LocalPattern(window), scale=0.3, softcap=softcap)
    ref_grads = grads(ref, (q, k, v))
    for block in (None, 4, 16, 64):  # auto, smaller than, equal to and longer than the window
        out = attend(q, k, v, pattern=LocalPattern(window), scale=0.3, softcap=softcap, block=block)
        assert (out - ref).abs().max() < 1e-10, block
        for a, b in zip(grads(out, (q, k, v)), ref_grads):
            assert (a - b).abs().max() < 1e-10, block


def test_window_blind_attention_differs():
    """The tests above can fail: global attention is not a window of 16 on 37 positions."""
    q, k, v = qkv(37)
    local = reference_attention(q, k, v, LocalPattern(16), scale=0.3)
    assert (attend(q, k, v, pattern=None, scale=0.3) - local).abs().max() > 1e-2
    wider = block_local_attention(q, k, v, LocalPattern(17), scale=0.3)
    assert (wider - local).abs().max() > 1e-3  # W+1 keys is a different model


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
    ],
)
def test_bad_attention_specs(spec, message):
    with pytest.raises(AttentionConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layer_patterns(spec, 3)
