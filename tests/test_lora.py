"""LoRA: adapters sharded like their base under tp (with SP), pp, interleaving, cp and ep; frozen base;
adapter-only checkpoints that resume exactly; PEFT adapters out (export-hf --adapter-only, loaded by
peft) and in (from_adapter, --adapter); trainable counts against peft; bad input in one line."""

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from test_hf import hf_configs
from transformers import AutoModelForCausalLM

from mt3d.data.corpora import stdlib_documents
from mt3d.data.tokenizer import train_bpe
from mt3d.model.hf import config_from_hf
from mt3d.model.lora import resolve, trainable_count
from mt3d.parallel.lora import LoraSpec
from mt3d.parallel.spawn import spawn

from helpers import run_grouped, tiny_config

peft = pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
               "shared_expert.down_proj", "down_proj"]  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random Llama (llama3 rope scaling), GPT-2, Qwen2-MoE (shared expert, a dense layer) and Qwen3.5
    (Gated DeltaNet) with a BPE tokenizer; norms and biases randomised, routers sharpened."""
    base = tmp_path_factory.mktemp("hf-lora")
    tok = train_bpe([d for _, d in zip(range(400), stdlib_documents())], 512, base / "tok")
    configs = hf_configs(tok.vocab_size, tok.eos_id)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):  # GPT-2's dropouts off: parity runs compare
        setattr(configs["gpt2"], key, 0.0)
    out = {}
    for i, name in enumerate(("llama", "gpt2", "qwen2_moe", "qwen3_5")):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(configs[name])
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.2)
                elif pname.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    p.mul_(30)
        model.save_pretrained(base / name)
        for f in (base / "tok").iterdir():
            (base / name / f.name).write_bytes(f.read_bytes())
        out[name] = base / name
    return out


def lora_config(save_dir, hf_dir, *, tp=1, pp=1, steps=5, lora=None, train=None, packed=False, zero=1,
                bf16=False, **parallel):  # fmt: skip
    raw = tiny_config(save_dir, tp=tp, pp=pp, steps=steps, zero=zero, **(train or {}))
    if bf16:  # the frozen base in bf16, the adapters' master weights and moments in fp32
        raw["bf16"] = {"enabled": True}
    raw["mt3d"]["model"] = {"from_hf": str(hf_dir)}
    raw["mt3d"]["data"] = {"corpus": "builtin", "seq_len": 32, "document_mask": packed}
    raw["mt3d"]["parallel"].update(parallel)
    raw["mt3d"]["lora"] = dict(lora or LORA)
    raw["optimizer"]["params"]["lr"] = 1e-2
    return raw


def close(got, want, what):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for key in ("loss", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), f"{what} step {i + 1} {key}"


@pytest.fixture(scope="module")
def lora_runs(hf_dirs, tmp_path_factory):
    """Every parallel LoRA run and its one-process reference; runs of a world size share a spawn."""
    base = tmp_path_factory.mktemp("lora-runs")
    llama, moe, gpt2 = hf_dirs["llama"], hf_dirs["qwen2_moe"], hf_dirs["gpt2"]
    moe_lora = {**LORA, "target_modules": MOE_TARGETS}
    step3 = str(base / "tp2pp2" / "checkpoints" / "step_00000003")
    # the Llama runs train on packed documents (document-masked attention, positions per document)
    runs = {  # world 4 first: the one-process reshard below resumes its checkpoint
        "tp2 pp2 sp": (4, lora_config(base / "tp2pp2", llama, tp=2, pp=2, sequence_parallel=True, packed=True,
                                      train={"save_at_end": True, "save_interval": 3})),
        "resumed": (4, lora_config(base / "resumed", llama, tp=2, pp=2, sequence_parallel=True, packed=True,
                                   train={"resume": step3})),
        "ref": (1, lora_config(base / "ref", llama, packed=True)),
        "resharded": (1, lora_config(base / "resharded", llama, packed=True, train={"resume": step3})),
        "moe ref": (1, lora_config(base / "moe-ref", moe, lora=moe_lora)),
        "gpt2 ref": (1, lora_config(base / "gpt2-ref", gpt2)),
        "cp2": (2, lora_config(base / "cp2", llama, context=2, packed=True,
                               train={"recompute": {"interval": 1}})),
        "ep2": (2, lora_config(base / "ep2", moe, lora=moe_lora, expert=2)),
        "pp2 v2": (2, lora_config(base / "pp2v2", llama, pp=2, virtual_stages=2, packed=True,
                                  train={"recompute": {"granularity": "selective"}})),
        "gpt2 pp2": (2, lora_config(base / "gpt2-pp2", gpt2, pp=2)),  # the tied, frozen embedding
        # ZB-V: adapters keep their gradients in B, the base's linears have none to defer
        "pp2 zbv": (2, lora_config(base / "pp2zbv", llama, pp=2, virtual_stages=2, schedule="zbv",
                                   packed=True)),
        "zero2 dp2": (2, lora_config(base / "zero2", llama, packed=True, zero=2)),  # the regular engine
        "bf16 tp2": (2, lora_config(base / "bf16", llama, tp=2, packed=True, bf16=True)),
    }  # fmt: skip
    names = list(runs)
    records = run_grouped([runs[n] for n in names], timeout=600)
    return base, dict(zip(names, records, strict=True))


def test_lora_training_matches_one_process_at_every_axis(lora_runs):
    """fp32, 5 steps: losses and grad norms within 1e-5 of one process for tp 2 x pp 2 with SP, cp 2
    (full recompute), the interleaved schedule (selective recompute) and ZB-V on packed documents, a MoE
    at ep 2 (attention and shared-expert adapters) and GPT-2 at pp 2 (its tied embedding frozen on
    both stages); a LoRA checkpoint (adapters and their optimizer states only) resumes exactly at
    tp 2 x pp 2 and resharded to one process (DeepSpeed's universal format, the adapters' splits
    declared)."""
    base, rec = lora_runs
    assert len(rec["ref"]) == 5 and rec["ref"][-1]["loss"] < rec["ref"][0]["loss"]
    for what in ("cp2", "pp2 v2", "tp2 pp2 sp", "pp2 zbv"):
        close(rec[what], rec["ref"], what)
    close(rec["ep2"], rec["moe ref"], "ep2")
    close(rec["gpt2 pp2"], rec["gpt2 ref"], "gpt2 pp2 (tied embedding)")
    close(rec["zero2 dp2"], rec["ref"], "ZeRO-2 at dp 2")
    for got, want in zip(rec["bf16 tp2"], rec["ref"], strict=True):  # bf16: its rounding, not another model
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
    assert [r["step"] for r in rec["resumed"]] == [4, 5]
    close(rec["resumed"], rec["tp2 pp2 sp"][3:], "resumed")
    close(rec["resharded"], rec["ref"][3:], "resharded to one process")
    # the checkpoint holds the adapters only: far smaller than the base's weights
    step = base / "tp2pp2" / "checkpoints" / "step_00000005"
    meta = json.loads((step / "manifest.json").read_text())["meta"]
    assert meta["lora"]["r"] == 4 and meta["lora"]["fingerprint"]
    layers = {}
    for f in step.glob("layer_*-model_states.pt"):
        layers.update(torch.load(f, weights_only=True))
    assert layers and all(".lora." in k for k in layers), sorted(layers)[:5]


def test_adapters_are_refused_on_another_base(lora_runs, hf_dirs, tmp_path):
    """A LoRA checkpoint whose base changed (same shapes, other weights) is refused in one line when it
    is exported or read as a model, and when a run resumes it onto another base."""
    import shutil

    from mt3d.checkpoint.loading import open_source
    from mt3d.checkpoint.resume import check_lora
    from mt3d.errors import UserError

    base, _ = lora_runs
    step = tmp_path / "step_00000005"
    shutil.copytree(base / "tp2pp2" / "checkpoints" / "step_00000005", step)
    other = tmp_path / "other-base"
    shutil.copytree(hf_dirs["llama"], other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1  # the last tensor: same header
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["meta"]["lora"]["base"] = str(other)
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="not the one its adapters were trained on"):
        open_source(step)
    out = mt3d_cli("export-hf", "--checkpoint", str(step), "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "fingerprint" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    lora = dict(manifest["meta"]["lora"])
    with pytest.raises(UserError, match="trained on another base"):
        check_lora(step, {"lora": {**lora, "fingerprint": "0" * 64}}, lora)
    with pytest.raises(UserError, match="r=4, this run asks for 8"):
        check_lora(step, {"lora": lora}, {**lora, "r": 8})
    with pytest.raises(UserError, match="a LoRA run's"):
        check_lora(step, {"lora": lora}, None)


def test_the_base_fingerprint_covers_every_byte_and_old_checkpoints_still_match(tmp_path, monkeypatch):
    """4 KiB changed in the middle of a 6 MiB weights file (size kept) is another base; the digest is
    cached by the file's version (the second fingerprint reads nothing); a fingerprint recorded before
    (first and last MiB sampled) still names the same base, and misses that change, as it did."""
    import os

    from safetensors.torch import save_file

    from mt3d.checkpoint.resume import check_lora
    from mt3d.errors import UserError
    from mt3d.model import peft as peft_io

    monkeypatch.setenv("MT3D_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.randn(1536, 1024)}, base / "model.safetensors")
    fp = peft_io.fingerprint(base)
    legacy = peft_io.sampled_fingerprint(base)
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    assert peft_io.fingerprint(base) == fp and not any(f.endswith(".safetensors") for f in opened)
    monkeypatch.undo()
    monkeypatch.setenv("MT3D_CACHE", str(tmp_path / "cache"))
    f = base / "model.safetensors"
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(st.st_size // 2)
        fh.write(os.urandom(4096))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert f.stat().st_size == st.st_size
    assert peft_io.fingerprint(base) != fp and fp.startswith(peft_io.FULL)
    assert peft_io.same_base(legacy, base)  # the old sampling missed the change
    assert not peft_io.same_base(fp, base)
    lora = {"r": 4, "alpha": 8.0, "rslora": False, "target_modules": ["q_proj"], "base": str(base)}
    check_lora(
        tmp_path,
        {"lora": {**lora, "fingerprint": legacy}},
        {**lora, "fingerprint": peft_io.fingerprint(base)},
    )
    with pytest.raises(UserError, match="trained on another base"):
        check_lora(
            tmp_path,
            {"lora": {**lora, "fingerprint": fp}},
            {**lora, "fingerprint": peft_io.fingerprint(base)},
        )


def mt3d_cli(*args):
    return subprocess.run([sys.executable, "-m", "mt3d", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)  # fmt: skip


def test_exported_adapter_loads_in_peft_and_equals_the_merged_export(lora_runs, hf_dirs, tmp_path, caplog):
    """The tp 2 x pp 2 run's adapter (--adapter-only) loaded by peft onto the HF base gives the merged
    export's logits within 1e-5, silently; every weight outside the targets is the base's, bit for bit."""
    base, _ = lora_runs
    run = base / "tp2pp2"
    out = mt3d_cli(
        "export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "adapter"), "--adapter-only"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    out = mt3d_cli("export-hf", "--checkpoint", str(run), "--out", str(tmp_path / "merged"))
    assert out.returncode == 0, out.stderr[-2000:]
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(3))
    hf_base = AutoModelForCausalLM.from_pretrained(hf_dirs["llama"])
    caplog.clear()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    noisy = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    noisy += [
        str(w.message) for w in caught if not issubclass(w.category, FutureWarning | DeprecationWarning)
    ]
    assert not noisy, noisy
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        a, b = model(ids).logits, merged(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(hf_dirs["llama"]).eval()(ids).logits
    assert (a - plain).abs().max() > 1e-3  # the adapters were trained: they change the function
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    from safetensors.torch import load_file

    before = load_file(hf_dirs["llama"] / "model.safetensors")
    after = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(before) == sorted(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert changed == {k for k in before if k.rsplit(".", 2)[-2] in linear}, sorted(changed)[:4]
    # mt3d eval of the base with --adapter = eval of the merged export
    text = tmp_path / "t.txt"
    text.write_text("\n".join(d for _, d in zip(range(3), stdlib_documents())))
    losses = []
    for model_args in (["--model", str(hf_dirs["llama"]), "--adapter", str(tmp_path / "adapter")],
                       ["--model", str(tmp_path / "merged")]):  # fmt: skip
        out = mt3d_cli("eval", *model_args, "--text", str(text), "--seq-len", "32", "--json")
        assert out.returncode == 0, out.stderr[-2000:]
        losses.append(json.loads(out.stdout.strip().splitlines()[-1])["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def peft_adapter(hf_dir, out, targets, seed=0):
    """A PEFT adapter made by peft on the HF model, with random (non-zero) A and B."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    pm = peft.get_peft_model(model, config)
    pm.save_pretrained(out)
    return pm.eval()


def adapter_logits_worker(cases, ids):
    from mt3d.checkpoint.loading import from_pretrained
    from mt3d.model.inference import logits

    out, state = {}, None
    for name, (path, adapter) in cases.items():
        model = from_pretrained(path, tp=2, state=state, adapter=adapter)
        state = model.state
        out[name] = logits(model, ids, state, model.config.hidden)
    return out


def test_peft_adapters_load_at_tp2_with_peft_logits(hf_dirs, tmp_path):
    """Adapters made by peft on the HF model (Llama q/k/v/o/gate/up/down, GPT-2's fused Conv1D c_attn and
    c_proj, Qwen3.5's DeltaNet projections with in_proj_qkv's q/k/v split over tp) read through
    --adapter at tp 2 give peft's logits within 1e-5."""
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(4))
    cases, want = {}, {}
    for name, targets in (("llama", "all-linear"), ("gpt2", ["c_attn", "c_proj"]), ("qwen3_5", "all-linear")):
        model = peft_adapter(hf_dirs[name], tmp_path / name, targets)
        with torch.no_grad():
            want[name] = model(ids).logits
        cases[name] = (str(hf_dirs[name]), str(tmp_path / name))
    got = spawn(adapter_logits_worker, 2, cases, ids, timeout=300)[0]
    for name in cases:
        torch.testing.assert_close(got[name][..., : want[name].shape[-1]], want[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name,targets",
    [
        ("llama", "all-linear"),
        ("llama", ["q_proj", "v_proj"]),
        ("gpt2", "all-linear"),
        ("qwen2_moe", MOE_TARGETS),
        ("qwen3_5", "all-linear"),
    ],
)
def test_trainable_counts_equal_peft(hf_dirs, name, targets):
    cfg = config_from_hf(hf_dirs[name])
    ours = trainable_count(resolve(cfg, cfg.vocab_size, targets), LoraSpec(4, 8.0))
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(hf_dirs[name]),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))  # fmt: skip
    assert ours == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "name,lora,zero,match",
    [
        ("llama", {"r": 0, "target_modules": ["q_proj"]}, 1, "r must be a positive integer"),
        (
            "llama",
            {"r": 4, "target_modules": ["c_attn"]},
            1,
            "'c_attn' is not a linear module of family 'llama'",
        ),
        ("llama", {"r": 4, "target_modules": r".*\.layers\.9\..*"}, 1, "matches no linear module"),
        ("llama", {"r": 4}, 1, "target_modules is required"),
        ("llama", {"r": 4, "target_modules": "all-linear"}, 3, "ZeRO-3 is not supported"),
        ("qwen2_moe", {"r": 4, "target_modules": ["gate"]}, 1, "is a router"),
        ("qwen2_moe", {"r": 4, "target_modules": r".*experts\.0\.up_proj"}, 1, "routed expert"),
        ("llama", {"from_adapter": "GPT2"}, 1, "adapter was made for another base"),
        ("llama", {"r": 8, "from_adapter": "LLAMA"}, 1, "r=8 differs from the adapter's 4"),
        (
            "llama",
            {"r": 4, "alpha": float("nan"), "target_modules": ["q_proj"]},
            1,
            "alpha must be a positive finite number, got nan",
        ),
        (
            "llama",
            {"r": 4, "alpha": float("inf"), "target_modules": ["q_proj"]},
            1,
            "alpha must be a positive finite number, got inf",
        ),
        (
            "llama",
            {"r": 10**9, "target_modules": "all-linear"},
            1,
            "r 1000000000 is above min(in, out) = 32 of the smallest adapted linear",
        ),
        ("llama", {"from_adapter": "LLAMA lora_alpha=nan"}, 1, "alpha must be a positive finite number"),
        (
            "llama",
            {"from_adapter": "LLAMA r=8"},
            1,
            "its rank is 4 but its adapter_config.json says r 8: the adapter's config does not match",
        ),
    ],
)
def test_bad_lora_input_is_one_line_before_any_weight(hf_dirs, tmp_path, name, lora, zero, match, capsys,
                                                     monkeypatch):  # fmt: skip
    """`mt3d train --check` (its entry point, in this process) refuses each in one line, exit 2, before
    any weight is read."""
    from mt3d.train import main

    if "from_adapter" in lora:
        which, *edit = lora["from_adapter"].split()
        src = {"GPT2": ("gpt2", ["c_attn"]), "LLAMA": ("llama", ["q_proj"])}[which]
        peft_adapter(hf_dirs[src[0]], tmp_path / "adapter", src[1])
        if edit:  # a config that says otherwise than the adapter's tensors, or a NaN alpha
            key, value = edit[0].split("=")
            cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
            cfg[key] = json.loads(value) if value != "nan" else float("nan")
            (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
        if src[0] == "gpt2":  # the same module names as Llama's, shapes of another model
            cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
            cfg["target_modules"] = ["q_proj"]
            (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
            from safetensors.torch import load_file, save_file

            t = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
            t = {k.replace("transformer.h.", "model.layers.").replace("attn.c_attn", "self_attn.q_proj"): v
                 for k, v in t.items()}  # fmt: skip
            save_file(t, tmp_path / "adapter" / "adapter_model.safetensors")
        lora = {**lora, "from_adapter": str(tmp_path / "adapter")}
    raw = lora_config(tmp_path / "run", hf_dirs[name], lora=lora)
    raw["zero_optimization"]["stage"] = zero
    (tmp_path / "c.json").write_text(json.dumps(raw))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    capsys.readouterr()
    assert main(["--config", str(tmp_path / "c.json"), "--check"]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and match in lines[0], err


def test_deepspeed_still_all_reduces_a_none_tied_gradient():
    """mt3d.ds.pipe skips DeepSpeed's tied-weight all-reduce when the tied embedding is frozen: upstream
    still calls ``dist.all_reduce(weight.grad)`` unconditionally."""
    import inspect

    from deepspeed.runtime.pipe.module import PipelineModule

    src = inspect.getsource(PipelineModule.allreduce_tied_weight_gradients)
    assert "dist.all_reduce(weight.grad" in src and "requires_grad" not in src


def test_planner_counts_the_adapters_and_their_states(hf_dirs):
    """``mt3d plan --lora R``: the adapters per rank equal the resolved targets' (all-linear) at tp 1 and
    what each rank holds at tp 2; model states are the frozen weights plus the adapters' full states."""
    from mt3d.planner.layout import Layout, Precision, lora_stage_params, stage_params
    from mt3d.planner.memory import memory_bytes

    cfg = config_from_hf(hf_dirs["llama"])
    targets = resolve(cfg, cfg.vocab_size, "all-linear")
    assert lora_stage_params(cfg, 4, 1, 1) == trainable_count(targets, LoraSpec(4, 8.0))
    split = [
        (t.in_features, t.out_features / 2) if t.column else (t.in_features / 2, t.out_features)
        for t in targets
    ]
    per_rank = sum(4 * (a + b) for a, b in split)
    assert lora_stage_params(cfg, 4, 2, 1) == per_rank
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=1, grad_accum=1, zero_stage=1, recompute=False,
                 sequence_parallel=False)  # fmt: skip
    prec = Precision.of("bf16", 1)
    full = memory_bytes(cfg, cfg.vocab_size, 32, lay, prec)["model_states"]
    lora = memory_bytes(cfg, cfg.vocab_size, 32, lay, prec, lora_rank=4)["model_states"]
    n, a = stage_params(cfg, cfg.vocab_size, 1, 1), lora_stage_params(cfg, 4, 1, 1)
    assert full == pytest.approx(n * (prec.param + prec.grad + prec.master + prec.optim))
    assert lora == pytest.approx(n * prec.param + a * (prec.param + prec.grad + prec.master + prec.optim))
