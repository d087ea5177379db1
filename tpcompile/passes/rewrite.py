"""Rewrite pass: one rank's graph, with local shape literals, sliced weights and collectives."""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import fx
from torch.fx import GraphModule, Node

import tpcompile.ops  # noqa: F401  (registers torch.ops.tpcompile.* and tpcompile_rng.*)
from tpcompile.layouts import dim_layout
from tpcompile.ops.schedule import collective_name
from tpcompile.passes.decisions import Decisions
from tpcompile.passes.pass_context import internal_error
from tpcompile.passes.pending_sums import reduce_site, sum_paths
from tpcompile.passes.rank_module import build_rank_module
from tpcompile.passes.rewrite_dropout import (emit_dropout, emit_sdpa_with_dropout, is_idle_dropout, is_live_dropout,
                                             sdpa_dropout)
from tpcompile.passes.rewrite_grad_mask import grad_masked
from tpcompile.passes.rewrite_regions import emit_region, is_region
from tpcompile.passes.rewrite_shapes import localize
from tpcompile.passes.rewrite_slices import local_slice, zero_padding
from tpcompile.passes.rewrite_stats import emit_stats, is_stats
from tpcompile.passes.rewrite_tables import emit_owned, emit_vocab
from tpcompile.passes.rewrite_tokens import gather_tokens, reduce_partial, scatter_tokens
from tpcompile.placement import REPLICATE, Partial, Replicate, Shard, is_seq, local_shape, shape_key, slice_shape
from tpcompile.sharding_rules.rule_context import Want, param_behind, weight_view
from tpcompile.sharding_rules.shared_pieces import cut_from_shared

aten = torch.ops.aten
tp = torch.ops.tpcompile


class _Emitter:
    """Builds the rank graph node by node, inserting each collective once per value."""

    def __init__(self, gm: GraphModule, plan: Decisions, rank: int) -> None:
        self.gm, self.plan, self.rank, self.ws = gm, plan, rank, plan.world_size
        self.graph = fx.Graph()
        self.graph._codegen = gm.graph._codegen  # pytree in/out specs, read-only
        self.env: dict[Node, Node] = {}
        self.cache: dict[tuple, Node] = {}
        self.current: Node = None  # the source node being rewritten, for meta
        self.sources: dict[Node, Node] = {}  # new node -> the source node whose value it holds

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta = {k: v for k, v in self.current.meta.items() if k in ("nn_module_stack", "stack_trace")}
        if collective_name(target) is not None:
            node.meta["tp_shape"] = self.input_shape(args[0])  # compared across ranks by verify_rank
        return node

    def copy(self, node: Node, lookup: Callable[[Node], Node]) -> Node:
        """The source node itself in the rank graph, its arguments looked up; it keeps the source's meta and
        the placement of the value it holds (`tp_placement`, from the frozen plan)."""
        new = self.graph.node_copy(node, lookup)
        if self.plan.placement(node) is not None:
            new.meta["tp_placement"] = self.plan.placement(node)
        return new

    def input_shape(self, x: Node) -> Optional[tuple[str, ...]]:
        """This rank's shape of a collective's input, as expressions (None when unknown)."""
        src = self.sources.get(x)
        if src is not None and src.op == "get_attr":
            t = self.plan.tensors.get(src.target)
            if t is None:
                return None
            return shape_key(slice_shape(t.shape, self.plan.slice_for(src.target), self.ws))
        # not a source's value: the partial sum of the op being rewritten (row split, vocabulary), full size
        p = self.plan.placement(src) if src is not None else None
        val = (src if src is not None else self.current).meta.get("val")
        if not isinstance(val, torch.Tensor) or isinstance(p, tuple):
            return None
        if is_seq(p):  # ranks' shares of the tokens may differ by one: the even share, alike on every rank
            p = replace(p, seq=False)
        return shape_key(local_shape(val.shape, p, self.rank, self.ws))

    def converted(self, w: Want) -> Node:
        """The new-graph value of an input, redistributed to what the consuming op wants."""
        have, src = self.plan.placement(w.node), self.env[w.node]
        if isinstance(have, Partial) and not isinstance(w.placement, Partial):  # the pending sum, reduced once
            have, src = REPLICATE, self._reduce_pending(w.node, src)
        if is_seq(have) and isinstance(w.placement, Replicate):
            # region entry under sequence parallelism: gather the tokens ((B*T, C): on its (B, T, C) view); a split
            # consumer's gradient is partial, so it is reduce-scattered back (all_gather's backward)
            op = tp.all_gather.default if w.grad_sync else tp.all_gather_replicated.default
            return self._tokens_gathered(op, w.node, src, have)
        if is_seq(have) and isinstance(w.placement, Shard) and not is_seq(w.placement):
            # a token split read split another way (a gate from the residual stream on split heads): the tokens
            # gathered as a whole value, then this rank's part of it as from any whole value, below
            have, src = REPLICATE, self._tokens_gathered(tp.all_gather_replicated.default, w.node, src, have)
        if isinstance(have, Replicate) and is_seq(w.placement):  # this rank's tokens (of every sequence)
            key = ("scatter", w.node, w.placement.dim)
            if key not in self.cache:
                self.cache[key] = scatter_tokens(self, src, w.node, w.placement)
            return self.cache[key]
        shared = cut_from_shared(have, w.placement, self.ws)  # its gradient is summed where the shared piece is made
        if shared or isinstance(have, Replicate) and isinstance(w.placement, Shard) and not w.placement.plain:
            key = ("slice", w.node, w.placement)  # segments, pieces, batch x heads: this rank's runs, no communication
            if key not in self.cache:
                self.cache[key] = local_slice(self, src, w.node, w.placement, sync=not shared,
                                              piece=have if shared and have.pieces > 1 else None)
            return self.cache[key]
        if isinstance(have, Replicate) and isinstance(w.placement, Shard):
            return self._once(("scatter", w.node, w.placement.dim), tp.scatter.default,
                              src, w.placement.dim, self.plan.group)
        if w.grad_sync and isinstance(have, Replicate):
            return self._once(("grad_all_reduce", w.node), tp.grad_all_reduce.default, src, self.plan.group)
        if have != w.placement:  # handed on as it is, the op would compute on a value laid out otherwise
            raise ValueError(f"{w.node.name} is laid out {have} here and read as {w.placement}, a conversion the "
                             f"rewrite has no step for")
        return src

    def _tokens_gathered(self, op: Any, value: Node, src: Node, have: Shard) -> Node:
        """Token-split `value` gathered whole by `op` (once per op and value)."""
        if (op, value) not in self.cache:
            self.cache[(op, value)] = gather_tokens(self, src, value, have, op)
        return self.cache[(op, value)]

    def _reduce_pending(self, value: Node, src: Node) -> Node:
        """The all-reduce of a pending sum, attributed (module path, stack) to the op that left it pending or to its
        first summand (passes/pending_sums.py); its meta names the modules whose splits made the sum."""
        consumer, self.current = self.current, reduce_site(value, self.plan)
        out = self._once(("reduce", value), tp.all_reduce.default, src, self.plan.group)
        self.current, out.meta["tp_sum_of"] = consumer, sum_paths(value, self.plan)
        return out

    def _once(self, key: tuple, target: Any, *args: Any) -> Node:
        if key not in self.cache:
            self.cache[key] = self.call(target, *args)
        return self.cache[key]


def rewrite_pass(gm: GraphModule, plan: Decisions, rank: int) -> GraphModule:
    """Return rank `rank`'s GraphModule: same inputs and outputs as the model, local weights."""
    return build_rank_module(gm, plan, rank, rewrite_graph(gm, plan, rank))


def rewrite_graph(gm: GraphModule, plan: Decisions, rank: int) -> fx.Graph:
    """Rank `rank`'s graph alone, without slicing any weights (what the verifier compares), from the captured
    graph and the frozen plan."""
    em = _Emitter(gm, plan, rank)
    for node in gm.graph.nodes:
        try:
            _rewrite_node(em, node)
        except Exception as e:  # name the node and pass, keep the cause
            raise internal_error("rewrite", node, e) from e
        if node in em.env:
            em.sources[em.env[node]] = node
    return em.graph


Lookup = Callable[[Node], Node]  # a source node -> its value in the rank graph, converted as the op wants
Emit = Callable[["_Emitter", Node, Lookup], Optional[Node]]  # emits the replacement; None emits nothing
Match = Callable[[Decisions, Node], bool]  # whether a row of REWRITES applies to a node


def _role(role: str) -> Match:
    return lambda plan, node: plan.layout(node).role == role


def _is_sdpa_with_dropout(node: Node) -> bool:
    return node.target is aten.scaled_dot_product_attention.default and sdpa_dropout(node) > 0


def _emit_copy(em: "_Emitter", node: Node, lookup: Lookup) -> Node:
    """The op itself on the rank's values, its size literals made local."""
    new = em.copy(node, lookup)
    layout = em.plan.layout(node)
    if layout.localize:
        new.args = localize(em, new, layout.localize, em.plan.placement(node))
    if isinstance(em.plan.placement(node), (Shard, tuple)):
        new.meta.pop("val", None)
        new.meta.pop("tensor_meta", None)
        new.kwargs = {k: v for k, v in new.kwargs.items() if k != "output_size"}  # repeat_interleave's whole size
    return new


# What happens to each call_function node, first match wins: (matches, emits).
REWRITES: list[tuple[Match, Emit]] = [
    (_role("row"), lambda em, node, lookup: _emit_row(em, node, lookup)),  # local matmul, all-reduce, bias once
    (_role("vocab"), emit_vocab),  # own rows, zero the rest, all-reduce (or the sum left pending)
    (_role("owned"), emit_owned),  # one row of a split table: its rank's, zeros elsewhere (a pending sum)
    # a reduction or norm over the split dim: partial statistics, one small collective
    (lambda plan, node: is_stats(node, plan), emit_stats),
    # cond / map / an autocast region: its bodies rewritten for this rank
    (lambda plan, node: is_region(node), lambda em, node, lookup: emit_region(em, node, lookup, _rewrite_node)),
    # an assertion of a sharded tensor's global size: dropped
    (lambda plan, node: _stale_metadata_assert(plan, node), lambda em, node, lookup: None),
    (lambda plan, node: is_idle_dropout(node), lambda em, node, lookup: lookup(node.args[0])),  # off: no op
    (lambda plan, node: is_live_dropout(node), emit_dropout),  # mask from each element's place in the whole
    (lambda plan, node: _is_sdpa_with_dropout(node), emit_sdpa_with_dropout),  # attention spelled out, masked
    # everything else: the same op on local values (inputs of a derivative unbounded at the padding masked there)
    (lambda plan, node: True, lambda em, node, lookup: _emit_copy(em, node, grad_masked(em, node, lookup))),
]


def _rewrite_node(em: _Emitter, node: Node) -> None:
    """Emit the rank-local replacement of one node: inputs converted as its layout wants, then its row."""
    em.current = node
    layout = em.plan.layout(node)
    if node.op == "output":
        _emit_output(em, node, layout.gather_output)
        return
    if layout is None or node.op != "call_function":
        em.env[node] = em.copy(node, lambda n: em.env[n])
        return
    repl = {w.node: em.converted(w) for w in layout.wants}
    if layout.role in ("column", "channels"):  # a grouped convolution's kernel is cut like its channels
        repl.update(_piece_params(em, node))
    lookup: Lookup = lambda n: repl.get(n, em.env[n])  # noqa: E731
    emit = next(emit for matches, emit in REWRITES if matches(em.plan, node))
    new = emit(em, node, lookup)
    if new is not None:
        em.env[node] = new


def _piece_params(em: _Emitter, node: Node) -> dict[Node, Node]:
    """Parameters cut into fewer pieces than ranks: their gradients summed over the sharing ranks."""
    out = {}
    for arg in node.all_input_nodes:
        p, transposed = weight_view(arg)
        behind = param_behind(arg, 0, depth=5) if p is None else None  # a kernel viewed as `w.squeeze(1)`
        at, p = (arg, behind[0]) if behind is not None and behind[1] == 0 else (p, p)  # summed at the view's dim 0
        sl = em.plan.slice_for(p.target) if p is not None else None
        if sl is not None and sl.fewer(em.ws):
            if ("pieces", at) not in em.cache:
                em.cache[("pieces", at)] = _summed_pieces(em, em.env[at], sl)
            summed = em.cache[("pieces", at)]
            # a weight read through a transpose: the transpose again, of the summed piece
            out[arg] = em.call(arg.target, summed, *arg.args[1:]) if transposed else summed
    return out


def _summed_pieces(em: _Emitter, w: Node, sl: Any) -> Node:
    """The weight, its gradient summed over the ranks sharing each piece (per segment for a fused q|k|v)."""
    piece = torch.ops.tpcompile.grad_piece_all_reduce.default
    if sl.pieces:  # one segment
        return em.call(piece, w, sl.dim, sl.pieces, em.plan.group)
    # this rank's part of each segment (none of most of a kv group's query heads cut one piece a rank), and its count
    sized = [(b - a, g) for (a, b), g in zip(dim_layout(sl, None, em.ws).blocks(em.rank), sl.counts(em.ws)) if b > a]
    parts = em.call(aten.split_with_sizes.default, w, [n for n, _ in sized], sl.dim)
    runs = [em.call(operator.getitem, parts, k) for k in range(len(sized))]
    runs = [em.call(piece, r, sl.dim, g, em.plan.group) if g < em.ws else r for r, (_, g) in zip(runs, sized)]
    return em.call(aten.cat.default, runs, sl.dim)


def _emit_output(em: _Emitter, node: Node, gather: bool) -> None:
    def fix(n: Node) -> Node:
        p = em.plan.placement(n)
        if isinstance(p, Partial):
            return em._once(("reduce", n), tp.all_reduce.default, em.env[n], em.plan.group)
        if is_seq(p) and gather:
            if ("gather", n) not in em.cache:
                em.cache[("gather", n)] = gather_tokens(em, em.env[n], n, p, tp.all_gather_replicated.default)
            return em.cache[("gather", n)]
        if isinstance(p, Shard) and gather:
            out = em._once(("gather", n), tp.all_gather_replicated.default, em.env[n], p.dim, em.plan.group)
            if p.padding is not None:  # drop the zero padding past the real size
                out = em._once(("unpad", n), aten.slice.Tensor, out, p.dim, 0, int(n.meta["val"].shape[p.dim]))
            return out
        return em.env[n]
    em.graph.output(fx.node.map_arg(node.args[0], fix))


def _emit_row(em: _Emitter, node: Node, lookup: Callable[[Node], Node]) -> Node:
    """Row split: local matmul without bias, one all-reduce, then the bias once (or the sum left pending)."""
    spec = em.plan.rule(node)
    src = node.args[spec.get("input")] if spec.get("input") is not None else None  # (an einsum's operands: none)
    x = zero_padding(em, src, lookup(src)) if src is not None else None  # padding that may not hold zeros: zeros
    if isinstance(em.plan.placement(node), Partial):  # reduced where a later op needs the whole value
        return _emit_copy(em, node, lambda n: x if n is src else lookup(n))
    w = lookup(node.args[spec.get("weight")])
    bi = spec.get("bias")
    bias = node.args[bi] if bi is not None and bi < len(node.args) else None
    # the same matmul without its bias (addmm's bias goes, leaving mm); a convolution keeps its other arguments
    conv = spec.rule == "weight_conv"
    rest = (None, *node.args[bi + 1:]) if conv else ()
    y = em.call(aten.mm.default if node.target is aten.addmm.default else node.target, x, w, *rest)
    y = reduce_partial(em, node, y)
    if not isinstance(bias, Node):
        return y
    b, out = lookup(bias), node.meta.get("val")
    if isinstance(out, torch.Tensor) and out.dtype != bias.meta["val"].dtype:  # autocast cast the fused bias too
        b = em.call(aten._to_copy.default, b, dtype=out.dtype)
    if conv:  # (C,) added to (B, C, *spatial)
        b = em.call(aten.view.default, b, [-1] + [1] * (out.dim() - 2))
    return em.call(aten.add.Tensor, y, b)


def _stale_metadata_assert(plan: Decisions, node: Node) -> bool:
    """A metadata assertion about a sharded tensor's global size no longer holds: drop it."""
    if node.target is not aten._assert_tensor_metadata.default:
        return False
    return node.kwargs.get("size") is not None and isinstance(plan.placement(node.args[0]), Shard)
