"""The commands about runs: ``mt3d train`` (the same as ``python -m mt3d.train``), ``plot``,
``summary`` and ``checkpoint info``."""

from __future__ import annotations

import argparse
import json

from .common import UsageError, writable_output


def _add_train(sub) -> None:
    from .. import train

    p = sub.add_parser(
        "train",
        help="train from one JSON config (the same as python -m mt3d.train; run it under a launcher)",
        description=train.DESCRIPTION,
        epilog=train.EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_arguments(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """``mt3d train``: ``mt3d.train.run`` (it reports its own errors and exit codes)."""
    from ..train import run

    return run(args)


# --- plot ----------------------------------------------------------------------------------
def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="write a PNG of a run's loss and throughput curves",
        description="Plot train/eval loss and tokens/s (and MFU) from RUN_DIR/metrics.jsonl.",
        epilog="example:\n  mt3d plot runs/cpu_demo_3d            # writes runs/cpu_demo_3d/curves.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="training run directory (the config's mt3d.train.save_dir)")
    p.add_argument("--out", help="output PNG (default RUN_DIR/curves.png)")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    """``mt3d plot``."""
    from ..training.plot import plot_run

    try:
        writable_output(args.out, "--out")
        print(plot_run(args.run_dir, args.out))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return 0


def _add_summary(sub) -> None:
    p = sub.add_parser(
        "summary",
        help="headline figures of a training run (losses, throughput, checkpoints, W&B runs)",
        description="Summarise RUN_DIR: first/last train loss, eval loss (vs the entropy floor of the "
        "synthetic corpus when known), tokens/s, complete checkpoints and W&B run directories.",
        epilog="example:\n  mt3d summary runs/cpu_demo_3d --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", help="training run directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_summary)


def cmd_summary(args: argparse.Namespace) -> int:
    """``mt3d summary``."""
    from ..training.plot import summarize

    s = summarize(args.run_dir)
    if args.json:
        print(json.dumps(s))
        return 0
    fmt = lambda v: "n/a" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))  # noqa: E731
    print(
        f"run {s['run_dir']}: {s['steps']} steps, train loss {fmt(s['first_loss'])} -> {fmt(s['last_loss'])}"
    )
    line = f"eval loss {fmt(s['last_eval_loss'])} (best {fmt(s['best_eval_loss'])})"
    if s["entropy_floor"] is not None and s["last_eval_loss"] is not None:
        gap = s["last_eval_loss"] - s["entropy_floor"]
        line += (
            f"; entropy floor {s['entropy_floor']:.4f}, gap {gap:.4f} nats ({gap / s['entropy_floor']:+.1%})"
        )
    print(line)
    print(f"throughput {fmt(s['tokens_per_s'])} tokens/s at the last logged step")
    print(f"checkpoints: {', '.join(s['checkpoints']) or 'none'}")
    print(f"W&B runs: {', '.join(s['wandb_runs']) or 'none'}")
    return 0


def _add_checkpoint(sub) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="inspect checkpoints: layout, step, model, size and validity",
        description="'mt3d checkpoint info DIR' describes one checkpoint (step_XXXXXXXX) or every checkpoint "
        "of a run: complete (manifest present, every file's size and sha256 match), incomplete (no "
        "manifest: interrupted while saving) or corrupt (names the file).",
        epilog="examples:\n  mt3d checkpoint info runs/x\n"
        "  mt3d checkpoint info runs/x/checkpoints/step_00000500 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = p.add_subparsers(dest="action", metavar="<action>", required=True)
    info = csub.add_parser("info", help="describe checkpoints")
    info.add_argument("path", help="checkpoint dir, run dir or checkpoints dir")
    info.add_argument("--fast", action="store_true", help="check sizes only, skip hashing")
    info.add_argument("--json", action="store_true", help="one JSON object per checkpoint, one per line")
    p.set_defaults(func=cmd_checkpoint)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """``mt3d checkpoint info``."""
    from ..checkpoint.info import describe, format_rows

    rows = describe(args.path, verify=not args.fast)
    print("\n".join(json.dumps(r) for r in rows) if args.json else format_rows(rows))
    return 0 if all(r["status"].startswith("complete") for r in rows[-1:]) else 1
