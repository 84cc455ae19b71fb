"""How tests/golden/checkpoint_v1 was made (run once, with main at 9135188, before the parallel
axes were declared once): a tiny GPT trained at (tp 2, pp 2, dp 2) with ZeRO-1, saved after step 3,
and what an unstopped run and a resharded resume do next (expected.json).

    python tests/golden/make_checkpoint_fixture.py tests/golden/checkpoint_v1

tests/test_checkpoint_fixture.py resumes it with today's code and compares.
"""

import copy
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mt3d.parallel.spawn import spawn  # noqa: E402

from helpers import step_records, train_worker  # noqa: E402

MODEL = {"preset": "tiny", "hidden": 32, "layers": 2, "heads": 2, "max_seq_len": 32}


def config(save_dir, cache_dir, *, tp=2, pp=2, steps=6, **train):
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 4},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "mt3d": {
            "model": copy.deepcopy(MODEL),
            "parallel": {"tensor": tp, "pipeline": pp},
            "data": {"corpus": "synthetic", "vocab_size": 128, "seq_len": 16, "cache_dir": str(cache_dir)},
            "train": {
                "steps": steps,
                "log_interval": 1,
                "eval_batches": 0,
                "save_dir": str(save_dir),
                "save_at_end": False,
                "seed": 1234,
                "progress": False,
                **train,
            },
        },
    }


def records(raw, world):
    return [
        {k: r[k] for k in ("step", "loss", "grad_norm", "lr")}
        for r in step_records(spawn(train_worker, world, raw, timeout=600)[0])
    ]


def main(out: Path) -> None:
    work = out.parent / (out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    cache = work / "cache"
    unstopped = records(config(work / "unstopped", cache), 8)
    records(config(work / "saved", cache, steps=3, save_interval=3), 8)
    src = work / "saved" / "checkpoints" / "step_00000003"
    resumed = records(config(work / "resumed", cache, resume=str(src)), 8)
    assert resumed == unstopped[3:], (resumed, unstopped)
    reshard = records(config(work / "reshard", cache, tp=1, pp=1, resume=str(src)), 1)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out / "step_00000003")
    (out / "expected.json").write_text(
        json.dumps(
            {
                "config": config("SAVE_DIR", "CACHE_DIR", resume="RESUME"),
                "unstopped": unstopped,
                "reshard_1_1_1": reshard,
            },
            indent=1,
        )
    )
    shutil.rmtree(work)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
