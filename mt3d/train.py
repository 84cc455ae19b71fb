"""Training entry point: ``python -m mt3d.train --config C.json [--set key.path=value ...]``.

Runs under any launcher: ``deepspeed --num_gpus N --module mt3d.train ...``, ``torchrun
--nproc_per_node N -m mt3d.train ...``, multi-node with ``--hostfile``, or plain python (one rank).
Everything that can be checked before process groups exist is checked first; a bad config exits
with code 2 and one line saying what to fix.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

EXAMPLES = """examples:
  deepspeed --num_gpus 8 --module mt3d.train --config ds_configs/cpu_demo_3d.json
  torchrun --nproc_per_node 4 -m mt3d.train --config ds_configs/cpu_demo_3d.json --set mt3d.parallel.tensor=1
  python -m mt3d.train --config ds_configs/cpu_demo_3d.json --set mt3d.parallel.pipeline=1 \\
      --set mt3d.parallel.tensor=1 --set mt3d.train.steps=20 --set bf16.enabled=false
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments (the launcher's --local_rank is accepted and ignored)."""
    p = argparse.ArgumentParser(
        prog="python -m mt3d.train",
        description="Train a GPT/Llama model with tensor x pipeline x ZeRO data parallelism.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="JSON file: DeepSpeed keys plus an 'mt3d' section")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override any key, e.g. --set mt3d.train.steps=10 --set bf16.enabled=false (repeatable)",
    )
    p.add_argument("--check", action="store_true", help="validate the config for this world size and exit")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prepare(args: argparse.Namespace):
    """Load and validate the config for this world size (no process groups yet)."""
    from .config import load, resolve_model, validate

    run = load(args.config, args.set)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model_cfg = resolve_model(run.mt3d.model)
    layout = validate(run, world, model_cfg)
    return run, layout, model_cfg


def quiet_known_warnings() -> None:
    """Silence warnings that DeepSpeed 0.19.8 triggers on torch 2.13 and users cannot act on."""
    import warnings

    # DeepSpeed's PartitionedTensor and ZeRO call the deprecated name of all_gather_single.
    warnings.filterwarnings(
        "ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning
    )


def main(argv: list[str] | None = None) -> int:
    """Validate, then train; returns the process exit code."""
    args = parse_args(argv)
    from .errors import EXIT_BAD_INPUT, UserError

    try:
        run, layout, model_cfg = prepare(args)
    except UserError as e:  # ConfigError, and any other bad input found before process groups exist
        print(f"mt3d train: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.check:
        print(
            f"config OK: world {layout.world} = tp {layout.tp} x pp {layout.pp} x dp {layout.dp}, "
            f"global batch {layout.global_batch} = micro {layout.micro_batch} x accum {layout.grad_accum} "
            f"x dp {layout.dp}"
        )
        return 0
    logging.basicConfig(level=logging.INFO, format="[mt3d] %(message)s")
    quiet_known_warnings()
    from .training.session import run_training

    return run_training(run, layout, model_cfg)


if __name__ == "__main__":
    sys.exit(main())
