"""The routed experts' grouped GEMM: torch's grouped matmul (rows grouped by expert, each group times
its expert's weight), where the device has it, with its weight gradient deferrable to W under a
split backward for the zero-bubble schedules (``parallel.deferred``)."""

from __future__ import annotations

import functools

import torch

from ..parallel.deferred import deferrable, deferring_function, is_split, weight_grad


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul (rows ``offs``-delimited, group g times ``w[g]``). Its backward on the
    CPU rejects a gradient with zero strides (an expanded one): the gradient is made dense first."""
    y = torch._grouped_mm(x, w, offs=offs)
    if y.requires_grad:
        y.register_hook(lambda g: g.contiguous())
    return y


@deferring_function
class _SplitGroupedMM(torch.autograd.Function):
    """Rows ``x`` (grouped by ``offs``) times ``w[g]`` [in, out], its weight gradient left to W under a
    split backward (``parallel.deferred``): B computes the input gradient only, W each group's
    x_g^T dy_g (one grouped matmul of two 2-D operands, the groups along the rows) and hands it to
    autograd on ``w``, the stacked view of the experts' weights, which passes each expert its slice."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        dy = grad.contiguous()
        dx = torch._grouped_mm(dy, w.transpose(1, 2), offs=offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = weight_grad(w, lambda: torch._grouped_mm(x.t(), dy, offs=offs))
        return dx, dw, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The experts' grouped GEMM: torch's own (and its autograd) unless the backward is split for a
    zero-bubble schedule (``_SplitGroupedMM``)."""
    return deferrable(_SplitGroupedMM)(x, w, offs) if is_split() else _grouped_mm(x, w, offs)


@functools.cache
def grouped_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs forward and backward on ``device`` in ``dtype`` and equals a
    loop of matmuls there (checked once per device and dtype on a small problem with an empty group;
    its kernels exist for fp32 on CPUs and for bf16 on recent GPUs, and need 16-byte-aligned rows)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    with torch.inference_mode(False), torch.enable_grad():  # first asked from under no_grad, perhaps
        return _grouped_gemm_probe(device, dtype)


def _grouped_gemm_probe(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(device, dtype).requires_grad_()
        w = torch.randn(3, 16, 8, generator=gen).to(device, dtype).requires_grad_()
        offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
        y = _grouped_mm(x, w, offs)
        y.sum().backward()
        ref = torch.cat([x[:8] @ w[0], x[8:] @ w[2]])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        xg, wg = x.grad.clone(), w.grad.clone()
        x.grad = w.grad = None
        ref.sum().backward()
        return all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)
                   for a, b in ((y, ref), (xg, x.grad), (wg, w.grad)))  # fmt: skip
    except (RuntimeError, NotImplementedError, TypeError):
        return False


__all__ = ["grouped_gemm_works", "grouped_linear"]
