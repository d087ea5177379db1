"""What one op's rule says on a node, and whether its inputs can be brought to what it wants.

`op_result` runs the op's rule; for an op with no rule, or a rule that gives up, it asks PyTorch
DTensor's strategy for the op (sharding_rules/dtensor_fallback.py; an in-place op as its
out-of-place twin), and only when that needs communication is the op replicated, a conflict
when a split value reaches it (named for in-place writes into parameters). `check_wants` says
why an input cannot be converted; `gathering_seq` retries an op with its token-split inputs
gathered first.
"""
from __future__ import annotations

import operator
from typing import Any, Collection, Optional

import torch
from torch.fx import Node

from tpcompile.placement import REPLICATE, Partial, Replicate, Shard, is_seq
from tpcompile.sharding_rules.dtensor_fallback import dtensor_result
from tpcompile.sharding_rules.registry import apply_rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want
from tpcompile.sharding_rules.shared_pieces import cut_from_shared
from tpcompile.sharding_rules.table import RuleSpec, load_table, op_name

_OWN_ONLY = ("weight_matmul", "embedding", "write_into", "no_output")  # rules that cut weights or state


def gathering_seq(node: Node, rules: RuleContext, placement: Any, res: Result, why: str, blame: Any) -> tuple:
    """Retry an op that cannot take token-split inputs with those inputs gathered first."""
    gathered = {i for i in node.all_input_nodes if is_seq(placement(i))}

    def view(n: Any) -> Any:
        return REPLICATE if n in gathered else placement(n)
    retry = op_result(node, rules.seeing(view), view)
    again = retry.conflict or check_wants(retry, view, rules.world_size)[0]
    return (res, why, blame) if again else (retry, None, None)


def op_result(node: Node, rules: RuleContext, placement: Any) -> Result:
    """The rule's answer for a node; an op with no rule is replicated, a conflict if an input is split."""
    spec = node.meta.get("tp_rule")
    if spec is not None:
        res = apply_rule(node, spec, rules)
        if res.conflict and spec.rule not in _OWN_ONLY and not res.regroup and not res.params:
            return dtensor_result(node, rules) or res  # a rule that gives up: DTensor may still place it
        return res
    tensors = [i for i in node.all_input_nodes if rules.is_tensor(i)]
    if node.target is operator.getitem:
        p = placement(node.args[0])
        out = p[node.args[1]] if isinstance(p, tuple) else REPLICATE
        return Result(out, [])
    res = Result(REPLICATE, [Want(i, REPLICATE) for i in tensors])
    if node.target is torch.ops.aten.sym_size.int and isinstance(placement(node.args[0]), Shard):
        p, ndim = placement(node.args[0]), len(rules.shape(node.args[0]) or ()) or 1
        d = node.args[1] % ndim
        if p.dim != d and not (p.split_next and d == p.dim + 1):
            return Result(REPLICATE, [Want(node.args[0], p)])  # a whole dim: read locally
        res.conflict = "size of a sharded dim"
        return res
    if not rules.all_replicated(tensors):
        written = [w for w in _written(node) if not isinstance(placement(w), Replicate)]
        if any(_value_name(w).startswith("parameter ") for w in written):
            # e.g. nn.Embedding(max_norm=...) renormalising rows of a vocabulary-split weight
            res.conflict = (f"it updates {_value_name(written[0])} in place and that value is split across ranks "
                            f"(each rank would update its slice as if it were the whole)")
            res.blame = written
            return res
        writes = _written(node)
        alt = _as_twin(node, rules, writes) if writes else dtensor_result(node, rules)
        if alt is not None:
            return alt
        res.conflict = "no sharding rule for this op (add a row to sharding_rules/ops.yaml)"
        if written:
            res.conflict = f"it updates {_value_name(written[0])} in place, and no rule places the result like it"
    return res


def _as_twin(node: Node, rules: RuleContext, written: list[Node]) -> Optional[Result]:
    """An in-place op placed as its out-of-place twin's row (or DTensor's strategy) says, when the result keeps
    the placement of the value it writes into; else None."""
    name = op_name(node.target)
    ns, base, overload = name.split(".") if name.count(".") == 2 else ("", "", "")
    twin = load_table().get(f"{ns}.{base[:-1]}.{overload}") if base.endswith("_") else None
    res = apply_rule(node, RuleSpec(twin.rule, twin.args), rules) if twin is not None else None
    if res is None or res.conflict:
        res = dtensor_result(node, rules)
    if res is None or res.conflict or any(rules.placement(w) != res.out for w in written):
        return None
    return res


def _written(node: Node) -> list[Node]:
    """The inputs an in-place op writes to (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [a for a, arg in zip(node.args, schema.arguments)
            if isinstance(a, Node) and arg.alias_info is not None and arg.alias_info.is_write]


def _value_name(node: Node) -> str:
    """'parameter e.weight' for a parameter read (through detach / alias), else the node's name."""
    for _ in range(4):
        if node.op == "get_attr":
            return f"parameter {node.target}"
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
            break
        node = node.args[0]
    return node.name


def check_wants(res: Result, placement: Any, world_size: int,
                own: Collection[Node] = ()) -> tuple[Optional[str], Optional[list[Node]]]:
    """Why an input cannot be brought to the placement the rule wants, and which, if any.

    `own`: the op's own weights, which it cuts itself (how the previous round cut them does not bind it).
    """
    for w in res.wants:
        if w.node in own:
            continue
        have = placement(w.node)
        if have == w.placement:
            continue
        if isinstance(have, Partial):  # summed first (an all-reduce), then as a whole value
            have = REPLICATE
            if have == w.placement:
                continue
        if isinstance(have, Replicate) and isinstance(w.placement, Shard) and w.placement.split_next is None \
                and (w.placement.padding is None
                     or (w.placement.padded is not None and w.placement.pieces is None and not w.placement.seq)
                     or (w.placement.seg_padded and w.placement.outer is None and not w.placement.seq)):
            continue  # a local slice, no communication (passes/rewrite_slices.py when not plain; padded heads,
            # folded with the batch or not, and padded segments)
        if cut_from_shared(have, w.placement, world_size):
            continue  # whole on every rank (one shared piece): its padded part, sliced locally
        if is_seq(have) and isinstance(w.placement, Replicate):
            continue  # an all-gather of the tokens
        return f"input {w.node.name} is {have} but the op needs {w.placement}", [w.node]
    return None, None
