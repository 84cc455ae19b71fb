"""Gated DeltaNet (``mt3d.model.gdn``, Qwen3-Next's linear attention) against transformers: the chunked
delta rule against its recurrent and chunked references, the layer (forward and every gradient) at tp 1
and tp 2, and packed documents against the same documents run one at a time."""

import pytest
import torch

from mt3d.parallel.spawn import spawn

HIDDEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 64, 4, 8, 16, 8


def _hf_layer(seed: int = 0):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = Qwen3NextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=KEY_DIM, linear_value_head_dim=VALUE_DIM, linear_conv_kernel_dim=4,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(seed)
    layer = Qwen3NextGatedDeltaNet(cfg, 0).double()
    with torch.no_grad():  # every feature exercised: decays apart, gates and norm weights not 1
        layer.A_log.copy_(torch.linspace(-1, 2, VALUE_HEADS))
        layer.dt_bias.copy_(torch.linspace(-0.5, 0.5, VALUE_HEADS))
        layer.norm.weight.copy_(torch.linspace(0.5, 1.5, VALUE_DIM))
    return layer


def _hf_tensors(hf, grads: bool = False) -> dict:
    """transformers' layer's tensors (or their gradients) under mt3d's names."""
    named = {"in_qkvz.weight": hf.in_proj_qkvz.weight, "in_ba.weight": hf.in_proj_ba.weight,
             "conv": hf.conv1d.weight, "A_log": hf.A_log, "dt_bias": hf.dt_bias,
             "norm.weight": hf.norm.weight, "out.weight": hf.out_proj.weight}  # fmt: skip
    out = {k: (p.grad if grads else p).detach() for k, p in named.items()}
    return out


def _mt3d_layer(hf, tp, sp=False):
    from mt3d.model.blocks import BuildContext
    from mt3d.model.config import ModelConfig
    from mt3d.model.gdn import GatedDeltaNet, GdnSpec
    from mt3d.parallel.marks import shard_of

    spec = GdnSpec(KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, 4)
    cfg = ModelConfig.from_dict(dict(hidden=HIDDEN, layers=1, heads=4, norm="rmsnorm", norm_eps=1e-6))
    layer = GatedDeltaNet(spec, cfg, BuildContext(tp=tp, dtype=torch.float64, sequence_parallel=sp), 0)
    full = _hf_tensors(hf)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(shard_of(full[name], p, tp.rank, tp.size))
    return layer


def test_the_chunked_rule_equals_transformers_recurrence():
    """100 tokens (not a multiple of the chunk), from a given state: outputs and the final state equal
    transformers' token-by-token recurrence and its chunked form, at chunks of 64 and 16."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from mt3d.model.gdn import gated_delta_rule, l2_normalize

    g = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 100, 3, 8, 6
    q, k = (torch.randn(b, t, h, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(b, t, h, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(b, t, h, generator=g, dtype=torch.float64)
    state = torch.randn(b, h, dk, dv, generator=g, dtype=torch.float64)
    args = dict(
        g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    want, want_state = hf.torch_recurrent_gated_delta_rule(q, k, v, **args)
    chunked, _ = hf.torch_chunk_gated_delta_rule(q, k, v, **args)
    torch.testing.assert_close(chunked, want, rtol=1e-5, atol=1e-6)  # both compute in fp32
    heads = lambda x: x.transpose(1, 2)  # noqa: E731
    for chunk in (64, 16):
        out, final = gated_delta_rule(heads(l2_normalize(q)) * dk**-0.5, heads(l2_normalize(k)), heads(v),
                                      heads(decay), heads(beta), state, chunk=chunk)  # fmt: skip
        torch.testing.assert_close(heads(out).double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final, want_state.double(), rtol=1e-5, atol=1e-5)


def _layer_worker(world: int, sp: bool):
    import torch.distributed as dist

    from mt3d.parallel.marks import shard_of
    from mt3d.parallel.state import AxisGroup

    me = dist.get_rank() if world > 1 else 0
    tp = AxisGroup("tp", tuple(range(world)), me, dist.new_group(list(range(world))) if world > 1 else None)
    hf = _hf_layer()
    layer = _mt3d_layer(hf, tp, sp)
    x = torch.randn(2, 80, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mine = slice(me * 80 // world, (me + 1) * 80 // world) if sp else slice(None)  # SP: the rank's shard
    x1, x2 = x.clone().requires_grad_(), x[:, mine].clone().requires_grad_()
    want = hf(x1)
    got = layer(x2)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (want * w).sum().backward()
    (got * w[:, mine]).sum().backward()
    errors = {"out": float((got - want[:, mine]).abs().max() / want.abs().max()),
              "input": float((x2.grad - x1.grad[:, mine]).abs().max() / x1.grad.abs().max())}  # fmt: skip
    grads = _hf_tensors(hf, grads=True)
    for name, p in layer.named_parameters():
        ref = shard_of(grads[name], p, me, world)
        errors[name] = float((p.grad - ref).abs().max() / ref.abs().max())
    return errors


@pytest.mark.parametrize("world,sp", [(1, False), (2, True)], ids=["one", "tp2-sp"])
def test_the_layer_equals_transformers(world, sp):
    """Qwen3NextGatedDeltaNet (4 key heads, 8 value heads, decays, gates and norm weights set apart) with
    mt3d's layer holding the same weights: the output, the input's gradient and every weight's gradient
    within 1e-5 (transformers' rule computes in fp32; most to 1e-7), one process and each rank of tp 2
    with sequence parallelism (its key heads and value heads, its sequence shard in and out)."""
    for errors in spawn(_layer_worker, world, world, sp, timeout=120):
        assert max(errors.values()) < 1e-5, errors


def test_packed_documents_equal_each_document_alone():
    """Three documents packed in one sample (and padding) through the layer equal each document run
    alone, outputs and the input's gradient: the convolution and the state restart at every start."""
    from mt3d.parallel.state import AxisGroup

    layer = _mt3d_layer(_hf_layer(), AxisGroup.alone("tp"))
    x = torch.randn(1, 60, HIDDEN, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    docs = torch.tensor([[0] * 25 + [1] * 3 + [2] * 27 + [-1] * 5])
    packed = x.clone().requires_grad_()
    out = layer(packed, documents=docs)
    out.sum().backward()
    for lo, hi in ((0, 25), (25, 28), (28, 55)):
        alone = x[:, lo:hi].clone().requires_grad_()
        want = layer(alone)
        want.sum().backward()
        torch.testing.assert_close(out[:, lo:hi], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(packed.grad[:, lo:hi], alone.grad, rtol=1e-12, atol=1e-12)
    whole = layer(x)
    assert (whole[:, 25:55] - out[:, 25:55]).abs().max() > 1e-3  # without documents the state carries over


HYBRID = dict(
    hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, ffn=128, position="rope", norm="rmsnorm",
    mlp="swiglu", bias=False, tie_embeddings=False, qk_norm=True, norm_unit_offset=True, rotary_fraction=0.25,
    attn_output_gate=True, norm_eps=1e-6,
    linear_attention=dict(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=16, full_every=2),
)  # fmt: skip
"""Qwen3-Next's block options at a tiny size: Gated DeltaNet in blocks 0 and 2, gated attention with
q/k norms and RoPE over a quarter of each head in blocks 1 and 3."""


def test_a_hybrid_model_trains_as_one_process_at_every_layout(tmp_path):
    """5 steps of the tiny hybrid: tp 2 x pp 2 with SP (world 4), dp 2 with ZeRO-1, cp 2 x tp 2 with SP and
    ZB-V at pp 2 (the DeltaNet's own weights' gradients in B, its linears' in W) equal one process within
    1e-5 (losses and grad norms), as LoRA on every linear of tiny Qwen3.5 (the DeltaNet projections too)
    at tp 2 with SP does, and both learn; bad input (cp chunks shorter than the convolution reads, key
    heads tp does not divide) is one line."""
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    from helpers import run_grouped, step_records, tiny_config

    def run(name, **parallel):
        raw = tiny_config(tmp_path / name, model=HYBRID, zero=parallel.pop("zero", 1))
        raw["mt3d"]["parallel"].update(parallel)
        return raw

    def adapted(name, **parallel):
        """Qwen3.5's separate projections, every linear adapted (in_proj_qkv's three parts in one tensor)."""
        raw = run(name, **parallel)
        raw["mt3d"]["model"] = {"preset": "tiny-qwen3.5"}
        raw["mt3d"]["lora"] = {"r": 4, "target_modules": "all-linear"}
        return raw

    runs = [(1, run("one")), (4, run("tp-pp", tensor=2, pipeline=2, sequence_parallel=True)), (2, run("dp")),
            (4, run("cp-tp", context=2, tensor=2, sequence_parallel=True)), (1, adapted("lora1")),
            (2, adapted("lora2", tensor=2, sequence_parallel=True)),
            (2, run("zbv", pipeline=2, schedule="zbv", virtual_stages=2))]  # fmt: skip
    one, tp_pp, dp, cp_tp, lora1, lora2, zbv = (step_records(r) for r in run_grouped(runs, timeout=600))
    for got, want in ((tp_pp, one), (dp, one), (cp_tp, one), (lora2, lora1), (zbv, one)):
        for a, b in zip(got, want, strict=True):
            for key in ("loss", "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), (a["step"], key, a[key], b[key])
    assert one[-1]["loss"] < one[0]["loss"] and lora1[-1]["loss"] < lora1[0]["loss"]
    one_key = dict(HYBRID, linear_attention=dict(HYBRID["linear_attention"], key_heads=1, value_heads=2))
    for model, change, message in (
        (HYBRID, dict(context=2, seq_len=8), "shorter than the linear attention's convolution reads"),
        (one_key, dict(tensor=2), "tensor parallelism 2 must divide the linear-attention key heads (1)"),
    ):
        seq_len = change.pop("seq_len", None)
        raw = run("bad", **change)
        if seq_len:
            raw["mt3d"]["data"]["seq_len"] = seq_len
        raw["mt3d"]["model"] = model
        with pytest.raises(ConfigError) as err:
            cfg = from_dict(raw)
            validate(cfg, 4, resolve_model(cfg.mt3d.model), here=False)
        assert message in str(err.value) and "\n" not in str(err.value)


def _cp_worker(docs):
    import torch.distributed as dist

    from mt3d.model.blocks import BuildContext
    from mt3d.model.config import ModelConfig
    from mt3d.model.gdn import GatedDeltaNet, GdnSpec
    from mt3d.parallel.context import split_sequence
    from mt3d.parallel.state import AxisGroup

    me, world = dist.get_rank(), dist.get_world_size()
    cp = AxisGroup("cp", tuple(range(world)), me, dist.new_group(list(range(world))))
    spec = GdnSpec(KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM, 4)
    cfg = ModelConfig.from_dict(dict(hidden=HIDDEN, layers=1, heads=4, norm="rmsnorm", norm_eps=1e-6))
    alone = AxisGroup.alone("tp")
    one = GatedDeltaNet(spec, cfg, BuildContext(tp=alone, dtype=torch.float64), 0)
    mine = GatedDeltaNet(spec, cfg, BuildContext(tp=alone, cp=cp, dtype=torch.float64), 0)
    with torch.no_grad():
        for p, q in zip(one.parameters(), mine.parameters(), strict=True):
            p.normal_(generator=torch.Generator().manual_seed(p.numel())).mul_(0.3)
            q.copy_(p)
    x = torch.randn(2, 96, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    w = torch.randn(2, 96, HIDDEN, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    documents = torch.tensor(docs) if docs else None
    x1, x2 = x.clone().requires_grad_(), split_sequence(x, cp).clone().requires_grad_()
    want = one(x1, documents=documents)
    got = mine(x2, documents=documents)
    (want * w).sum().backward()
    (got * split_sequence(w, cp)).sum().backward()
    errors = {"out": float((got - split_sequence(want, cp)).abs().max()),
              "input": float((x2.grad - split_sequence(x1.grad, cp)).abs().max())}  # fmt: skip
    for (name, p), q in zip(one.named_parameters(), mine.parameters(), strict=True):
        total = q.grad.clone()
        dist.all_reduce(total)  # cp ranks hold parts of every weight's gradient
        errors[name] = float((total - p.grad).abs().max() / p.grad.abs().max())
    return errors


@pytest.mark.parametrize(
    "docs",
    [
        None,  # 4 chunks of 24 over 2 ranks in the load-balanced order
        # a document from inside chunk 0 across chunks 1 and 2; one starting exactly at chunk 3 (48 + 24);
        # one starting 2 tokens before chunk 2 (the convolution's halo cut to it); padding at the end
        [[0] * 10 + [1] * 36 + [2] * 26 + [3] * 20 + [-1] * 4, [0] * 46 + [1] * 50],
    ],
    ids=["whole", "packed"],
)
def test_context_parallel_layer_equals_one_process(docs):
    """cp 2: each rank's two chunks through the layer (the convolution's halo from the previous chunk's
    rank, the chunks' state maps all-gathered and chained) equal one process on the whole sequence,
    outputs and input gradients, and the weight gradients summed over the cp ranks (fp64, 1e-10), also
    with packed documents whose starts fall inside, at and just before chunk boundaries."""
    for errors in spawn(_cp_worker, 2, docs, timeout=120):
        assert max(errors.values()) < 1e-10, errors


def test_a_gated_deltanet_checkpoint_resumes_and_reshards(tmp_path):
    """Tiny Qwen3.5 (the convolution's and in_proj_qkv's q/k/v parts split over tp) at tp 2 with ZeRO-1,
    saved at step 2: resumed at tp 2 it takes the straight run's steps 3-4 bit for bit; resharded to one
    process (DeepSpeed's universal format, the fused parts by their patterns) it continues within 1e-5."""
    from helpers import step_records, tiny_config, train_worker

    def config(d, tp, **train):
        return tiny_config(
            d, model={"preset": "tiny-qwen3.5"}, tp=tp, steps=4, zero=1, save_interval=2, **train
        )

    key = lambda rs: [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(rs)]  # noqa: E731
    straight = key(spawn(train_worker, 2, config(tmp_path / "a", 2), timeout=300)[0])
    step2 = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    again = key(spawn(train_worker, 2, config(tmp_path / "b", 2, resume=step2), timeout=300)[0])
    assert again[-2:] == straight[2:]
    one = key(spawn(train_worker, 1, config(tmp_path / "c", 1, resume=step2), timeout=300)[0])
    for got, want in zip(one[-2:], straight[2:], strict=True):
        assert got[0] == want[0] and got[1:] == pytest.approx(want[1:], rel=1e-5)


def test_muon_orthogonalises_each_hf_matrix_of_a_qwen35_block():
    """Muon's unit is the HF matrix: Qwen3.5's in_proj_qkv is one (its q/k/v parts are only the TP split),
    while the attention block's fused q/k/v weight is three."""
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.parallel.state import AxisGroup
    from mt3d.presets import get_preset
    from mt3d.training.muon import muon_matrices

    cfg, tp = get_preset("tiny-qwen3.5"), AxisGroup.alone("tp")
    for layer, name, count in (
        (0, "attn.in_qkv.weight", 1),
        (1, "attn.qkv.weight", 3),
        (0, "attn.in_z.weight", 1),
    ):
        block = TransformerBlock(cfg, BuildContext(tp=tp), layer)
        p = dict(block.named_parameters())[name]
        assert len(muon_matrices(block, tp)[id(p)].pieces(p.detach())) == count, name


def test_the_planner_times_the_scan_not_attention_in_deltanet_blocks():
    """The shape model's attention time: the full-attention blocks' share at every length, the DeltaNet
    blocks' share as the chunked scan (linear in the length), three scans a pass under cp."""
    from mt3d.config import resolve_model
    from mt3d.planner.compute import micro_batch_seconds
    from mt3d.planner.hardware import get_device

    dev = get_device("h100")
    hybrid = resolve_model({"preset": "qwen3-next-80b-a3b"})
    full = resolve_model({"preset": "qwen3-next-80b-a3b", "linear_attention": None})
    args = (151936, 32768, 1, 4, 12, dev)
    one, three = (micro_batch_seconds(hybrid, *args, scans=s)["attention_s"] for s in (1, 3))
    dense = micro_batch_seconds(full, *args)["attention_s"]
    scan = (three - one) / 2  # the DeltaNet share's one scan
    assert abs((one - scan) - dense / 4) < 1e-9 * dense  # a quarter of the blocks keep attention
    assert 0 < scan < dense / 20
    longer = micro_batch_seconds(hybrid, 151936, 65536, 1, 4, 12, dev, scans=3)["attention_s"]
    full_long = micro_batch_seconds(full, 151936, 65536, 1, 4, 12, dev)["attention_s"]
    assert abs((longer - full_long / 4) / (three - dense / 4) - 2) < 1e-6  # the scan: twice the tokens


@pytest.mark.parametrize("kh, vh, dk, dv", [(1, 2, 32, 16), (2, 4, 16, 48), (1, 1, 96, 16), (4, 8, 64, 16)])
def test_the_planners_activation_estimate_holds_against_the_saved_tensors(kh, vh, dk, dv):
    """GdnSpec.activation_width against what the layer's autograd graph keeps (unique storages)."""
    from mt3d.model.blocks import BuildContext
    from mt3d.model.config import ModelConfig
    from mt3d.model.gdn import GatedDeltaNet
    from mt3d.parallel.state import AxisGroup

    s = 256
    lin = {"key_heads": kh, "value_heads": vh, "key_head_dim": dk, "value_head_dim": dv}
    cfg = ModelConfig.from_dict(dict(hidden=64, layers=1, heads=4, norm="rmsnorm", linear_attention=lin))
    layer = GatedDeltaNet(cfg.gdn_spec, cfg, BuildContext(tp=AxisGroup.alone("tp")), 0)
    x = torch.randn(1, s, 64, requires_grad=True)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    measured = sum(n for ptr, n in kept.items() if ptr not in skip) / (4 * s)
    assert 0.8 < measured / cfg.gdn_spec.activation_width() < 1.1, (measured, cfg.gdn_spec.activation_width())


def test_fp8_reaches_the_deltanet_projections(monkeypatch):
    """train.fp8 runs the q/k/v/z projections and the output in FP8 (forward, input and weight
    gradients: 3 GEMMs each), beta's and the decay's in bf16; the layer's output stays near bf16's."""
    from mt3d.model.blocks import BuildContext
    from mt3d.model.config import ModelConfig
    from mt3d.model.gdn import GatedDeltaNet
    from mt3d.parallel.state import AxisGroup

    cfg = ModelConfig.from_dict(dict(HYBRID, family=None))
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    outs, counts, count, real = [], [], [0], torch._scaled_mm

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    for fp8 in (None, "tensorwise"):
        count[0] = 0
        ctx = BuildContext(tp=AxisGroup.alone("tp"), dtype=torch.bfloat16, fp8=fp8)
        layer = GatedDeltaNet(cfg.gdn_spec, cfg, ctx, 0)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.float().square().sum().backward()
        outs.append(y.float())
        counts.append(count[0])
    assert counts == [0, 6]
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert 0 < err < 0.25, err  # e4m3 keeps 3 mantissa bits; a wrong scale or shard is off by 1 or more
