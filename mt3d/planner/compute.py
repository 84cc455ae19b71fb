"""Compute time of one micro-batch on one pipeline stage, from the shapes of its kernels.

A GEMM of (M x K) @ (K x N) runs as output tiles spread over the GPU's streaming multiprocessors
in waves. Its time is the larger of

* compute: waves x (time of one tile), where a tile of tm x tn outputs costs 2 tm tn K FLOPs at the
  per-SM share of ``GEMM_FRACTION`` x ``Device.gemm_tflops`` (the device's "maximum achievable
  matmul FLOPS", the best of a published shape sweep; the fraction is fitted once). Partial tiles and a last
  partial wave cost as much as full ones: this is tile and wave quantisation, and it is why small
  hidden sizes and narrow tensor-parallel slices run at a lower fraction of peak;
* memory: the operands and the result once through HBM at ``Device.hbm_gbps``.

cuBLAS picks among several tile shapes; the model takes the fastest of ``TILES``. Everything that
is not a GEMM (norms, bias + activation, dropout + residual, rotary embeddings, and with
materialised attention the softmax and dropout of the s x s scores) is memory-bound: elements
read and written per token, at ``HBM_FRACTION`` of the HBM bandwidth. Backward is two GEMMs per
forward GEMM (input and weight gradients) and about twice the forward's elementwise traffic;
full recompute runs the forward once more.

``attention="flash"`` (mt3d: ``scaled_dot_product_attention``) keeps no score matrix; its FLOPs run
at ``FLASH_FRACTION`` of the GEMM ceiling. ``"materialized"`` is Megatron-LM 2021 (fused
scale-mask-softmax, scores written to HBM), which the fidelity table's published runs used.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..model.config import GATED_MLPS, ModelConfig
from ..model.gdn import per_kind
from ..parallel.layers import pad_vocab
from .choices import ATTENTION_KERNELS  # its home imports nothing (the CLI parser reads it)

TILES = ((128, 256), (256, 128), (128, 128))
GEMM_FRACTION = 0.78
"""The share of the device's GEMM ceiling (a shape sweep's best) that a training step's GEMMs
reach: the one calibration of this model, fitted on PTD-P's Table 1 (A100, 211.5 of 271.2 TFLOP/s;
``python -m mt3d.bench planner`` refits it) and assumed for the other devices."""
HBM_FRACTION = 0.85
"""Achieved share of HBM bandwidth by streaming kernels (STREAM-like copy/triad on A100/H100)."""
FLASH_FRACTION = 0.55
"""A flash kernel's causal attention FLOP rate (the tiles it visits: about half of s x s) relative to
the calibrated GEMM rate. Measured on one H200 (docs/benchmarks/2026-11-27-h200-gpu-record.log, the
profiled gpt3-1.3b step): cuDNN's flash kernels ran sequence 2048, head dim 128 forward and backward
in 58.2 ms, 340 TFLOP/s counted causally, 0.55 of 0.78 x 794.5."""
FLASH_TILE = 128
"""The query and key tile of a flash kernel: causal attention visits the tiles on and below the
diagonal, n (n + 1) / 2 of n^2 for n = ceil(s / 128)."""


def causal_share(seq_len: int, tile: int = FLASH_TILE) -> float:
    """The share of an s x s score matrix a causal flash kernel computes (whole tiles on and below the
    diagonal); FlashAttention's own benchmarks count causal attention at half the FLOPs."""
    n = math.ceil(seq_len / tile)
    return (n + 1) / (2 * n)


@dataclass(frozen=True)
class Gemm:
    """One (batched) matrix multiply: ``batch`` products of (m x k) @ (k x n)."""

    m: float
    n: float
    k: float
    batch: float = 1.0

    @property
    def flops(self) -> float:
        """Multiply-add FLOPs."""
        return 2.0 * self.m * self.n * self.k * self.batch

    def backward(self) -> tuple[Gemm, Gemm]:
        """Input gradient (m x n) @ (n x k) and weight gradient (k x m) @ (m x n)."""
        return Gemm(self.m, self.k, self.n, self.batch), Gemm(self.k, self.n, self.m, self.batch)


def gemm_seconds(g: Gemm, dev, elem: int = 2, fraction: float = GEMM_FRACTION,
                 ceiling: float | None = None) -> float:  # fmt: skip
    """Time of ``g`` on ``dev``: the slower of the quantised compute (at ``fraction`` of the device's
    GEMM ceiling, or of ``ceiling`` TFLOP/s: FP8's) and the HBM traffic."""
    per_sm = (ceiling or dev.gemm_tflops) * fraction * 1e12 / dev.sms
    return _gemm_seconds(g.m, g.n, g.k, g.batch, per_sm, dev.sms, elem / (dev.hbm_gbps * 1e9 * HBM_FRACTION))


@functools.lru_cache(maxsize=1 << 16)
def _gemm_seconds(m: float, n: float, k: float, batch: float, per_sm: float, sms: int,
                  seconds_per_byte: float) -> float:  # fmt: skip
    """``gemm_seconds`` of one shape, remembered: the planner times the same GEMMs for many layouts."""
    best = math.inf
    for tm, tn in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
        waves = math.ceil(tiles / sms)
        best = min(best, waves * 2.0 * tm * tn * k / per_sm)
    return max(best, batch * (m * k + k * n + m * n) * seconds_per_byte)


def block_gemms(cfg: ModelConfig, tokens: int, tp: int) -> list[Gemm]:
    """The forward weight GEMMs of one block on one TP rank (QKV, output, MLP in and out)."""
    h = cfg.hidden
    ffn = cfg.mlp_token_width()  # MoE: the k experts a token visits (as one GEMM of their total width)
    mlp_in = (2 if cfg.mlp in GATED_MLPS else 1) * ffn / tp
    attn_in, attn_out = cfg.attn_widths(tp)
    return [
        Gemm(tokens, attn_in, h),
        Gemm(tokens, h, attn_out),
        Gemm(tokens, mlp_in, h),
        Gemm(tokens, h, ffn / tp),
    ]


def expert_gemms(cfg: ModelConfig, tokens: int, tp: int, ep: int, etp: int,
                 chunks: int = 1) -> list[tuple[Gemm, float]]:  # fmt: skip
    """The MLP GEMMs of one block on one rank of a mixture of experts as they run, each with the share
    of blocks that runs it: a dense block's MLP (1 - s of them), a sparse block's shared expert and its
    routed experts (s) as one grouped GEMM per projection: experts / ep of them on the rank, each over
    the rows routed to it (every rank dispatches its ``tokens`` / (tp / etp): ``tp / etp`` TP ranks
    share a token's dispatch; k assignments a token, balanced over the experts) and 1/etp of its inner
    size; ``chunks`` (``train.overlap.dispatch_chunks``): each expert's rows in that many GEMMs. The FLOPs
    equal ``block_gemms``' MLP part; the shapes are what whole experts (etp 1) and chunks change."""
    spec, h = cfg.moe_spec, cfg.hidden
    ins = 2 if cfg.mlp in GATED_MLPS else 1
    share = cfg.sparse_layers / cfg.layers

    def mlp(width: float, rows: float, split: int, batch: float = 1.0) -> list[Gemm]:
        return [Gemm(rows, ins * width / split, h, batch), Gemm(rows, h, width / split, batch)]

    out = [(g, 1 - share) for g in mlp(cfg.ffn, tokens, tp)] if share < 1 else []
    if spec.shared_ffn:
        out += [(g, share) for g in mlp(spec.shared_ffn, tokens, tp)]
    rows = tokens / (tp // etp) * spec.top_k * ep / spec.experts
    return out + [(g, share) for g in mlp(spec.expert_ffn, rows / chunks, etp, spec.experts // ep * chunks)]


COLUMN_GEMMS = (0, 2)
"""The column-parallel linears among ``block_gemms`` (QKV and the MLP's input): the ones whose
backward transfers overlap their GEMMs (``costs.tp_hidden``)."""


def block_gemm_seconds(cfg: ModelConfig, tokens: int, tp: int, dev, fraction: float = GEMM_FRACTION,
                       rate: float | None = None) -> list[tuple[float, float, float]]:  # fmt: skip
    """(forward, input-gradient, weight-gradient) GEMM seconds of each of ``block_gemms`` (QKV, output,
    MLP in and out) for ``tokens`` tokens: from the shape model on a calibrated ``dev``, else at
    ``rate`` FLOP/s."""
    out = []
    for g in block_gemms(cfg, tokens, tp):
        three = (g, *g.backward())
        if rate is None:
            out.append(tuple(gemm_seconds(x, dev, fraction=fraction) for x in three))
        else:
            out.append(tuple(x.flops / rate for x in three))
    return out


FP8_CAST_BYTES = {"tensorwise": 7.0, "rowwise": 12.0, "blockwise": 12.0, "mxfp8": 12.0}
"""Bytes moved per element of a linear's input and of its output gradient to cast them for FP8 GEMMs
(``mt3d.parallel.fp8``): tensorwise reads the bf16 tensor for its amax (2), reads it again and writes
e4m3/e5m2 (3), and transposes the FP8 copy once for the weight gradient (2); rowwise casts each along
two axes (twice 2 + 3) and transposes one FP8 copy (2); the tiled recipes (blockwise, mxfp8) the same
passes as rowwise (their scales, 1/128 and 1/32 of a byte per element, not counted). Every recipe's
GEMMs run at the device's one FP8 ceiling (``gemm_tflops_fp8``): block-scaled kernels were not
measured here."""


def fp8_cast_seconds(cfg: ModelConfig, tokens: int, tp: int, dev, recipe: str, fwd_passes: int = 1) -> float:
    """HBM time of one block's FP8 casts per micro-batch of ``tokens``: every linear's input and output
    gradient (``FP8_CAST_BYTES``, the input once more per recomputed forward) and its weight (cast
    along both axes, about 12 bytes per element)."""
    per = FP8_CAST_BYTES[recipe]
    moved = 0.0
    for g in block_gemms(cfg, tokens, tp):  # (m tokens, n out, k in)
        moved += g.m * (g.k * (per + 5.0 * (fwd_passes - 1)) + g.n * per) + 12.0 * g.k * g.n
    return moved / (dev.hbm_gbps * 1e9 * HBM_FRACTION)


def elementwise_elements(
    cfg: ModelConfig, seq_len: int, keys: float, tp: int, sp: bool, attention: str
) -> float:
    """Elements one block reads and writes per token in its forward, outside GEMMs (one TP rank).

    Two norms (read + write h), two dropout + residual adds (read 2h, write h, a mask of h/2 in
    16-bit units): replicated over TP ranks unless sequence parallel; bias + activation over the
    local MLP slice; rotary on q and k; with materialised attention the softmax (read + write the
    local heads' scores) and its dropout (read, write, mask)."""
    h, t = cfg.hidden, tp
    replicated = (4 * h + 7 * h) / (t if sp else 1)
    act = (3 if cfg.mlp in GATED_MLPS else 2) * cfg.mlp_token_width() / t
    rope = 4 * (cfg.q_size + cfg.kv_size) / t if cfg.position == "rope" else 0.0
    scores = 4.5 * cfg.heads / t * keys if attention == "materialized" else 0.0
    return replicated + act + rope + scores


def micro_batch_seconds(
    cfg: ModelConfig,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    tp: int,
    blocks: int,
    dev,
    *,
    sp: bool = False,
    recompute: bool = False,
    selective: bool = False,
    attention: str = "flash",
    keys: float | None = None,
    with_logits: bool = True,
    elem: int = 2,
    fraction: float = GEMM_FRACTION,
    fp8: str | None = None,
    experts: tuple[int, ...] | None = None,
    scans: int = 1,
) -> dict[str, float]:
    """Forward + backward (+ recompute) seconds of one micro-batch through ``blocks`` blocks on one
    GPU, split into GEMMs, attention and elementwise work; ``with_logits`` adds the output layer.
    ``fraction``: of the GEMM ceiling the GEMMs reach (the calibration). ``selective`` recompute runs
    the attention core's forward and the elementwise work once more (an upper bound for the latter:
    only the MLP's activation is recomputed), no GEMM. ``fp8`` (a ``train.fp8`` recipe): the blocks'
    linears at the device's FP8 GEMM ceiling with one-byte operands, plus their casts
    (``fp8_cast_seconds``, counted as elementwise work); the output layer stays 16-bit. ``experts``
    (ep, etp[, chunks]): a mixture of experts' MLP GEMMs as its experts run them (``expert_gemms``).
    Gated DeltaNet blocks (``model.linear_attention``) run the chunked scan instead of attention,
    ``scans`` times a pass (3 under context parallelism: ``mt3d.model.gdn_context``), timed as
    attention's kernels are."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
    tokens = seq_len * micro_batch
    keys = seq_len if keys is None else keys
    fwd_passes = 2 if recompute else 1
    again = 1 if selective and not recompute else 0  # the selectively recomputed parts' forward
    gemm = 0.0
    linear = (1, fraction, dev.gemm_tflops_fp8) if fp8 else (elem, fraction, None)
    gemms = [(g, 1.0) for g in block_gemms(cfg, tokens, tp)]
    if experts is not None and cfg.moe_spec is not None:
        gemms = gemms[:2] + expert_gemms(cfg, tokens, tp, *experts)
    for g, weight in gemms:
        dgrad, wgrad = g.backward()
        gemm += weight * (
            fwd_passes * gemm_seconds(g, dev, *linear)
            + gemm_seconds(dgrad, dev, *linear)
            + gemm_seconds(wgrad, dev, *linear)
        )
    heads = cfg.heads / tp
    if attention == "materialized":  # scores = q k^T and out = p v per head; backward two of each
        qk = Gemm(seq_len, keys, cfg.head_dim, micro_batch * heads)
        pv = Gemm(seq_len, cfg.head_dim, keys, micro_batch * heads)
        one = gemm_seconds(qk, dev, elem, fraction) + gemm_seconds(pv, dev, elem, fraction)
        attn = (fwd_passes + again + 2) * one
    else:
        # forward (backward 2x) over the tiles a causal kernel visits; ``keys`` already scales dense
        # causal attention down to the local patterns' tiles
        flops = 4.0 * tokens * keys * causal_share(seq_len) * cfg.q_size / tp
        attn = (fwd_passes + again + 2) * flops / (dev.gemm_tflops * fraction * 1e12 * FLASH_FRACTION)
    rate = dev.gemm_tflops * fraction * 1e12 * FLASH_FRACTION  # the DeltaNet blocks' share runs the scan
    attn = per_kind(
        cfg, attn, lambda spec: (fwd_passes + again + 2) * scans * tokens * spec.core_flops() / tp / rate
    )
    per_token = elementwise_elements(cfg, seq_len, keys, tp, sp, attention)
    mem = (fwd_passes + again + 2) * per_token * tokens * elem / (dev.hbm_gbps * 1e9 * HBM_FRACTION)
    if fp8:
        mem += fp8_cast_seconds(cfg, tokens, tp, dev, fp8, fwd_passes)
    out = {"gemm_s": blocks * gemm, "attention_s": blocks * attn, "elementwise_s": blocks * mem}
    logits = 0.0
    if with_logits:
        g = Gemm(tokens, pad_vocab(vocab, tp) / tp, cfg.hidden)
        logits = sum(gemm_seconds(x, dev, elem, fraction) for x in (g, *g.backward()))
        logits += 3 * tokens * pad_vocab(vocab, tp) / tp * 4 / (dev.hbm_gbps * 1e9 * HBM_FRACTION)  # fp32 CE
    out["logits_s"] = logits
    out["total_s"] = sum(out.values())
    return out


def optimizer_seconds(elements: float, dev) -> float:
    """The Adam step over ``elements`` parameters on the GPU: memory-bound, about 28 bytes each
    (fp32 master, moments and gradient read, master and moments written, 16-bit copy written)."""
    return 28.0 * elements / (dev.hbm_gbps * 1e9 * HBM_FRACTION)
