"""The GEMMs of the tensor-parallel linears, plain or in FP8 (``train.fp8``): one home for both.

A linear runs three GEMMs: the forward ``Y = X W^T``, the input gradient ``dX = dY W`` and the weight
gradient ``dW = dY^T X``. :class:`Gemms` runs them as they always ran (``F.linear`` and ``matmul``);
:class:`Fp8Gemms` casts both operands of each to FP8 with current (dynamic) scaling, multiplies with
``torch._scaled_mm`` (FP8 tensor cores on Hopper and Ada; a reference kernel on CPUs, where the
numerics are tested) and returns the result in the operands' own dtype (bf16). The TP layers
(``mt3d.parallel.layers``) call these three methods from their autograd functions, between their
collectives, so every axis that reaches a column- or row-parallel linear gets FP8 from this file.

Recipes (torchao's float8 training recipes, whose names and choices they follow):

* ``tensorwise``: one scale per tensor, ``amax(|T|) -> 448 / amax`` for e4m3 inputs and weights; the
  output gradient in e5m2 (wider range, 2 mantissa bits: gradients span more decades than they need
  precision), scale ``57344 / amax``.
* ``rowwise``: one scale per row of each operand along the GEMM's reduction dimension (so the
  forward, the input gradient and the weight gradient each scale their operands along a different
  axis), every operand in e4m3, and each scale rounded down to a power of two (exact to invert; the
  rounding costs at most one bit of range).

Scales are computed from this rank's shard: a TP rank never waits for another to cast (no amax
all-reduce per GEMM). Without sequence parallelism a column-parallel input is the same on every TP
rank, so its scale is too; weight shards and row-parallel inputs are scaled on their own, so FP8
rounding depends on tp (tests hold layouts within a measured tolerance). With ``all_gather`` under
SP the column-parallel input is cast before the all-gather (half the bytes): rowwise rows carry
their own scales, so gathering (FP8 rows, scales) is exactly the cast of the gathered tensor;
tensorwise needs one scale for the gathered tensor, so the shards' amax is all-reduced (MAX, one
scalar) first. The backward gathers the bf16 shard again (the weight gradient scales X along the
tokens under rowwise, which the forward's row scales cannot give).

Why not torchao's ``Float8Linear``: it replaces a linear's forward and backward with its own autograd
function, which would take the TP layers' collectives out of their place between the backward's
GEMMs (the input-gradient all-reduce or reduce-scatter overlapped with the weight-gradient GEMM), and
it would add a dependency pinned to one torch build on both the CPU and the GPU images. The three
scaled GEMMs are a few lines on ``torch._scaled_mm``; the layers keep their own autograd.

The tiled recipes (``blockwise``, ``mxfp8``: ``TiledFp8Gemms``) also run the routed experts' GEMMs
(``experts``; their token counts vary, which only tiles take) and cast the MoE dispatch's rows
(``dispatch``: ``DispatchRows``). Master weights, optimizer states, norms, softmax, the router, the
embedding and the output layer keep their own precision. Dynamic scaling has no state: a recomputed
forward casts the same inputs to the same FP8 values, and a checkpoint has nothing extra to save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .state import AxisGroup

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12
"""Smallest amax a scale is computed from (an all-zero tensor gets a finite scale)."""
MULTIPLE = 16
"""FP8 GEMMs need every dimension (rows, reduction, columns) a multiple of this (cuBLASLt)."""


@dataclass(frozen=True)
class Recipe:
    """How a recipe casts the three GEMMs' operands."""

    name: str
    grad_dtype: torch.dtype
    """The output gradient's FP8 dtype (inputs and weights are always e4m3)."""
    rowwise: bool
    """One scale per row along the reduction dimension (else one per tensor)."""
    pow2_scales: bool
    """Scales rounded down to a power of two."""
    block: int = 0
    """Tiles of this many values along the reduction dimension, each with its own scale (0: none)."""
    weight_block: int = 0
    """Weights in square blocks of this side, each with its own scale, shared by the forward and the
    input gradient (0: tiled as the activations are)."""
    e8m0: bool = False
    """MX scales: a power of two 2^(floor(log2 amax) - 8), so the tile's largest value lands in e4m3's
    top binade (OCP Microscaling; the scale is an e8m0 byte)."""

    @property
    def multiple(self) -> int:
        """What every weight dimension must be a multiple of."""
        return max(MULTIPLE, self.block, self.weight_block)


RECIPES = {
    "tensorwise": Recipe("tensorwise", E5M2, rowwise=False, pow2_scales=False),
    "rowwise": Recipe("rowwise", E4M3, rowwise=True, pow2_scales=True),
    # DeepSeek-V3's: 1x128 tiles of activations and gradients, 128x128 blocks of weights, all e4m3
    "blockwise": Recipe("blockwise", E4M3, rowwise=True, pow2_scales=False, block=128, weight_block=128),
    # OCP MXFP8 (Blackwell's native format): 1x32 tiles of every operand, e8m0 scales, all e4m3
    "mxfp8": Recipe("mxfp8", E4M3, rowwise=True, pow2_scales=True, block=32, e8m0=True),
}


def quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool = False):
    """``(q, inverse_scale)``: ``x`` cast to FP8 ``dtype`` with scale ``max(dtype) / amax``; ``dim``
    None: one scale for the tensor (0-d); else one per slice along ``dim`` (keepdim shape).
    ``q * inverse_scale`` approximates ``x``; ``torch._scaled_mm`` takes the inverse scales."""
    a = x.abs()
    amax = (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()
    return _cast(x, amax, dtype, pow2)


def _cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, pow2: bool):
    top = torch.finfo(dtype).max
    scale = top / amax.clamp(min=EPS)
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (x.float() * scale).clamp(-top, top).to(dtype)
    return q, scale.reciprocal()


def _tiled(x: torch.Tensor, dim: int, block: int):
    """x [m, n] seen as tiles of ``block`` along ``dim`` (the last tile padded with zeros, which change
    no amax): [rows, tiles, block] with ``dim``'s tiles in the middle (none for an empty ``dim``)."""
    t = x.movedim(dim, 1)
    pad = -t.shape[1] % block
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    return t.reshape(t.shape[0], t.shape[1] // block, block)


def _tile_scales(amax: torch.Tensor, dtype: torch.dtype, pow2: bool, e8m0: bool) -> torch.Tensor:
    """Scales (what values are multiplied by before the cast) from each tile's amax."""
    if e8m0:  # 2^-(floor(log2 amax) - emax of the element format), the exponent within e8m0's range
        emax = math.floor(math.log2(torch.finfo(dtype).max))
        floor_log2 = torch.frexp(amax.clamp(min=2.0**-127)).exponent - 1  # exact: amax = m 2^e, m in [0.5, 1)
        return torch.exp2(-(floor_log2 - emax).clamp(-127, 127).float())
    scale = torch.full_like(amax, torch.finfo(dtype).max) / amax.clamp(min=EPS)  # a division, rounded once
    return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale


def quantize_tiles(x: torch.Tensor, dtype: torch.dtype, dim: int, block: int, pow2: bool = False,
                   e8m0: bool = False):  # fmt: skip
    """``(q, inverse_scale)``: x [m, n] cast to FP8 ``dtype`` with one scale per tile of ``block``
    values along ``dim`` (a partial last tile has its own); the inverse scales are [m, ceil(n / block)]
    (``dim`` 1) or [ceil(m / block), n] (``dim`` 0). ``q`` dequantises by ``dequantize_tiles``."""
    top = torch.finfo(dtype).max
    t = _tiled(x.float(), dim, block)
    scale = _tile_scales(t.abs().amax(dim=-1, keepdim=True), dtype, pow2, e8m0)
    q = (t * scale).clamp(-top, top).to(dtype).reshape(t.shape[0], t.shape[1] * block)[:, : x.shape[dim]]
    return q.movedim(1, dim).contiguous(), scale.reciprocal()[..., 0].movedim(1, dim).contiguous()


def quantize_blocks(w: torch.Tensor, dtype: torch.dtype, block: int):
    """``(q, inverse_scale)``: w [m, n] cast with one scale per square block of side ``block``; the
    inverse scales are [m / block, n / block] (both dims multiples of ``block``)."""
    top = torch.finfo(dtype).max
    m, n = w.shape
    t = w.float().reshape(m // block, block, n // block, block)
    scale = _tile_scales(t.abs().amax(dim=(1, 3), keepdim=True), dtype, False, False)
    q = (t * scale).clamp(-top, top).to(dtype).reshape(m, n)
    return q, scale.reciprocal()[:, 0, :, 0].contiguous()


def dequantize_tiles(q: torch.Tensor, inverse: torch.Tensor, dim: int | None, block: int) -> torch.Tensor:
    """fp32 values of a tile-quantised (``dim``) or block-quantised (``dim`` None) tensor."""
    if dim is None:
        full = inverse.repeat_interleave(block, 0).repeat_interleave(block, 1)
    else:
        full = inverse.repeat_interleave(block, dim).narrow(dim, 0, q.shape[dim])
    return q.float() * full


def _col_major(q: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (``_scaled_mm``'s second operand)."""
    return q.t().contiguous().t()


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class Grad(NamedTuple):
    """A linear's output gradient as its backward GEMMs read it: ``rows`` [m, out] (cast to FP8 once,
    with its inverse ``scale``, where the recipe reuses one cast for both GEMMs) and the gradient's
    leading shape."""

    rows: torch.Tensor
    scale: torch.Tensor | None
    shape: tuple


class Gemms:
    """A linear's three GEMMs as mt3d always ran them (bit-identical to F.linear and matmul).

    The autograd functions of ``mt3d.parallel.layers`` call ``linear`` in their forward (which also
    returns what the backward keeps of the input: the input itself here), and ``grad_of``, ``dgrad``
    and ``wgrad`` in their backward, between their collectives."""

    fp8 = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """``(x W^T + b, kept)``: [..., in] -> [..., out], and the tensors the weight gradient reads."""
        return F.linear(x, weight, bias), (x,)

    def kept_of(self, x_rows: torch.Tensor) -> tuple:
        """What ``wgrad`` reads of an input the backward made again (gathered, recomputed): [m, in]."""
        return (x_rows,)

    def grad_of(self, grad: torch.Tensor) -> Grad:
        """The output gradient as ``dgrad`` and ``wgrad`` read it."""
        return Grad(grad, None, grad.shape)

    def dgrad(self, g: Grad, weight: torch.Tensor) -> torch.Tensor:
        """Input gradient ``dY W``: [..., out] -> [..., in]."""
        return g.rows.matmul(weight)

    def wgrad(self, g: Grad, kept: tuple) -> torch.Tensor:
        """Weight gradient ``dY^T X`` over every row: [out, in]."""
        return _rows(g.rows).t().matmul(_rows(kept[0]))

    def gather_linear(self, x, weight, bias, g: AxisGroup, dim: int):
        """``linear`` of ``x`` all-gathered over ``g`` along ``dim`` (sequence parallelism)."""
        from .mappings import start_gather

        return self.linear(start_gather(x, g, dim)(), weight, bias)


PLAIN = Gemms()


class Fp8Gemms(Gemms):
    """The three GEMMs in FP8 with current scaling, per ``recipe`` (module docstring).

    Tensorwise casts each operand once: the forward keeps the input's FP8 rows (half its bf16 bytes)
    for the weight gradient, and one cast of the output gradient feeds both backward GEMMs (an FP8
    transpose gives the weight gradient's layout). Rowwise scales each GEMM's operands along that
    GEMM's reduction dimension, so the backward casts the bf16 input and gradient again along the
    other axis (casting before the transpose: the FP8 copy moves half the bytes)."""

    def __init__(self, recipe: str, all_gather: bool = False) -> None:
        self.fp8 = RECIPES[recipe]
        self.all_gather = all_gather

    def __repr__(self) -> str:
        return f"Fp8Gemms({self.fp8.name}, all_gather={self.all_gather})"

    def _q(self, x: torch.Tensor, dtype: torch.dtype, dim: int):
        """Cast ``x`` for a GEMM that reduces over ``dim`` of it."""
        r = self.fp8
        return quantize(x, dtype, dim if r.rowwise else None, r.pow2_scales)

    @staticmethod
    def _mm(a, sa, b, sb, out_dtype, bias=None):
        """``a @ b`` (a [m, k] row-major, b [k, n] column-major) from FP8 operands and their
        inverse scales (rowwise: [m, 1] and [1, n])."""
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        return y if bias is None else y + bias

    def linear(self, x, weight, bias):
        """Forward: X (e4m3, scaled along in) x W^T (e4m3, scaled along in)."""
        xq, sx = self._q(_rows(x), E4M3, 1)
        y = self._linear_q(xq, sx, x.shape, weight, bias, x.dtype)
        return y, ((x,) if self.fp8.rowwise else (xq, sx))

    def _linear_q(self, xq, sx, shape, weight, bias, out_dtype):
        wq, sw = self._q(weight, E4M3, 1)
        y = self._mm(xq, sx, wq.t(), sw.reshape(1, -1) if sw.dim() else sw, out_dtype, bias)
        return y.reshape(*shape[:-1], weight.shape[0])

    def kept_of(self, x_rows):
        """Tensorwise: the FP8 rows and their scale; rowwise: the bf16 rows."""
        return (x_rows,) if self.fp8.rowwise else self._q(x_rows, E4M3, 1)

    def grad_of(self, grad):
        """Tensorwise: cast once (grad dtype, one scale); rowwise: the bf16 rows (cast per GEMM)."""
        rows = _rows(grad)
        if self.fp8.rowwise:
            return Grad(rows, None, grad.shape)
        gq, sg = self._q(rows, self.fp8.grad_dtype, 1)
        return Grad(gq, sg, grad.shape)

    def dgrad(self, g, weight):
        """Input gradient: dY (grad dtype, scaled along out) x W (e4m3, scaled along out)."""
        gq, sg = (g.rows, g.scale) if g.scale is not None else self._q(g.rows, self.fp8.grad_dtype, 1)
        wq, sw = self._q(weight, E4M3, 0)
        dx = self._mm(gq, sg, _col_major(wq), sw, weight.dtype)
        return dx.reshape(*g.shape[:-1], weight.shape[1])

    def wgrad(self, g, kept):
        """Weight gradient: dY^T (grad dtype, scaled along the tokens) x X (e4m3, along the tokens)."""
        if g.scale is not None:  # tensorwise: the casts are made; lay them out for the GEMM
            xq, sx = kept
            return self._mm(g.rows.t().contiguous(), g.scale, _col_major(xq), sx, torch.bfloat16)
        gq, sg = self._q(g.rows, self.fp8.grad_dtype, 0)  # [m, out], one scale per column
        xq, sx = self._q(_rows(kept[0]), E4M3, 0)
        return self._mm(gq.t().contiguous(), sg.reshape(-1, 1), _col_major(xq), sx, g.rows.dtype)

    def gather_linear(self, x, weight, bias, g: AxisGroup, dim: int):
        """With ``all_gather``: cast this rank's sequence shard, all-gather the FP8 bytes (and the
        rowwise scales), then the forward GEMM; else gather in the input's dtype (``Gemms``). The
        kept input is None: the backward gathers the shard again."""
        if not self.all_gather or g.size == 1:
            return super().gather_linear(x, weight, bias, g, dim)
        front = x.movedim(dim, 0).contiguous()  # gather along the first dimension, rows after it
        rows = _rows(front)
        if self.fp8.rowwise:
            xq, sx = self._q(rows, E4M3, 1)
            sx = _gather_rows(sx.contiguous(), g)
        else:
            amax = rows.abs().amax().float()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g.group)  # one scale for the gathered X
            xq, sx = _cast(rows, amax, E4M3, self.fp8.pow2_scales)
        xq = _gather_rows(xq.view(torch.uint8), g).view(E4M3)  # collectives move bytes, not float8
        shape = (g.size * front.shape[0], *front.shape[1:])
        y = self._linear_q(xq, sx, shape, weight, bias, x.dtype)
        return y.movedim(0, dim).contiguous(), None


class TiledFp8Gemms(Fp8Gemms):
    """The three GEMMs of a tiled recipe (blockwise, mxfp8): each operand cast with one scale per tile
    along the GEMM's reduction dimension (blockwise weights: per 128x128 block, one cast for the
    forward and the input gradient), multiplied as the dequantised tiles in fp32 and returned in the
    operands' dtype: the products a block-scaled kernel computes from the same FP8 values and scales
    (torch's ``scaled_mm`` with BlockWise scales; not called yet: no kernel ran on a GPU here)."""

    def _q(self, x, dtype, dim):
        r = self.fp8
        return quantize_tiles(x, dtype, dim, r.block, r.pow2_scales, r.e8m0)

    def _w(self, weight, dim):
        """The weight cast for a GEMM reducing over ``dim`` of it, and its dequantised fp32 values."""
        r = self.fp8
        if r.weight_block:
            wq, sw = quantize_blocks(weight, E4M3, r.weight_block)
            return dequantize_tiles(wq, sw, None, r.weight_block)
        wq, sw = self._q(weight, E4M3, dim)
        return dequantize_tiles(wq, sw, dim, r.block)

    def linear(self, x, weight, bias):
        """Forward: X (tiles along in) x W^T (blocks, or tiles along in); keeps the bf16 input."""
        xq, sx = self._q(_rows(x), E4M3, 1)
        return self._linear_q(xq, sx, x.shape, weight, bias, x.dtype), (x,)

    def _linear_q(self, xq, sx, shape, weight, bias, out_dtype):
        y = dequantize_tiles(xq, sx, 1, self.fp8.block) @ self._w(weight, 1).t()
        y = y.to(out_dtype)
        y = y if bias is None else y + bias
        return y.reshape(*shape[:-1], weight.shape[0])

    def kept_of(self, x_rows):
        """The bf16 rows (the weight gradient tiles them along the tokens)."""
        return (x_rows,)

    def grad_of(self, grad):
        """The bf16 rows (each GEMM tiles them along its own reduction dimension)."""
        return Grad(_rows(grad), None, grad.shape)

    def dgrad(self, g, weight):
        """Input gradient: dY (tiles along out) x W (blocks, or tiles along out)."""
        gq, sg = self._q(g.rows, self.fp8.grad_dtype, 1)
        dx = (dequantize_tiles(gq, sg, 1, self.fp8.block) @ self._w(weight, 0)).to(weight.dtype)
        return dx.reshape(*g.shape[:-1], weight.shape[1])

    def wgrad(self, g, kept):
        """Weight gradient: dY^T x X, both in tiles along the tokens."""
        b = self.fp8.block
        gq, sg = self._q(g.rows, self.fp8.grad_dtype, 0)
        xq, sx = self._q(_rows(kept[0]), E4M3, 0)
        dw = dequantize_tiles(gq, sg, 0, b).t() @ dequantize_tiles(xq, sx, 0, b)
        return dw.to(g.rows.dtype)


class DispatchRows:
    """FP8 rows for the MoE dispatch (``train.fp8.dispatch``, as DeepSeek-V3 dispatched): each row cast
    to e4m3 in the recipe's activation tiles along the hidden dimension (blockwise: 1x128 with fp32
    scales; mxfp8: 1x32 with e8m0 scale bytes) and packed with its scales into one uint8 row, so the
    all-to-all carries one byte per value plus the scales (``scale_bytes``), about half of bf16's.
    ``decode`` gives the values the rows' receiver computes with, in the sender's dtype; an FP8 expert
    GEMM tiling them again along the same axis gets the same FP8 values (mxfp8 exactly: its power-of-two
    scale is unchanged by the round trip). Only the forward's dispatch is cast: the combine and every
    gradient travel in 16 bits (``mappings.all_to_all_rows``)."""

    def __init__(self, recipe: str) -> None:
        self.fp8 = RECIPES[recipe]
        if not self.fp8.block:
            raise ValueError(f"FP8 dispatch needs a tiled recipe (blockwise or mxfp8), got {recipe}")

    def __repr__(self) -> str:
        return f"DispatchRows({self.fp8.name})"

    def scale_bytes(self, width: int) -> int:
        """Bytes of one row's scales: one per tile (e8m0) or four (fp32)."""
        return -(-width // self.fp8.block) * (1 if self.fp8.e8m0 else 4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, width] -> uint8 [rows, width + scale_bytes(width)]: the e4m3 bytes, then the scales."""
        r = self.fp8
        q, inverse = quantize_tiles(x, E4M3, 1, r.block, r.pow2_scales, r.e8m0)
        if r.e8m0:  # inverse = 2^k, k in [-127, 127]: the byte k + 127
            scales = (torch.log2(inverse).round() + 127).to(torch.uint8)
        else:
            scales = inverse.float().contiguous().view(torch.uint8)
        return torch.cat([q.view(torch.uint8), scales], dim=1)

    def decode(self, packed: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """The rows ``encode`` packed, dequantised to ``dtype``."""
        q = packed[:, :width].contiguous().view(E4M3)
        scales = packed[:, width:].contiguous()
        if self.fp8.e8m0:
            inverse = torch.exp2(scales.float() - 127)
        else:
            inverse = scales.view(torch.float32)
        return dequantize_tiles(q, inverse, 1, self.fp8.block).to(dtype)


def _gather_rows(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """All-gather a 2-d tensor's rows over ``g`` (rank order)."""
    from .mappings import start_gather

    return start_gather(t, g, 0)()


def gemms_for(recipe: str | None, all_gather: bool = False) -> Gemms:
    """The GEMMs of a linear: FP8 per ``recipe``, or the plain ones (None)."""
    if recipe is None:
        return PLAIN
    return (TiledFp8Gemms if RECIPES[recipe].block else Fp8Gemms)(recipe, all_gather)


def fp8_support(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on ``device`` (None: they can). CUDA needs compute capability 8.9
    (Ada) or newer; CPUs run ``torch._scaled_mm``'s reference kernel."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            cc = f"{major}.{minor}"
            return f"{name} (compute capability {cc}) has no FP8 GEMMs; they need 8.9 (Ada, Hopper) or newer"
    return None
