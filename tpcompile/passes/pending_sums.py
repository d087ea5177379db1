"""Pending sums that would be reduced alone: the row-split lookups that are not worth their all-reduce.

An embedding table read with indices other than the user's token ids (positions, token types) is split by
rows like the token embeddings (sharding_rules/matmul.py `embedding`): each rank looks up its own rows and
the sum stays pending (sharding_rules/partial.py). Added to the token embeddings' pending sum, it is reduced
by the same all-reduce: its table is split for free. Where its sum reaches an op that needs it whole without
meeting a pending sum of the token ids or of a row split (a relative-position bias added to split attention
scores, a table whose token embeddings are kept whole), it would cost an all-reduce of its own: such lookups
are blamed with a choice (shown in the plan, not warned), and the next round keeps their tables whole.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.decisions import ANNOTATIONS
from tpcompile.passes.pass_context import describe, module_path
from tpcompile.placement import Partial
from tpcompile.sharding_rules.rule_context import Choice

aten = torch.ops.aten


def lonely_lookups(gm: GraphModule, is_user_input: Any) -> list[tuple[frozenset, Choice]]:
    """(lookups, why) for each pending sum that is reduced while made only of lookups with other indices."""
    found: dict[frozenset, Node] = {}
    for node in gm.graph.nodes:
        for value in _reduced_inputs(node):
            made = frozenset(summands(value, ANNOTATIONS))
            if made and all(_side_lookup(m, is_user_input) for m in made):
                found.setdefault(made, value)
    return [(made, Choice(f"{describe(value)}: reads whole the sum of {', '.join(sorted(describe(m) for m in made))}, "
                          f"looked up with indices that are not the token ids; that sum would need an all-reduce "
                          f"of its own, so the table is kept whole"))
            for made, value in found.items()]


def _side_lookup(node: Node, is_user_input: Any) -> bool:
    """A vocabulary lookup whose indices are not the user's token ids (positions, token types)."""
    layout = node.meta.get("tp_layout")
    return layout is not None and layout.role == "vocab" and not is_user_input(node.args[1]) \
        and not _joined_ids(node.args[1], is_user_input)


def _joined_ids(ids: Any, is_user_input: Any) -> bool:
    """Token ids joined by a cat with ids the model makes from constants alone (CPM-Ant prepends the ids of its
    prompt tokens): one operand the user's ids, every other one read from no model input."""
    spec = ids.meta.get("tp_rule") if isinstance(ids, Node) else None
    if spec is None or spec.rule != "cat":
        return False
    joined = [a for a in ids.args[0] if isinstance(a, Node)]
    users = [a for a in joined if is_user_input(a)]
    return len(users) == 1 and all(not _reads_input(a) for a in joined if a is not users[0])


def _reads_input(node: Node, limit: int = 64) -> bool:
    """True when `node` is computed from a model input's values (its sizes do not count), or from more nodes than
    `limit` (not worth following)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.target is aten.sym_size.int:  # a size: the batch a constant is repeated over
            continue
        if n.op == "placeholder" or len(seen) > limit:
            return True
        seen.add(n)
        todo += [a for a in n.all_input_nodes if a not in seen]
    return False


def _reduced_inputs(node: Node) -> list[Node]:
    """The pending inputs this op reads whole (the rewriter all-reduces them before it)."""
    pending = [i for i in node.all_input_nodes if isinstance(i.meta.get("tp_placement"), Partial)]
    if not pending:
        return []
    if node.op == "output":
        return pending
    layout = node.meta.get("tp_layout")
    if layout is None:
        return pending
    wanted = {w.node: w.placement for w in layout.wants}
    return [i for i in pending if not isinstance(wanted.get(i), Partial)]


def summands(value: Node, decided: Any) -> list[Node]:
    """The ops whose summands make the pending `value` (row splits, lookups), in graph order, as `decided` (the
    frozen plan, or the annotations while propagation runs) places them."""
    made, todo, seen = set(), [value], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        layout = decided.layout(n)
        ins = [w.node for w in (layout.wants if layout is not None else []) if isinstance(w.placement, Partial)
               and isinstance(decided.placement(w.node), Partial)]
        todo += ins
        if not ins:
            made.add(n)
    return [n for n in value.graph.nodes if n in made]


def sum_paths(value: Node, decided: Any) -> tuple[str, ...]:
    """The module paths of the summands of the pending `value`: an all-reduce of a sum joined outside them (token
    plus position embeddings) is priced by the planner as their split's."""
    return tuple(p for n in summands(value, decided) if (p := module_path(n)))


def reduce_site(value: Node, decided: Any) -> Node:
    """The op an all-reduce of the pending `value` is attributed to: `value`, when a module of its own holds every
    summand (experts summed in their MoE layer), else the first summand (token and position embeddings added at
    the top, or in a dropout's module)."""
    where, made = module_path(value) or "", summands(value, decided)
    inside = all((module_path(m) or "").startswith(where + ".") or module_path(m) == where for m in made)
    return value if where and inside else made[0]
