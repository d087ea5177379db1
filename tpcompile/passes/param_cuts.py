"""Parameters cut where their only reader takes a slice of them.

A small parameter combined elementwise with a split value (Mamba's `A_log`, `D` and `dt_proj.bias`
against the split inner channels; a norm's weight against a value split on its features) is
wanted split by that op. Read whole, each rank would hold all of it and cut its slice at run
time. When the parameter reaches that op only through ops that keep its elements in place (casts,
unary elementwise ops, unsqueeze, squeeze, transpose), each with no other reader, the parameter
is stored cut instead, and the ops before the reader run on the slice. Such a cut is a wish, not
a demand: it is made only when every wish for the parameter agrees, no weight op cuts it and
the parameter has one name (not tied) (Sweep.settle_parameters), so it never creates a conflict.

A parameter that two weight ops cut two ways (`cut_two_ways`): a tied vocabulary table that the embedding cuts by
rows and a masked-LM head, after a split transform, by its input features. The transform's weights are kept whole
instead, where they hold fewer bytes than the table, so the head reads the table by rows too.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.fx import Node

from tpcompile.passes.pass_context import describe
from tpcompile.placement import REPLICATE, ParamSlice, Shard, pad_cuts
from tpcompile.sharding_rules.rule_context import Choice, param_behind, readers


def wished_cut(node: Any, want: Any, param: Callable[[Any], Optional[torch.Tensor]],
               world_size: int) -> Optional[tuple[str, ParamSlice]]:
    """(parameter name, slice) when `node`, wanted split as `want`, is a parameter seen through in-place ops
    that nothing else reads, and cutting the parameter would give each rank exactly its part; else None."""
    if not (isinstance(want, Shard) and (want.plain or want.plain_padded) and not want.seq) \
            or not isinstance(node, Node) \
            or len(readers(node)) != 1:
        return None
    found = param_behind(node, want.dim, sole=True)
    if found is None:
        return None
    attr, d = found
    t = param(attr)
    if t is None:
        return None
    if want.padded is not None:  # zero-padded like the value it meets (a norm weight over padded heads)
        return None if want.padded % world_size else (str(attr.target), ParamSlice(d, cuts=want.cuts))
    if t.shape[d] % world_size:
        return None
    return str(attr.target), ParamSlice(d)


def cut_two_ways(target: str, by_slice: dict, ctx: Any,
                 weight_args: Callable[[Node], set]) -> Optional[tuple[frozenset, str]]:
    """A parameter cut two ways, one of them by a row split (a tied vocabulary: the embedding cuts its rows,
    the head after a split transform its input features): the weights that split the row reader's input
    are kept whole when they hold fewer bytes than the parameter, so that it is cut one way; a planned
    choice. None when that does not apply."""
    if None in by_slice or len(by_slice) != 2:
        return None
    rows = {sl: users for sl, users in by_slice.items()
            if all(u.meta.get("tp_layout") is not None and u.meta["tp_layout"].role == "row" for u in users)}
    if len(rows) != 1:
        return None
    (sl, row_users), = rows.items()
    feeders = frozenset().union(*(ctx.row_inputs.get(u, frozenset()) for u in row_users))
    tensors = {id(t): t for f in feeders for w in weight_args(f) for t in [ctx.tensors.get(w.target)]
               if t is not None}
    own = ctx.tensors.get(target)
    if not feeders or own is None or sum(t.numel() for t in tensors.values()) > own.numel():
        return None
    names = ", ".join(sorted(describe(u) for u in row_users))
    other = next(k for k in by_slice if k is not sl).dim
    return feeders, Choice(f"{names}: its input is kept whole, so that {target} is cut one way: along dim "
                           f"{other} as its other readers cut it, not along dim {sl.dim} by this row split "
                           f"(the weights that would split the input hold fewer bytes than {target})")


def cut_unread(gm: Any, ctx: Any) -> list[str]:
    """Cut along dim 0 (zero-padded when the world size does not divide it) each parameter the captured graph never
    reads: a causal-LM decoder's cross-attention run without an encoder, a head the forward skips. No op sees it,
    so each rank only stores its share, and checkpoints put it back together. The names cut."""
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.users}  # (export keeps dead reads)
    ws, cut, seen = ctx.world_size, [], set()
    for name, t in ctx.tensors.items():
        if not isinstance(t, torch.nn.Parameter) or id(t) in seen or t.dim() == 0 or t.shape[0] < ws:
            continue
        seen.add(id(t))
        if any(a in read for a in ctx.aliases(name)) or ctx.slice_for(name) is not None:
            continue
        rows = int(t.shape[0])
        ctx.param_slices[name] = ParamSlice(0, cuts=None if rows % ws == 0 else pad_cuts(-(-rows // ws) * ws, ws))
        cut.append(name)
    return cut


def wished_upstream(sweep: Any) -> set[str]:
    """The parameters cut by wishes whose split reaches one of a sweep's conflicts along split values: what keeps
    a conflict alive once every seed it could blame is replicated (read split as the last round cut it, the op
    combining it with the now whole value still wants it split)."""
    found, todo, seen = set(), list(sweep.conflicted), set()
    while todo:
        n = todo.pop()
        for i in n.all_input_nodes:
            p = i.meta.get("tp_placement", REPLICATE)
            if i in seen or not any(isinstance(q, Shard) for q in (p if isinstance(p, tuple) else (p,))):
                continue
            seen.add(i)
            if i.op != "get_attr":
                todo.append(i)
            elif sweep.assumed.get(i.target) is not None and i.target not in sweep.requests:
                found.add(str(i.target))
    return found
