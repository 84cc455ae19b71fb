"""``mt3d checkpoint info``: what a checkpoint (or every checkpoint of a run) is, and whether it is usable."""

from __future__ import annotations

from pathlib import Path

from ..parallel.axes import NAMES, shown
from .manager import TAG_RE, checkpoints_dir
from .manifest import CheckpointError, check_sizes, read_manifest, verify_files


def describe_checkpoint(path: str | Path, verify: bool = True) -> dict:
    """Status (complete / incomplete / corrupt), step, layout, model and size of one checkpoint dir."""
    p = Path(path)
    size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    out: dict = {"path": str(p), "tag": p.name, "bytes": size}
    try:
        manifest = read_manifest(p)
    except CheckpointError as e:
        return {**out, "status": "incomplete", "problem": str(e)}
    meta = manifest["meta"]
    out.update(
        step=meta.get("step"),
        layout=meta.get("layout"),
        model=meta.get("model", {}).get("name"),
        params=_params(meta),
        precision=meta.get("precision"),
        files=len(manifest["files"]),
    )
    try:
        check_sizes(p, manifest)
        if verify:
            verify_files(p, manifest, sorted(manifest["files"]))
    except CheckpointError as e:
        return {**out, "status": "corrupt", "problem": str(e)}
    return {**out, "status": "complete" if verify else "complete (sizes checked, not hashed)"}


def _params(meta: dict) -> int | None:
    from ..model.config import ModelConfig

    try:
        return ModelConfig.from_dict(meta["model"]).num_params(meta.get("vocab_size"))
    except Exception:
        return None


def describe(path: str | Path, verify: bool = True) -> list[dict]:
    """One checkpoint dir, or every checkpoint (complete or not) of a run dir / checkpoints dir."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"not found: {p}")
    if (p / "manifest.json").is_file() or TAG_RE.match(p.name) or p.name.endswith(".tmp"):
        return [describe_checkpoint(p, verify)]
    root = p if p.name == "checkpoints" else checkpoints_dir(p)
    dirs = sorted(d for d in root.glob("step_*") if d.is_dir()) if root.is_dir() else []
    if not dirs:
        raise CheckpointError(f"no checkpoints under {p}")
    return [describe_checkpoint(d, verify) for d in dirs]


def format_rows(rows: list[dict]) -> str:
    """Human-readable lines."""
    lines = []
    for r in rows:
        gb = r["bytes"] / 1e9
        if r["status"] == "incomplete":
            lines.append(f"{r['tag']:<22} INCOMPLETE  {gb:8.3f} GB  ({r['problem']})")
            continue
        lay = r.get("layout") or {}
        degrees = " ".join(f"{a} {lay.get(a, 1)}" for a in shown({a: lay.get(a, 1) for a in NAMES}))
        v = f" v {lay['virtual_stages']}" if lay.get("virtual_stages", 1) > 1 else ""
        line = (
            f"{r['tag']:<22} {r['status'].upper():<10}  {gb:8.3f} GB  step {r['step']}  "
            f"{degrees}{v} zero {lay.get('zero_stage')}  "
            f"model {r['model']} ({(r['params'] or 0) / 1e6:.2f}M params, {r['precision']})"
        )
        if r["status"] == "corrupt":
            line += f"\n{'':<22} problem: {r['problem']}"
        lines.append(line)
    return "\n".join(lines)
