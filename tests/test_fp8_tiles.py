"""The tiled FP8 recipes (``train.fp8.recipe`` "blockwise": DeepSeek-V3's 1x128 tiles and 128x128
weight blocks; "mxfp8": OCP MX 1x32 tiles with e8m0 scales): the quantizers against a reference written
here tile by tile (bit-identical values and scales, a partial last tile along the tokens, saturation),
each GEMM against fp64 products of the reference casts, and training: 40 steps of each recipe near
bf16's loss, tp 2 with SP near one process."""

import math

import pytest
import torch

from mt3d.parallel.fp8 import E4M3, dequantize_tiles, gemms_for, quantize_blocks, quantize_tiles
from mt3d.parallel.spawn import spawn

from helpers import step_records, tiny_config

M, K, N = 48, 256, 128  # tokens (48: a partial 128-tile along them), in, out


def reference_tiles(x: torch.Tensor, dim: int, block: int, mx: bool):
    """(values cast to e4m3, inverse scales), one tile of ``block`` values along ``dim`` at a time."""
    x = x.float().movedim(dim, 1)
    q, inv = torch.empty(x.shape, dtype=E4M3), []
    for r in range(x.shape[0]):
        row = []
        for j in range(0, x.shape[1], block):
            tile = x[r, j : j + block]
            amax = float(tile.abs().max())
            if mx:  # OCP MX: X = floor(log2 amax) - 8 (e4m3's largest power of two), scale 2^-X
                e = math.frexp(max(amax, 2.0**-127))[1] - 1 - 8
                scale = torch.tensor(2.0 ** -max(-127, min(127, e)), dtype=torch.float32)
            else:
                scale = torch.tensor(448.0, dtype=torch.float32) / torch.tensor(max(amax, 1e-12))
            q[r, j : j + block] = (tile * scale).clamp(-448, 448).to(E4M3)
            row.append(1 / scale)
        inv.append(torch.stack(row))
    return q.movedim(1, dim), torch.stack(inv).movedim(1, dim)


def reference_blocks(w: torch.Tensor, block: int):
    w = w.float()
    q, inv = torch.empty(w.shape, dtype=E4M3), torch.empty(w.shape[0] // block, w.shape[1] // block)
    for i in range(0, w.shape[0], block):
        for j in range(0, w.shape[1], block):
            tile = w[i : i + block, j : j + block]
            scale = torch.tensor(448.0) / tile.abs().max().clamp(min=1e-12)
            q[i : i + block, j : j + block] = (tile * scale).clamp(-448, 448).to(E4M3)
            inv[i // block, j // block] = 1 / scale
    return q, inv


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    x[3, 5] = 4000.0  # one outlier: only its tiles' scales change
    w = (torch.randn(N, K, generator=g) * torch.logspace(-3, 0, K)).to(torch.bfloat16)  # uneven columns
    dy = (torch.randn(M, N, generator=g) * torch.logspace(-3, 1, N)).to(torch.bfloat16)
    return x, w, dy


@pytest.mark.parametrize("block,mx", [(128, False), (32, True)])
def test_tile_quantizers_equal_the_reference_bit_for_bit(operands, block, mx):
    x, w, dy = operands
    for t in (x, w, dy):
        for dim in (0, 1):  # dim 0 along the 48 tokens: a partial last 128-tile
            q, inv = quantize_tiles(t, E4M3, dim, block, pow2=mx, e8m0=mx)
            rq, rinv = reference_tiles(t, dim, block, mx)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(inv, rinv.float())
            if mx:  # e8m0: every inverse scale a power of two, the tile's amax in e4m3's top binade
                assert torch.equal(torch.exp2(torch.round(torch.log2(inv))), inv)
    xq, xinv = quantize_tiles(x, E4M3, 1, block, pow2=mx, e8m0=mx)
    assert xq.float().abs().max() <= 448 and (xinv[3, 5 // block] > 100 * xinv[3, -1])  # the outlier's tile
    q, inv = quantize_blocks(w, E4M3, 128)
    rq, rinv = reference_blocks(w, 128)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(inv, rinv)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_each_tiled_gemm_is_the_product_of_the_recipe_casts(operands, recipe):
    """Forward, input- and weight-gradient GEMMs equal fp64 products of the reference casts: tiles
    along each GEMM's reduction dimension (the weight gradient's along the tokens), blockwise weights
    in 128x128 blocks for both the forward and the input gradient; the FP8 rounding is visible."""
    x, w, dy = operands
    gemms = gemms_for(recipe)
    y, kept = gemms.linear(x, w, None)
    g = gemms.grad_of(dy)
    dx, dw = gemms.dgrad(g, w), gemms.wgrad(g, kept)
    block, mx = (128, False) if recipe == "blockwise" else (32, True)

    def cast(t, dim):
        q, inv = reference_tiles(t, dim, block, mx)
        return dequantize_tiles(q, inv.float(), dim, block).double()

    if recipe == "blockwise":
        wq, winv = reference_blocks(w, 128)
        wf = wb = dequantize_tiles(wq, winv, None, 128).double()
    else:
        wf, wb = cast(w, 1), cast(w, 0)
    want = [cast(x, 1) @ wf.T, cast(dy, 1) @ wb, cast(dy, 0).T @ cast(x, 0)]
    exact = [x.double() @ w.double().T, dy.double() @ w.double(), dy.double().T @ x.double()]
    for name, got, ref, plain in zip(
        ("forward", "input gradient", "weight gradient"), (y, dx, dw), want, exact
    ):
        assert got.dtype == torch.bfloat16
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        off = ((plain - ref).norm() / ref.norm()).item()
        assert rel < 4e-3 and off > 5 * rel, f"{recipe} {name}: {rel:.2e} from the casts, bf16 {off:.2e}"


MODEL = {"preset": "tiny-llama", "hidden": 256, "layers": 2, "heads": 4, "kv_heads": 4, "ffn": 512}
"""Every weight dimension a multiple of 128 at tp 2 (blockwise's blocks)."""


def run(d, recipe, tp=1, steps=40):
    raw = tiny_config(d, model=MODEL, tp=tp, steps=steps, global_batch=8, micro=4)
    raw["bf16"] = {"enabled": True}
    raw["mt3d"]["data"]["seq_len"] = 64
    raw["mt3d"]["parallel"]["sequence_parallel"] = tp > 1
    if recipe:
        raw["mt3d"]["train"]["fp8"] = {"recipe": recipe}
    return raw


# Layout noise, measured (5 steps of MODEL, bf16, tp 2 with SP against one process, largest relative
# difference of a loss or grad norm): bf16 without FP8 4.8e-4; blockwise 6.1e-3, mxfp8 9.0e-3,
# rowwise 1.1e-2, tensorwise 2.6e-2. The tiles and blocks are the same at tp 1 and 2 (every shard a
# multiple of them); the row-parallel outputs' bf16 partial sums differ, and FP8 rounding amplifies it.
LAYOUT_RTOL = 2e-2


def test_tiled_recipes_train_near_bf16_and_alike_at_every_layout(tmp_path):
    """40 steps: each recipe's final loss within 3% of bf16's and not equal to it; tp 2 with SP within
    the measured layout noise of one process of the same recipe (5 steps)."""
    from helpers import run_grouped

    runs = [(1, run(tmp_path / "bf16", None)), (1, run(tmp_path / "bw", "blockwise")),
            (1, run(tmp_path / "mx", "mxfp8")), (2, run(tmp_path / "bw2", "blockwise", tp=2, steps=5)),
            (2, run(tmp_path / "mx2", "mxfp8", tp=2, steps=5))]  # fmt: skip
    bf16, bw, mx, bw2, mx2 = (step_records(r) for r in run_grouped(runs, timeout=900))
    for name, got in (("blockwise", bw), ("mxfp8", mx)):
        assert len(got) == 40 and got[-1]["loss"] < 0.8 * got[0]["loss"]
        rel = abs(got[-1]["loss"] - bf16[-1]["loss"]) / bf16[-1]["loss"]
        assert 0 < rel < 0.03, f"{name}: final loss {got[-1]['loss']} vs bf16 {bf16[-1]['loss']}"
    for name, two, one in (("blockwise", bw2, bw), ("mxfp8", mx2, mx)):
        for a, b in zip(two, one[:5], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= LAYOUT_RTOL * abs(b[key]), (
                    name,
                    a["step"],
                    key,
                    a[key],
                    b[key],
                )


MOE = {"preset": "tiny-mixtral", "kv_heads": 4}
"""hidden 64, experts' inner 64, kv heads x head_dim 64: multiples of mxfp8's 32 at tp 1 and 2."""


def moe_run(d, recipe, experts=True, ep=1, steps=40, dispatch=False, tp=1):
    raw = run(d, None, steps=steps, tp=tp)
    raw["mt3d"]["model"] = dict(MOE)
    raw["mt3d"]["parallel"]["expert"] = ep
    if tp > 1:  # folded: ep over the TP ranks, whole experts
        raw["mt3d"]["parallel"]["expert_tensor"] = 1
    if recipe:
        raw["mt3d"]["train"]["fp8"] = {"recipe": recipe, "experts": experts, "dispatch": dispatch}
    return raw


def test_experts_in_fp8_train_near_bf16_and_alike_at_ep_2(tmp_path):
    """``fp8.experts``: a Mixtral's routed experts in mxfp8 too (one tiled GEMM per expert, any number
    of rows): 40 steps within 3% of bf16's final loss and not equal to the run with bf16 experts; ep 2
    within the measured layout noise of one process; and with ``fp8.dispatch`` at ep 2 folded over tp 2
    with SP (whole experts) within that noise too (the dispatch's effect is only on the experts'
    weight gradients: ``test_fp8_dispatch_halves_the_rows_bytes_at_ep_2``)."""
    from helpers import run_grouped

    runs = [(1, moe_run(tmp_path / "bf16", None)), (1, moe_run(tmp_path / "mx", "mxfp8")),
            (1, moe_run(tmp_path / "dense", "mxfp8", experts=False)),
            (2, moe_run(tmp_path / "ep2", "mxfp8", ep=2, steps=5)),
            (2, moe_run(tmp_path / "fold", "mxfp8", ep=2, steps=5, dispatch=True, tp=2))]  # fmt: skip
    bf16, mx, dense_only, ep2, fold = (step_records(r) for r in run_grouped(runs, timeout=900))
    rel = abs(mx[-1]["loss"] - bf16[-1]["loss"]) / bf16[-1]["loss"]
    assert 0 < rel < 0.03 and mx[-1]["loss"] < 0.8 * mx[0]["loss"], (mx[-1]["loss"], bf16[-1]["loss"])
    assert mx[-1]["loss"] != dense_only[-1]["loss"]  # the experts' GEMMs did run in FP8
    for got in (ep2, fold):
        for a, b in zip(got, mx[:5], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= LAYOUT_RTOL * abs(b[key]), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("fp8,model,message", [
    ({"recipe": "rowwise", "experts": True}, MOE, "mt3d.train.fp8.experts needs a tiled recipe"),
    ({"recipe": "mxfp8", "experts": True}, MODEL, "the model has no routed experts"),
    ({"recipe": "mxfp8", "experts": True}, {**MOE, "moe": {"experts": 4, "top_k": 2, "expert_ffn": 48}},
     "expert_ffn / expert_tensor = 48"),
    ({"recipe": "rowwise", "dispatch": True}, MOE, "mt3d.train.fp8.dispatch needs a tiled recipe"),
    ({"recipe": "mxfp8", "dispatch": True}, MODEL, "fp8.dispatch: the model has no routed experts"),
])  # fmt: skip
def test_fp8_experts_bad_input_is_one_line(tmp_path, fp8, model, message):
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    raw = run(tmp_path, None)
    raw["mt3d"]["model"], raw["mt3d"]["train"]["fp8"] = model, fp8
    with pytest.raises(ConfigError) as err:
        cfg = from_dict(raw)
        validate(cfg, 1, resolve_model(cfg.mt3d.model))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_lora_adapts_a_base_whose_gemms_run_in_tiled_fp8(tmp_path):
    """LoRA (r 8, every linear) on a base whose GEMMs run in mxfp8 and blockwise at tp 2 with SP: the
    frozen base's forward and input-gradient GEMMs in FP8 (no weight gradient for it), the adapters
    in bf16; 5 steps within 1% of LoRA on the bf16 base and not equal to it."""
    from helpers import run_grouped

    runs = []
    for name, recipe in (("bf16", None), ("mx", "mxfp8"), ("bw", "blockwise")):
        raw = run(tmp_path / name, recipe, tp=2, steps=5)
        raw["mt3d"]["lora"] = {"r": 8, "target_modules": "all-linear"}
        runs.append((2, raw))
    bf16, *fp8 = (step_records(r) for r in run_grouped(runs, timeout=900))
    assert bf16[-1]["loss"] < bf16[0]["loss"]
    for got in fp8:
        assert got[0]["loss"] != bf16[0]["loss"]
        assert abs(got[-1]["loss"] - bf16[-1]["loss"]) < 0.01 * bf16[-1]["loss"]


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_dispatch_rows_pack_the_tile_casts_with_their_scales(operands, recipe):
    """``fp8.DispatchRows``: a row's bytes are its e4m3 values then its scales (fp32, or one e8m0 byte
    per 1x32 tile), and decode to the tile cast's dequantised values bit for bit; with mxfp8 casting
    the decoded rows again gives the same FP8 values (an FP8 expert GEMM sees what it would have seen
    without the FP8 dispatch)."""
    from mt3d.parallel.fp8 import RECIPES, DispatchRows

    r, codec = RECIPES[recipe], DispatchRows(recipe)
    x = operands[0][:, :96]  # a partial last 128-tile along the hidden dimension
    packed = codec.encode(x)
    tiles = -(-96 // r.block)
    assert packed.dtype == torch.uint8 and packed.shape == (M, 96 + tiles * (1 if r.e8m0 else 4))
    q, inv = quantize_tiles(x, E4M3, 1, r.block, r.pow2_scales, r.e8m0)
    assert torch.equal(packed[:, :96], q.view(torch.uint8))
    if r.e8m0:
        assert torch.equal(torch.exp2(packed[:, 96:].float() - 127), inv)
    back = codec.decode(packed, 96, torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back, dequantize_tiles(q, inv, 1, r.block).bfloat16())
    if r.e8m0:
        again = quantize_tiles(back, E4M3, 1, r.block, True, True)
        assert torch.equal(again[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(again[1], inv)
    empty = codec.encode(x[:0])
    assert empty.shape == (0, packed.shape[1]) and codec.decode(empty, 96, torch.bfloat16).shape == (0, 96)


def _dispatch_worker(recipe, experts):
    """ep 2, bf16: per dispatch (once per rank, once per assignment) the block without and with
    ``fp8_dispatch``: (output, input gradient, weight gradients, the all-to-alls' (bytes, elements))."""
    import torch.distributed as dist
    from test_moe import _ep_batch, _ep_block

    from mt3d.parallel.commlog import CollectiveLog
    from mt3d.parallel.fp8 import DispatchRows

    me, group = dist.get_rank(), dist.new_group([0, 1])
    runs = []
    for dedup, dispatch in ((True, False), (True, True), (False, False), (False, True)):
        if experts:  # FP8 everywhere in the block: its attention's linears too (hidden 32: mxfp8's tiles)
            ctx = dict(fp8=recipe, fp8_experts=True, fp8_dispatch=dispatch)
        else:  # only the dispatch (blockwise GEMMs would need the linears' dimensions multiples of 128)
            ctx = {}
        block = _ep_block(1, 2, 0, me, (None, group), **ctx).to(torch.bfloat16)
        if not experts:
            block.mlp.codec = DispatchRows(recipe) if dispatch else None
        block.mlp.dedup = dedup
        x = _ep_batch(me).to(torch.bfloat16).requires_grad_()
        with CollectiveLog() as log:
            out = block(x)
            out.backward(torch.ones_like(out))
        sizes = [(c.bytes, c.numel) for c in log.calls if c.op == "all_to_all_single"]
        runs.append((out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}, sizes))
    return runs


@pytest.mark.parametrize("recipe,experts", [("mxfp8", True), ("blockwise", False)])
def test_fp8_dispatch_halves_the_rows_bytes_at_ep_2(recipe, experts):
    """``train.fp8.dispatch`` at ep 2 (bf16, hidden 32), both dispatches: the one all-to-all that carries
    the rows to their experts sends 1 byte per value plus the scales (0.5x bf16's plus 1 or 4 bytes per
    row: the collective recorder's bytes); every other transfer (counts, metadata, the combine, all the
    gradients) is bf16's, byte for byte. With mxfp8 experts the outputs and input gradients equal those
    without the FP8 dispatch bit for bit (the experts' GEMMs cast the same FP8 values) and only the
    experts' weight gradients move (their saved inputs are the dispatched values); with bf16 experts
    (blockwise) the output moves by e4m3's rounding."""
    from mt3d.parallel.fp8 import DispatchRows

    scale_bytes = DispatchRows(recipe).scale_bytes(32)
    for runs in spawn(_dispatch_worker, 2, recipe, experts, timeout=120):
        for plain, fp8 in (runs[0:2], runs[2:4]):
            changed = [(a, b) for a, b in zip(plain[3], fp8[3], strict=True) if a != b]
            assert len(changed) == 1, changed
            (bf16_bytes, bf16_numel), (fp8_bytes, fp8_numel) = changed[0]
            rows = bf16_numel // 32
            assert rows > 0 and fp8_bytes == fp8_numel == bf16_bytes // 2 + rows * scale_bytes
            if experts:
                assert torch.equal(plain[0], fp8[0]) and torch.equal(plain[1], fp8[1])
                moved = [n for n in plain[2] if not torch.equal(plain[2][n], fp8[2][n])]
                assert moved and all(".experts." in n for n in moved), moved
            else:
                err = (fp8[0] - plain[0]).float().norm() / plain[0].float().norm()
                assert 0 < err < 0.05, err


def test_fp8_dispatch_without_expert_parallelism_is_noted():
    from types import SimpleNamespace

    from mt3d.config.rules import fp8_notes

    fp8 = SimpleNamespace(all_gather=False, dispatch=True)
    assert [n for n in fp8_notes(fp8, False, 1, ep=1) if "fp8.dispatch does nothing" in n]
    assert fp8_notes(fp8, False, 1, ep=2) == []
