"""Fingerprints of what a rank is about to run: its tensors, its captured graph and its plan, as comparable records.

The startup agreement (runtime/agreement.py) exchanges these between ranks before any collective of
the model runs. Each record is canonical: nothing in it depends on the process (object ids, the
device index, file paths), so equal models on different ranks give equal records, and the first
unequal record says where two ranks differ.

- `TensorEntry`: a parameter or buffer by name, shape and dtype, and (for real tensors) a cheap
  fingerprint of its values: the sum and sum of squares (float32 for floating tensors), and a hash
  of up to SAMPLE evenly strided elements. Never a copy of the tensor.
- `graph_lines`: one line per captured node: op, target, arguments (other nodes by the hash of their
  own line, devices by type), the module that traced it, and for inputs their dtype and rank; compared
  as a multiset, so the order of independent nodes does not matter.
- `plan_lines`: one line per parameter's split and per module's role, and the user's overrides.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.pass_context import module_path

__all__ = ["SAMPLE", "TensorEntry", "digest", "first_difference_at", "graph_digest", "graph_lines", "plan_lines",
           "tensor_entries", "values_differ"]

SAMPLE = 1024  # elements hashed per tensor (evenly strided, the last one included)
CHUNK = 1 << 22  # elements summed at a time (a half-precision chunk is widened to float32: 16 MiB)
# Two float32 sums of the same values added in another order (another thread count) differ by about 1e-7.
SUM_RTOL = 1e-5


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a rank holds it: name, shape, dtype, and its values' fingerprint (None on meta)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    stats: Optional[tuple[float, float]] = None  # sum, sum of squares
    sample: Optional[str] = None  # hash of the sampled elements' bytes

    def layout(self) -> tuple[str, tuple[int, ...], str]:
        """What must agree exactly between ranks: name, shape and dtype."""
        return self.name, self.shape, self.dtype

    def describe(self) -> str:
        return f"{self.name} ({'x'.join(map(str, self.shape)) or 'scalar'} {self.dtype.removeprefix('torch.')})"


def tensor_entries(named: Iterable[tuple[str, torch.Tensor]], *, values: bool) -> list[TensorEntry]:
    """The entries of named tensors (tied names each listed); value fingerprints when `values` and not on meta."""
    named = list(named)
    real = [t.detach() for _, t in named if values and not t.is_meta]
    stats = _stats(real) if real else []
    it = iter(stats)
    out = []
    for name, t in named:
        s, sample = next(it) if values and not t.is_meta else (None, None)
        out.append(TensorEntry(name, tuple(int(d) for d in t.shape), str(t.dtype), s, sample))
    return out


def _stats(tensors: list[torch.Tensor]) -> list[tuple[tuple[float, float], str]]:
    """Per tensor (sum, sum of squares) and a hash of its sampled elements; one device-to-host copy each."""
    sums, samples = [], []
    for t in tensors:
        flat = t.reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        acc = torch.zeros(2, dtype=torch.float64, device=flat.device)
        for part in flat.split(CHUNK):  # a copy of one chunk at a time at most, never of the whole tensor
            if part.is_floating_point():  # float32 sums: 40x faster than float64 on a CPU, exact enough here
                part = part.float()
                acc += torch.stack([part.sum(), torch.dot(part, part)]).double()
            else:
                wide = part.to(torch.float64)
                acc += torch.stack([wide.sum(), wide.square().sum()])
        sums.append(acc)
        step = max(1, flat.numel() // SAMPLE)
        picked = torch.cat([flat[::step][:SAMPLE], flat[-1:]]) if flat.numel() else flat
        samples.append(picked.contiguous().view(torch.uint8))  # the bytes (bfloat16 has no numpy type)
    host = torch.stack(sums).cpu().tolist() if sums else []
    sizes = [s.numel() for s in samples]
    raw = torch.cat(samples).cpu().numpy().tobytes() if samples else b""
    hashes, at = [], 0
    for n in sizes:
        hashes.append(hashlib.sha256(raw[at:at + n]).hexdigest()[:16])
        at += n
    return [((a, b), h) for (a, b), h in zip(host, hashes)]


def values_differ(a: TensorEntry, b: TensorEntry) -> bool:
    """True when two entries of one tensor hold different values (sums within SUM_RTOL count as equal)."""
    if a.stats is None or b.stats is None:
        return False
    return a.sample != b.sample or not all(math.isclose(x, y, rel_tol=SUM_RTOL) or (math.isnan(x) and math.isnan(y))
                                           for x, y in zip(a.stats, b.stats))


def _target(node: Node) -> str:
    """A node's target by name: 'aten.view.default', 'operator.getitem', a module or attribute path."""
    t = node.target
    if isinstance(t, str):
        return t
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(t)
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', repr(t))}"


def _canon(value: Any, ids: dict[Node, str]) -> str:
    """An argument in words that do not depend on the process: nodes by their hash, devices by type."""
    if isinstance(value, Node):
        return f"#{ids.get(value, '?')}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_canon(v, ids) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_canon(v, ids)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.device):
        return value.type
    if isinstance(value, torch.Tensor):
        return f"tensor({list(value.shape)}, {value.dtype})"
    if isinstance(value, slice):
        return f"slice({_canon(value.start, ids)}, {_canon(value.stop, ids)}, {_canon(value.step, ids)})"
    return repr(value)


def _input_val(node: Node) -> str:
    """An input's dtype and shape (symbols renamed afterwards: their numbers differ between captures)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ""
    return f" : {val.dtype} ({', '.join(str(d) for d in val.shape)})"


_SYMBOL = re.compile(r"\b[su]\d+\b")


def graph_lines(gm: GraphModule) -> list[str]:
    """One canonical line per node of a captured graph, in graph order: `#hash op target(args) @module`.

    A node's hash covers its op, target and arguments, other nodes by their own hashes (a Merkle hash of
    the dataflow), so two captures that order independent nodes differently (model code iterating a set,
    whose order follows Python's per-process hash seed) give the same lines in another order; compare
    them as a multiset (`graph_digest`). Symbols are renamed d0, d1, ... by first use in the inputs.
    """
    names: dict[str, str] = {}

    def rename(text: str, new: bool) -> str:
        return _SYMBOL.sub(lambda m: names.setdefault(m.group(0), f"d{len(names)}") if new or m.group(0) in names
                           else "d?", text)
    ids: dict[Node, str] = {}
    lines, inputs = [], 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            body, inputs = rename(f"placeholder {inputs}{_input_val(n)}", new=True), inputs + 1
        else:
            kwargs = f" {_canon(n.kwargs, ids)}" if n.kwargs else ""
            body = rename(f"{n.op} {_target(n)} {_canon(n.args, ids)}{kwargs}", new=False)
        body += f" @{module_path(n) or '-'}"
        ids[n] = hashlib.sha256(body.encode()).hexdigest()[:12]
        lines.append(f"#{ids[n]} {body}")
    return lines


def graph_digest(lines: list[str]) -> str:
    """The digest of a graph's lines as a multiset: the same for the same dataflow in any node order."""
    return digest(sorted(lines))


def plan_lines(plan: Any, overrides: Any = None, extra: Iterable[str] = ()) -> list[str]:
    """One line per parameter's split and per module's role (sorted), then the overrides and other options."""
    lines = [f"param {p.name} {p.role} dim={p.dim} segments={p.segments} {p.global_shape}->{p.local_shape} "
             f"padded={p.padded} pieces={p.pieces} seg_pieces={p.seg_pieces}" + (f" cuts={p.cuts}" if p.cuts else "")
             for p in plan.parameters.values()]
    lines += [f"module {m} {role}" for m, role in sorted(plan.modules.items())]
    lines += [f"override {k} {v}" for k, v in sorted((overrides or {}).items())]
    return lines + list(extra)


def digest(lines: Iterable[Any]) -> str:
    """A short hash of a list of records."""
    h = hashlib.sha256()
    for line in lines:
        h.update(repr(line).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def first_difference_at(lists: list[list[Any]]) -> tuple[int, int]:
    """(other rank, index) of the first record where a rank's list differs from rank 0's; (-1, -1) if none."""
    ref = lists[0]
    for r, other in enumerate(lists[1:], start=1):
        if other != ref:
            i = next((k for k, (a, b) in enumerate(zip(ref, other)) if a != b), min(len(ref), len(other)))
            return r, i
    return -1, -1
