"""check_gradients: one forward and backward of every simulated rank against the original model on the same inputs.

The default loss is the sum over every floating output tensor of (output * R).sum(), R a fixed standard
normal tensor drawn from `seed` per output: every output element gets its own random weight, so no
parameter's gradient is trivially zero or identical across positions. An output the plan leaves split
(`sharded_output`) contributes, on rank r, the sum over rank r's slice weighted by rank r's slice of R;
its terms are summed over the ranks to give each rank's loss as a whole. Gradients come from
`torch.autograd.grad`, so neither the user's model nor the rank modules are left holding a `.grad`; the
buffers a forward writes (running statistics) are put back afterwards.

Each rank's gradient of a parameter is compared with the original's, cut the way the plan cuts that
parameter (`placement.rank_pieces`: fused q|k|v segments, kv-head pieces several ranks share, padding rows
left out). The tolerance is atol + rtol * max|original gradient| per parameter, torch.testing.assert_close's
defaults for the dtype unless given (tpcompile.cli.compare.tolerance).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError
from tpcompile.placement import Shard, local_shape, rank_pieces
from tpcompile.runtime.gradient_report import GradientCheck, GradientReport, LossCheck
from tpcompile.runtime.simulator import simulate_ranks

__all__ = ["GradientCheck", "GradientReport", "LossCheck", "check_gradients"]

DEFAULT_SEED = 1


def check_gradients(model: nn.Module, sharded: Any, *args: Any, loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
                    seed: int = DEFAULT_SEED, atol: Optional[float] = None, rtol: Optional[float] = None,
                    **kwargs: Any) -> GradientReport:
    """Run one forward and backward of every rank and of `model` on (args, kwargs) and compare losses and gradients."""
    from tpcompile.api import ShardedModel
    from tpcompile.cli.compare import check_outputs, leaves, output_placements  # the CLI's helpers, loaded late
    if not isinstance(sharded, ShardedModel):
        raise TPCompileError(f"check_gradients needs the ShardedModel that tpcompile.shard(model, ...) returned as "
                             f"its second argument, got {type(sharded).__name__}")
    if sharded.shapes is not None:  # a shape its guards refuse: the capture for it, as tpcompile.simulate runs
        sharded = sharded.shapes.sharded_for(*args, **kwargs)
    _refuse_live_dropout(model, sharded)
    ws = sharded.world_size
    ranks = [sharded.rank(r) for r in range(ws)]  # built here, not on the rank threads
    kept = [_buffers(m) for m in (model, *ranks)]
    try:
        with torch.enable_grad():  # also on the rank threads: simulate_ranks carries the caller's grad mode over
            ref_out = model(*args, **kwargs)
            ref_leaves = leaves(ref_out)
            weights = _loss_weights(ref_leaves, seed)
            placements = output_placements(sharded, len(ref_leaves))
            ref_loss, ref_scale, dtypes = _reference_loss(ref_out, ref_leaves, weights, loss_fn)
            ref_grads = _grads(ref_loss, model)

            def one_rank(r: int) -> tuple[Any, float, float, dict[int, Optional[torch.Tensor]]]:
                """This rank's forward, loss (whole part, split part) and backward."""
                out = ranks[r](*args, **kwargs)
                whole, split = _rank_loss(out, leaves(out), ref_leaves, weights, placements, loss_fn, r, ws)
                grads = _grads(whole + split, ranks[r])
                return out, float(whole.detach()), float(split.detach()), grads

            results = simulate_ranks(ws, one_rank)
    finally:
        for m, saved in zip((model, *ranks), kept):
            _restore(m, saved)
    split_total = sum(res[2] for res in results)
    a, r = _loosest(dtypes, atol, rtol)
    loss = LossCheck(float(ref_loss.detach()), [res[1] + split_total for res in results], ref_scale, a, r)
    outputs = check_outputs(ref_out, [res[0] for res in results], sharded, atol=atol, rtol=rtol)
    gradients = _compare_gradients(model, sharded, ranks, ref_grads, [res[3] for res in results], atol, rtol)
    return GradientReport(ws, loss, outputs, gradients)


def _refuse_live_dropout(model: nn.Module, sharded: Any) -> None:
    """Raise when dropout is on in the captured graph or the model: the ranks and the original draw other masks."""
    from tpcompile.passes.pass_context import module_path
    from tpcompile.passes.rewrite_dropout import is_live_dropout, sdpa_dropout
    where = ""
    for node in sharded.captured.graph.nodes:
        if is_live_dropout(node):
            where = f"dropout (p={node.args[1]}) at {module_path(node) or node.name} in the captured graph"
        elif node.target is torch.ops.aten.scaled_dot_product_attention.default and sdpa_dropout(node) > 0:
            where = (f"attention dropout (p={sdpa_dropout(node)}) at {module_path(node) or node.name} in the "
                     f"captured graph")
        if where:
            break
    live = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd)
            and m.training and m.p > 0]
    if not where and live:
        name, mod = live[0]
        where = f"{name or 'the model'} ({type(mod).__name__}, p={mod.p}) in training mode"
    if where:
        raise TPCompileError(f"check_gradients cannot compare gradients with live dropout: {where}; the ranks draw "
                             f"their masks from tpcompile's streams and the original from torch's, so no gradient "
                             f"could agree. Call model.eval() before tpcompile.shard (eval mode turns dropout off; "
                             f"gradients still flow) or set the dropout probabilities to 0")


def _loss_weights(ref_leaves: list[tuple[str, torch.Tensor]], seed: int) -> list[Optional[torch.Tensor]]:
    """A standard normal tensor of each floating output's shape and dtype, drawn in output order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    out: list[Optional[torch.Tensor]] = []
    for _, t in ref_leaves:
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype).to(t.device))
        else:
            out.append(None)
    return out


def _reference_loss(out: Any, ref_leaves: list[tuple[str, torch.Tensor]], weights: list[Optional[torch.Tensor]],
                    loss_fn: Optional[Callable[[Any], torch.Tensor]]) -> tuple[torch.Tensor, float, list[torch.dtype]]:
    """The original's loss, what its rounding grows with (sum |terms|, or |loss| for loss_fn), and its dtypes."""
    if loss_fn is not None:
        loss = _scalar(loss_fn(out))
        return loss, float(loss.detach().abs()), [loss.dtype]
    terms = [(t * w).sum(dtype=torch.float64) for (_, t), w in zip(ref_leaves, weights) if w is not None]
    if not terms:
        raise TPCompileError("check_gradients' default loss sums the model's floating-point outputs, and this "
                             "model returns none; pass loss_fn=... that makes a scalar loss from its output")
    scale = sum(float((t.detach().double() * w.double()).abs().sum()) for (_, t), w in zip(ref_leaves, weights)
                if w is not None)
    return torch.stack(terms).sum(), scale, [t.dtype for (_, t), w in zip(ref_leaves, weights) if w is not None]


def _rank_loss(out: Any, got: list[tuple[str, torch.Tensor]], ref_leaves: list[tuple[str, torch.Tensor]],
               weights: list[Optional[torch.Tensor]], placements: list[Any], loss_fn: Optional[Callable[[Any], Any]],
               rank: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(terms of outputs this rank holds whole, terms of its slices of split outputs); loss_fn's loss and 0."""
    zero = torch.zeros((), dtype=torch.float64)
    if len(got) != len(ref_leaves):
        raise TPCompileError(f"rank {rank} returns {len(got)} output tensors and the original {len(ref_leaves)}; "
                             f"every rank must return the original's output structure")
    sliced = [k for k, ((_, t), (_, ref)) in enumerate(zip(got, ref_leaves)) if t.shape != ref.shape]
    if loss_fn is not None:
        if sliced:
            raise TPCompileError(f"loss_fn needs whole outputs, but output {got[sliced[0]][0]} stays split across "
                                 f"ranks on rank {rank} (sharded_output in the plan); leave loss_fn=None (the "
                                 f"default loss takes each rank's slice) or shard without sharded_output there")
        return _scalar(loss_fn(out)).to(torch.float64), zero
    whole, split = zero, zero
    for k, ((path, t), (_, ref), w) in enumerate(zip(got, ref_leaves, weights)):
        if w is None:
            continue
        if k in sliced:
            local = _local_weight(w, placements[k], tuple(t.shape), path, rank, ws)
            split = split + (t * local).sum(dtype=torch.float64)
        else:
            whole = whole + (t * w).sum(dtype=torch.float64)
    return whole, split


def _local_weight(w: torch.Tensor, p: Any, shape: tuple[int, ...], path: str, rank: int, ws: int) -> torch.Tensor:
    """Rank `rank`'s slice of the loss weight `w` of a split output; zero on padding, an element held by k ranks
    weighted 1/k so that the ranks' terms add up to the original's."""
    if (not isinstance(p, Shard) or p.outer is not None or p.split_next
            or shape != tuple(local_shape(w.shape, p, rank, ws))):
        raise TPCompileError(f"output {path} of rank {rank} has shape {tuple(shape)}, neither the original's "
                             f"{tuple(w.shape)} nor a slice check_gradients can map onto it ({p}); pass loss_fn=... "
                             f"or shard without sharded_output on the module that makes it")
    held = torch.zeros(w.shape[p.dim], dtype=w.dtype, device=w.device)
    for r in range(ws):  # how many ranks hold each position along the split dim
        for start, _, n in rank_pieces(p, w.shape[p.dim], r, ws):
            held[start:start + n] += 1
    shape_1d = [1] * w.dim()
    shape_1d[p.dim] = -1
    shared = w / held.clamp(min=1).view(shape_1d)
    out = w.new_zeros(shape)
    for start, local, n in rank_pieces(p, w.shape[p.dim], rank, ws):
        out.narrow(p.dim, local, n).copy_(shared.narrow(p.dim, start, n))
    return out


def _scalar(loss: Any) -> torch.Tensor:
    """loss_fn's result, checked to be a one-element tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TPCompileError(f"loss_fn must return a one-element tensor, got {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return loss.reshape(())


def _grads(loss: torch.Tensor, module: nn.Module) -> dict[int, Optional[torch.Tensor]]:
    """id(parameter) -> d loss / d parameter (None where the loss does not depend on it); no .grad is written."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or not loss.requires_grad:
        return {id(p): None for p in params}
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {id(p): None if g is None else g.detach() for p, g in zip(params, grads)}


def _compare_gradients(model: nn.Module, sharded: Any, ranks: list[nn.Module], ref: dict[int, Optional[torch.Tensor]],
                       got: list[dict[int, Optional[torch.Tensor]]], atol: Optional[float],
                       rtol: Optional[float]) -> list[GradientCheck]:
    """One GradientCheck per parameter of the original model (tied names once)."""
    from tpcompile.cli.compare import tolerance
    from tpcompile.report.plan_table import split_text
    params = dict(model.named_parameters(remove_duplicate=False))
    checks, covered = [], set()
    for name, pp in sharded.plan.parameters.items():
        covered.update((name, *pp.tied))
        if name not in params:
            continue
        g_ref = ref.get(id(params[name]))
        diffs, problems = [], {}
        for r, gm in enumerate(ranks):
            diff, why = _rank_diff(g_ref, _rank_param(gm, name), got[r], pp, r, len(ranks))
            diffs.append(diff)
            if why:
                problems[r] = why
        dtype = params[name].dtype if g_ref is None else g_ref.dtype
        a, rt = tolerance(dtype, atol, rtol)
        scale = float(g_ref.double().abs().max()) if g_ref is not None and g_ref.numel() else 0.0
        unused = ""
        if g_ref is None and not problems and all(got[r].get(id(_rank_param(gm, name))) is None
                                                  for r, gm in enumerate(ranks)):
            unused = "frozen (requires_grad=False)" if not params[name].requires_grad else \
                "the loss does not depend on it"
        checks.append(GradientCheck(name, pp.tied, pp.global_shape, split_text(pp), diffs, scale, a, rt, problems,
                                    unused))
    for name, p in params.items():  # gradients of parameters the sharded model does not hold
        if name not in covered and ref.get(id(p)) is not None:
            a, rt = tolerance(p.dtype, atol, rtol)
            why = "the sharded model has no such parameter (it was not captured)"
            checks.append(GradientCheck(name, (), tuple(p.shape), "missing", [math.inf] * len(ranks), 0.0, a, rt,
                                        {r: why for r in range(len(ranks))}))
    return checks


def _rank_param(gm: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The rank module's parameter of that name, or None."""
    try:
        return gm.get_parameter(name)
    except AttributeError:
        return None


def _rank_diff(ref: Optional[torch.Tensor], param: Optional[torch.Tensor], got: dict[int, Optional[torch.Tensor]],
               pp: Any, rank: int, ws: int) -> tuple[float, str]:
    """Largest |difference| of one rank's gradient from its slice of the original's, and why there is none."""
    g = None if param is None else got.get(id(param))
    if param is None:
        return math.inf, f"has no parameter {pp.name}"
    if ref is None and g is None:
        return 0.0, ""
    if g is None:
        return math.inf, "no gradient on this rank, but the original has one (the loss does not reach it here)"
    if ref is None:
        return math.inf, f"a gradient (max |grad| {float(g.abs().max()):.2e}) where the original has none"
    if tuple(g.shape) != tuple(pp.local_shape):
        return math.inf, f"gradient of shape {tuple(g.shape)}, the plan's slice is {tuple(pp.local_shape)}"
    sl = pp.slice()
    if sl is None:
        return float((g.double() - ref.double()).abs().max()) if g.numel() else 0.0, ""
    worst = 0.0
    for start, local, n in rank_pieces(sl, ref.shape[sl.dim], rank, ws):  # padding rows have no counterpart
        piece = (ref.narrow(sl.dim, start, n).double() - g.narrow(sl.dim, local, n).double()).abs()
        worst = max(worst, float(piece.max()) if piece.numel() else 0.0)
    return worst, ""


def _loosest(dtypes: list[torch.dtype], atol: Optional[float], rtol: Optional[float]) -> tuple[float, float]:
    """The largest (atol, rtol) over the loss terms' dtypes (the given ones where given)."""
    from tpcompile.cli.compare import tolerance
    pairs = [tolerance(d, atol, rtol) for d in dtypes] or [tolerance(torch.float32, atol, rtol)]
    return max(a for a, _ in pairs), max(r for _, r in pairs)


def _buffers(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, a copy of it) for every buffer, so that a forward's writes (running statistics) can be undone."""
    return [(b, b.detach().clone()) for b in module.buffers()]


def _restore(module: nn.Module, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write the saved values back into the buffers."""
    with torch.no_grad():
        for b, value in saved:
            if b.shape == value.shape:
                b.copy_(value)
