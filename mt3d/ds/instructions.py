"""The pipeline engine's instruction table: the one place mt3d wraps its handlers (the overlap, the
logits release, the bubble and overlap benchmarks). A leaf of the door: it imports nothing of mt3d."""

from __future__ import annotations


def wrap_instructions(engine, wrap) -> None:
    """Replace each handler of a pipeline engine's instruction table by ``wrap(instruction, handler)``
    (the handler itself where nothing changes), on this engine instance only. DeepSpeed dispatches
    ``self._INSTRUCTION_MAP[type(cmd)](self, **cmd.kwargs)``, a class-level table looked up on the
    instance (tests/test_overlap.py watches that line): the instance's copy overrides the class's, and
    each call wraps what the previous ones left, so the wrappers compose. The one home of that table
    for mt3d (the overlap, the logits release, the bubble and overlap benchmarks)."""
    engine._INSTRUCTION_MAP = {kind: wrap(kind, fn) for kind, fn in engine._INSTRUCTION_MAP.items()}
