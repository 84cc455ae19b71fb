"""What a training run shows: mt3d's lines on rank 0's terminal, DeepSpeed's in the run's log.

DeepSpeed logs through its own "DeepSpeed" logger (its own stdout handler, not propagated) and
prints some lines directly while it sets up (op builds, the pipeline topology, the seeds); with
eight ranks every one of them appears eight times before mt3d's first line. Unless ``--verbose``
is given, those go to ``<save_dir>/logs/rank<N>.log`` instead, and a few warnings users cannot act
on are dropped everywhere (``KNOWN_NOISE``).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from pathlib import Path

from ..inputs import env_int

KNOWN_NOISE = (
    # WarmupLR/WarmupCosineLR call get_lr() in their constructor, before the first step
    "Attempting to get learning rate from scheduler before it has started",
)


def _not_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(noise in message for noise in KNOWN_NOISE)


def quiet_known_warnings() -> None:
    """Silence warnings that the pinned DeepSpeed triggers on torch 2.13 and users cannot act on."""
    # DeepSpeed's PartitionedTensor and ZeRO call the deprecated name of all_gather_single.
    warnings.filterwarnings(
        "ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning
    )


def configure_logging(verbose: bool = False) -> None:
    """mt3d's log lines (``[mt3d] ...``) on rank 0, warnings on every rank; DeepSpeed's noise dropped."""
    rank = env_int("RANK", 0)
    logging.basicConfig(level=logging.INFO, format="[mt3d] %(message)s")
    logging.getLogger("mt3d").setLevel(logging.INFO if rank == 0 or verbose else logging.WARNING)
    ds = logging.getLogger("DeepSpeed")
    if _not_noise not in ds.filters:
        ds.addFilter(_not_noise)
    quiet_known_warnings()


@contextlib.contextmanager
def deepspeed_output(save_dir: str | Path, verbose: bool):
    """While open, DeepSpeed's logger and anything printed to stdout go to this rank's log file
    (the set-up phase); afterwards DeepSpeed's logger keeps writing there. No-op when verbose."""
    if verbose:
        yield None
        return
    rank = env_int("RANK", 0)
    path = Path(save_dir) / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "a", buffering=1)  # noqa: SIM115 - kept open for the rest of the run
    ds = logging.getLogger("DeepSpeed")
    for h in list(ds.handlers):
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.stderr):
            ds.removeHandler(h)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d] %(message)s")
    )
    ds.addHandler(handler)
    with contextlib.redirect_stdout(stream):
        yield path
