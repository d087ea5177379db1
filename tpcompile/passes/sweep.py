"""One round of propagation: a Sweep over the graph in order (see passes/propagate.py for the rounds).

`visit` asks each node's rule (passes/op_result.py), `judge` blames or regroups the origins of a conflict, `record`
writes node.meta['tp_placement'] and ['tp_layout'], `read_parameter` places a parameter read as
the previous round cut it, `settle_parameters` gives each parameter one cut.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.blame import upstream
from tpcompile.passes.layout import Layout
from tpcompile.passes.param_cuts import cut_two_ways, wished_cut
from tpcompile.passes.op_result import check_wants, gathering_seq, op_result
from tpcompile.passes.pass_context import PassContext, describe, internal_error
from tpcompile.passes.pending_sums import lonely_lookups
from tpcompile.passes.region_bodies import place_body
from tpcompile.placement import REPLICATE, ParamSlice, Shard, is_seq, slice_placement
from tpcompile.sharding_rules.conform import conformed
from tpcompile.sharding_rules.partial import partial_result
from tpcompile.sharding_rules.rule_context import Choice, Result, RuleContext, Want, keeps_entries, param_view_chain, weight_view

SEED_RULES = ("weight_matmul", "weight_conv", "embedding", "weight_contract")  # the ops that hold the weights a split starts from
WRITE_RULES = ("write_into",)  # in-place writes into a buffer, which they cut like the value written
SEED_ROLES = ("column", "vocab")  # the roles that start a split (a row split ends one)
# ops that keep a model input a model input: views, casts, parts of it, values written into a copy of it (the
# ids an embedding reads are checked against its rows whatever their source, passes/rewrite.py _emit_vocab)
_INPUT_LIKE = ("reshape", "pointwise", "expand", "slice", "select", "write_into")


def seed_path(node: Node, decided: Any = None) -> Optional[str]:
    """The module path of a weight op (matmul with a parameter, embedding), else None (read off a frozen plan)."""
    spec = node.meta.get("tp_rule") if decided is None else decided.rule(node)
    if node.op != "call_function" or spec is None or spec.rule not in SEED_RULES:
        return None
    return spec.get("owner")  # written by annotate


class Sweep:
    """One round: every node's placement in graph order, and what the next round must change.

    After `run()`, `conflicts` holds (blamed origins, reason), `regroups` (origins, pieces) and `unpieces` (origins
    whose pieces go one to a rank instead);
    ctx.param_slices holds how each parameter is cut this round, `unsettled` the parameters read
    outside their weight ops whose cut differs from the one this round assumed (-> their seeds).
    """

    def __init__(self, gm: GraphModule, ctx: PassContext) -> None:
        self.gm, self.ctx = gm, ctx
        self.origins: dict[Node, frozenset] = {}  # sharded value -> the seeds whose splits it carries
        self.grad: dict[Node, bool] = {}
        self.requests: dict[str, dict[Optional[ParamSlice], set]] = {}  # parameter -> slice -> users
        self.wishes: dict[str, dict[ParamSlice, set]] = {}  # parameter -> slice -> seeds (param_cuts.py)
        self.conflicts: list[tuple[frozenset, str]] = []
        self.conflicted: list[Node] = []  # the ops of the conflicts, in graph order
        self.regroups: list[tuple[frozenset, int]] = []
        self.unpieces: list[frozenset] = []
        self.tainted: set[Node] = set()  # downstream of a conflict whose guess may be wrong
        self.lost: dict[Node, frozenset] = {}  # node -> the seeds whose splits conflicts took from its inputs
        ctx.notes = {}
        self.assumed = dict(ctx.param_slices)  # how the previous round cut each parameter
        self.assumed_seeds = dict(ctx.param_seeds)
        self.unsettled: dict[str, frozenset] = {}
        # Seeds this sweep has already blamed: the next round replicates them, so a value split only
        # by them is replicated there too, and the rest of this sweep reads it that way. Otherwise
        # their splits travel on (along a residual stream, say) and later ops blame seeds that are fine.
        self.doomed: set[Node] = set()
        self.rules = RuleContext(
            world_size=ctx.world_size, placement=self.placement, requires_grad=lambda n: self.grad.get(n, False),
            param=self.param, is_user_input=_is_user_input, demoted=lambda n: n in ctx.demoted,
            segment_hint=lambda n: n.meta["tp_rule"].get("segments"),
            sequence_parallel=ctx.sequence_parallel, pieces_of=ctx.pieces.get,
            unpieced=lambda n: n in ctx.unpieced, buffer=self.buffer,
            split_bytes=self.split_bytes, place_body=place_body)

    def run(self) -> None:
        """Visit every node in order, then settle each parameter's slice."""
        for node in self.gm.graph.nodes:
            self.grad[node] = _requires_grad(node, self.ctx, self.grad)
            if node.op == "output":
                self.conflicts += _output(node, self.placement, self.sources(node), self.ctx, self.unpieces)
            elif node.op == "get_attr":
                self.read_parameter(node)
            elif node.op != "call_function":
                node.meta["tp_placement"] = REPLICATE
                node.meta["tp_layout"] = Layout()
            else:
                self.visit(node)
        # token ids laid out (T, B) by a transpose (XLNet's) are the token ids still
        self.conflicts += lonely_lookups(self.gm, lambda n: _is_user_input(n, _INPUT_LIKE + ("transpose", "permute")))
        self.settle_parameters()

    def read_parameter(self, node: Node) -> None:
        """A parameter or buffer read: split as the previous round cut it, its origins the seeds that cut it."""
        sl = self.assumed.get(node.target)
        node.meta["tp_layout"] = Layout()
        node.meta["tp_placement"] = REPLICATE if sl is None else slice_placement(sl)
        if sl is not None:
            self.origins[node] = self.ctx.param_seeds.get(node.target, frozenset())

    def placement(self, n: Any) -> Any:
        """A node's placement so far; a value split only by doomed seeds reads as replicated."""
        if not isinstance(n, Node):
            return REPLICATE
        p = n.meta.get("tp_placement", REPLICATE)
        return _replicated_like(p) if self.doomed and n in self.origins and self.origins[n] <= self.doomed else p

    def buffer(self, n: Any) -> Optional[torch.Tensor]:
        """The buffer a get_attr node reads (a KV cache, a running statistic), else None."""
        if isinstance(n, Node) and n.op == "get_attr":
            t = self.ctx.tensors.get(n.target)
            return t if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) else None
        return None

    def param(self, n: Any) -> Optional[torch.Tensor]:
        """The parameter a get_attr node reads, else None."""
        if isinstance(n, Node) and n.op == "get_attr":
            t = self.ctx.tensors.get(n.target)
            return t if isinstance(t, torch.nn.Parameter) else None
        return None

    def split_bytes(self, n: Node) -> int:
        """Bytes of the weights the origins of a split value cut (what replicating them would cost)."""
        tensors = {id(t): t for seed in self.origins.get(n, frozenset()) for w in weight_args(seed)
                   for t in [self.ctx.tensors.get(w.target)] if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def sources(self, node: Node) -> frozenset:
        """The origins of the node's sharded inputs (a weight op's own weights are not data to it)."""
        weights = weight_args(node)
        return frozenset().union(*(self.origins.get(i, frozenset()) for i in node.all_input_nodes
                                   if i not in weights and _sharded(self.placement(i))))

    def visit(self, node: Node) -> None:
        """Ask the op's rule, judge any conflict, record the result."""
        src = self.sources(node)  # before judging: blaming dooms seeds, which changes what inputs read as
        try:
            res = conformed(node, partial_result(node, self.rules, self.placement, op_result))
        except Exception as e:  # a rule bug: name the node and pass, keep the cause
            raise internal_error("propagate", node, e) from e
        # the splits lost on the way here (blamed at a conflict, or doomed): a seed fed by them is whole-input
        lost = frozenset().union(*(self.lost.get(i, frozenset()) for i in node.all_input_nodes))
        lost |= frozenset().union(*(self.origins[i] for i in node.all_input_nodes if i in self.origins
                                    and self.origins[i] <= self.doomed and i.op != "get_attr"))
        res = self.judge(node, res, src)
        self.record(node, res, src, lost | self.lost.get(node, frozenset()))

    def judge(self, node: Node, res: Result, src: frozenset) -> Result:
        """Blame the origins of a conflict (or ask to regroup them); a conflicted op reads as replicated."""
        inputs = node.all_input_nodes
        why, blame = res.conflict, res.blame
        if why is None:
            why, blame = check_wants(res, self.placement, self.rules.world_size, weight_args(node))
        if why and any(is_seq(self.placement(i)) for i in inputs):
            res, why, blame = gathering_seq(node, self.rules, self.placement, res, why, blame)
        # A conflicted op is taken as replicated for the rest of the sweep. That guess is what
        # the next round computes when every origin of its inputs is replicated; when only some
        # are (or they are regrouped), what follows it is a guess, judged in the next round.
        downstream = any(i in self.tainted for i in inputs)
        if res.demote_self and not downstream:
            self.conflicts.append((frozenset([node]), f"{describe(node)}: {res.demote_self}"))
            self.conflicted.append(node)
            self.doomed.add(node)
        if downstream:
            self.tainted.add(node)
        if why and not downstream:
            blamed = upstream(frozenset().union(*(self.origins.get(b, frozenset()) for b in blame)) if blame else src)
            pieced = upstream(frozenset().union(*(self.origins.get(i, frozenset()) for i in res.unpiece or ())))
            if res.regroup and blamed and not any(o in self.ctx.pieces for o in blamed):
                self.regroups.append((blamed, res.regroup))  # split into fewer pieces instead
                self.tainted.add(node)
            elif pieced and not pieced & self.ctx.unpieced:
                self.unpieces.append(pieced)  # their pieces one to a rank instead of shared
                self.tainted.add(node)
            else:
                text = f"{describe(node)}: {why}"
                self.conflicts.append((blamed or src, Choice(text) if isinstance(why, Choice) else text))
                self.conflicted.append(node)
                self.doomed.update(blamed or src)
                self.lost[node] = blamed or src
                if (blamed or src) != src:
                    self.tainted.add(node)
        if why:
            res = Result(_replicated_like(res.out), [Want(w.node, REPLICATE) for w in res.wants])
        return res

    def record(self, node: Node, res: Result, src: frozenset, lost: frozenset = frozenset()) -> None:
        """Write the node's placement and layout; note its parameter uses and its origins."""
        for p, sl in res.params.items():
            self.requests.setdefault(p.target, {}).setdefault(sl, set()).add(node)
        # after a conflict, wants are guesses; a step on the way from a parameter (a cast, a squeeze) only passes
        # on the placement it reads, which would keep a cut alive once its reader no longer wants it
        for w in res.wants if node not in self.tainted and not keeps_entries(node) else ():
            wish = wished_cut(w.node, w.placement, self.param, self.ctx.world_size)
            if wish is not None:
                self.wishes.setdefault(wish[0], {}).setdefault(wish[1], set()).update(src)
        node.meta["tp_placement"] = res.out
        node.meta["tp_layout"] = Layout(res.role, res.wants, res.localize)
        if res.note:
            self.ctx.notes[node] = res.note
        if lost:
            self.lost[node] = lost
        if res.role == "row":  # what made it a row split: if those are replicated later, that is the root cause
            self.ctx.row_inputs.setdefault(node, src)
        elif res.role == "column" and lost:  # would have been a row split, had its input kept its splits
            self.ctx.row_inputs.setdefault(node, lost)
        if _sharded(res.out) and not is_seq(res.out):
            self.origins[node] = src | (frozenset([node]) if res.role in SEED_ROLES else frozenset())

    def settle_parameters(self) -> None:
        """One slice per parameter; a parameter used both split and whole blames its split users (in a round
        with no other conflict; until then it is whole)."""
        self.ctx.param_slices, self.ctx.param_seeds = {}, {}
        # This round's other conflicts change what reaches a parameter's users (a weight shared by layers,
        # first reached while the residual stream is still split): a disagreement is judged once they are gone.
        progress = self.regroups or self.unpieces or any(o not in self.ctx.demoted for origins, _ in self.conflicts
                                                         for o in origins)
        for target, by_slice in self.requests.items():
            if len(by_slice) > 1 and not progress:
                self.conflicts.append(cut_two_ways(target, by_slice, self.ctx, weight_args) or (
                    frozenset().union(*(s for sl, s in by_slice.items() if sl is not None)),
                    f"parameter {target} is used both split and whole"))
            sl = next(iter(by_slice)) if len(by_slice) == 1 else None
            self.ctx.param_slices[target] = sl
            if sl is not None:
                self.ctx.param_seeds[target] = frozenset(by_slice[sl])
        for target, wished in self.wishes.items():  # cut where every reader wants the same slice
            if target not in self.requests and len(wished) == 1 and len(self.ctx.aliases(target)) == 1 \
                    and target not in self.ctx.unwished and target not in self.ctx.whole:
                sl, seeds = next(iter(wished.items()))
                self.ctx.param_slices[target], self.ctx.param_seeds[target] = sl, frozenset(seeds)
        for node in self.gm.graph.nodes:  # reads outside the weight ops must see the cut they will get
            if node.op == "get_attr" and self.ctx.param_slices.get(node.target) != self.assumed.get(node.target):
                seeds = self.ctx.param_seeds.get(node.target, frozenset())
                if any(u not in seeds for u in node.users):
                    self.unsettled[node.target] = seeds or self.assumed_seeds.get(node.target, frozenset())


def weight_args(node: Node) -> set:
    """The weight and bias arguments of a weight op (it cuts them itself), else nothing."""
    spec = node.meta.get("tp_rule")
    if node.op == "call_function" and spec is not None and spec.rule in WRITE_RULES:
        dst = node.args[0]
        return {dst} if isinstance(dst, Node) and dst.op == "get_attr" else set()
    if node.op != "call_function" or spec is None or spec.rule not in SEED_RULES:
        return set()
    if spec.get("view") is not None:  # a parameter viewed through transposes / a gather by expert ids
        return {spec.get("view").param, *spec.get("view").nodes}
    pieces = {n for k in ("weight_piece", "bias_piece") if spec.get(k) is not None  # a row piece of a parameter
              for n in (spec.get(k).param, *spec.get(k).nodes)}
    positions = [spec.get("weight"), spec.get("bias")] if spec.rule in ("weight_matmul", "weight_conv") else [0]
    args = [node.args[i] for i in positions if i is not None and i < len(node.args)]
    pieces |= {n for a in args for n in param_view_chain(a)} if spec.rule == "weight_conv" else set()  # w.squeeze(1)
    return pieces | {w for w in (weight_view(a)[0] for a in args) if w is not None} | \
        {a for a in args if isinstance(a, Node) and a.op == "call_function" and weight_view(a)[0] is not None}


def _sharded(p: Any) -> bool:
    """True for a Shard, or a tuple of placements (a split's outputs) holding one."""
    return isinstance(p, Shard) or (isinstance(p, tuple) and any(isinstance(q, Shard) for q in p))


def _is_user_input(node: Node, through: tuple = _INPUT_LIKE) -> bool:
    """A model input, possibly reshaped or converted (token ids reaching an embedding)."""
    for _ in range(8):
        if node.op == "placeholder":
            return True
        spec = node.meta.get("tp_rule")
        if node.op != "call_function" or spec is None or spec.rule not in through:
            return False
        if not isinstance(node.args[0], Node):
            return False
        node = node.args[0]
    return False


def _replicated_like(out: Any) -> Any:
    return tuple(REPLICATE for _ in out) if isinstance(out, tuple) else (None if out is None else REPLICATE)


def _output(node: Node, placement: Any, src: frozenset, ctx: PassContext, unpieces: list) -> list:
    """Sharded results are gathered once at the end (or left sharded when the plan says so); heads in pieces
    shared by ranks are asked to go one to a rank first (`unpieces`)."""
    keep = bool(src) and all(ctx.override_for(seed_path(o) or "") == "sharded_output" for o in src)
    node.meta["tp_layout"] = Layout("output", [], gather_output=not keep)
    node.meta["tp_placement"] = REPLICATE
    for n in node.all_input_nodes:
        p = placement(n)
        if isinstance(p, Shard) and (p.segments is not None and len(p.segments) > 1 or p.outer is not None):
            return [(src, f"output {n.name} is split in segments {p.segments}; cannot gather it in order")]
        if isinstance(p, Shard) and p.pieces is not None and src and not src & ctx.unpieced:
            unpieces.append(src)
        elif isinstance(p, Shard) and p.pieces is not None:
            return [(src, f"output {n.name} is {p.pieces} pieces shared among {ctx.world_size} ranks; "
                          f"a gather would repeat them")]
    return []


def _requires_grad(node: Node, ctx: PassContext, grad: dict[Node, bool]) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]  # a multi-output op (topk, split): any float output
    if not any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals):
        return False
    if node.op == "get_attr":
        t = ctx.tensors.get(node.target)
        return bool(t is not None and t.requires_grad)
    if node.op == "placeholder":
        return True
    return any(grad.get(i, False) for i in node.all_input_nodes)

