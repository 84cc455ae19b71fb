"""FP8 GEMMs in the TP linears (``train.fp8``, ``mt3d.parallel.fp8``): each recipe's casts and scales
against a quantise-dequantise reference, the plain GEMMs bit-identical to what mt3d ran before,
recompute bit-identical, every layout within FP8's measured layout noise of one process, exact resume
and reshard, and the bad inputs refused in one line."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from mt3d.config import ConfigError, from_dict, resolve_model, validate
from mt3d.parallel import fp8 as fp8_module
from mt3d.parallel.fp8 import E4M3, E5M2, PLAIN, Fp8Gemms
from mt3d.parallel.spawn import spawn
from mt3d.parallel.state import AxisGroup

from helpers import TINY_LLAMA, step_records, tiny_config, train_worker

M, K, N = 48, 64, 96  # tokens, in, out: multiples of 16


def reference_cast(x: torch.Tensor, dtype, dim, pow2: bool) -> torch.Tensor:
    """x cast to ``dtype`` and back (fp64), one scale per tensor (dim None) or per slice along ``dim``,
    written from the recipe's definition: scale = max(dtype) / amax, optionally rounded down to 2^n."""
    x = x.double()
    top = torch.finfo(dtype).max
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = top / amax.clamp(min=1e-12)
    if pow2:
        scale = 2.0 ** torch.floor(torch.log2(scale))
    return (x * scale).clamp(-top, top).to(dtype).double() / scale


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def operands():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * 0.05).to(torch.bfloat16)
    dy = (torch.randn(M, N, generator=g) * torch.logspace(-3, 1, N)).to(torch.bfloat16)  # uneven columns
    return x, w, dy


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_gemm_casts_and_scales_its_operands_as_the_recipe_says(recipe, operands, monkeypatch):
    """Forward, input- and weight-gradient GEMMs equal fp64 products of the recipe's quantise-dequantise
    casts (tensorwise: one scale, e4m3 inputs and weights, e5m2 gradients; rowwise: all e4m3, one
    power-of-two scale per row along each GEMM's reduction dimension) within bf16's output rounding;
    the operands and scales reaching torch._scaled_mm have the recipe's dtypes and shapes."""
    x, w, dy = operands
    calls = []
    real = torch._scaled_mm

    def spy(a, b, scale_a, scale_b, **kw):
        calls.append((a.dtype, b.dtype, tuple(scale_a.shape), tuple(scale_b.shape), scale_a, scale_b))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    gemms = Fp8Gemms(recipe)
    y, kept = gemms.linear(x, w, None)
    g = gemms.grad_of(dy)
    dx, dw = gemms.dgrad(g, w), gemms.wgrad(g, kept)

    rw = recipe == "rowwise"
    grad_dtype = E4M3 if rw else E5M2
    along = (lambda d: d) if rw else (lambda d: None)

    def q(t, dtype, dim):
        return reference_cast(t, dtype, along(dim), rw)

    want = {
        "forward": q(x, E4M3, 1) @ q(w, E4M3, 1).T,
        "input gradient": q(dy, grad_dtype, 1) @ q(w, E4M3, 0),
        "weight gradient": q(dy, grad_dtype, 0).T @ q(x, E4M3, 0),
    }
    exact = {"forward": x.double() @ w.double().T, "input gradient": dy.double() @ w.double(),
             "weight gradient": dy.double().T @ x.double()}  # fmt: skip
    for (name, ref), got in zip(want.items(), (y, dx, dw), strict=True):
        assert got.dtype == torch.bfloat16
        assert relative(got, ref) < 4e-3, f"{recipe} {name}: {relative(got, ref):.2e} from the reference"
        # the FP8 rounding is visible: the unquantised product is far outside that tolerance
        assert relative(exact[name], ref) > 5 * relative(got, ref), name

    shapes = {  # (a dtype, b dtype, scale_a shape, scale_b shape) per GEMM
        "tensorwise": [(E4M3, E4M3, (), ()), (E5M2, E4M3, (), ()), (E5M2, E4M3, (), ())],
        "rowwise": [(E4M3, E4M3, (M, 1), (1, N)), (E4M3, E4M3, (M, 1), (1, K)), (E4M3, E4M3, (N, 1), (1, K))],
    }[recipe]
    assert [c[:4] for c in calls] == shapes
    for *_, sa, sb in calls:
        for s in (sa, sb):
            assert s.dtype == torch.float32
            if rw:  # inverse scales are powers of two: exact to apply
                assert torch.equal(torch.exp2(torch.round(torch.log2(s))), s)


def test_plain_gemms_are_bit_identical_to_what_mt3d_ran(operands):
    """With fp8 off, the TP layers' GEMMs are F.linear and the backward's matmuls mt3d always ran:
    the same bits through every autograd function and a tp-1 layer."""
    from mt3d.parallel import layers

    x, w, dy = (t.float() for t in operands)
    b = torch.randn(N)
    g = PLAIN.grad_of(dy.view(2, M // 2, N))
    assert torch.equal(PLAIN.linear(x, w, b)[0], F.linear(x, w, b))
    assert torch.equal(PLAIN.dgrad(g, w), dy.view(2, M // 2, N).matmul(w))
    assert torch.equal(PLAIN.wgrad(g, (x.view(2, M // 2, K),)), dy.t().matmul(x))

    alone = AxisGroup.alone("tp")
    for fn in (layers._AllReducingLinear, layers._ShardSavingLinear):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x.view(2, M // 2, K), w, b))
        y = fn.apply(xi, wi, bi, alone, PLAIN)
        y.backward(dy.view(2, M // 2, N))
        assert torch.equal(y, F.linear(x.view(2, M // 2, K), w, b))
        assert torch.equal(xi.grad, dy.view(2, M // 2, N).matmul(w))
        assert torch.equal(wi.grad, dy.t().matmul(x))
        assert torch.equal(bi.grad, dy.sum(0))
    row = layers.RowParallelLinear(K, N, tp=alone, init=layers.NormalInit(0.02, 1))
    y = row(x)
    assert torch.equal(y, F.linear(x, row.weight) + row.bias)
    assert y.grad_fn.next_functions[0][0].name() != "_LinearBackward"  # F.linear itself, not mt3d's


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_recompute_rebuilds_fp8_activations_bit_identically(recipe):
    """A block recomputed in the backward (mt3d's checkpoint) casts the same inputs to the same FP8
    values with the same current scales: its output and every gradient equal the kept run's bits."""
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.parallel.random import checkpoint

    cfg = ModelConfig(hidden=64, layers=2, heads=4, position="rope", norm="rmsnorm", mlp="swiglu",
                      bias=False, max_seq_len=32, ffn=128)  # fmt: skip
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), dtype=torch.bfloat16, fp8=recipe), 0)
    assert isinstance(block.attn.qkv.gemms, Fp8Gemms)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    runs = []
    for recompute in (False, True):
        xi = x.clone().requires_grad_()
        y = checkpoint(block, xi) if recompute else block(xi)
        y.float().square().sum().backward()
        runs.append([y.detach(), xi.grad] + [p.grad.clone() for p in block.parameters()])
        block.zero_grad(set_to_none=True)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def fp8_worker(raw):
    """Train ``raw``; return rank 0's records and how many FP8 GEMMs this rank ran."""
    count = [0]
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    torch._scaled_mm = counting
    try:
        return train_worker(raw), count[0]
    finally:
        torch._scaled_mm = real


def fp8_config(d, recipe, model=TINY_LLAMA, tp=1, pp=1, cp=1, ep=1, sp=False, all_gather=False, **train):
    raw = tiny_config(d, model=model, tp=tp, pp=pp, **train)
    raw["bf16"] = {"enabled": True}
    raw["mt3d"]["parallel"].update(sequence_parallel=sp, context=cp, expert=ep)
    raw["mt3d"]["train"]["fp8"] = {"recipe": recipe, "all_gather": all_gather}
    return raw


def compare(got, ref, rtol, what):
    assert [r["step"] for r in got] == [r["step"] for r in ref] and ref
    for a, b in zip(got, ref, strict=True):
        for key in ("loss", "grad_norm"):
            assert math.isfinite(a[key])
            rel = abs(a[key] - b[key]) / abs(b[key])
            assert rel <= rtol, f"{what} step {a['step']} {key}: {a[key]} vs {b[key]} ({rel:.2e} > {rtol})"


# FP8 rounding depends on the shard: a tensorwise scale is the amax of this rank's weight shard or of
# its tokens (cp chunks), so tp and cp change which values round where. Measured (5 steps, bf16 tiny
# Llama, largest relative difference of a loss or grad norm from one process): bf16 without FP8
# 2.0e-3 at (2,2,2)+SP and 1.8e-3 at cp 2; tensorwise 1.7e-2 and 9.6e-3; rowwise 3.8e-3 and 1.3e-3
# (its scales follow rows: the forward's are the same at every tp); the MoE at ep 2: bf16 1.7e-3,
# tensorwise 4.5e-3. A lost collective or a wrong shard moves them by tens of percent. The Gated DeltaNet
# hybrid (tiny-qwen3.5, its q/k/v/z and output projections in FP8): rowwise at tp 2 with SP 1e-2; tensorwise
# 8.6e-2 (one DeltaNet layer in FP8 is 11% from bf16 with either recipe, and tensorwise's per-shard scales
# move it 3% from the one-process FP8 layer, rowwise's 0.3%, bf16 alone 0.3%), so the hybrid runs rowwise.
CASES = {
    "tensorwise (2,2,2) SP FP8 gather": (dict(tp=2, pp=2, sp=True, all_gather=True), 8, 3e-2),
    "rowwise tp 2 SP FP8 gather": (dict(tp=2, sp=True, all_gather=True), 2, 1e-2),
    "rowwise cp 2": (dict(cp=2), 2, 1e-2),
    "tensorwise MoE ep 2": (dict(ep=2, model={"preset": "tiny-qwen2-moe"}), 2, 1e-2),
    "rowwise Qwen3.5 tp 2 SP FP8 gather": (
        dict(tp=2, sp=True, all_gather=True, model={"preset": "tiny-qwen3.5"}),
        2,
        1e-2,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_layouts_train_like_one_process(tmp_path, case):
    """FP8 at (tp, pp, dp) = (2, 2, 2) with SP and the FP8 all-gather (rowwise's gather, which moves the
    rows' scales, at tp 2), cp 2 and a MoE at ep 2 (its shared expert's linears in FP8): within FP8's
    measured layout noise of the one-process FP8 run, every rank running FP8 GEMMs."""
    kw, world, rtol = copy.deepcopy(CASES[case])
    recipe = case.split()[0]
    single = {k: v for k, v in kw.items() if k == "model"}
    ref, ref_count = spawn(fp8_worker, 1, fp8_config(tmp_path / "one", recipe, **single), timeout=300)[0]
    out = spawn(fp8_worker, world, fp8_config(tmp_path / "layout", recipe, **kw), timeout=600)
    ref = step_records(ref)
    assert len(ref) == 5 and ref[-1]["loss"] < ref[0]["loss"]
    compare(step_records(out[0][0]), ref, rtol, case)
    assert ref_count > 0 and all(count > 0 for _, count in out), [c for _, c in out]


def test_fp8_resume_is_exact_and_reshards(tmp_path):
    """An FP8 run (tensorwise, tp 2) saved at step 2 resumes bit-exactly (current scaling keeps no
    state), and resharded to one process continues within FP8's layout noise."""
    straight = step_records(spawn(train_worker, 2, fp8_config(tmp_path / "a", "tensorwise", tp=2, steps=4,
                                                              save_interval=2), timeout=300)[0])  # fmt: skip
    step2 = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert step2.is_dir()
    again = fp8_config(tmp_path / "b", "tensorwise", tp=2, steps=4, resume=str(step2))
    resumed = step_records(spawn(train_worker, 2, again, timeout=300)[0])
    key = lambda rs: [(r["step"], r["loss"], r["grad_norm"]) for r in rs]  # noqa: E731
    assert key(resumed)[-2:] == key(straight)[2:]
    one = fp8_config(tmp_path / "c", "tensorwise", steps=4, resume=str(step2))
    compare(step_records(spawn(train_worker, 1, one, timeout=300)[0])[-2:], straight[2:], 3e-2, "reshard")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"bf16": {"enabled": False}}, '"bf16": {"enabled": true}'),
        ({"fp16": {"enabled": True}}, "trains in fp16"),
        ({"mt3d.train.fp8": {"recipe": "block"}}, "must be one of tensorwise, rowwise, blockwise, mxfp8"),
        ({"mt3d.train.fp8": {"recipe": "blockwise"}}, "blockwise FP8 GEMMs need every weight dimension a "
                                                      "multiple of 128"),
        ({"mt3d.train.fp8": {"recipe": "mxfp8"}, "mt3d.model": {**TINY_LLAMA, "hidden": 80, "heads": 5,
                                                                 "kv_heads": 5}}, "hidden = 80"),
        ({"mt3d.train.fp8": {"recipe": "rowwise", "scaling": "x"}}, "unknown key 'mt3d.train.fp8.scaling'"),
        ({"mt3d.model": {**TINY_LLAMA, "hidden": 72, "heads": 4, "kv_heads": 2}}, "hidden = 72"),
        ({"train_micro_batch_size_per_gpu": 1, "mt3d.data.seq_len": 40}, "tokens per micro-batch"),
    ],
)  # fmt: skip
def test_fp8_bad_input_is_refused_before_any_process_group(tmp_path, change, message):
    """fp8 without bf16, with fp16, an unknown recipe or key, a GEMM dimension that is not a multiple of
    16: a one-line ConfigError from validation (nothing built)."""
    raw = fp8_config(tmp_path, "tensorwise")
    for dotted, value in change.items():
        *path, last = dotted.split(".")
        target = raw
        for part in path:
            target = target[part]
        target[last] = value
    if raw.get("fp16", {}).get("enabled"):
        raw["bf16"] = {"enabled": False}
    with pytest.raises(ConfigError) as err:
        run = from_dict(raw)
        validate(run, 1, resolve_model(run.mt3d.model))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fp8_refuses_a_gpu_without_fp8_gemms(monkeypatch):
    """A CUDA device below compute capability 8.9 (an A100 here, described to the check) is named in
    one line; CPUs run _scaled_mm's reference kernel."""
    assert fp8_module.fp8_support(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    why = fp8_module.fp8_support(torch.device("cuda"))
    assert "A100" in why and "8.0" in why and "8.9" in why


@pytest.mark.parametrize(
    "fp8,selective", [(None, False), ("tensorwise", False), ("rowwise", True), (None, True)]
)
def test_compiled_blocks_trace_whole(fp8, selective):
    """train.compile traces each block as one graph, FP8 and selective recompute included (found on the
    H200: the selective core's checkpoint read RNG states and its MLP recompute called autograd, which
    split every compiled block into 8 graphs): torch._dynamo.explain sees no graph break."""
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig

    cfg = ModelConfig(hidden=64, layers=2, heads=4, position="rope", norm="rmsnorm", mlp="swiglu",
                      bias=False, max_seq_len=32, ffn=128)  # fmt: skip
    ctx = BuildContext(tp=AxisGroup.alone("tp"), dtype=torch.bfloat16, fp8=fp8, selective=selective)
    block = TransformerBlock(cfg, ctx, 0)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    assert explained.graph_count == 1
