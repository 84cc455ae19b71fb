"""Reading what users hand mt3d: command-line numbers, launcher environment variables, JSON and
text files. Each reader turns bad input into one ``UserError`` line naming the flag, variable or
file (exit code 2), instead of a traceback from wherever the value is first used.

Light on purpose (no torch, no DeepSpeed): the CLI and ``mt3d.train`` use it before anything
heavy is imported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .errors import EXIT_BAD_INPUT, UserError

MAX_WORLD = 2**20
"""The largest world mt3d maps or plans for (1,048,576 ranks); bigger counts are refused."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr (``prog: error: ...``) and exit code 2."""

    def error(self, message: str):
        """Print the error without the usage block and exit with the bad-input code."""
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: a comma-separated list of integers >= 1 ("1,2,4")."""
    values = tuple(positive_int(x.strip()) for x in text.split(","))
    return values


def optional_positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: a comma-separated list of integers >= 1, or "" for none."""
    return positive_ints(text) if text.strip() else ()


def choices_list(allowed: tuple, what: str):
    """argparse type: a comma-separated list of values among ``allowed`` (ints when they are ints:
    "0,1"; names otherwise: "none,opt-cpu")."""

    def parse(text: str) -> tuple:
        words = tuple(x.strip() for x in text.split(","))
        by_text = {str(a): a for a in allowed}
        bad = [w for w in words if w not in by_text]
        if bad:
            raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(by_text)}, got {bad[0]!r}")
        return tuple(by_text[w] for w in words)

    return parse


def world_size(text: str) -> int:
    """argparse type: a rank or GPU count, 1 .. MAX_WORLD."""
    v = positive_int(text)
    if v > MAX_WORLD:
        raise argparse.ArgumentTypeError(f"{v} exceeds mt3d's limit of {MAX_WORLD} ranks")
    return v


def positive_float(text: str, least: float = 0.0, inclusive: bool = False) -> float:
    """argparse type: a number > 0 (>= / > ``least`` as asked)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if not (v >= least if inclusive else v > least):
        raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {least:g}, got {text}")
    return v


def nonnegative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    return positive_float(text, 0.0, inclusive=True)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def byte_size(text: str) -> str:
    """argparse type: a size like ``5GB``, ``500MB``, ``2GiB`` or a byte count (returned as given)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size like 5GB, 500MB or 2GiB, got {text!r}")
    return text.strip()


# --- the launcher's environment -----------------------------------------------------------------
def env_int(name: str, default: int | None = None, minimum: int = 0) -> int | None:
    """An integer environment variable set by the launcher (``default`` when unset or empty)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise UserError(
            f"environment variable {name}={raw!r} is not an integer >= {minimum} "
            "(the launcher sets it: unset it, or fix the launch command)"
        )
    return value


def launcher_world() -> int:
    """WORLD_SIZE as the launcher set it (1 when run without one)."""
    return env_int("WORLD_SIZE", 1, minimum=1)


def check_launcher(world: int) -> None:
    """Before processes meet: the launcher's variables agree. A stray WORLD_SIZE without RANK (left in
    a shell), a rank outside the world, or a MASTER_PORT that is no port would otherwise fail deep
    inside torch.distributed. (``mt3d train --check`` reads WORLD_SIZE alone: the world to check.)"""
    rank = env_int("RANK", None)
    if world > 1 and rank is None:
        raise UserError(
            f"WORLD_SIZE={world} is set but RANK is not: launch with deepspeed, torchrun or accelerate "
            "(they set both), or unset WORLD_SIZE for a single process"
        )
    if rank is not None and rank >= world:
        raise UserError(f"RANK={rank} is outside WORLD_SIZE={world}: fix the launch command")
    port = os.environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise UserError(f"environment variable MASTER_PORT={port!r} is not a TCP port (1-65535)")


# --- files ------------------------------------------------------------------------------------------
def read_text(path: str | Path, what: str = "text file") -> str:
    """A UTF-8 text file; a binary or mis-encoded one is refused with the offset of the first bad byte."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} not found: {p}")
    data = p.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{p} is not UTF-8 text (invalid byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def read_json(path: str | Path, what: str = "JSON file", expect: type | None = dict) -> Any:
    """A JSON file whose top level has type ``expect``; errors name the file, line and column."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} not found: {p}")
    try:
        value = json.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{p} is not UTF-8 JSON (invalid byte at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{p}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from None
    if expect is not None and not isinstance(value, expect):
        raise UserError(f"{p} must hold a JSON {expect.__name__}, got {type(value).__name__}")
    return value


def entry_inside(root: str | Path, entry: Any, listed_in: str, error: type[UserError] = UserError) -> Path:
    """The file ``entry`` names inside ``root`` (a name read from a file list: a checkpoint manifest,
    an NVMe swap index, an HF shard index), or ``error``.

    The one rule for every file list mt3d reads: an entry is a relative path whose real location,
    symbolic links followed, stays inside ``root``. An absolute path, ``..`` climbing out, or a link
    to another directory (another model, a secret) is refused with the list that named it.
    """
    if not isinstance(entry, str) or not entry or "\x00" in entry or Path(entry).is_absolute():
        raise error(f"{listed_in} lists {entry!r}, not a relative path inside {root}: refusing to read it")
    path = Path(root) / entry
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise error(
            f"{listed_in} lists {entry!r}, which leads outside {root} (to {real}): refusing to read it "
            "(a tampered or foreign file list; use a copy you trust)"
        )
    return path


def fail(prog: str, message: str) -> int:
    """Print ``prog: error: message`` as one line on stderr; returns the bad-input exit code."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def cached_digest(path: str | Path, cache_dir: str | Path) -> str:
    """sha256 of a whole file, read once per version of it: the digest is kept in ``cache_dir`` under
    the file's resolved path, size, inode and modification time, so a file changed in place (any
    byte) is hashed again, and the processes of one host hash a shared file once between them (the
    first holds a lock while it hashes; the others then read its digest)."""
    import fcntl
    import hashlib

    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    store = Path(cache_dir) / "digests"
    store.mkdir(parents=True, exist_ok=True)
    entry = store / key
    with open(store / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if entry.is_file():
            return entry.read_text().strip()
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(h.hexdigest())
        os.replace(tmp, entry)
        return h.hexdigest()
