"""What the zoo's model families share: argument checks, config overrides, the example seed."""

from __future__ import annotations

import dataclasses

__all__ = ["EXAMPLE_SEED", "check_positive", "replace_fields"]

# Example inputs come from their own generator so that asking for them never moves the global
# RNG, which would change the initialization of a model built afterwards.
EXAMPLE_SEED = 1234


def check_positive(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if not (isinstance(value, int) and value > 0):
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def replace_fields(cfg, overrides: dict):
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(
            f"unknown {type(cfg).__name__} field(s) {unknown}; valid fields: {sorted(fields)}"
        )
    return dataclasses.replace(cfg, **overrides)
