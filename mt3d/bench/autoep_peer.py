"""DeepSpeed AutoEP's side of ``python -m mt3d.bench autoep``: a standalone script run by the peer
virtualenv's python under ``torch.distributed.run`` (mt3d's pinned DeepSpeed with transformers <= 5.22: AutoEP
fails in ``deepspeed.initialize`` with 5.23+). It imports nothing from mt3d.

    python autoep_peer.py make MODEL_DIR              # a tiny random Mixtral, saved for both trainers
    torchrun --nproc_per_node 2 autoep_peer.py train MODEL_DIR TOKENS OUT.json [--ep 2]

``train`` fine-tunes MODEL_DIR with AutoEP (``expert_parallel`` in DeepSpeed's config: each
``MixtralSparseMoeBlock`` becomes an AutoEP layer holding experts / ep), ZeRO-1, fp32, torch's AdamW,
on the token batches in TOKENS (a tensor [steps, world, micro, seq + 1]: rank r's micro-batch of
step s), and writes per step the loss (mean over ranks), DeepSpeed's gradient norm and the step's
wall time (a barrier before the forward, one after the optimizer step).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
"""The benchmark's Mixtral: 8 experts, top-2, no aux loss (mt3d would add it; AutoEP adds it only
with output_router_logits), no router jitter, untied embeddings."""
OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
CLIP = 1.0


def make(model_dir: str, seed: int = 1234) -> None:
    """Save a random tiny Mixtral (``SHAPE``) to ``model_dir``."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        **SHAPE,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        router_jitter_noise=0.0,
        tie_word_embeddings=False,
        use_cache=False,
    )
    MixtralForCausalLM(cfg).save_pretrained(model_dir)


def train(model_dir: str, tokens: str, out: str, ep: int) -> None:
    """AutoEP fine-tuning of ``model_dir`` on ``tokens``; rank 0 writes the record to ``out``."""
    import deepspeed
    from transformers import MixtralForCausalLM

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = torch.load(tokens)
    model = MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    micro = batches.shape[2]
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro * world,
        "optimizer": {**OPTIMIZER, "params": {**OPTIMIZER["params"], "torch_adam": True}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "expert_parallel": {
            "enabled": True,
            "autoep_size": ep,
            "preset_model": "mixtral",
            "use_grouped_mm": True,
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    steps = []
    for s in range(batches.shape[0]):
        ids = batches[s, rank]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss  # transformers shifts the labels
        engine.backward(loss)
        engine.step()
        dist.barrier()
        seconds = time.perf_counter() - t0
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        norm = engine.get_global_grad_norm()
        steps.append({"loss": mean.item() / world, "grad_norm": float(norm), "step_s": seconds})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": steps, "optimizer": type(engine.optimizer).__name__}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """``make`` or ``train`` (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("make")
    m.add_argument("model_dir")
    t = sub.add_parser("train")
    t.add_argument("model_dir")
    t.add_argument("tokens")
    t.add_argument("out")
    t.add_argument("--ep", type=int, default=2)
    a = p.parse_args()
    if a.what == "make":
        make(a.model_dir)
    else:
        train(a.model_dir, a.tokens, a.out, a.ep)


if __name__ == "__main__":
    main()
