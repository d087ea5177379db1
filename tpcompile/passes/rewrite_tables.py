"""Tables split by rows, rewritten for one rank: a lookup of its own rows (zeros for the others' ids), and one row
selected by the rank that holds it (zeros on the others). Both leave a summand per rank: reduced at once, or
left pending to join other sums (sharding_rules/partial.py)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import Node

from tpcompile.ops.guards import check_token_ids
from tpcompile.passes.pass_context import describe
from tpcompile.passes.rewrite_tokens import reduce_partial
from tpcompile.placement import Partial

aten = torch.ops.aten
Lookup = Callable[[Node], Node]  # a source node -> its value in the rank graph, converted as the op wants


def emit_vocab(em: Any, node: Node, lookup: Lookup) -> Node:
    """Vocabulary split: look up only this rank's rows, zero the rest; one all-reduce, or the sum left pending."""
    w, idx = lookup(node.args[0]), lookup(node.args[1])
    sl = em.plan.slice_for(node.args[0].target)
    rows_in_model = int(node.args[0].meta["val"].shape[0])
    idx = em.call(check_token_ids, idx, rows_in_model, describe(node))  # the original raises on such ids
    vocab = sl.padded or rows_in_model
    start, stop = em.rank * vocab // em.ws, (em.rank + 1) * vocab // em.ws
    outside = em.call(aten.bitwise_or.Tensor, em.call(aten.lt.Scalar, idx, start), em.call(aten.ge.Scalar, idx, stop))
    local = em.call(aten.masked_fill.Scalar, em.call(aten.sub.Scalar, idx, start), outside, 0)
    pad = node.args[2] if len(node.args) > 2 else -1
    pad = pad - start if start <= pad < stop else -1
    rows = em.call(aten.embedding.default, w, local, pad, *node.args[3:])
    rows = em.call(aten.masked_fill.Scalar, rows, em.call(aten.unsqueeze.default, outside, -1), 0.0)
    return rows if isinstance(em.plan.placement(node), Partial) else reduce_partial(em, node, rows)  # or pending


def emit_owned(em: Any, node: Node, lookup: Lookup) -> Node:
    """One entry along a dim split in even blocks (zero-padded or not): the rank whose block holds it selects it,
    the others give zeros of its shape; the sum stays pending (sharding_rules/slicing.select)."""
    x, dim, index = node.args[0], node.args[1], node.args[2]
    shape, p = x.meta["val"].shape, em.plan.placement(x)
    dim = dim % len(shape)
    index = index % int(shape[dim])
    block = (p.padded or int(shape[dim])) // em.ws
    entry = em.call(aten.select.int, lookup(x), dim, index % block)
    return entry if index // block == em.rank else em.call(aten.zeros_like.default, entry)
