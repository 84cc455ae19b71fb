"""Muon (``"optimizer": {"type": "Muon"}``, ``mt3d.training.muon``): one process against a reference
written here per HF matrix, the defining property of its updates, every layout it runs at against
one process, and bad input."""

import math

import pytest
import torch

from helpers import run_grouped, step_records, tiny_config

HIDDEN, HEADS, KV, FFN, EXPERT, SHARED = 32, 4, 2, 64, 16, 32
HEAD_DIM = HIDDEN // HEADS


def _block():
    from mt3d.model.blocks import BuildContext, TransformerBlock
    from mt3d.model.config import ModelConfig
    from mt3d.parallel.state import AxisGroup

    moe = dict(experts=4, top_k=2, expert_ffn=EXPERT, shared_ffn=SHARED, shared_gate=True)
    dims = dict(hidden=HIDDEN, layers=1, heads=HEADS, kv_heads=KV, ffn=FFN, position="rope", norm="rmsnorm")
    cfg = ModelConfig.from_dict(dict(**dims, mlp="swiglu", bias=False, moe=moe))
    block = TransformerBlock(cfg, BuildContext(tp=AxisGroup.alone("tp"), seed=3), 0)
    with torch.no_grad():
        block.mlp.router.weight.mul_(10)  # routers not uniform
    return block


def hf_matrices(name: str, w: torch.Tensor) -> list[torch.Tensor] | None:
    """The HF matrices a block weight holds (None: AdamW's), from the model's sizes alone: q, k, v of the
    fused attention input; gate and up of a fused MLP input; the rest whole; routers and gates none."""
    if w.ndim != 2 or "router" in name or "shared_gate" in name:
        return None
    if name == "attn.qkv.weight":
        return list(w.split([HEADS * HEAD_DIM, KV * HEAD_DIM, KV * HEAD_DIM]))
    if name.endswith("up.weight"):
        return list(w.chunk(2))
    return [w]


def newton_schulz5(g: torch.Tensor) -> torch.Tensor:
    """Keller Jordan's iteration, written out: X / ||X||, then 5 times X <- a X + (b A + c A^2) X."""
    x = g.double()
    if x.shape[0] > x.shape[1]:
        return newton_schulz5(g.T).T
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x


def reference_step(params, grads, state, lr, adam_lr, wd, beta, betas=(0.9, 0.95), eps=1e-8):
    """One step of Muon (per HF matrix, rate ``lr``) and AdamW (the rest, ``adam_lr``), in place on a
    dict of plain tensors, in fp64; decay ``wd`` on 2-D weights only (mt3d's parameter groups)."""
    for name, w in params.items():
        g = grads[name].double()
        st = state.setdefault(name, {})
        decay = wd if w.ndim == 2 else 0.0
        if hf_matrices(name, w) is not None:
            m = st.setdefault("m", torch.zeros_like(g))
            m.mul_(beta).add_((1 - beta) * g)
            u = (1 - beta) * g + beta * m
            ups = [
                newton_schulz5(p) * math.sqrt(max(1, p.shape[0] / p.shape[1])) for p in hf_matrices(name, u)
            ]
            params[name] = w * (1 - lr * decay) - lr * torch.cat(ups)
        else:
            st["t"] = st.get("t", 0) + 1
            m = st.setdefault("m", torch.zeros_like(g)).mul_(betas[0]).add_((1 - betas[0]) * g)
            v = st.setdefault("v", torch.zeros_like(g)).mul_(betas[1]).add_((1 - betas[1]) * g * g)
            mh, vh = m / (1 - betas[0] ** st["t"]), v / (1 - betas[1] ** st["t"])
            params[name] = w * (1 - adam_lr * decay) - adam_lr * mh / (vh.sqrt() + eps)


def test_newton_schulz_equalises_the_spectrum_both_ways():
    """``newton_schulz``: "gram" (iterating on X X^T) equals "standard" and the written-out iteration;
    a spread spectrum (singular values 1e-2 to 1) ends inside [0.5, 1.2], with either orientation."""
    from mt3d.training.muon import newton_schulz

    g = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(48, 16, generator=g))
    v, _ = torch.linalg.qr(torch.randn(16, 16, generator=g))
    m = u @ torch.diag(torch.logspace(-2, 0, 16)) @ v.T
    for x in (m, m.T):
        a, b = newton_schulz(x, method="gram"), newton_schulz(x, method="standard")
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(a.double(), newton_schulz5(x), rtol=1e-4, atol=1e-5)
        s = torch.linalg.svdvals(a)
        assert s.max() < 1.2 and s.min() > 0.5, s


def test_one_process_equals_a_reference_muon_and_its_updates_are_orthogonal():
    """Three steps of mt3d's Muon on a MoE block (fused q/k/v and gate/up, four experts, a gated shared
    expert) equal the reference per HF matrix within 1e-6 per weight; after one step with weight decay
    0 each Muon matrix's (W1 - W0) / lr / scale has its largest singular value near 1 and its median
    above 0.5 (what Newton-Schulz does), and the router's (AdamW: its first step is a sign matrix)
    does not."""
    from mt3d.parallel.state import AxisGroup
    from mt3d.training.engine import param_groups
    from mt3d.training.muon import build

    block = _block().double()
    params = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1, "betas": [0.9, 0.95], "adam_lr": 0.01}
    opt = build(params, param_groups(block), block, AxisGroup.alone("tp"), None)
    assert {
        n
        for n, p in block.named_parameters()
        if any(p is q for g in opt.param_groups if g["use_muon"] for q in g["params"])
    } == {  # fmt: skip
        n for n, p in block.named_parameters() if hf_matrices(n, p) is not None
    }
    ref = {n: p.detach().clone() for n, p in block.named_parameters()}
    state = {}
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        block.zero_grad()
        x = torch.randn(2, 8, HIDDEN, generator=gen, dtype=torch.float64)
        block(x)[0].pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        reference_step(ref, grads, state, 0.02, 0.01, 0.1, 0.9)
        opt.step()
        for n, p in block.named_parameters():
            torch.testing.assert_close(p.detach(), ref[n], rtol=0, atol=1e-6, msg=n)
    _check_spectra()


def _check_spectra():
    from mt3d.parallel.state import AxisGroup
    from mt3d.training.engine import param_groups
    from mt3d.training.muon import build

    block = _block().double()
    opt = build({"lr": 1e-3, "weight_decay": 0.0}, param_groups(block), block, AxisGroup.alone("tp"), None)
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    x = torch.randn(4, 32, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    target = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (block(x)[0] - target).pow(2).mean().backward()  # 128 tokens, random targets: gradients of full rank
    opt.step()
    for n, p in block.named_parameters():
        parts = hf_matrices(n, (p.detach() - before[n]) / -1e-3)
        if parts is None:
            continue
        for u in parts:
            s = torch.linalg.svdvals(u / math.sqrt(max(1, u.shape[0] / u.shape[1])))
            assert 0.6 < s.max() < 1.25 and 0.5 < s.median(), (n, s)
    s = torch.linalg.svdvals((block.mlp.router.weight.detach() - before["mlp.router.weight"]) / -1e-3)
    assert s.max() > 2, s  # AdamW's first update: the gradient's signs, not an orthogonal matrix


ADAM = {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}}
MUON = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "adam_lr": 2e-3,
                                   "betas": [0.9, 0.95]}}  # fmt: skip


def muon_run(d, model=None, tp=1, steps=4, optimizer=MUON, save_interval=0, resume=None, zero=0, bf16=False,
             lora=None, qk_clip=None, **parallel):  # fmt: skip
    train = {"save_interval": save_interval, **({"resume": resume} if resume else {})}
    raw = tiny_config(
        d, model=model or {"preset": "tiny-llama"}, tp=tp, steps=steps, zero=zero, micro=2, **train
    )
    raw["optimizer"] = dict(optimizer)
    raw["mt3d"]["parallel"].update(parallel)
    if bf16:
        raw["bf16"] = {"enabled": True}
    if lora:
        raw["mt3d"]["lora"] = lora
    if qk_clip:
        raw["mt3d"]["train"]["muon"] = {"qk_clip": qk_clip}
    return raw


LORA = {"r": 8, "target_modules": "all-linear"}
TAU = 0.06
"""QK-clip's tau for the tiny models' first steps, whose largest logits are 0.06-0.13."""


def test_every_layout_equals_one_process(tmp_path):
    """4 steps: every layout equals one process (losses and grad norms within 1e-5 in fp32): without
    ZeRO tp 2 with SP and cp 2; ZeRO-1 and ZeRO-2 at dp 2, pp 2 and tp 2 x pp 2 x dp 2 (flat
    partitions: each rank orthogonalises the whole weights its partition overlaps); ep 2 of
    tiny-mixtral, also folded over tp 2 (whole experts); tiny-deepseek-v3's latent projections at tp 2;
    LoRA's adapters at tp 2; ZB-V at pp 2 (whose ranks hold different AdamW weights: the optimizer's
    groups are the same on every stage, as ZeRO's per-group norm collectives need). In bf16
    (DeepSpeed's bf16 optimizer at ZeRO-1, its ZeRO optimizer at ZeRO-2) dp 2 stays within bf16's
    layout noise (3e-3) of one process. AdamW's run differs from step 2."""
    mix, ds3, d = {"preset": "tiny-mixtral"}, {"preset": "tiny-deepseek-v3"}, tmp_path
    four = {"preset": "tiny-llama", "layers": 4}
    runs = {
        "one": (1, muon_run(d / "one")), "tp": (2, muon_run(d / "tp", tp=2, sequence_parallel=True)),
        "cp": (2, muon_run(d / "cp", context=2)), "z1": (2, muon_run(d / "z1", zero=1)),
        "z2": (2, muon_run(d / "z2", zero=2)), "pp": (2, muon_run(d / "pp", zero=1, pipeline=2)),
        "3d": (8, muon_run(d / "3d", tp=2, zero=1, pipeline=2, sequence_parallel=True)),
        "adam": (1, muon_run(d / "adam", optimizer=ADAM)),
        "mix": (1, muon_run(d / "mix", mix)), "ep": (2, muon_run(d / "ep", mix, zero=1, expert=2)),
        "fold": (2, muon_run(d / "fold", mix, tp=2, zero=1, sequence_parallel=True, expert=2,
                             expert_tensor=1)),
        "ds1": (1, muon_run(d / "ds1", ds3)), "ds2": (2, muon_run(d / "ds2", ds3, tp=2)),
        "lora1": (1, muon_run(d / "lora1", lora=LORA)),
        "lora2": (2, muon_run(d / "lora2", tp=2, zero=1, sequence_parallel=True, lora=LORA)),
        "b1": (1, muon_run(d / "b1", zero=1, bf16=True)), "b2": (2, muon_run(d / "b2", zero=1, bf16=True)),
        "b3": (2, muon_run(d / "b3", zero=2, bf16=True)),
        "four": (1, muon_run(d / "four", four)),  # ZB-V's second rank holds no embedding, head or router
        "zbv": (2, muon_run(d / "zbv", four, zero=1, pipeline=2, schedule="zbv", virtual_stages=2)),
        # QK-clip: heads over tau in every step; the maxima of tp 2 x cp 2 (all-to-all: each cp rank
        # sees half of its heads) reduced over cp, flat ZeRO partitions; latent attention at cp 2; a tau
        # no logit reaches
        "qc1": (1, muon_run(d / "qc1", qk_clip=TAU)), "qn1": (1, muon_run(d / "qn1", qk_clip=1e9)),
        "qc2": (4, muon_run(d / "qc2", tp=2, zero=1, context=2, sequence_parallel=True, qk_clip=TAU)),
        "qm1": (1, muon_run(d / "qm1", ds3, qk_clip=TAU)),
        "qm2": (2, muon_run(d / "qm2", ds3, zero=1, context=2, qk_clip=TAU)),
    }  # fmt: skip
    got = dict(
        zip(runs, (step_records(r) for r in run_grouped(list(runs.values()), timeout=900)), strict=True)
    )
    pairs = [("one", k, 1e-5) for k in ("tp", "cp", "z1", "z2", "pp", "3d")]
    pairs += [("mix", "ep", 1e-5), ("mix", "fold", 1e-5), ("ds1", "ds2", 1e-5), ("lora1", "lora2", 1e-5),
              ("four", "zbv", 1e-5)]  # fmt: skip
    pairs += [("b1", "b2", 3e-3), ("b1", "b3", 3e-3), ("qc1", "qc2", 1e-5), ("qm1", "qm2", 1e-5)]
    for want, name, rel in pairs:
        for a, b in zip(got[name], got[want], strict=True):
            for key in ("loss", "grad_norm") + (("attn_logit_max",) if name[0] == "q" else ()):
                assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (name, a["step"], key)
            assert a.get("qk_clipped_heads") == b.get("qk_clipped_heads"), (name, a["step"])
    for name in ("qc1", "qm1"):  # some heads clipped in every step, not all of them
        assert all(0 < r["qk_clipped_heads"] < 16 for r in got[name][1:]), got[name]
    # a tau no logit reaches: the maxima noted, nothing clipped, training unchanged bit for bit
    assert [r["loss"] for r in got["qn1"]] == [r["loss"] for r in got["one"]]
    assert all(r["qk_clipped_heads"] == 0 for r in got["qn1"])
    assert got["qn1"][0]["attn_logit_max"] == got["qc1"][0]["attn_logit_max"] > TAU
    assert all(a["attn_logit_max"] < b["attn_logit_max"] for a, b in zip(got["qc1"][1:], got["qn1"][1:]))
    one, adam = got["one"], got["adam"]
    assert one[0]["loss"] == pytest.approx(adam[0]["loss"]) and one[1]["loss"] != pytest.approx(
        adam[1]["loss"]
    )
    assert one[-1]["loss"] < one[0]["loss"] and got["lora1"][-1]["loss"] < got["lora1"][0]["loss"]


@pytest.mark.parametrize("change,message", [
    ({"zero": 3}, "mt3d runs Muon with ZeRO stage 0-2 in fp32 or stage 1-2 in bf16"),
    ({"bf16": True}, "this run: stage 0, bf16"),
    ({"params": {"ns_method": "svd"}}, "optimizer.params.ns_method must be one of gram, standard"),
    ({"params": {"nesterov": False}}, "optimizer.params.nesterov is not a Muon key"),
    ({"params": {"momentum": 1.0}}, "optimizer.params.momentum must be in [0, 1)"),
    ({"muon": {"qk_clip": 0.0}}, "mt3d.train.muon.qk_clip must be a positive number"),
    ({"muon": {"qk_clip": "100"}}, "'mt3d.train.muon.qk_clip' must be float | None"),
    ({"muon": {"qk_clip": 100.0}, "model": {"preset": "tiny-qwen3"}}, "its q/k norms (model.qk_norm) undo"),
    ({"muon": {"qk_clip": 100.0}, "lora": LORA}, "which mt3d.lora freezes"),
    ({"muon": {"scale": "spectral"}}, "mt3d.train.muon.scale must be one of deepspeed, match_rms"),
    ({"muon": {"ns_dtype": "fp16"}}, "mt3d.train.muon.ns_dtype must be one of fp32, bf16"),
    ({"pipeline": 2}, "ZeRO stage 0 with pipeline > 1"),
])  # fmt: skip
def test_muon_bad_input_is_one_line(tmp_path, change, message):
    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    raw = muon_run(tmp_path, change.get("model"), lora=change.get("lora"))
    raw["optimizer"] = {"type": "Muon", "params": {**MUON["params"], **change.get("params", {})}}
    if "zero" in change:
        raw["zero_optimization"]["stage"] = change["zero"]
    if "bf16" in change:
        raw["bf16"] = {"enabled": True}
    if "muon" in change:
        raw["mt3d"]["train"]["muon"] = change["muon"]
    if "pipeline" in change:
        raw["mt3d"]["parallel"]["pipeline"] = change["pipeline"]
    with pytest.raises(ConfigError) as err:
        cfg = from_dict(raw)
        validate(cfg, change.get("pipeline", 1), resolve_model(cfg.mt3d.model))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_muon_resumes_exactly_and_reshards(tmp_path):
    """A Muon run at tp 2 with SP saved at step 2 resumes bit-exactly without ZeRO and with ZeRO-1 (the
    momentum of each rank's shard or flat partition and the AdamW half's moments are in DeepSpeed's
    checkpoint), and its ZeRO-1 checkpoint reshards to one process (the momentum saved as Adam's
    exp_avg, which DeepSpeed's universal converter reads) and continues within 1e-5 of the straight
    run. Another optimizer's run, and a ZeRO-0 checkpoint at another layout, are refused in one line
    (exit 2)."""
    from mt3d.config.optimizer_rules import optimizer_resume_conflict
    from mt3d.ds.universal import unsupported_reshard
    from mt3d.parallel.spawn import spawn

    from helpers import train_rc_worker, train_worker

    def config(d, **kw):
        return muon_run(d, tp=2, sequence_parallel=True, save_interval=2, **kw)

    key = lambda rs: [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(rs)]  # noqa: E731
    straight = {}
    for zero in (1, 0):
        straight[zero] = key(spawn(train_worker, 2, config(tmp_path / f"a{zero}", zero=zero), timeout=300)[0])
        step2 = str(tmp_path / f"a{zero}" / "checkpoints" / "step_00000002")
        again = spawn(train_worker, 2, config(tmp_path / f"b{zero}", zero=zero, resume=step2), timeout=300)[0]
        assert key(again)[-2:] == straight[zero][2:]
    one = muon_run(tmp_path / "c", zero=1, resume=step2.replace("a0", "a1"))
    for got, want in zip(key(spawn(train_worker, 1, one, timeout=300)[0])[-2:], straight[1][2:], strict=True):
        assert got[0] == want[0] and got[1:] == pytest.approx(want[1:], rel=1e-5)
    refused = [
        (1, muon_run(tmp_path / "d", resume=step2)),
        (2, config(tmp_path / "e", resume=step2, optimizer=ADAM)),
    ]
    for world, raw in refused:
        assert spawn(train_rc_worker, world, raw, timeout=300)[0][0] == 2
    saved = {"tp": 2, "pp": 1, "dp": 1, "zero_stage": 0}
    why = unsupported_reshard(saved, {**saved, "tp": 1})  # any ZeRO-0 checkpoint, Muon's or Adam's
    assert "saved without ZeRO" in why and "tensor=2, pipeline=1, dp=1" in why and "\n" not in why
    assert "optimizer.type AdamW" in optimizer_resume_conflict("AdamW", "Muon")
    assert (
        optimizer_resume_conflict("Muon", "muon") is None
        and optimizer_resume_conflict("AdamW", "adam") is None
    )


def test_match_rms_scale_and_bf16_iterations():
    """``train.muon.scale: "match_rms"`` scales each matrix's orthogonalised update by 0.2 max(rows,
    cols) ** 0.5 (Moonlight's: an update RMS of 0.2, near AdamW's) instead of max(1, rows/cols) ** 0.5;
    ``ns_dtype: "bf16"`` iterates in bf16: 3-5% from the fp64 iteration on a random matrix (bf16's
    rounding compounds over five steps), 17% on a block's gradient, its spectrum as equalised."""
    from mt3d.parallel.state import AxisGroup
    from mt3d.training.engine import param_groups
    from mt3d.training.muon import build, scale_of

    assert scale_of(64, 16, "deepspeed") == 2.0 and scale_of(16, 64, "deepspeed") == 1.0
    assert scale_of(16, 64, "match_rms") == pytest.approx(0.2 * 8)
    updates = {}
    for scale, dtype in (("deepspeed", "fp32"), ("match_rms", "fp32"), ("deepspeed", "bf16")):
        block = _block().double()
        before = block.attn.out.weight.detach().clone()
        tp = AxisGroup.alone("tp")
        opt = build({"lr": 1e-3, "weight_decay": 0.0}, param_groups(block), block, tp, None, scale, dtype)
        x, y = (torch.randn(4, 32, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                for s in (4, 5))  # fmt: skip
        (block(x)[0] - y).pow(2).mean().backward()  # 128 tokens: a gradient of full rank
        opt.step()
        updates[(scale, dtype)] = (before - block.attn.out.weight.detach()) / 1e-3
    plain = updates[("deepspeed", "fp32")]
    rms = updates[("match_rms", "fp32")]
    torch.testing.assert_close(rms, plain * 0.2 * math.sqrt(HIDDEN))  # a square matrix: 1 -> 0.2 sqrt(32)
    assert 0.1 < rms.pow(2).mean().sqrt() < 0.3  # 0.2 for an exactly orthogonal update: 0.14 measured
    low = updates[("deepspeed", "bf16")]  # bf16's rounding compounds over the iterations ...
    assert not torch.equal(low, plain) and (low - plain).norm() / plain.norm() < 0.25  # 0.17 measured
    s = torch.linalg.svdvals(low)
    assert 0.6 < s.max() < 1.25 and 0.5 < s.median(), s  # ... and the update is as orthogonal
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(6))
    from mt3d.training.muon import newton_schulz

    ref = newton_schulz(g.double(), dtype=torch.float64)
    assert (newton_schulz(g, dtype=torch.bfloat16).double() - ref).norm() / ref.norm() < 6e-2  # 4.8e-2


def test_an_exported_step_is_orthogonal_per_hf_matrix(tmp_path):
    """The defining property end to end: one Muon step at tp 2 with SP from an HF Qwen2-MoE checkpoint
    (constant lr, weight decay 0), exported with ``mt3d export-hf``: (W0 - W1) / lr of every HF matrix of
    the blocks (q, k, v, o; each expert's gate, up and down; the shared expert's; the dense layer's),
    over its scale, has its largest singular value near 1 and its median above 0.5; the embedding's,
    the routers' and the shared-expert gate's (AdamW's sign-like first step) do not."""
    import subprocess
    import sys

    from test_hf import hf_configs
    from transformers import AutoModelForCausalLM

    from mt3d.data.corpora import stdlib_documents
    from mt3d.data.tokenizer import train_bpe
    from mt3d.parallel.spawn import spawn

    from helpers import train_worker

    tok = train_bpe([d for _, d in zip(range(400), stdlib_documents(), strict=False)], 512, tmp_path / "tok")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(hf_configs(tok.vocab_size, tok.eos_id)["qwen2_moe"])
    base.save_pretrained(tmp_path / "hf")
    for f in (tmp_path / "tok").iterdir():
        (tmp_path / "hf" / f.name).write_bytes(f.read_bytes())
    lr = 1e-3
    raw = muon_run(tmp_path / "run", tp=2, steps=1, zero=1, sequence_parallel=True,
                   optimizer={"type": "Muon", "params": {"lr": lr, "weight_decay": 0.0}})  # fmt: skip
    raw["mt3d"]["model"] = {"from_hf": str(tmp_path / "hf")}
    raw["mt3d"]["data"] = {"corpus": "builtin", "seq_len": 32}
    raw["mt3d"]["train"]["save_at_end"] = True
    spawn(train_worker, 2, raw, timeout=300)
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    out = subprocess.run([sys.executable, "-m", "mt3d", "export-hf", "--checkpoint", str(step), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    after = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "out").named_parameters())
    checked = {"muon": 0, "adamw": 0}
    for name, w0 in base.named_parameters():
        update = (w0.detach() - after[name].detach()).double() / lr
        if w0.ndim < 2:
            continue
        if "layers." not in name or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            assert torch.linalg.svdvals(update).max() > 2, name  # AdamW: the gradient's signs
            checked["adamw"] += 1
            continue
        mats = (
            [m for e in update for m in (e.chunk(2) if "gate_up" in name else (e,))]
            if w0.ndim == 3
            else [update]
        )
        for m in mats:
            s = torch.linalg.svdvals(m / math.sqrt(max(1, m.shape[0] / m.shape[1])))
            assert 0.6 < s.max() < 1.25 and 0.5 < s.median(), (name, s)
            checked["muon"] += 1
    assert checked["muon"] >= 4 * 4 + 3 * 4 * 3 + 3 * 3 + 3 and checked["adamw"] >= 1 + 3 + 3
