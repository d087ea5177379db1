"""Input dims the capture fixed, said at shard() time and checked on every call.

torch.export makes every input dim marked Dim.AUTO dynamic unless it cannot: an example size of
0 or 1 is fixed, and model code that needs an exact size (a bias table built for the length,
a check against a weight's size) fixes it too. A fixed dim means the rank graphs accept only
that size, so shard() warns about the ones a user would expect to vary (sizes 0 and 1, any dim
of an integer input such as token ids, the leading dims of a float input unless a weight has
that size), and every fixed dim gets a run-time check that names it (ops/guards.InputGuard); where users
call rank graphs, a size the check refuses is captured again (runtime/shape_cache.py).
"""
from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from tpcompile.errors import TPCompileWarning
from tpcompile.ops.guards import ExportGuards, FixedDim, InputGuard


def fixed_dims(gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[FixedDim, ...]:
    """Every input dim the captured graph fixed (placeholders in the order of the flattened inputs)."""
    leaves = pytree.tree_leaves((args, kwargs))
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(leaves) != len(holders):
        return ()
    out = []
    for i, (node, example) in enumerate(zip(holders, leaves)):
        val = node.meta.get("val")
        if not isinstance(example, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        for d, (size, got) in enumerate(zip(example.shape, val.shape)):
            if _is_fixed(got):
                cause = (f"the example has size {size} there, and torch.export fixes dims of size 0 and 1"
                         if size in (0, 1) else "the model's code needs this exact size")
                out.append(FixedDim(node.name, i, d, int(size), cause))
    return tuple(out)


def _is_fixed(size: object) -> bool:
    """An int, or a symbolic size the capture replaced by a number."""
    if isinstance(size, torch.SymInt):
        return bool(size.node.expr.is_number)
    return isinstance(size, int)


def warn_fixed(fixed: tuple[FixedDim, ...], args: tuple, kwargs: dict, model: nn.Module) -> None:
    """One TPCompileWarning per fixed dim a user would expect to vary, naming the input, dim, size and cause."""
    leaves = pytree.tree_leaves((args, kwargs))
    weight_sizes = {int(s) for p in model.parameters() for s in p.shape}
    for f in fixed:
        if _surprising(f, leaves[f.index], weight_sizes):
            # a size of 0 or 1 is export's choice; any other size is the code's, and another example only moves it
            advice = ("If it should vary, shard with an example of size 2 or more in that dim (and different from "
                      "the other dims' sizes)" if f.size in (0, 1) else
                      "Another example size would be fixed the same way; to run without a capture per size, "
                      "change the code that needs it")
            warnings.warn(
                f"{type(model).__name__}: input {f.input!r} dim {f.dim} is fixed at {f.size} ({f.cause}); the "
                f"rank graphs take only that size there, and tpcompile.simulate and tpcompile.parallelize capture "
                f"and shard the model again for each other size at its first call (docs/runtime.md, 'Other input "
                f"shapes'). {advice}", TPCompileWarning, stacklevel=4)


def _surprising(f: FixedDim, example: torch.Tensor, weight_sizes: set[int]) -> bool:
    """A fixed dim a user would expect to vary: size 0/1, any dim of token ids, a float input's batch,
    or a float input's inner dim (not its last, the features) that no weight has the size of."""
    if f.size in (0, 1) or not (example.is_floating_point() or example.is_complex()):
        return True
    return f.dim < example.dim() - 1 and (f.dim == 0 or f.size not in weight_sizes)


def guard_dims_fixed_later(gm: fx.GraphModule, args: tuple, kwargs: dict, name: str) -> None:
    """Input dims fixed after the capture (a pass that compared a symbolic size with a number fixes it at the example's
    size): added to the input guard, with a TPCompileWarning, so that other sizes are refused (captured again where
    users call rank graphs) rather than run on graphs built for the example's size."""
    guard = getattr(gm, "_tpcompile_input_guard", None)
    if not isinstance(guard, InputGuard):
        return
    known = {(f.index, f.dim) for f in guard.fixed}
    cause = "a sharding pass compared it with a size of the model, which fixed it"
    new = tuple(replace(f, cause=cause) for f in fixed_dims(gm, args, kwargs) if (f.index, f.dim) not in known)
    guard.fixed += new
    for f in new:
        warnings.warn(f"{name}: input {f.input!r} dim {f.dim} was dynamic in the capture, but sharding fixed it at "
                      f"{f.size} ({cause}); the rank graphs take only that size there, and tpcompile.simulate and "
                      f"tpcompile.parallelize shard again for each other size. Please report it with the model",
                      TPCompileWarning, stacklevel=3)


def install_guards(gm: fx.GraphModule, fixed: tuple[FixedDim, ...], autocast: tuple) -> None:
    """Call an InputGuard right after the inputs; wrap torch.export's own guards (their failures become TPCompileErrors)."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    gm.add_module("_tpcompile_input_guard", InputGuard(fixed, autocast))
    if isinstance(getattr(gm, "_guards_fn", None), nn.Module):
        gm._guards_fn = ExportGuards(gm._guards_fn)
    anchor = holders[-1] if holders else next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(anchor):
        gm.graph.call_module("_tpcompile_input_guard", tuple(holders))
    gm.recompile()
