"""The one error every MODEL, --model-config and --inputs mistake raises."""

from __future__ import annotations

__all__ = ["SpecError"]


class SpecError(ValueError):
    """A MODEL, --model-config or --inputs spec that does not resolve; the message says how to fix it."""
