"""Weight ops beyond a 2-D weight in a matmul: expert weights stored as one 3-D parameter, einsum with a weight.

A mixture of experts keeps its experts' weights as (experts, out, in) parameters and applies them by
grouped matmul (`torch._grouped_mm`, transformers' `grouped_mm_fallback`), by bmm on the weights
gathered per token (`W[expert_ids]`), by einsum, or one expert at a time (`W[e]`). Each is a
contraction between an activation and a view of the parameter; written as an einsum equation
(`si,gio->so`), one rule gives Megatron's split inside every expert at once: a whole input splits
the weight's output features (column), an input split on the contracted features splits the
weight's input features and leaves the sum pending (row; sharding_rules/partial.py), so the
experts' results are combined before one all-reduce. The expert dim itself is never cut.

annotate finds these ops (`contraction`) and gives them the rule `weight_contract` with the
equation, the activation and the parameter view; the view's ops (transposes, the gather by
expert ids, sharding_rules/slicing.py's `index`) carry the parameter's split to the operand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.fx import Node

from tpcompile.placement import PARTIAL, REPLICATE, ParamSlice, Replicate, Shard, padded_size, segmented
from tpcompile.sharding_rules.contract_readers import REFUSED, TAKEN, WANTED
from tpcompile.sharding_rules.registry import rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.table import RuleSpec, op_name

_LETTERS = "abcdefgh"
_GROUPED = ("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


@dataclass(frozen=True)
class ParamView:
    """A parameter as an op's operand sees it: which parameter dim each operand dim is (None: gathered)."""

    param: Node  # the get_attr node
    dims: tuple[Optional[int], ...]  # operand dim -> parameter dim, None for a dim gathered by expert ids
    nodes: tuple[Node, ...]  # the view ops from the parameter to the operand, in graph order


def param_view(arg: Any, depth: int = 3) -> Optional[ParamView]:
    """The view of a parameter that `arg` is (through transposes, permutes, `W[e]`, `W[ids]`), else None."""
    chain: list[Node] = []
    n = arg
    while isinstance(n, Node) and n.op == "call_function" and len(chain) < depth and n.args:
        chain.append(n)
        n = n.args[0]
    if not (isinstance(n, Node) and n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)):
        return None
    dims: list[Optional[int]] = list(range(n.meta["val"].dim()))
    for v in reversed(chain):
        name, nd = op_name(v.target), len(dims)
        if name == "aten.transpose.int":
            a, b = v.args[1] % nd, v.args[2] % nd
            dims[a], dims[b] = dims[b], dims[a]
        elif name == "aten.t.default" and nd == 2:
            dims.reverse()
        elif name == "aten.permute.default":
            dims = [dims[d % nd] for d in v.args[1]]
        elif name == "aten.select.int":
            del dims[v.args[1] % nd]
        elif name == "aten.index.Tensor" and len(v.args[1]) == 1 and isinstance(v.args[1][0], Node):
            ids = v.args[1][0].meta.get("val")  # expert ids gather along dim 0
            if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                return None
            dims = [None] * ids.dim() + dims[1:]
        else:
            return None
    return ParamView(n, tuple(dims), tuple(reversed(chain)))


def _batched(na: int, nb: int) -> tuple[str, str, str]:
    """Letters of a broadcasting matmul of an na-D and an nb-D operand: '...ij,...jk->...ik'."""
    batch = _LETTERS[:max(na, nb) - 2]
    return batch[len(batch) - (na - 2):] + "ij", batch[len(batch) - (nb - 2):] + "jk", batch + "ik"


def contraction(node: Node) -> Optional[tuple[Node, Node, ParamView, str]]:
    """(activation, weight operand, its parameter view, 'act,weight->out') for a contraction whose one
    operand is a view of a parameter that the 2-D weight ops do not cover, else None."""
    name = op_name(node.target)
    nds = [a.meta["val"].dim() if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor) else None
           for a in node.args[:2]]
    if name in _GROUPED and nds == [2, 3]:
        terms = ("si", "gio", "so")
    elif name in ("aten.bmm.default", "aten.mm.default", "aten.matmul.default") and None not in nds and min(nds) >= 2:
        terms = _batched(*nds)
    elif name == "aten.linear.default" and nds[1] == 2 and (len(node.args) < 3 or node.args[2] is None):
        terms = (_LETTERS[:nds[0] - 1] + "i", "oi", _LETTERS[:nds[0] - 1] + "o")
    elif name == "aten.einsum.default" and len(node.args[1]) == 2 and "." not in node.args[0] and "->" in node.args[0]:
        lhs, out = node.args[0].replace(" ", "").split("->")
        return _pick(list(node.args[1]), lhs.split(","), out, plain_ok=True)
    else:
        return None
    # a plain 2-D parameter on the left (`W @ x`, Mamba's dt_proj) is no 2-D weight op's: it is contracted here
    return _pick(list(node.args[:2]), list(terms[:2]), terms[2], plain_ok=name != "aten.linear.default"
                 and name not in _GROUPED and param_view(node.args[0]) is not None)


def _pick(operands: list, terms: list[str], out: str, plain_ok: bool) -> Optional[tuple]:
    """The one operand that is a parameter view (a plain 2-D parameter only where `plain_ok`)."""
    views = [(i, param_view(a)) for i, a in enumerate(operands)]
    found = [(i, v) for i, v in views if v is not None and (plain_ok or v.param.meta["val"].dim() > 2
                                                              or any(d is None for d in v.dims) or
                                                              any(op_name(n.target) == "aten.select.int"
                                                                  for n in v.nodes))]
    if len(found) != 1 or len(operands) != 2:
        return None
    i, view = found[0]
    return operands[1 - i], operands[i], view, f"{terms[1 - i]},{terms[i]}->{out}"


def _segments(letter: str, tw: str, tout: str, view: ParamView, spec: RuleSpec) -> tuple[int, ...]:
    """The segments of output index `letter` (a fused projection's parts along the last dim), else its size."""
    size = int(view.param.meta["val"].shape[view.dims[tw.index(letter)]])
    return (spec.get("segments") if tout.index(letter) == len(tout) - 1 else None) or (size,)


def _split_index(kept: list[str], tw: str, tout: str, view: ParamView, spec: RuleSpec, world_size: int) -> str:
    """The output index a column split cuts: one the readers want split (annotate's `needs`,
    sharding_rules/contract_readers.py: the heads another operand's split meets), zero-padded where the world size
    does not divide it (4 heads at 8 ranks, not their head_dim of 8: the attention probabilities are split by
    heads); else one the world size divides that the readers take best (whole heads over head_dim, never a
    stacked q|k|v index), the innermost parameter dim among equals (the features, not the experts)."""
    needs = spec.get("needs") or {}

    def key(c: str) -> tuple:
        need = needs.get(c, TAKEN)
        fits = not any(s % world_size for s in _segments(c, tw, tout, view, spec))
        return need == WANTED, fits and need > REFUSED, need, view.dims[tw.index(c)]
    return max(kept, key=key)


@rule("weight_contract")
def weight_contract(node: Node, spec: RuleSpec, ctx: RuleContext) -> Result:
    """An activation contracted with a parameter view: column split on a whole input, row split (pending sum)
    on an input split along the contracted features."""
    act, view, eq = spec.get("act"), spec.get("view"), spec.get("equation")
    if view is None:  # a grouped matmul of two activations: whole, or a conflict on a split input
        tensors = [a for a in node.all_input_nodes if ctx.is_tensor(a)]
        conflict = None if ctx.all_replicated(tensors) else "grouped matmul of split activations"
        return Result(REPLICATE, [Want(a, REPLICATE) for a in tensors], conflict=conflict)
    (ta, tw), tout = eq.split("->")[0].split(","), eq.split("->")[1]
    others = [a for a in node.all_input_nodes if a is not act and a is not spec.get("weight")
              and a not in view.nodes and a is not view.param]
    params: dict[Node, Optional[ParamSlice]] = {view.param: None}
    px = ctx.placement(act)
    whole = [Want(act, REPLICATE)] + [Want(o, REPLICATE) for o in others]
    if isinstance(px, Replicate) or (isinstance(px, Shard) and px.seq):
        if ctx.demoted(node):
            return Result(REPLICATE, whole, role="replicated", params=params)
        kept = [c for c in tw if c in tout and c not in ta and view.dims[tw.index(c)] is not None]
        if not kept:
            return Result(REPLICATE, whole, role="replicated", params=params,
                          note="no output feature of the weight to split (only expert or batch dims)")
        letter = _split_index(kept, tw, tout, view, spec, ctx.world_size)
        pdim, odim = view.dims[tw.index(letter)], tout.index(letter)
        segments = _segments(letter, tw, tout, view, spec)
        # zero-padded to a multiple of the ranks, each segment its own, by whole heads where the features are cut
        # into heads later (annotate's `heads`: JetMoE's attention experts)
        head = (spec.get("heads") or (None,))[0] if odim == len(tout) - 1 and len(segments) == 1 else None
        unit = head if head and segments[0] % head == 0 else 1
        out = segmented(odim, segments, ctx.world_size, [padded_size(s, ctx.world_size * unit) for s in segments])
        params[view.param] = ParamSlice(pdim, out.segments, cuts=out.cuts)
        return Result(out, [ctx.replicated_want(act, out)] + [ctx.replicated_want(o, out) for o in others],
                      role="column", params=params)
    letter = ta[px.dim] if isinstance(px, Shard) and px.dim < len(ta) else None
    pdim = view.dims[tw.index(letter)] if letter in tw else None
    if letter is None or letter in tout or pdim is None or px.pieces is not None or px.outer is not None:
        return Result(REPLICATE, whole, params=params,
                      conflict=f"input split as {px}, not along the features the weight contracts ({eq})")
    params[view.param] = ParamSlice(pdim, px.segments, cuts=px.cuts)  # padded rows meet the input's zeros
    return Result(PARTIAL, [Want(act, px)] + [Want(o, REPLICATE) for o in others], role="row", params=params)
