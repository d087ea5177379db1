"""What one op's rule says on a node, and whether its inputs can be brought to what it wants.

`op_result` runs the op's rule (or the fallback for an op with no rule: replicated, a conflict
when a split value reaches it, named for in-place writes); `check_wants` says why an input cannot
be converted; `gathering_seq` retries an op with its token-split inputs gathered first.
"""
from __future__ import annotations

import operator
from typing import Any, Collection, Optional

import torch
from torch.fx import Node

from tpcompile.placement import REPLICATE, Replicate, Shard, is_seq
from tpcompile.sharding_rules.registry import apply_rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want


def gathering_seq(node: Node, rules: RuleContext, placement: Any, res: Result, why: str, blame: Any) -> tuple:
    """Retry an op that cannot take token-split inputs with those inputs gathered first."""
    gathered = {i for i in node.all_input_nodes if is_seq(placement(i))}

    def view(n: Any) -> Any:
        return REPLICATE if n in gathered else placement(n)
    retry = op_result(node, rules.seeing(view), view)
    again = retry.conflict or check_wants(retry, view)[0]
    return (res, why, blame) if again else (retry, None, None)


def op_result(node: Node, rules: RuleContext, placement: Any) -> Result:
    """The rule's answer for a node; an op with no rule is replicated, a conflict if an input is split."""
    spec = node.meta.get("tp_rule")
    if spec is not None:
        return apply_rule(node, spec, rules)
    tensors = [i for i in node.all_input_nodes if rules.is_tensor(i)]
    if node.target is operator.getitem:
        p = placement(node.args[0])
        out = p[node.args[1]] if isinstance(p, tuple) else REPLICATE
        return Result(out, [])
    res = Result(REPLICATE, [Want(i, REPLICATE) for i in tensors])
    if not rules.all_replicated(tensors):
        res.conflict = "no sharding rule for this op (add a row to sharding_rules/ops.yaml)"
        written = [w for w in _written(node) if not isinstance(placement(w), Replicate)]
        if written:  # e.g. nn.Embedding(max_norm=...) renormalising rows of a vocabulary-split weight
            res.conflict = (f"it updates {_value_name(written[0])} in place and that value is split across ranks "
                            f"(each rank would update its slice as if it were the whole)")
            res.blame = written
    if node.target is torch.ops.aten.sym_size.int and isinstance(placement(node.args[0]), Shard):
        res.conflict = None if placement(node.args[0]).dim != node.args[1] else "size of a sharded dim"
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


def check_wants(res: Result, placement: Any, own: Collection[Node] = ()) -> tuple[Optional[str], Optional[list[Node]]]:
    """Why an input cannot be brought to the placement the rule wants, and which, if any.

    `own`: the op's own weights, which it cuts itself (how the previous round cut them does not bind it).
    """
    for w in res.wants:
        if w.node in own:
            continue
        have = placement(w.node)
        if have == w.placement:
            continue
        if isinstance(have, Replicate) and isinstance(w.placement, Shard) and w.placement.plain:
            continue  # a local slice, no communication
        if is_seq(have) and isinstance(w.placement, Replicate):
            continue  # an all-gather of the tokens
        return f"input {w.node.name} is {have} but the op needs {w.placement}", [w.node]
    return None, None
