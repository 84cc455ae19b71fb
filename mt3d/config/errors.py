"""The error of a configuration that cannot run."""

from __future__ import annotations

from ..errors import UserError


class ConfigError(UserError):
    """A configuration that cannot run; the message is one actionable line."""
