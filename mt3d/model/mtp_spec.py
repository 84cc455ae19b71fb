"""``model.mtp``, parsed: how many multi-token-prediction depths and their loss weight (the modules are
``mt3d.model.mtp``; this module imports no model code, so ``ModelConfig`` can parse with it)."""

from __future__ import annotations

from dataclasses import dataclass

from .options import ModelConfigError

MTP_KEYS = ("layers", "loss_weight")


@dataclass(frozen=True)
class MtpSpec:
    """The parsed ``model.mtp`` option: D depths, their loss weight (the sum over depths is divided by D)."""

    layers: int
    loss_weight: float = 0.1

    @classmethod
    def parse(cls, d) -> MtpSpec:
        """From the config dict; one-line errors for unknown keys and bad values."""
        if not isinstance(d, dict):
            raise ModelConfigError(f'model.mtp must be {{"layers": D, "loss_weight": w}}, got {d!r}')
        unknown = sorted(set(d) - set(MTP_KEYS))
        if unknown:
            raise ModelConfigError(f"model.mtp: unknown keys {unknown}; valid: {list(MTP_KEYS)}")
        layers, w = d.get("layers"), d.get("loss_weight", cls.loss_weight)
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ModelConfigError(f"model.mtp.layers must be an integer >= 1, got {layers!r}")
        if isinstance(w, bool) or not isinstance(w, int | float) or not w > 0:
            raise ModelConfigError(f"model.mtp.loss_weight must be a positive number, got {w!r}")
        return cls(layers, float(w))

    def params(self, cfg, ep: int = 1) -> int:
        """Parameters of the D depths (the shared embedding and head not counted again; with ``ep`` the
        routed experts one expert-parallel rank holds)."""
        one = 2 * cfg.hidden * cfg.hidden + 3 * cfg.hidden * (2 if cfg.norm == "layernorm" else 1)
        return sum(one + cfg.block_params(cfg.layers + k, ep=ep) for k in range(self.layers))
