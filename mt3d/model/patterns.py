"""Attention patterns: which keys each query of a layer sees (``LocalPattern``), the per-layer list a
``ModelConfig.attention`` spec describes (``layer_patterns``) and the keys counted for FLOPs. The
kernels that compute attention over these patterns are ``mt3d.model.attention``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import UserError


class AttentionConfigError(UserError):
    """An attention pattern that cannot be built; the message names the key."""


FULL, SLIDING = "full_attention", "sliding_attention"  # HF's layer_types names


@dataclass(frozen=True)
class LocalPattern:
    """Causal neighbourhood attention with window W, stride s and dilation d (NATTEN's causal na1d).

    For a sequence of n tokens, query i attends to key j exactly when

    * j is in i's dilation group: j = i (mod d); inside the group positions are counted as
      i' = i // d and j' = j // d, and the group holds n_g = ceil((n - i mod d) / d) tokens;
    * j' <= i' (causal), and
    * L - j' < W, where L = min(floor(i'/s)*s + s - 1, n_g - 1) is the leader of i's stride group
      (its last query, or the group's last token when the sequence ends inside the stride group).

    The queries of a stride group share where their window starts (L - W + 1, cut at 0), so only
    the leader sees W keys; query i' sees W - (L - i'). s = d = 1 is the sliding window (W keys up
    to and including the query: transformers' ``kv > q - W``); s = W is blocked attention (each
    query sees its own block of W, causally). Needs 1 <= s <= W and d >= 1.
    """

    window: int
    stride: int = 1
    dilation: int = 1

    def allowed(self, q: torch.Tensor, k: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """Which key positions ``k`` each query position ``q`` sees (broadcasting integer tensors) in
        a sequence of ``n`` tokens (None: no stride group is cut short by the end)."""
        d, s = self.dilation, self.stride
        qi, kj = q // d, k // d
        lead = qi if s == 1 else (qi // s) * s + (s - 1)
        if s > 1 and n is not None:
            lead = torch.minimum(lead, (n - q % d + d - 1) // d - 1)
        ok = (kj <= qi) & (lead - kj < self.window)
        return ok & ((q - k) % d == 0) if d > 1 else ok

    def history(self) -> int:
        """Past positions a future query can still see: what a generation cache must keep."""
        return self.window * self.dilation - 1

    def grouped(self) -> LocalPattern:
        """The pattern inside one dilation group (the group's tokens as a contiguous sequence)."""
        return replace(self, dilation=1)


def _positive_int(value, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AttentionConfigError(f"model.attention.{key} must be a positive integer, got {value!r}")
    return value


ATTENTION_KEYS = {
    "window": "keys each local query's window spans (W), itself included",
    "stride": "queries per stride group sharing one window start (1: sliding; W: blocked)",
    "dilation": "attend within every d-th token (d interleaved groups)",
    "layer_types": f"per layer '{SLIDING}' (local) or '{FULL}' (global), as in HF configs",
    "global_every": "every k-th layer (the k-th, 2k-th, ...) is global, the others local",
    "block": "query rows per tile of the block-local kernel (default: chosen from the pattern)",
    "kernel": "auto (flex on CUDA, block-local elsewhere), block-local, flex or dense",
}
KERNELS = ("auto", "block-local", "flex", "dense")


def layer_patterns(spec: dict | None, layers: int) -> list[LocalPattern | None]:
    """One entry per layer: its LocalPattern, or None for global causal attention.

    ``spec`` is ``ModelConfig.attention``: ``{"window": W, "stride": s, "dilation": d}`` (every
    layer local; stride and dilation default to 1), with ``"layer_types": [...]`` (HF names, one per
    layer) or ``"global_every": k`` to mix in global layers. None: every layer global.
    """
    if spec is None:
        return [None] * layers
    if not isinstance(spec, dict):
        raise AttentionConfigError(f"model.attention must be an object like {{'window': 256}}, got {spec!r}")
    unknown = sorted(set(spec) - set(ATTENTION_KEYS))
    if unknown:
        raise AttentionConfigError(
            f"unknown key model.attention.{unknown[0]} (valid: {', '.join(ATTENTION_KEYS)})"
        )
    if "window" not in spec:
        raise AttentionConfigError("model.attention needs 'window' (keys each local query sees)")
    window, stride, dilation = (_positive_int(spec.get(k, 1), k) for k in ("window", "stride", "dilation"))
    if stride > window:
        raise AttentionConfigError(
            f"model.attention.stride {stride} is larger than the window {window} "
            "(blocked attention is stride = window)"
        )
    local = LocalPattern(window, stride, dilation)
    if "block" in spec:
        _positive_int(spec["block"], "block")
    if spec.get("kernel", "auto") not in KERNELS:
        raise AttentionConfigError(f"model.attention.kernel must be one of {KERNELS}, got {spec['kernel']!r}")
    if "layer_types" in spec and "global_every" in spec:
        raise AttentionConfigError("model.attention: give layer_types or global_every, not both")
    if "global_every" in spec:
        k = _positive_int(spec["global_every"], "global_every")
        if k > layers:
            raise AttentionConfigError(
                f"model.attention.global_every {k} is larger than the {layers} layers: no layer would be "
                f"global (use a value <= {layers}, or drop global_every for an all-local model)"
            )
        return [None if (i + 1) % k == 0 else local for i in range(layers)]
    types = spec.get("layer_types")
    if types is None:
        return [local] * layers
    if not isinstance(types, list) or len(types) != layers:
        got = len(types) if isinstance(types, list) else repr(types)
        raise AttentionConfigError(f"model.attention.layer_types must list {layers} layers, got {got}")
    bad = [t for t in types if t not in (FULL, SLIDING)]
    if bad:
        raise AttentionConfigError(
            f"model.attention.layer_types: unknown type {bad[0]!r} (use {SLIDING!r} or {FULL!r})"
        )
    return [local if t == SLIDING else None for t in types]


def keys_per_query(pattern: LocalPattern | None, seq_len: int) -> float:
    """Keys a query attends to in a ``seq_len`` sequence, as counted for model FLOPs: ``seq_len`` for
    global layers (the Narayanan et al. convention) and the pattern's mean for local ones (W for a
    sliding window; W - (s - 1) / 2 with stride s, whose queries see W - (L - i) keys)."""
    if pattern is None:
        return seq_len
    return min(seq_len, pattern.window - (pattern.stride - 1) / 2)
