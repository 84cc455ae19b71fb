"""Checkpoint manifests: what a complete checkpoint contains, and checks against it.

A checkpoint directory is complete only when its ``manifest.json`` exists and every file it lists
has the listed size and sha256. The manifest is written last (after every rank's files were
fsynced), so a checkpoint interrupted at any point has no manifest, or files that disagree with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import CheckpointError, UserError  # noqa: F401 - CheckpointError: re-exported
from ..inputs import entry_inside

MANIFEST = "manifest.json"
FORMAT = "mt3d-checkpoint-1"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (after creating or renaming something in it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(root: Path) -> list[str]:
    """Every regular file under ``root`` (relative, sorted), the manifest excluded."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _workers(n: int) -> int:
    return max(1, min(n, 8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 4))


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """fsync each file and record its size and sha256 (files hashed in parallel threads:
    hashlib releases the GIL, so large checkpoints hash at several cores' speed)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(rel: str) -> tuple[str, dict]:
        p = root / rel
        fsync_file(p)
        return rel, {"size": p.stat().st_size, "sha256": sha256_file(p)}

    with ThreadPoolExecutor(_workers(len(names))) as pool:
        return dict(pool.map(one, names))


def write_manifest(root: Path, files: dict[str, dict], meta: dict) -> None:
    """Write ``manifest.json`` atomically (temp file, fsync, rename, fsync dir)."""
    data = {"format": FORMAT, "files": files, "meta": meta}
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)
    fsync_dir(root)


def read_manifest(root: Path) -> dict:
    """The manifest of a checkpoint directory (CheckpointError if missing or unreadable)."""
    p = Path(root) / MANIFEST
    if not p.is_file():
        raise CheckpointError(f"{root} is incomplete: no {MANIFEST} (interrupted while saving?)")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{p} is corrupt (not valid JSON)") from None
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or not isinstance(data.get("files"), dict)
        or not isinstance(data.get("meta"), dict)
        or not all(isinstance(v, dict) and {"size", "sha256"} <= v.keys() for v in data["files"].values())
    ):
        raise CheckpointError(f"{p}: not an mt3d checkpoint manifest")
    for name in data["files"]:
        entry_inside(root, name, str(p), CheckpointError)
    return data


def manifest_digest(root: Path) -> str:
    """sha256 of a checkpoint's manifest file: names the exact content the checkpoint had."""
    return sha256_file(Path(root) / MANIFEST)


def verify_everywhere(root: Path, manifest: dict) -> None:
    """sha256 of every file against the manifest, each rank a share (collective); raises on every
    rank alike, so no rank goes on to use a checkpoint another rank found corrupt."""
    import torch.distributed as dist

    names = sorted(manifest["files"])
    rank, world = dist.get_rank(), dist.get_world_size()
    error = ""
    try:
        verify_files(root, manifest, names[rank::world])
    except CheckpointError as e:
        error = str(e)
    errors: list = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def check_sizes(root: Path, manifest: dict) -> None:
    """Fast check: every listed file exists with its size."""
    for rel, want in manifest["files"].items():
        p = Path(root) / rel
        if not p.is_file():
            raise CheckpointError(f"{p} is missing from checkpoint {root}")
        if p.stat().st_size != want["size"]:
            raise CheckpointError(
                f"{p} has {p.stat().st_size} bytes, manifest says {want['size']} (truncated or replaced)"
            )


def verify_files(root: Path, manifest: dict, names: list[str]) -> None:
    """Full check of ``names``: size and sha256 against the manifest."""
    for rel in names:
        want = manifest["files"][rel]
        p = Path(root) / rel
        if not p.is_file():
            raise CheckpointError(f"{p} is missing from checkpoint {root}")
        if p.stat().st_size != want["size"]:
            raise CheckpointError(f"{p} has {p.stat().st_size} bytes, manifest says {want['size']}")
        if sha256_file(p) != want["sha256"]:
            raise CheckpointError(
                f"{p} is corrupted (sha256 differs from the manifest); use an older checkpoint"
            )
