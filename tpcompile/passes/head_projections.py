"""The projections an attention's inputs, and what is computed per head beside them, come from: the one linear
behind each of q, k and v (`projection`), a gate of the merged heads (`gates`), a bias of the scores (`biases`) and
a projection of values per kv head beside k or v (`kv_companions`). passes/head_groups.py cuts them together."""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from tpcompile.passes.pass_context import PassContext
from tpcompile.sharding_rules import RuleSpec
from tpcompile.sharding_rules.rule_context import weight_view

SDPA = (torch.ops.aten.scaled_dot_product_attention.default,)
MATMUL = (torch.ops.aten.matmul.default,)
_TRANSPOSE = (torch.ops.aten.transpose.int,)
WALK = 64  # nodes visited back from an attention input before giving up
SCORES = 12  # nodes followed from the scores q @ k^T to the product with v
_GATE_WALK = 12  # nodes followed from an attention's output to a gate of its merged heads


def gates(out: Node, width: int, found: list, ctx: PassContext) -> list[Node]:
    """The projections whose output of `width` features multiplies the attention's output, its heads merged back
    (through views, transposes and elementwise ops: AFMoE's, Dory's sigmoid gate): split as the query heads are."""
    gates, todo, seen = [], [out], set()
    while todo and len(seen) < _GATE_WALK:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            spec = u.meta.get("tp_rule")
            if spec is None or spec.rule not in ("reshape", "transpose", "pointwise"):
                continue
            todo.append(u)
            for i in u.all_input_nodes if spec.rule == "pointwise" else ():
                proj = projection(i, ctx) if i is not n else None
                if proj is not None and proj not in found and proj not in gates \
                        and int(proj.meta["val"].shape[-1]) == width:
                    gates.append(proj)
    return gates


def biases(out: Node, heads: int, found: list, ctx: PassContext) -> list[tuple[Node, int]]:
    """(projection, its head size) of each term added to the attention's scores that a projection of `heads` heads
    computes, one per query head (Inkling's relative-position bias, r_proj's per-head states through a bank of
    profiles and a gather by distance): the attention mask of scaled_dot_product_attention, the other operands of
    the ops between a written-out attention's q @ k^T and its softmax. Through a weight matmul that keeps the heads
    (the states times a bank of profiles) to the projection before it."""
    if out.target in SDPA:
        terms = [out.args[3] if len(out.args) > 3 else out.kwargs.get("attn_mask")]
    else:
        terms = _score_terms(out)
    biases: list = []
    for term in terms:
        proj = projection(term, ctx)
        if proj is not None and not proj.meta["tp_rule"].get("heads"):  # a bank applied to each head's states
            proj = projection(proj.args[proj.meta["tp_rule"].get("input", 0)], ctx)
        head = proj.meta["tp_rule"].get("heads") if proj is not None else None
        if proj is None or proj in found or not head or len(head) != 1 or any(b is proj for b, _ in biases) \
                or int(proj.meta["val"].shape[-1]) != heads * head[0]:
            continue
        biases.append((proj, head[0]))
    return biases


def _score_terms(out: Node) -> list[Node]:
    """The operands met on the way from a written-out attention's scores (q @ k^T) to its product with v, in either
    order: the ops within SCORES of the product that the scores reach, and their other inputs."""
    back, todo, scores = set(), [(out.args[0], 0)], None
    while todo:
        n, depth = todo.pop()
        if not isinstance(n, Node) or n in back or depth > SCORES:
            continue
        back.add(n)
        if n.target in MATMUL and transposed(n.args[1]):
            scores = n
            continue
        todo += [(i, depth + 1) for i in n.all_input_nodes]
    path, todo = set(), [scores] if scores is not None else []
    while todo:
        for u in todo.pop().users:
            if u in back and u not in path:
                path.add(u)
                todo.append(u)
    return [i for n in path for i in n.all_input_nodes if i not in path and i is not scores]


def transposed(n: object) -> bool:
    """k^T: a transpose of the last two dims of a 4-D value."""
    if not isinstance(n, Node) or n.target not in _TRANSPOSE or not isinstance(n.args[0], Node):
        return False
    val = n.args[0].meta.get("val")
    return val is not None and val.dim() == 4 and sorted(d % 4 for d in n.args[1:3]) == [2, 3]


def kv_companions(kv_args: tuple, kv_projs: tuple, kv: int, ctx: PassContext) -> list[Node]:
    """The projections beside the key and value projections upstream of the attention's k and v whose outputs are
    whole values per kv head (Inkling 2's per-token convolution taps, kv heads x taps): in the kv pieces too."""
    out: list = []
    for arg, proj in zip(kv_args, kv_projs):
        out += [f for f in _projections(arg, ctx) if f is not proj and f not in out and f not in kv_projs
                and int(f.meta["val"].shape[-1]) % kv == 0]
    return out


def head_size(arg: Node) -> Optional[int]:
    """The head size of an attention input (B, heads, T, head size)."""
    val = arg.meta.get("val") if isinstance(arg, Node) else None
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() == 4 else None


def projection(arg: object, ctx: PassContext, head: Optional[int] = None) -> Optional[Node]:
    """The one linear with a 2-D parameter weight that an attention input is computed from, if there is one; with
    `head`, the one of whole heads of that size among several (a key projection, beside the projection of its
    convolution's per-token taps: Inkling 2's dynamic short convolution)."""
    found = _projections(arg, ctx)
    if head and len(found) > 1:  # the one viewed as heads of that size, else of whole heads not viewed otherwise
        heads = [f.meta["tp_rule"].get("heads") for f in found]
        found = [f for f, h in zip(found, heads) if h and head in h] or \
            [f for f, h in zip(found, heads) if not h and int(f.meta["val"].shape[-1]) % head == 0]
    return found[0] if len(found) == 1 else None


def _projections(arg: object, ctx: PassContext) -> list[Node]:
    """The linears with a 2-D parameter weight nearest upstream of `arg` (within WALK nodes)."""
    todo, seen, found = [arg] if isinstance(arg, Node) else [], set(), []
    while todo and len(seen) < WALK:
        n = todo.pop(0)
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if is_projection(n, ctx):
            found.append(n)
            continue
        spec = n.meta.get("tp_rule")  # (a value reshaped as another: only its shape is read from that one)
        todo.extend(n.args[:1] if spec is not None and spec.rule == "view_as" else n.all_input_nodes)
    return found


def is_projection(node: Node, ctx: PassContext) -> bool:
    """A weight matmul (a linear) whose weight is a 2-D parameter."""
    spec = node.meta.get("tp_rule")
    return spec is not None and spec.rule == "weight_matmul" and _has_weight(node, spec, ctx)


def _has_weight(node: Node, spec: RuleSpec, ctx: PassContext) -> bool:
    i = spec.get("weight")
    w, _ = weight_view(node.args[i]) if i is not None and i < len(node.args) else (None, False)
    t = ctx.tensors.get(w.target) if w is not None else None
    return isinstance(t, torch.nn.Parameter) and t.dim() == 2
