"""Versions: mt3d's own, and DeepSpeed's (pinned in one place, setup.cfg's requirement, and read back
from the installed metadata; messages name the running one). A base module: the config rules, the
door (``mt3d.ds``) and run metadata all read it."""

from __future__ import annotations

import functools

__version__ = "0.1.0"


@functools.cache
def running_version() -> str:
    """The DeepSpeed version this process runs."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:  # pragma: no cover - deepspeed is a hard requirement
        return "unknown"


@functools.cache
def pinned_version() -> str | None:
    """The DeepSpeed version mt3d's package requires (``deepspeed==X`` in setup.cfg), or None."""
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("mt3d") or []
    except PackageNotFoundError:
        return None
    for req in reqs:
        m = re.match(r"deepspeed\s*==\s*([\w.]+)", req)
        if m:
            return m.group(1)
    return None
