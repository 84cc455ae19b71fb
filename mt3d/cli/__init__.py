"""The ``mt3d`` command (also ``python -m mt3d``): one sub-command per task, each with --help; one module
per command group (``topo``, ``plan``, ``runs``: train, plot, summary and checkpoint, ``data``, ``models``:
eval, generate and export-hf), sharing ``common``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..errors import EXIT_BAD_INPUT
from ..inputs import OneLineParser
from ..planner.args import plan_inputs  # noqa: F401 - callers and tests reach it as mt3d.cli.plan_inputs
from .common import KNOWN_ERRORS, UsageError, writable_output  # noqa: F401 - the shared names
from .data import _add_data, _add_preprocess, _add_train_tokenizer
from .models import _add_eval, _add_export, _add_generate
from .plan import _add_plan
from .runs import _add_checkpoint, _add_plot, _add_summary, _add_train
from .topo import _add_topo

COMMANDS: list[Callable] = [
    _add_train,
    _add_plan,
    _add_checkpoint,
    _add_topo,
    _add_plot,
    _add_summary,
    _add_preprocess,
    _add_data,
    _add_train_tokenizer,
    _add_eval,
    _add_generate,
    _add_export,
]


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (sub-commands registered by COMMANDS)."""
    parser = OneLineParser(
        prog="mt3d",
        description="3D-parallel (tensor x pipeline x ZeRO data) LLM training on DeepSpeed.",
        epilog="Run 'mt3d <command> --help' for a command's options and examples.",
    )
    # `deepspeed --module mt3d train ...` puts the launcher's --local_rank before the sub-command
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run, and turn known bad-input errors into one line + exit code 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    import warnings

    # Layout notes are part of every report; no need to repeat them as Python warnings.
    warnings.filterwarnings("ignore", message="mt3d topology")
    try:
        return int(args.func(args) or 0)
    except KNOWN_ERRORS as e:
        print(f"mt3d {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # `mt3d topo ... | head`: the reader left, nothing is wrong
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
