"""The base of every spec section and the checks the sections share."""

from __future__ import annotations

import math
from typing import Any

from .errors import require


class Section:
    """Base of every spec section: mutable while OmegaConf builds it, read-only once `freeze`d by the compiler."""

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"the spec is frozen once compiled; cannot set {type(self).__name__}.{name}")
        object.__setattr__(self, name, value)

    def freeze(self) -> None:
        """Make this section and its nested sections read-only."""
        for value in vars(self).values():
            if isinstance(value, Section):
                value.freeze()
        object.__setattr__(self, "_frozen", True)


def positive(value: float, where: str) -> None:
    require(value > 0, where, f"must be > 0, got {value}", f"set {where} to a positive value")


def non_negative(value: float, where: str) -> None:
    require(value >= 0, where, f"must be >= 0, got {value}", f"set {where} to 0 or more")


def finite(value: float, where: str) -> None:
    require(math.isfinite(value), where, f"must be a finite number, got {value}", f"set {where} to a finite number")
