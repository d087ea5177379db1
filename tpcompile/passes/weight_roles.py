"""Weight ops kept whole by design, found by annotate before propagation: routers, low-rank down-projections,
narrow chains and embedding projections.

Megatron, vLLM and DeepSpeed keep these whole on every rank: a mixture of experts' router (its output
is one score per expert, and the top-k choice needs them all), the narrow projection of a
low-rank pair (LoRA's A, MLA's q_a / kv_a in DeepSeek), whose widening partner is split instead
with no communication between them, and the projection of the embeddings to the model's width
(OPT's project_in, ALBERT's embedding_hidden_mapping_in) or of the image's patches (a ViT's patch
convolution), whose output is the residual stream every layer reads whole. A narrow value and the few
numbers projected from it (mixing coefficients, Gemma 3n's AltUp) are kept whole too: each is too small
to split, and cutting them apart would cut apart what they weight. The reason is a note in the plan, not
a warning.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.pass_context import PassContext
from tpcompile.sharding_rules import RuleSpec, lookup, op_name
from tpcompile.sharding_rules.rule_context import weight_view

_THROUGH = {"pointwise", "reshape", "norm", "reduce", "split"}  # what lies between a low-rank pair's projections
_NORMS = {"norm", "reduce"}  # a norm over the narrow features (written out: pow, mean, rsqrt)
# choices among the last dim's entries: op -> (position of its dim argument, default dim)
_SELECT = {"aten.topk.default": (2, -1), "aten.sort.default": (1, -1), "aten.sort.stable": (2, -1),
           "aten.argsort.default": (1, -1), "aten.argsort.stable": (2, -1), "aten.argmax.default": (1, None),
           "aten.max.dim": (1, None), "aten.kthvalue.default": (2, -1)}
_SCORES = {"pointwise", "reshape", "along_dim", "softmax", "expand", "transpose", "permute", "cat"}  # logits -> choice


def mark_kept_whole(gm: GraphModule, ctx: PassContext) -> None:
    """Mark routers (`router`), low-rank pairs (`low_rank` on the narrow one, `low_rank_from` on the wide one),
    narrow chains (`low_rank` "narrow" on each) and embedding projections (`embedding_projection`)."""
    for node in _routers(gm, ctx):
        node.meta["tp_rule"] = RuleSpec("weight_matmul", {**node.meta["tp_rule"].args, "router": True})
    for node in _embedding_projections(gm, ctx):
        spec = node.meta["tp_rule"]
        node.meta["tp_rule"] = RuleSpec(spec.rule, {**spec.args, "embedding_projection": True})
    pairs, chains = _low_rank(gm, ctx)
    for node in (n for chain in chains for n in chain):
        node.meta["tp_rule"] = RuleSpec("weight_matmul", {**node.meta["tp_rule"].args, "low_rank": "narrow"})
    for down, up in pairs:
        down.meta["tp_rule"] = RuleSpec("weight_matmul", {**down.meta["tp_rule"].args, "low_rank": "down"})
        up.meta["tp_rule"] = RuleSpec("weight_matmul", {**up.meta["tp_rule"].args, "low_rank_from": down})


def weight_sizes(node: Node, ctx: PassContext) -> Optional[tuple[int, int]]:
    """(in, out) features of a weight matmul with a 2-D parameter weight, else None."""
    spec = node.meta.get("tp_rule")
    if spec is None or spec.rule != "weight_matmul":
        return None
    w, transposed = weight_view(node.args[spec.get("weight")] if spec.get("weight") < len(node.args) else None)
    if w is None or w.target not in ctx.tensors or ctx.tensors[w.target].dim() != 2:
        return None
    rows, cols = ctx.tensors[w.target].shape
    out_in = (spec.get("weight_layout") == "out_in") != transposed
    return (int(cols), int(rows)) if out_in else (int(rows), int(cols))


def _low_rank(gm: GraphModule, ctx: PassContext) -> tuple[list[tuple[Node, Node]], list[list[Node]]]:
    """Low-rank pairs and narrow chains.

    Pairs: (down, up) projections through a narrow value, everything computed from it (dropout, scaling, a
    norm, a reshape, a split; nothing else mixed in) flowing into one weight matmul that widens (part of) it
    again: LoRA's A -> B when out <= in/8 and the value goes nowhere else; MLA's q_a -> q_b and kv_a -> kv_b
    (out <= in/2, a norm over the narrow features on the way), where part of the value may also go elsewhere
    (kv_a's rotary key, whole on every rank anyway). A value meeting another activation (a residual
    stream) is not followed. Megatron and vLLM keep such a down-projection whole on every rank and split the
    up-projection, which needs no communication; propagation does the same when the down-projection's input
    is whole.

    Chains: a projection to at most 1/8 of its input features whose value flows (as above) only into weight
    matmuls that give at most half those input features, each output weighting another activation (a factor of
    a product, `_weights_other`): a few numbers a token projected to a few more coefficients (Gemma 3n's AltUp: a
    router of 4 modalities, then 16 and 4 coefficients that mix its streams). Every part is too small to split,
    and splitting them would cut the coefficients apart: all whole (`low_rank` "narrow"). A LoRA pair on a
    narrow projection (a kv projection half the model's width) is a pair: its B is added to the projection.
    """
    pairs, chains = [], []
    for node in gm.graph.nodes:
        sizes = weight_sizes(node, ctx)
        if sizes is None or sizes[1] * 2 > sizes[0]:
            continue
        ends, region, todo, normed, escapes = set(), {node}, list(node.users), False, False
        while todo and len(region) < 48:
            u = todo.pop()
            if u in region or u in ends or _metadata_read(u):
                continue  # a shape read or an assertion on its metadata: not a use of the values
            spec = u.meta.get("tp_rule")
            if weight_sizes(u, ctx) is not None:
                ends.add(u)
            elif u.op == "call_function" and (u.target is operator.getitem or spec is not None and spec.rule in
                                              _THROUGH) and all(i in region or i.op == "get_attr" or not _tensor(i)
                                                                for i in _values_read(u)):  # nothing else mixed in
                region.add(u)
                normed = normed or (spec is not None and spec.rule in _NORMS)
                todo += list(u.users)
            else:
                escapes = True  # the value goes elsewhere too
        if not ends or todo:
            continue
        narrow = [weight_sizes(u, ctx)[1] * 2 <= sizes[0] and _weights_other(u) for u in ends]
        if sizes[1] * 8 <= sizes[0] and all(narrow):
            chains.append([node, *sorted(ends, key=lambda u: u.name)])
            continue
        up = next(iter(ends)) if len(ends) == 1 else None
        if up is None:
            continue
        up_in, up_out = weight_sizes(up, ctx)
        lora = not escapes and sizes[1] * 8 <= sizes[0] and up_in == sizes[1]
        if lora or (normed and up_in <= sizes[1] < up_out):
            pairs.append((node, up))
    return pairs, chains


_MIXING = {"aten.mul.Tensor", "aten.matmul.default", "aten.bmm.default", "aten.mm.default", "aten.einsum.default"}
_CARRY = {"pointwise", "reshape", "transpose", "permute", "expand"}  # a value carried on, by itself or with constants


def _weights_other(end: Node) -> bool:
    """True when the value of weight op `end`, carried on by elementwise ops with constants, reshapes and
    permutes, meets other activations only as a factor of a product (a matmul of activations, an elementwise
    product): coefficients weighting them, not a term added to one (LoRA's B added to its base projection)."""
    region, todo, found = {end}, list(end.users), False
    while todo and len(region) < 32:
        u = todo.pop()
        if u in region or _metadata_read(u):
            continue
        others = [i for i in _values_read(u) if i not in region and _tensor(i) and i.op != "get_attr"]
        spec = lookup(u.target) if u.op == "call_function" else None
        if not others and spec is not None and spec.rule in _CARRY:
            region.add(u)
            todo += list(u.users)
        elif others and u.op == "call_function" and op_name(u.target) in _MIXING:
            found = True
        else:
            return False
    return found and not todo


def _values_read(node: Node) -> list[Node]:
    """The inputs whose values `node` reads (type_as reads only its other operand's dtype)."""
    if op_name(node.target) == "aten.type_as.default":
        return [a for a in node.args[:1] if isinstance(a, Node)]
    return list(node.all_input_nodes)


def _metadata_read(node: Node) -> bool:
    """True for an op that reads a value's metadata only: a size (sym_size), an assertion on its dtype."""
    val = node.meta.get("val")
    return val is None and node.op == "call_function" or isinstance(val, (int, torch.SymInt))


def _tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _routers(gm: GraphModule, ctx: PassContext) -> list[Node]:
    """Weight matmuls whose output reaches a choice among its features (top-k, max, sort) through
    elementwise ops, softmax and reshapes, directly or inside a no-grad region: a mixture of experts' router."""
    out = []
    for node in gm.graph.nodes:
        if weight_sizes(node, ctx) is None:
            continue
        width = weight_sizes(node, ctx)[1]
        seen, todo = {node}, list(node.users)
        while todo and len(seen) < 24:
            u = todo.pop()
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if _selects(u, width) or _selects_inside(u, gm, width):
                out.append(node)
                break
            spec = lookup(u.target)
            if (spec is None or spec.rule in _SCORES) and _last(u) == width:  # masking, scattering the scores
                todo += list(u.users)
    return out


def _last(node: Node) -> Optional[int]:
    val = node.meta.get("val")
    return int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[-1], int) else None


def _selects(node: Node, width: int) -> bool:
    """True for a top-k / max / sort along the last dim of a value whose last dim is `width` wide."""
    where = _SELECT.get(op_name(node.target))
    if where is None or not node.args or not isinstance(node.args[0], Node) or _last(node.args[0]) != width:
        return False
    i, default = where
    dim = node.args[i] if i < len(node.args) else node.kwargs.get("dim", default)
    return dim is not None and dim % node.args[0].meta["val"].dim() == node.args[0].meta["val"].dim() - 1


def _selects_inside(node: Node, gm: GraphModule, width: int) -> bool:
    """True for a higher-order op (a no-grad region) whose subgraph makes a top-k / max choice."""
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return False
    for a in node.args:
        sub = getattr(gm, a.target, None) if isinstance(a, Node) and a.op == "get_attr" else None
        if isinstance(sub, GraphModule) and any(_selects(n, width) for n in sub.graph.nodes if n.op == "call_function"):
            return True
    return False


_STREAM = {"pointwise", "norm", "reshape"}  # between the embeddings and their projection
_ALONG = {"pointwise", "reshape", "transpose", "permute", "cat"}  # along the stream it starts (patches into tokens)
_WEIGHT_OPS = {"weight_matmul", "weight_conv", "weight_contract"}  # what a later layer's output is computed by


def _embedding_projections(gm: GraphModule, ctx: PassContext) -> list[Node]:
    """Weight ops that start a residual stream from the model's inputs: a weight matmul fed by embedding
    lookups alone, or a convolution (a patch or frame embedding) fed by them or by the model's inputs (through
    elementwise ops, norms and reshapes, no other weight op), whose output, through elementwise ops, reshapes,
    transposes and concatenation (the class token), is read by a norm and added to a value computed from it
    through a later weight op (the first layer's output). The first layer's q/k/v and MLP, also fed by the
    embeddings, are not: their outputs are reshaped into heads or activated, never added back after a weight
    op (rotary embeddings add values computed from q without one); a CNN's convolutions are not added back."""
    out, order = [], list(gm.graph.nodes)
    for node in order:
        x = _projection_input(node, ctx)
        if x is None or not _from_embeddings(x, inputs=node.meta["tp_rule"].rule == "weight_conv"):
            continue
        stream, todo = set(), [node]
        while todo and len(stream) < 24:  # the value and what elementwise ops and reshapes make of it
            n = todo.pop()
            if n not in stream:
                stream.add(n)
                todo += [u for u in n.users if _rule(u) in _ALONG]
        normed = any(_rule(u) in _NORMS for n in stream for u in n.users)
        if normed and _adds_back(stream, order):
            out.append(node)
    return out


def _projection_input(node: Node, ctx: PassContext) -> Optional[Node]:
    """The input of a weight matmul with a 2-D parameter weight, or of an ungrouped convolution with a parameter
    weight; else None."""
    spec = node.meta.get("tp_rule")
    if weight_sizes(node, ctx) is not None:
        x = node.args[spec.get("input")]
    elif spec is not None and spec.rule == "weight_conv":
        args = node.args
        w = args[spec.get("weight")] if spec.get("weight") < len(args) else None
        groups = spec.get("groups_arg")
        if groups is not None and groups < len(args) and args[groups] != 1:
            return None
        if not isinstance(w, Node) or w.op != "get_attr" or w.target not in ctx.tensors:
            return None
        x = args[spec.get("input")]
    else:
        return None
    return x if isinstance(x, Node) else None


def _rule(node: Node) -> Optional[str]:
    spec = lookup(node.target) if node.op == "call_function" else None
    return spec.rule if spec is not None else None


def _from_embeddings(value: object, *, inputs: bool = False, limit: int = 32) -> bool:
    """True when `value` is computed from embedding lookups (at least one; with `inputs`, the model's inputs
    count too), parameters and constants alone, through elementwise ops, norms and reshapes."""
    todo, seen, found = [value], set(), False
    while todo:
        n = todo.pop()
        if not isinstance(n, Node) or n in seen or n.op == "get_attr":
            continue
        seen.add(n)
        rule = _rule(n)
        if rule == "embedding" or (inputs and n.op == "placeholder"):
            found = True
        elif rule not in _STREAM or len(seen) > limit:
            return False  # a placeholder, a weight op, attention: not the embeddings alone
        else:
            todo += n.all_input_nodes
    return found


def _adds_back(stream: set, order: list[Node]) -> bool:
    """True when an add in the stream has an operand computed from the stream through a weight op (a later
    layer's output), found in one pass over the graph in order up to the last such add."""
    adds = {n for n in stream if n.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)}
    if not adds:
        return False
    last = max(i for i, n in enumerate(order) if n in adds)
    reach, through = set(stream), set()  # computed from the stream; and so through a weight op
    for n in order[:last]:
        if n in stream or not any(i in reach for i in n.all_input_nodes):
            continue
        reach.add(n)
        spec = n.meta.get("tp_rule")
        if (spec is not None and spec.rule in _WEIGHT_OPS) or any(i in through for i in n.all_input_nodes):
            through.add(n)
    return any(i in through for a in adds for i in a.all_input_nodes if i not in stream)
