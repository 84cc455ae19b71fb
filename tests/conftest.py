"""Shared test setup: one thread per process, offline W&B, and the distributed harness."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

import tempfile  # noqa: E402

# Corpora and sample indices built by the tests go to a fresh cache, set before any process is
# forked so that every spawned rank sees it.
if "MT3D_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="mt3d-test-cache-")
    os.environ["MT3D_CACHE"] = _CACHE

    def pytest_unconfigure(config):
        """Remove the session's corpus cache (only the controlling process made it)."""
        import shutil

        if os.getpid() == _OWNER:
            shutil.rmtree(_CACHE, ignore_errors=True)

    _OWNER = os.getpid()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """Single-process fp32 runs of the tiny GPT-2 and Llama (``helpers.tiny_config``): the reference
    every parity test compares a layout with, run once per session."""
    from mt3d.parallel.spawn import spawn

    from helpers import TINY_GPT, TINY_LLAMA, step_records, tiny_config, train_worker

    base = tmp_path_factory.mktemp("reference")
    return {
        name: step_records(spawn(train_worker, 1, tiny_config(base / name, model=model), timeout=300)[0])
        for name, model in (("gpt", TINY_GPT), ("llama", TINY_LLAMA))
    }
