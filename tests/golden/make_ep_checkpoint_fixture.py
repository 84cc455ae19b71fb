"""How the expert-parallel checkpoint fixtures were made (each run once): a tiny Mixtral trained at
ep 2 (dp 2) with ZeRO-1, saved after step 3, and what the unstopped run did next (expected.json).

tests/golden/checkpoint_ep_v1: with main at 430d643, when ZeRO-1 under expert parallelism partitioned
dense optimizer states over dp / ep x cp and each ep rank wrote them whole (weight decay 0.1):

    git worktree add /tmp/old 430d643
    PYTHONPATH=/tmp/old python tests/golden/make_ep_checkpoint_fixture.py tests/golden/checkpoint_ep_v1

tests/golden/checkpoint_ep_v2: with main at 7c08900, dense states over dp x cp, weight decay 0, when the
optimizer still grouped parameters by weight decay at 0 too (three groups: dense matrices, dense norms,
experts; mt3d.config.layout.PARAM_GROUPS):

    git worktree add /tmp/old2 7c08900
    PYTHONPATH=/tmp/old2 python tests/golden/make_ep_checkpoint_fixture.py tests/golden/checkpoint_ep_v2 0

tests/test_golden.py resumes them with today's code and compares.
"""

import copy
import json
import shutil
import sys
from pathlib import Path

from mt3d.parallel.spawn import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers import step_records, train_worker  # noqa: E402

MODEL = {"preset": "tiny-mixtral", "hidden": 16, "layers": 2, "heads": 2, "kv_heads": 1, "ffn": 32,
         "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16, "aux_loss_coef": 0.02}}  # fmt: skip


def config(save_dir, steps=6, weight_decay=0.1, **train):
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": weight_decay},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "mt3d": {
            "model": copy.deepcopy(MODEL),
            "parallel": {"expert": 2},
            "data": {"corpus": "synthetic", "vocab_size": 512, "seq_len": 32},
            "train": {
                "steps": steps,
                "log_interval": 1,
                "eval_interval": 0,
                "save_dir": str(save_dir),
                "save_at_end": False,
                "seed": 1234,
                "progress": False,
                **train,
            },  # fmt: skip
        },
    }


def main(out: Path, weight_decay: float = 0.1) -> None:
    work = out.with_name(out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    raw = config(work, weight_decay=weight_decay, save_interval=3)
    got = step_records(spawn(train_worker, 2, raw, timeout=600)[0])
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(work / "checkpoints" / "step_00000003", out / "step_00000003", dirs_exist_ok=True)
    unstopped = [{k: r[k] for k in ("step", "loss", "grad_norm", "lr", "moe_aux_loss")} for r in got]
    expected = {"config": config("SAVE_DIR", weight_decay=weight_decay), "unstopped": unstopped}
    (out / "expected.json").write_text(json.dumps(expected, indent=1))
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), *(float(a) for a in sys.argv[2:3]))
