"""Multi-token prediction (``model.mtp``): DeepSeek-V3's, GLM-4.5's and Qwen3-Next's MTP layers read from
their checkpoints' tensors give the loss a reference built from transformers' own decoder layers gives,
training with them at tp 2 x pp 2 (SP), under ZB-V and at cp 2 over packed documents equals one process,
and export writes them back."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig, Qwen3NextConfig

from mt3d.config.models import with_mtp
from mt3d.data.corpora import stdlib_documents
from mt3d.data.loader import mtp_batch
from mt3d.data.tokenizer import train_bpe

from helpers import run_grouped, tiny_config

LAYERS = 4  # the main model's; the checkpoints' fifth block is the MTP layer's


def configs(vocab):
    """Five-block tiny models; block 4 becomes the MTP layer (sparse, full attention)."""
    small = dict(hidden_size=64, num_hidden_layers=LAYERS + 1, intermediate_size=128, vocab_size=vocab,
                 max_position_embeddings=128)  # fmt: skip
    return {
        "deepseek_v3": DeepseekV3Config(
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
            **small,
        ),
        "glm4_moe": Glm4MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
            attention_bias=True, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            **small,
        ),
        "qwen3_next": Qwen3NextConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            mlp_only_layers=[1], layer_types=["linear_attention", "full_attention"] * 2 + ["full_attention"],
            **small,
        ),
    }  # fmt: skip


def mtp_names(name):
    """(the MTP block's prefix, its own tensors' names: enorm, hnorm, eh_proj, norm), as the family names
    them."""
    if name == "qwen3_next":
        own = ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.fc", "mtp.norm")
        return "mtp.layers.0.", [f"{n}.weight" for n in own]
    at = f"model.layers.{LAYERS}."
    return at, [f"{at}{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")]


@pytest.fixture(scope="module")
def mtp_dirs(tmp_path_factory):
    """Per family: (checkpoint dir with an MTP layer, the five-block transformers model it came from)."""
    base = tmp_path_factory.mktemp("mtp")
    docs = [d for _, d in zip(range(800), stdlib_documents())]
    tok = train_bpe(docs, 384, base / "tok")
    out = {}
    for i, (name, config) in enumerate(configs(tok.vocab_size).items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.ndim == 1:  # norms and biases: non-trivial
                    p.add_(torch.randn_like(p) * 0.2)
                elif pname.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                    p.mul_(30)  # routers far from uniform
        model.save_pretrained(base / f"{name}-five")
        tensors = load_file(base / f"{name}-five" / "model.safetensors")
        prefix, own = mtp_names(name)
        state = {}
        for k, v in tensors.items():
            block = k.startswith(f"model.layers.{LAYERS}.")
            state[prefix + k[len(f"model.layers.{LAYERS}.") :] if block else k] = v
        g = torch.Generator().manual_seed(10 + i)
        h = config.hidden_size
        offset = 0.0 if name == "qwen3_next" else 1.0  # Qwen3-Next's norms scale by (1 + w)
        for n in own[:2] + own[3:]:
            state[n] = offset + 0.2 * torch.randn(h, generator=g)
        state[own[2]] = torch.randn(h, 2 * h, generator=g) * 0.05
        if name != "qwen3_next":  # DeepSeek's format keeps copies of the shared embedding and head
            state[f"{prefix}embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
            state[f"{prefix}shared_head.head.weight"] = state["lm_head.weight"].clone()
        d = base / name
        d.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})  # fmt: skip
        hf = json.loads((base / f"{name}-five" / "config.json").read_text())
        hf["num_hidden_layers"] = LAYERS
        if name == "qwen3_next":
            hf.update(layer_types=hf["layer_types"][:LAYERS], mtp_num_hidden_layers=1)
        else:
            hf["num_nextn_predict_layers"] = 1
        (d / "config.json").write_text(json.dumps(hf))
        for f in (base / "tok").iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        out[name] = (d, model)
    return out


def reference_losses(name, d, five, ids):
    """(main loss, MTP depth-1 loss) built from transformers' modules: the four-block model's normalised
    output, the MTP tensors' norms and projection, the fifth block as transformers runs it, the head."""
    four = AutoModelForCausalLM.from_pretrained(d).eval()
    tensors = load_file(d / "model.safetensors")
    _, (enorm, hnorm, eh, norm) = mtp_names(name)
    norm_cls, eps = type(four.model.norm), four.config.rms_norm_eps
    h_size = four.config.hidden_size

    def rms(key):
        m = norm_cls(h_size, eps=eps)
        m.weight.data.copy_(tensors[key])
        return m

    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        h = four.model(x).last_hidden_state
        main = F.cross_entropy(four.lm_head(h).flatten(0, 1), y.flatten())
        e = four.model.embed_tokens(x[:, 1:])  # token i + 1 at position i
        z = F.linear(torch.cat([rms(enorm)(e), rms(hnorm)(h[:, :-1])], -1), tensors[eh])
        n = z.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), -math.inf).triu(1)[None, None]
        z = five.model.layers[LAYERS](z, attention_mask=mask, position_ids=pos,
                                      position_embeddings=five.model.rotary_emb(z, pos))  # fmt: skip
        z = z[0] if isinstance(z, tuple) else z
        mtp = F.cross_entropy(four.lm_head(rms(norm)(z)).flatten(0, 1), y[:, 1:].flatten())
    return float(main), float(mtp)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe", "qwen3_next"])
def test_mtp_layers_read_from_the_checkpoint_give_the_reference_loss(mtp_dirs, name):
    from mt3d.checkpoint.loading import build_model, load_weights, open_source
    from mt3d.model.hf import config_from_hf
    from mt3d.parallel.state import ParallelState

    d, five = mtp_dirs[name]
    ids = torch.randint(0, 300, (2, 21), generator=torch.Generator().manual_seed(3))
    main, mtp = reference_losses(name, d, five, ids)
    cfg = with_mtp(config_from_hf(d), {"layers": 1, "loss_weight": 0.5}, d)
    source = open_source(d, cfg=cfg)
    state = ParallelState.single()
    model = build_model(cfg, source.vocab, state, skip_init=True)
    load_weights(model, source, state.tp)
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        assert abs(float(model.eval()(x, y)) - main) < 1e-5
    loss = model.train()(x, (y, *mtp_batch(x, y, None, 1)))
    (got,) = model.loss_fn.mtp_log[-1].tolist()
    assert abs(got - mtp) < 1e-5, (got, mtp)
    assert abs(float(loss.detach()) - (main + 0.5 * mtp)) < 1e-5  # no router loss in these configs
    assert abs(mtp - main) > 1e-3  # the depth's own loss, not the main one again


def test_mtp_batch_shifts_within_documents():
    """Depth k at position i: token i + k in, label i + k out, inside i's document only."""
    ids = torch.arange(10, 18)[None]
    labels = torch.tensor([[11, -100, 13, -100, 15, 16, 17, -100]])  # a prompt token; document ends
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    mi, ml = mtp_batch(ids, labels, docs, 2)
    assert mi[0, :, 0].tolist() == [11, 12, 13, 0, 15, 16, 17, 0]
    assert ml[0, :, 0].tolist() == [-100, 13, -100, -100, 16, 17, -100, -100]
    assert mi[0, :, 1].tolist() == [12, 13, 0, 0, 16, 17, 0, 0]
    assert ml[0, :, 1].tolist() == [13, -100, -100, -100, 17, -100, -100, -100]
    mi, ml = mtp_batch(ids, labels, None, 1)
    assert ml[0, :, 0].tolist() == [-100, 13, -100, 15, 16, 17, -100, -100]


def fine_tune(save_dir, hf_dir, *, tp=1, pp=1, packed=False, **parallel):
    raw = tiny_config(save_dir, tp=tp, pp=pp, steps=4, save_at_end=True)
    raw["mt3d"]["model"] = {"from_hf": str(hf_dir), "mtp": {"layers": 1, "loss_weight": 0.3}}
    raw["mt3d"]["data"] = {"corpus": "builtin", "seq_len": 32, "document_mask": packed}
    raw["mt3d"]["parallel"].update(parallel)
    raw["optimizer"]["params"]["lr"] = 3e-3
    return raw


def two_depths(save_dir, tp=1, pp=1, **parallel):
    """Two depths on a preset (random weights): depth 2 reads depth 1's output."""
    raw = tiny_config(save_dir, tp=tp, pp=pp, steps=4)
    raw["mt3d"]["model"] = {"preset": "tiny-deepseek-v3", "mtp": {"layers": 2}}
    raw["mt3d"]["parallel"].update(parallel)
    return raw


def dense_mtp(save_dir, tp=1, pp=1, zero=1, steps=4, **train):
    """Qwen3.5 (dense, untied) with MTP over a 4096-token vocabulary: each stage's copy of the embedding is
    split over dp in DeepSpeed's universal format (resharding reads them as one tied weight)."""
    raw = tiny_config(save_dir, tp=tp, pp=pp, zero=zero, steps=steps, **train)
    raw["mt3d"]["model"] = {"preset": "tiny-qwen3.5", "mtp": {"layers": 1}}
    raw["mt3d"]["data"]["vocab_size"] = 4096
    return raw


def test_training_with_mtp_at_tp2_pp2_and_cp2_equals_one_process_and_exports(mtp_dirs, tmp_path):
    from mt3d.checkpoint.export import MTP_FILE, export_hf
    from mt3d.checkpoint.loading import open_source
    from mt3d.model.sharding import global_names

    ds, qn = mtp_dirs["deepseek_v3"][0], mtp_dirs["qwen3_next"][0]
    runs = [
        (1, fine_tune(tmp_path / "ds-ref", ds)),
        (1, fine_tune(tmp_path / "qn-ref", qn, packed=True)),
        (4, fine_tune(tmp_path / "ds-tp2pp2", ds, tp=2, pp=2, sequence_parallel=True)),
        (2, fine_tune(tmp_path / "qn-cp2", qn, packed=True, context=2)),
        (2, fine_tune(tmp_path / "ds-zbv", ds, pp=2, virtual_stages=2, schedule="zbv")),
        (1, two_depths(tmp_path / "d2-ref")),
        (4, two_depths(tmp_path / "d2-tp2pp2", tp=2, pp=2, sequence_parallel=True)),
        (1, dense_mtp(tmp_path / "q35-ref")),
        (4, dense_mtp(tmp_path / "q35-pp2dp2", pp=2, steps=2, save_at_end=True)),
        (2, dense_mtp(tmp_path / "q35-resumed", pp=2, resume=str(tmp_path / "q35-pp2dp2"))),
        (2, dense_mtp(tmp_path / "q35-zero3", zero=3)),
    ]
    ds_ref, qn_ref, ds_par, qn_cp, ds_zbv, d2_ref, d2_par, q35_ref, _, q35_resumed, q35_z3 = run_grouped(runs)
    checks = ((ds_par, ds_ref, "tp 2 x pp 2"), (qn_cp, qn_ref, "cp 2, packed"),
              (ds_zbv, ds_ref, "ZB-V at pp 2"), (d2_par, d2_ref, "two depths, tp 2 x pp 2"),
              (q35_resumed, q35_ref[2:], "saved at pp 2 x dp 2, resumed at pp 2"),
              (q35_z3, q35_ref, "ZeRO-3 at dp 2"))  # fmt: skip
    for got, ref, what in checks:
        assert len(got) == len(ref) > 0
        for a, b in zip(got, ref):
            assert a["step"] == b["step"], what
            for key in ("loss", "grad_norm", "mtp_loss"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (what, a["step"], key, a[key], b[key])
        depths = [k for k in ref[0] if k.startswith("mtp_loss_")]
        assert ref[0]["mtp_loss"] == pytest.approx(sum(ref[0][k] for k in depths) / len(depths))
        assert all(r["loss"] > r["mtp_loss"] * 0.3 for r in ref)  # the depth's loss is in the total
    assert all(ref[-1]["mtp_loss"] < ref[0]["mtp_loss"] for ref in (ds_ref, qn_ref, d2_ref))  # it learns
    # the tp 2 x pp 2 run's checkpoint exports its MTP layer, which reads back as the same tensors
    out = export_hf(tmp_path / "ds-tp2pp2", tmp_path / "export")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[f"model.layers.{LAYERS}.eh_proj.weight"] == MTP_FILE
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    trained = open_source(tmp_path / "ds-tp2pp2")
    back = open_source(out, cfg=trained.cfg)
    names = global_names(trained.cfg, trained.vocab)
    assert any(".depth.0.block." in n for n in names)
    for n in names:
        assert torch.equal(trained.full(n), back.full(n)), n
    # inference reads the main model of the run (its embedding under the name a model without MTP gives
    # it) and the export's main model is transformers' with the same logits
    from mt3d.checkpoint.loading import from_pretrained
    from mt3d.model.inference import logits

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(4))
    model = from_pretrained(tmp_path / "ds-tp2pp2")
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert model.config.mtp is None and (logits(model, ids, model.state, 64) - want).abs().max() < 1e-5
    exported = load_file(out / MTP_FILE)  # with DeepSeek's copies of the shared embedding and head
    assert torch.equal(
        exported[f"model.layers.{LAYERS}.shared_head.head.weight"], trained.full(f"{LAYERS + 3}.weight")
    )
    assert torch.equal(exported[f"model.layers.{LAYERS}.embed_tokens.weight"],
                       trained.full("tied_modules.embed.embed.weight"))  # fmt: skip


def test_bad_mtp_input_is_one_line_before_any_process_group(mtp_dirs, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from mt3d.config import ConfigError, from_dict, resolve_model, validate

    ds, qn = str(mtp_dirs["deepseek_v3"][0]), str(mtp_dirs["qwen3_next"][0])
    one = {"from_hf": ds, "mtp": {"layers": 1}}
    cases = [
        ({"from_hf": ds, "mtp": {"layers": 2}}, "", "holds 1 multi-token-prediction layers, model.mtp"),
        ({"from_hf": qn, "mtp": {"layers": 2}}, "", "its checkpoints hold one MTP module (mtp.*)"),
        ({"preset": "tiny-llama", "family": "llama", "mtp": {"layers": 1}}, "",
         "has no multi-token-prediction layers (deepseek_v3, glm4_moe"),
        ({"from_hf": ds, "mtp": {"layers": 1, "depth": 2}}, "", "model.mtp: unknown keys ['depth']"),
        ({"from_hf": ds, "mtp": {"layers": 0}}, "", "model.mtp.layers must be an integer >= 1, got 0"),
        ({"from_hf": ds, "mtp": {"layers": 1, "loss_weight": -1}}, "", "model.mtp.loss_weight must be a"),
        (one, "dpo", "model.mtp trains next-token objectives"),
        (one, "lora", "model.mtp does not combine with mt3d.lora"),
    ]  # fmt: skip
    for model, change, message in cases:
        raw = tiny_config(tmp_path / "bad")
        raw["mt3d"]["model"] = model
        if change == "dpo":
            raw["mt3d"]["train"]["objective"] = "dpo"
        if change == "lora":
            raw["mt3d"]["lora"] = {"r": 4}
        with pytest.raises(ConfigError) as err:
            cfg = from_dict(raw)
            validate(cfg, 1, resolve_model(cfg.mt3d.model), here=False)
        assert message in str(err.value) and "\n" not in str(err.value), (model, str(err.value))
    raw = fine_tune(tmp_path / "bad", ds)  # and through the command: exit 2, one line
    raw["mt3d"]["model"]["mtp"]["layers"] = 2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "mt3d", "train", "--config", str(path), "--check"],
                         capture_output=True, text=True, timeout=120, cwd=root)  # fmt: skip
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "model.mtp.layers asks 2" in out.stderr


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-qwen3-next"])
def test_counts_include_the_depths_the_model_builds(preset):
    """num_params and the planner's last stage grow by what the built depths hold."""
    from mt3d.config.models import resolve_model
    from mt3d.model.blocks import BuildContext
    from mt3d.model.pipeline import StackedModel, layer_specs
    from mt3d.parallel.state import AxisGroup
    from mt3d.planner.layout import stage_params

    plain, mtp = resolve_model({"preset": preset}), resolve_model({"preset": preset, "mtp": {"layers": 1}})
    ctx = BuildContext(tp=AxisGroup.alone("tp"), skip_init=True)
    with torch.device("meta"):
        built = [
            sum(p.numel() for p in StackedModel(layer_specs(c, ctx, 256)).parameters()) for c in (plain, mtp)
        ]
    assert (
        mtp.family == plain.family and built[1] - built[0] == mtp.num_params(256) - plain.num_params(256) > 0
    )
    assert stage_params(mtp, 256, 1, 1) - stage_params(plain, 256, 1, 1) == built[1] - built[0]
    assert mtp.flops_per_token(64, 256) > plain.flops_per_token(64, 256)
