"""Training entry point: ``mt3d train --config C.json [--set key.path=value ...]`` (also
``python -m mt3d.train``, with the same arguments).

Runs under any launcher: ``deepspeed --num_gpus N --module mt3d.train ...``, ``torchrun
--nproc_per_node N -m mt3d.train ...``, multi-node with ``--hostfile``, or plain python (one rank).
Everything that can be checked before process groups exist is checked first; a bad config exits
with code 2 and one line saying what to fix.
"""

from __future__ import annotations

import argparse
import sys

from .errors import UserError

DESCRIPTION = "Train a model with tensor x pipeline x ZeRO data parallelism from one JSON config."
EXAMPLES = """examples:
  mt3d train --config ds_configs/cpu_demo_3d.json --set mt3d.parallel.tensor=1 --set mt3d.parallel.pipeline=1
  deepspeed --num_gpus 8 --module mt3d.train --config ds_configs/cpu_demo_3d.json
  torchrun --nproc_per_node 4 -m mt3d.train --config ds_configs/cpu_demo_3d.json --set mt3d.parallel.tensor=1
  python -m mt3d.train --config ds_configs/cpu_demo_3d.json --set mt3d.parallel.pipeline=1 \\
      --set mt3d.parallel.tensor=1 --set mt3d.train.steps=20 --set bf16.enabled=false
"""


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training arguments (shared by ``mt3d train`` and ``python -m mt3d.train``)."""
    p.add_argument("--config", required=True, help="JSON file: DeepSpeed keys plus an 'mt3d' section")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override any key, e.g. --set mt3d.train.steps=10 --set bf16.enabled=false (repeatable)",
    )
    p.add_argument("--check", action="store_true", help="validate the config for this world size and exit")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show DeepSpeed's own log lines on the terminal (default: the run's log)",
    )
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line arguments of ``python -m mt3d.train`` (the launcher's --local_rank is ignored)."""
    from .inputs import OneLineParser

    p = OneLineParser(
        prog="python -m mt3d.train",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return add_arguments(p).parse_args(argv)


def prepare(args: argparse.Namespace):
    """Load and validate the config for this world size (no process groups yet)."""
    from .config import load, resolve_model, validate
    from .config.preflight import check_accelerate
    from .inputs import check_launcher, launcher_world

    world = launcher_world()
    run = load(args.config, args.set)
    model_cfg = resolve_model(run.mt3d.model)
    layout = validate(run, world, model_cfg)
    check_accelerate(run.deepspeed)
    if not args.check:
        try:
            check_launcher(world)
        except UserError as e:  # this rank's own variables: it says so itself
            raise RankError(str(e)) from None
    preflight(run, layout, model_cfg)
    return run, layout, model_cfg


class RankError(UserError):
    """Bad launcher variables of one rank (every rank reports its own)."""


def preflight(run, layout, model_cfg) -> None:
    """What the machine must offer before process groups: NVMe offload's disk and libaio, and no
    leftover lock of an interrupted DeepSpeed op build (which would hang the start for ever)."""
    import torch

    from .ds.ops import check_op_locks
    from .training.offload import check_offload

    check_offload(run.deepspeed.offload, layout, model_cfg, run.mt3d.data.vocab_size)
    check_op_locks(run.deepspeed, on_cpu=not torch.cuda.is_available())


def run(args: argparse.Namespace, prog: str = "mt3d train") -> int:
    """Validate, then train; returns the process exit code."""
    from .errors import EXIT_BAD_INPUT
    from .inputs import env_int

    try:
        run_cfg, layout, model_cfg = prepare(args)
    except UserError as e:  # ConfigError, and any other bad input found before process groups exist
        # The config and this host's files are the same for every rank of the host: its first rank
        # speaks for them (a launcher variable is the rank's own).
        if isinstance(e, RankError) or env_int("LOCAL_RANK", 0) == 0:
            print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if env_int("RANK", 0) == 0:  # once per run
        for note in layout.notes:
            print(f"{prog}: warning: {note}", file=sys.stderr)
    if args.check:
        print(
            f"config OK: {layout.headline()}, global batch {layout.global_batch} = micro "
            f"{layout.micro_batch} x accum {layout.grad_accum} x dp {layout.dp}"
        )
        return 0
    from .training.logs import configure_logging

    configure_logging(verbose=args.verbose)
    from .training.session import run_training

    return run_training(run_cfg, layout, model_cfg, verbose=args.verbose)


def main(argv: list[str] | None = None) -> int:
    """``python -m mt3d.train``: parse, validate, train; returns the process exit code."""
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
