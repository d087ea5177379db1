"""The collectives of a token split (sequence parallelism), on a view that puts the tokens in a dim of their own.

A split dim holds, per sequence, T tokens of k entries each (k = 1 but for a router's top-k choices flattened
with the tokens: `layouts.token_shares.tokens_of`), and, when flattened with the batch ((B*T, C):
`Shard(0, seq, outer=B)`), B such sequences. Each collective runs on the (B, T, k, ...) view (the sizes B and T
read off the model inputs that have them), so that a rank's share is whole tokens of every sequence, in order;
shares differ by one token when ws does not divide T (the first T % ws ranks hold one more), and a gather is
given T to drop the padding each share is sent with.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch.fx import Node

from tpcompile.layouts import block_of, token_shares
from tpcompile.passes.rewrite_sizes import learn_size, size_node, size_op
from tpcompile.placement import Shard, is_seq
from tpcompile.sharding_rules.rule_context import to_size

aten = torch.ops.aten
tp = torch.ops.tpcompile


def _tokens(dim_size: Any, p: Shard) -> tuple[Any, int]:
    """(tokens of one sequence, entries per token) of a dim of `dim_size` token-split as `p`, as sizes."""
    return token_shares.tokens_of(block_of(to_size(dim_size), p.outer))


def token_total(em: Any, dim_size: Any, p: Shard) -> Optional[tuple[Any, int]]:
    """(the tokens of one sequence, as a value of the rank graph: an int, or a model input's size; entries per
    token) of a dim of `dim_size` token-split as `p`; None when no model input has that many tokens."""
    tokens, inner = _tokens(dim_size, p)
    try:
        return size_node(em, tokens), inner
    except ValueError:
        return None


def token_share(em: Any, total: Any) -> Any:
    """This rank's share of `total` tokens (an int, or a node of the rank graph): ceil((total - rank) / ws)."""
    if isinstance(total, int):
        return token_shares.share(total, em.rank, em.ws)
    extra = em.ws - 1 - em.rank
    return em.call(operator.floordiv, em.call(operator.add, total, extra) if extra else total, em.ws)


def local_tokens(em: Any, dim_size: Any, p: Shard, given: Any) -> Any:
    """This rank's size of a token-split dim of global `dim_size` whose size the graph gives as `given`."""
    found = token_total(em, dim_size, p) if _tokens(dim_size, p)[1] > 1 else None  # k entries a token: T's share
    if found is None:
        return token_share(em, given)
    return size_op(em, operator.mul, token_share(em, found[0]), found[1])


def local_flat_tokens(em: Any, dim_size: Any, p: Shard, given: Any) -> Any:
    """This rank's size of a dim of B sequences' tokens flattened ((B*T, C): `Shard(d, seq, outer=B)`) of global
    `dim_size`, whose size the graph gives as `given`: B times its share of T, k entries a token."""
    outer = size_node(em, p.outer)
    found = token_total(em, dim_size, p)
    if found is None:  # T read off the given size
        inner = _tokens(dim_size, p)[1]
        found = size_op(em, operator.floordiv, given, size_op(em, operator.mul, outer, inner)), inner
    share = token_share(em, found[0])
    return size_op(em, operator.mul, size_op(em, operator.mul, outer, share), found[1])


def _view(em: Any, x: Node, p: Shard, tokens: Any, inner: int) -> tuple[Node, int]:
    """x with its split dim as (B, tokens, k) (B when flattened with the batch, k when > 1); the tokens' dim."""
    sizes = ([size_node(em, p.outer)] if p.outer is not None else []) + [tokens] + ([inner] if inner > 1 else [])
    if len(sizes) == 1:
        return x, p.dim
    return em.call(aten.unflatten.int, x, p.dim, sizes), p.dim + (p.outer is not None)


def _flat(em: Any, x: Node, p: Shard, inner: int) -> Node:
    """The view of `_view` flattened back."""
    extra = (p.outer is not None) + (inner > 1)
    return em.call(aten.flatten.using_ints, x, p.dim, p.dim + extra) if extra else x


def _tokens_shape(node: Node, p: Shard, rank_tokens: bool, ws: int) -> tuple:
    """The (B, T, k, ...) view's shape, the tokens as an even share on a rank (alike on every rank)."""
    shape = [to_size(s) for s in node.meta["val"].shape]
    tokens, inner = token_shares.tokens_of(block_of(shape[p.dim], p.outer))
    shape[p.dim:p.dim + 1] = [p.outer, tokens // ws if rank_tokens else tokens] + ([inner] if inner > 1 else [])
    return tuple(str(s) for s in shape)


def _cut(em: Any, op: Any, x: Node, node: Node, p: Shard) -> Node:
    """A reduce-scatter or scatter of the whole value x (the rank graph's value of `node`) by tokens."""
    tokens, inner = _tokens(node.meta["val"].shape[p.dim], p)
    view, d = _view(em, x, p, -1, inner)
    if not isinstance(tokens, int):  # a token count no model input gives (patches): the gathers later read it here
        learn_size(em, tokens, lambda: em.call(aten.sym_size.int, view, d))
    out = em.call(op, view, d, em.plan.group)
    if p.outer is not None:
        out.meta["tp_shape"] = _tokens_shape(node, p, False, em.ws)
    return _flat(em, out, p, inner)


def scatter_tokens(em: Any, src: Node, node: Node, p: Shard) -> Node:
    """This rank's tokens of the whole value `src`, without communicating."""
    return _cut(em, tp.scatter.default, src, node, p)


def reduce_scatter_tokens(em: Any, node: Node, y: Node, p: Shard) -> Node:
    """A row split's sum `y` reduce-scattered by tokens."""
    return _cut(em, tp.reduce_scatter.default, y, node, p)


def gather_tokens(em: Any, src: Node, node: Node, p: Shard, op: Any) -> Node:
    """Every rank's tokens of `src` (this rank's) gathered, given the length when shares may differ by one."""
    found = token_total(em, node.meta["val"].shape[p.dim], p)
    total, inner = (None, 1) if found is None else found
    size = {} if total is None or isinstance(total, int) and total % em.ws == 0 else {"size": total}
    viewed = p.outer is not None or inner > 1  # no -1 next to a share of 0 in the view: a rank may hold none
    view, d = _view(em, src, p, token_share(em, total) if viewed and total is not None else -1, inner)
    out = em.call(op, view, d, em.plan.group, **size)
    if p.outer is not None:
        out.meta["tp_shape"] = _tokens_shape(node, p, True, em.ws)
    return _flat(em, out, p, inner)


def reduce_partial(em: Any, node: Node, y: Node) -> Node:
    """Sum the ranks' partial results: all-reduce, or reduce-scatter by tokens under SP."""
    p = em.plan.placement(node)
    if is_seq(p):
        return reduce_scatter_tokens(em, node, y, p)
    return em.call(tp.all_reduce.default, y, em.plan.group)
