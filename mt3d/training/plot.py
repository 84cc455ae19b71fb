"""``mt3d plot RUN_DIR``: loss and throughput curves of a run as one PNG."""

from __future__ import annotations

from pathlib import Path

from ..inputs import read_json
from .metrics import read_metrics


def split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, eval) records, one per step: after a resume the re-run steps replace the earlier ones."""
    train = {r["step"]: r for r in records if r.get("loss") is not None}
    evals = {r["step"]: r for r in records if r.get("eval_loss") is not None}
    return [train[k] for k in sorted(train)], [evals[k] for k in sorted(evals)]


def run_facts(run_dir: Path) -> dict:
    """``run.json`` of a run directory ({} when absent)."""
    p = Path(run_dir) / "run.json"
    return read_json(p, "run.json") if p.is_file() else {}


def summarize(run_dir: str | Path) -> dict:
    """Headline figures of a run: last train loss, last/best eval loss, throughput, entropy floor."""
    run_dir = Path(run_dir)
    src = run_dir / "metrics.jsonl"
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found (is {run_dir} a training run directory?)")
    train, evals = split_records(read_metrics(src))
    facts = run_facts(run_dir)
    out = {
        "run_dir": str(run_dir),
        "steps": train[-1]["step"] if train else 0,
        "first_loss": train[0]["loss"] if train else None,
        "last_loss": train[-1]["loss"] if train else None,
        "last_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "best_eval_loss": min(r["eval_loss"] for r in evals) if evals else None,
        "tokens_per_s": train[-1].get("tokens_per_s") if train else None,
        "entropy_floor": facts.get("data", {}).get("entropy_floor"),
    }
    ckpt = run_dir / "checkpoints"
    out["checkpoints"] = sorted(p.name for p in ckpt.glob("step_*") if (p / "manifest.json").is_file())
    wb = run_dir / "wandb"
    out["wandb_runs"] = sorted(str(p) for p in wb.glob("offline-run-*")) + sorted(
        str(p) for p in wb.glob("run-*")
    )
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``<run_dir>/curves.png`` (or ``out``) from ``<run_dir>/metrics.jsonl``; returns the path."""
    run_dir = Path(run_dir)
    src = run_dir / "metrics.jsonl"
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found (is {run_dir} a training run directory?)")
    train, evals = split_records(read_metrics(src))
    if not train and not evals:
        raise ValueError(f"{src} has no training or eval records yet")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    floor = run_facts(run_dir).get("data", {}).get("entropy_floor")
    if floor is not None:
        ax_loss.axhline(floor, color="gray", linestyle="--", label=f"entropy floor {floor:.3f}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    tput = [r for r in train if r.get("tokens_per_s")]
    if tput:
        ax_tput.plot([r["step"] for r in tput], [r["tokens_per_s"] for r in tput], color="tab:green")
        ax_tput.set_ylabel("tokens/s")
        if any(r.get("mfu") is not None for r in tput):
            ax_mfu = ax_tput.twinx()
            ax_mfu.plot(
                [r["step"] for r in tput],
                [100 * (r.get("mfu") or 0) for r in tput],
                color="tab:red",
                alpha=0.5,
            )
            ax_mfu.set_ylabel("MFU (%)", color="tab:red")
    ax_tput.set_xlabel("step")
    ax_tput.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
