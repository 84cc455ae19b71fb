"""QK-clip (``train.muon.qk_clip``, ``mt3d.training.qk_clip``): the logit maxima every attention path
notes against brute-force scores, and a step that scales exactly the heads over tau, back to tau.
Its layouts against one process are in test_muon.py's layout run."""

import dataclasses
import math

import pytest
import torch

from mt3d.model.attention import LocalPattern, attend
from mt3d.model.logit_max import LogitMax, max_logits


def brute_max(q, k, pattern, scale, q_start=0, k_start=0, n=None):
    """Each query head's largest scaled q.k over the keys it sees, from the whole score matrix."""
    hq, hk = q.shape[1], k.shape[1]
    n = q_start + q.shape[2] if n is None else n
    scores = q @ k.repeat_interleave(hq // hk, dim=1).transpose(-1, -2) * scale
    qpos = torch.arange(q_start, q_start + q.shape[2])[:, None]
    kpos = torch.arange(k_start, k_start + k.shape[2])[None, :]
    mask = (kpos <= qpos) if pattern is None else pattern.allowed(qpos, kpos, n)
    return scores.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))


PATTERNS = [None, LocalPattern(5), LocalPattern(6, stride=3), LocalPattern(3, dilation=2)]


@pytest.mark.parametrize("pattern", PATTERNS, ids=["causal", "sliding", "strided", "dilated"])
def test_every_attention_path_notes_the_largest_logit(pattern, monkeypatch):
    """``max_logits`` (also tile by tile, and for a chunk of queries over earlier keys: context
    parallelism's calls) and what ``attend`` records through each kernel, with attention sinks and
    packed documents, equal brute-force scores; a sink is not a q.k logit."""
    import mt3d.model.logit_max as lm

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 24, 8, generator=gen, dtype=torch.float64) * 3 for h in (4, 2, 2))
    want = brute_max(q, k, pattern, 0.3)
    torch.testing.assert_close(max_logits(q, k, pattern=pattern, scale=0.3), want.float())
    monkeypatch.setattr(lm, "TILE_ELEMENTS", 2 * 4 * 24 * 3)  # three query rows a tile
    torch.testing.assert_close(max_logits(q, k, pattern=pattern, scale=0.3), want.float())
    chunk = brute_max(q[:, :, 16:], k[:, :, 4:], pattern, 0.3, q_start=16, k_start=4, n=32)
    got = max_logits(q[:, :, 16:], k[:, :, 4:], pattern=pattern, scale=0.3, q_start=16, k_start=4, n=32)
    torch.testing.assert_close(got, chunk.float())
    for kernel in ("auto", "dense") + (("block-local",) if pattern is not None else ()):
        seen = LogitMax(4)
        attend(q, k, v, pattern=pattern, scale=0.3, kernel=kernel, record=seen.note,
               sinks=torch.full((4,), 50.0, dtype=torch.float64))  # fmt: skip
        torch.testing.assert_close(seen.take(), want.float(), msg=kernel)
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    seen = LogitMax(4)
    attend(q, k, v, pattern=pattern, scale=0.3, documents=documents, record=seen.note)
    first = brute_max(q[:1, :, :10], k[:1, :, :10], pattern, 0.3)
    second = brute_max(q[:1, :, 10:], k[:1, :, 10:], pattern, 0.3)
    whole = brute_max(q[1:], k[1:], pattern, 0.3)
    torch.testing.assert_close(seen.take(), torch.stack([first, second, whole]).amax(0).float())


def _block(preset: dict):
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.parallel.state import AxisGroup
    from mt3d.presets import get_preset

    cfg = dataclasses.replace(get_preset(preset.pop("preset")), **preset)
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), seed=5), 0).double()
    with torch.no_grad():  # logits of a few units, heads apart
        for name, p in block.named_parameters():
            if name.startswith("attn.") and p.ndim == 2:
                p.mul_(torch.linspace(2, 12, p.shape[0], dtype=p.dtype)[:, None])
            elif name.startswith("attn."):
                p.copy_(torch.linspace(-1, 1, p.shape[0], dtype=p.dtype))
    return block, cfg


def _clipped_step(block, cfg):
    """One Muon step at learning rates 0 with QK-clip at tau between the heads' maxima: (maxima before, after,
    tau, weights before)."""
    from mt3d.parallel.state import AxisGroup
    from mt3d.training.engine import param_groups
    from mt3d.training.muon import build
    from mt3d.training.qk_clip import QKClip

    clip = QKClip(block, math.inf, AxisGroup.alone("dp"))
    rates = {"lr": 1.0, "muon_lr": 0.0, "adam_lr": 0.0, "weight_decay": 0.0}
    opt = build(rates, param_groups(block), block, AxisGroup.alone("tp"), None, clip=clip)
    x = torch.randn(2, 16, cfg.hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    block.train()
    block(x)[0].pow(2).mean().backward()
    (layer,) = clip.layers
    before = layer.logit_max.value.clone()
    clip.tau = float(before.median())
    weights = {n: p.detach().clone() for n, p in block.named_parameters()}
    opt.step()
    assert clip.figures(torch.device("cpu"))["qk_clipped_heads"] == int((before > clip.tau).sum()) > 0
    block(x)
    return before, layer.logit_max.take(), clip.tau, weights


def test_the_clip_scales_the_heads_over_tau_back_to_tau_and_nothing_else():
    """Grouped-query attention with q/k/v biases (4 query heads on 2 key heads): after the step every
    head over tau has its largest logit at tau, the others keep theirs; only q/k rows and biases moved,
    values and every other weight are as they were, and a key group without a clipped head is
    untouched. Latent attention (DeepSeek-V3's): the same, the shared rotary key (``kv_a``) untouched,
    each clipped head's rotary query rows scaled by its whole factor."""
    block, cfg = _block({"preset": "tiny-llama", "qkv_bias": True, "family": "custom"})
    before, after, tau, weights = _clipped_step(block, cfg)
    over = before > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-6, atol=0)
    q, kv, hd = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.head_dim
    for name, p in block.named_parameters():
        same = p.detach() == weights[name]
        if not name.startswith("attn.qkv"):
            assert same.all(), name
            continue
        assert same[q + kv :].all(), name  # values
        for j, group in enumerate(over.view(cfg.kv_heads, -1)):
            rows = torch.cat(
                [torch.arange(q)[j * 2 * hd : (j + 1) * 2 * hd], torch.arange(q + j * hd, q + (j + 1) * hd)]
            )
            assert bool(same[rows].all()) != bool(group.any()), (name, j)
    block, cfg = _block({"preset": "tiny-deepseek-v3"})
    before, after, tau, weights = _clipped_step(block, cfg)
    over = before > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-6, atol=0)
    torch.testing.assert_close(after[~over], before[~over], rtol=1e-6, atol=0)
    moved = {n for n, p in block.named_parameters() if not torch.equal(p.detach(), weights[n])}
    assert moved == {"attn.q_b.weight", "attn.kv_b.weight"}, moved
    spec = cfg.mla_spec
    ratio = (block.attn.q_b.weight / weights["attn.q_b.weight"]).view(cfg.heads, spec.qk_head_dim, -1)
    gamma = torch.where(over, tau / before, 1.0)
    torch.testing.assert_close(
        ratio[:, spec.qk_nope_head_dim :],
        gamma.view(-1, 1, 1).expand_as(ratio[:, spec.qk_nope_head_dim :]).double(),
    )
