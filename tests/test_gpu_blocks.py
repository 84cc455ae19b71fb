"""On a GPU, the blocks of the 2025 families give the CPU's numbers: gpt-oss's local layer (its sinks
through FlexAttention's key 0, compiled), its biased router and clamped-SwiGLU experts; DeepSeek-V3's
latent attention (CUDA SDPA over the qk 192 / v 128 split of the published model, v padded) and
sigmoid group-limited routing. Outputs and every gradient in fp32 within 1e-4 of the CPU; bf16 outputs
within 5e-2 and gradients within 15% in norm (bf16 moves a few near-tied tokens to other experts, which
changes rows of those experts' gradients: up to 8% in norm, 14% in the largest element on an H200). Skipped
without CUDA: the CPU suite checks every kernel against the brute force (tests/test_attention.py) and
the families against transformers (tests/test_hf.py)."""

import pytest
import torch

from mt3d.model.blocks import BuildContext, TransformerBlock
from mt3d.model.config import ModelConfig
from mt3d.parallel.state import AxisGroup
from mt3d.presets import get_preset

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (checked on GPU runs)")

LATENT = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=384,
              rope_interleave=True)  # fmt: skip


def _config(preset: str) -> ModelConfig:
    d = get_preset(preset).to_dict()
    if preset == "tiny-deepseek-v3":  # the published head split (and latents), on a small model
        d.update(hidden=256, heads=4, kv_heads=4, head_dim=None, mla=LATENT)
    return ModelConfig.from_dict(d)


def _run(cfg: ModelConfig, layer: int, device: str, dtype: torch.dtype, n: int = 256):
    """A block's output and its input's and parameters' gradients (fp32, on the CPU)."""
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), device=device, dtype=dtype), layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, n, cfg.hidden, generator=g).to(device, dtype).requires_grad_()
    y = block.train()(x)
    y.backward(torch.randn(y.shape, generator=g).to(device, dtype))
    grads = {"x": x.grad, **{k: p.grad for k, p in block.named_parameters() if p.grad is not None}}
    return y.detach().float().cpu(), {k: v.float().cpu() for k, v in grads.items()}


@pytest.mark.parametrize("preset, layer", [("tiny-gpt-oss", 0), ("tiny-deepseek-v3", 1)])
def test_the_new_blocks_on_a_gpu_equal_the_cpu(preset, layer):
    cfg = _config(preset)
    ref, ref_grads = _run(cfg, layer, "cpu", torch.float32)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        out, grads = _run(cfg, layer, "cuda", dtype)
        scale = ref.abs().max()
        assert (out - ref).abs().max() <= tol * scale, (dtype, float((out - ref).abs().max() / scale))
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            want = ref_grads[name]
            if dtype == torch.float32:
                err = float((g - want).abs().max() / want.abs().max().clamp(min=1e-12))
            else:
                err = float((g - want).norm() / want.norm().clamp(min=1e-12))
            assert err <= (tol if dtype == torch.float32 else 0.15), (dtype, name, err)


def test_the_compiled_whole_vocabulary_cross_entropy_equals_the_cpu():
    """tp 1 on a GPU runs the cross entropy's two halves compiled (``parallel.cross_entropy``): bf16
    logits with padded columns and ignored targets give the CPU's eager loss and gradient."""
    from mt3d.parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy

    tp = AxisGroup.alone("tp")
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 512, 50_304, generator=g) * 3).bfloat16()
    target = torch.randint(0, 50_257, (4, 512), generator=g)
    target[0, :64] = IGNORE_INDEX
    weight = torch.rand(4, 512, generator=g)
    out = {}
    for device in ("cpu", "cuda"):
        x = logits.clone().to(device).requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target.to(device), tp, 50_257)
        (loss * weight.to(device)).sum().backward()
        out[device] = (loss.detach().cpu(), x.grad.float().cpu())
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=8e-3, atol=1e-7)
    assert torch.all(out["cuda"][1][..., 50_257:] == 0)
