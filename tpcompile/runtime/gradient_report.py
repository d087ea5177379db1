"""What check_gradients found: the loss and every parameter's gradient per rank against the original's, in words."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tpcompile.report.tolerance import Tolerance


def _ratio(worst: float, allowed: float) -> float:
    """How far a difference is into (below 1) or past (above 1) its tolerance."""
    return worst / allowed if allowed else (0.0 if worst == 0 else math.inf)


@dataclass
class LossCheck(Tolerance):
    """The loss of every rank against the original's loss."""

    reference: float
    losses: list[float]  # per rank: its loss as a whole (a split output's terms summed over the ranks)
    scale: float  # the sum of |terms| of the reference loss: what a sum's rounding grows with
    atol: float
    rtol: float

    @property
    def diffs(self) -> list[float]:
        return [abs(x - self.reference) if math.isfinite(x) else math.inf for x in self.losses]

    @property
    def ok(self) -> bool:
        return self.worst <= self.allowed

    def describe(self) -> str:
        """'loss 3.1416 (original): max |diff| 2.4e-07, allowed 1.2e-04 (rank 0 2.4e-07, ...)'."""
        ranks = ", ".join(f"rank {r} {d:.2e}" for r, d in enumerate(self.diffs))
        return (f"loss {self.reference:.6g} (original): max |diff| {self.worst:.2e}, allowed {self.allowed:.1e} "
                f"= atol {self.atol:g} + rtol {self.rtol:g} x sum |terms| {self.scale:.3g} ({ranks})")


@dataclass
class GradientCheck(Tolerance):
    """One parameter: its gradient on every rank against that rank's slice of the original's gradient."""

    name: str
    tied: tuple[str, ...]  # other names of the same parameter
    shape: tuple[int, ...]  # the original's
    split: str  # how the plan cuts it ('column@0 64|64|64', 'replicated')
    diffs: list[float]  # per rank, largest |difference| (inf where there is nothing to compare)
    scale: float  # max |original gradient|
    atol: float
    rtol: float
    problems: dict[int, str] = field(default_factory=dict)  # rank -> why its gradient cannot be compared
    unused: str = ""  # why no side has a gradient ('frozen (requires_grad=False)', ...); '' when compared

    @property
    def bad_ranks(self) -> list[int]:
        return [r for r, d in enumerate(self.diffs) if r in self.problems or not d <= self.allowed]

    @property
    def ok(self) -> bool:
        return not self.bad_ranks

    @property
    def title(self) -> str:
        return " = ".join((self.name, *self.tied))

    def describe(self) -> str:
        """'h.0.mlp.c_fc.weight (256x64, column@0): max |grad diff| 1.2e-07, allowed 1.1e-05 (rank 0 ...)'."""
        shape = "x".join(map(str, self.shape)) or "scalar"
        head = f"{self.title} ({shape}, {self.split})"
        if self.unused:
            return f"{head}: no gradient on the original or any rank: {self.unused}"
        ranks = ", ".join(f"rank {r} {d:.2e}" for r, d in enumerate(self.diffs))
        text = f"{head}: max |grad diff| {self.worst:.2e}, allowed {self.allowed:.1e} ({ranks})"
        if self.bad_ranks:
            text += f"; MISMATCH on rank{'s' if len(self.bad_ranks) > 1 else ''} " + \
                    ", ".join(map(str, self.bad_ranks))
        return text + "".join(f"; rank {r}: {why}" for r, why in sorted(self.problems.items()))


@dataclass
class GradientReport:
    """The outputs, the loss and every parameter's gradient of one forward and backward, rank by rank."""

    world_size: int
    loss: LossCheck
    outputs: list[Any]  # tpcompile.cli.compare.OutputCheck per output tensor
    gradients: list[GradientCheck]

    @property
    def mismatches(self) -> list[GradientCheck]:
        """The parameters whose gradient differs on some rank, worst first."""
        bad = [g for g in self.gradients if not g.ok]
        return sorted(bad, key=lambda g: (not g.problems, -_ratio(g.worst, g.allowed)))

    @property
    def ok(self) -> bool:
        return self.loss.ok and all(o.ok for o in self.outputs) and not self.mismatches

    def lines(self) -> list[str]:
        """One line per output, the loss, one per parameter, then the verdict."""
        from tpcompile.cli.verify import describe  # verify's own wording of an output line
        return [*map(describe, self.outputs), self.loss.describe(), *(g.describe() for g in self.gradients),
                self.verdict()]

    def verdict(self) -> str:
        """'OK: ...' with the gradient nearest to its tolerance, or 'FAIL: ...' naming the worst parameter and rank."""
        used = [g for g in self.gradients if not g.unused]
        counts = (f"over {self.world_size} ranks, {len(used)} parameter gradient{'' if len(used) == 1 else 's'} and "
                  f"{len(self.outputs)} output{'' if len(self.outputs) == 1 else 's'}")
        if self.mismatches:
            g = self.mismatches[0]
            r = max(g.bad_ranks, key=lambda k: (k in g.problems, g.diffs[k]))
            why = g.problems.get(r) or (f"max |grad diff| {g.diffs[r]:.2e} > {g.allowed:.2e} = atol {g.atol:g} + "
                                        f"rtol {g.rtol:g} x max |grad| {g.scale:.3g}")
            more = len(self.mismatches) - 1
            where = f"rank{'s' if len(g.bad_ranks) > 1 else ''} {', '.join(map(str, g.bad_ranks))}"
            others = {0: "no other parameter differs", 1: "1 other parameter differs"}.get(
                more, f"{more} other parameters differ")
            return f"FAIL: gradient of {g.title} on rank {r}: {why} (differs on {where}; {others}) {counts}"
        if not self.loss.ok:
            return (f"FAIL: loss differs by {self.loss.worst:.2e} > {self.loss.allowed:.2e} from the original's "
                    f"{self.loss.reference:.6g} {counts}")
        bad_out = [o for o in self.outputs if not o.ok]
        if bad_out:
            o = bad_out[0]
            return f"FAIL: output {o.path} differs by {o.worst:.2e} > {o.allowed:.2e} {counts}"
        if not used:
            return f"OK: the loss agrees; no parameter gets a gradient {counts}"
        g = max(used, key=lambda c: _ratio(c.worst, c.allowed))
        return (f"OK: every gradient agrees; closest: max |grad diff| {g.worst:.2e} <= {g.allowed:.2e} = atol "
                f"{g.atol:g} + rtol {g.rtol:g} x max |grad| {g.scale:.3g} ({g.title}) {counts}")

    def __str__(self) -> str:
        return "\n".join(self.lines())
