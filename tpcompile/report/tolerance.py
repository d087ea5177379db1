"""A difference per rank against an allowed atol + rtol * scale: what every numerical check reports."""
from __future__ import annotations


class Tolerance:
    """Mixin for a check with `diffs` (per rank), `scale`, `atol` and `rtol`: the allowed and the worst difference."""

    diffs: list[float]
    scale: float
    atol: float
    rtol: float

    @property
    def allowed(self) -> float:
        return self.atol + self.rtol * self.scale

    @property
    def worst(self) -> float:
        return max(self.diffs, default=0.0)
