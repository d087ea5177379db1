"""One round of propagation: a Sweep over the graph in order (see passes/propagate.py for the rounds).

`visit` asks each node's rule, `judge` blames or regroups the origins of a conflict, `record`
writes node.meta['tp_placement'] and ['tp_layout'], `read_parameter` places a parameter read as
the previous round cut it, `settle_parameters` gives each parameter one cut.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

import torch
from torch.fx import GraphModule, Node

from tpcompile.passes.pass_context import PassContext, describe, internal_error
from tpcompile.placement import REPLICATE, ParamSlice, Replicate, Shard, is_seq, slice_placement
from tpcompile.sharding_rules.registry import apply_rule
from tpcompile.sharding_rules.rule_context import Result, RuleContext, Want, weight_view

SEED_RULES = ("weight_matmul", "embedding")  # the ops that hold the weights a split starts from
SEED_ROLES = ("column", "vocab")  # the roles that start a split (a row split ends one)
_INPUT_LIKE = ("reshape", "pointwise", "expand")  # ops that keep a model input a model input


@dataclass
class Layout:
    """node.meta['tp_layout']: what the rewriter must do around one node."""

    role: str = "generic"
    wants: list[Want] = field(default_factory=list)
    localize: Optional[list[tuple]] = None
    gather_output: bool = True


def seed_path(node: Node) -> Optional[str]:
    """The module path of a weight op (matmul with a parameter, embedding), else None."""
    spec = node.meta.get("tp_rule")
    if node.op != "call_function" or spec is None or spec.rule not in SEED_RULES:
        return None
    return spec.get("owner")  # written by annotate


class Sweep:
    """One round: every node's placement in graph order, and what the next round must change.

    After `run()`, `conflicts` holds (blamed origins, reason) and `regroups` (origins, pieces);
    ctx.param_slices holds how each parameter is cut this round, `unsettled` the parameters read
    outside their weight ops whose cut differs from the one this round assumed (-> their seeds).
    """

    def __init__(self, gm: GraphModule, ctx: PassContext) -> None:
        self.gm, self.ctx = gm, ctx
        self.origins: dict[Node, frozenset] = {}  # sharded value -> the seeds whose splits it carries
        self.grad: dict[Node, bool] = {}
        self.requests: dict[str, dict[Optional[ParamSlice], set]] = {}  # parameter -> slice -> users
        self.conflicts: list[tuple[frozenset, str]] = []
        self.regroups: list[tuple[frozenset, int]] = []
        self.tainted: set[Node] = set()  # downstream of a conflict whose guess may be wrong
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
            sequence_parallel=ctx.sequence_parallel, pieces_of=ctx.pieces.get)

    def run(self) -> None:
        """Visit every node in order, then settle each parameter's slice."""
        for node in self.gm.graph.nodes:
            self.grad[node] = _requires_grad(node, self.ctx, self.grad)
            if node.op == "output":
                self.conflicts += _output(node, self.placement, self.sources(node), self.ctx)
            elif node.op == "get_attr":
                self.read_parameter(node)
            elif node.op != "call_function":
                node.meta["tp_placement"] = REPLICATE
                node.meta["tp_layout"] = Layout()
            else:
                self.visit(node)
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

    def param(self, n: Any) -> Optional[torch.Tensor]:
        """The parameter a get_attr node reads, else None."""
        if isinstance(n, Node) and n.op == "get_attr":
            t = self.ctx.tensors.get(n.target)
            return t if isinstance(t, torch.nn.Parameter) else None
        return None

    def sources(self, node: Node) -> frozenset:
        """The origins of the node's sharded inputs (a weight op's own weights are not data to it)."""
        weights = _weight_args(node)
        return frozenset().union(*(self.origins.get(i, frozenset()) for i in node.all_input_nodes
                                   if i not in weights and _sharded(self.placement(i))))

    def visit(self, node: Node) -> None:
        """Ask the op's rule, judge any conflict, record the result."""
        src = self.sources(node)  # before judging: blaming dooms seeds, which changes what inputs read as
        try:
            res = _result(node, self.rules, self.placement)
        except Exception as e:  # a rule bug: name the node and pass, keep the cause
            raise internal_error("propagate", node, e) from e
        self.record(node, self.judge(node, res, src), src)

    def judge(self, node: Node, res: Result, src: frozenset) -> Result:
        """Blame the origins of a conflict (or ask to regroup them); a conflicted op reads as replicated."""
        inputs = node.all_input_nodes
        why, blame = res.conflict, res.blame
        if why is None:
            why, blame = _check_wants(res, self.placement, _weight_args(node))
        if why and any(is_seq(self.placement(i)) for i in inputs):
            res, why, blame = _gathering_seq(node, self.rules, self.placement, res, why, blame)
        # A conflicted op is taken as replicated for the rest of the sweep. That guess is what
        # the next round computes when every origin of its inputs is replicated; when only some
        # are (or they are regrouped), what follows it is a guess, judged in the next round.
        downstream = any(i in self.tainted for i in inputs)
        if res.demote_self and not downstream:
            self.conflicts.append((frozenset([node]), f"{describe(node)}: {res.demote_self}"))
            self.doomed.add(node)
        if downstream:
            self.tainted.add(node)
        if why and not downstream:
            blamed = frozenset().union(*(self.origins.get(b, frozenset()) for b in blame)) if blame else src
            if res.regroup and blamed and not any(o in self.ctx.pieces for o in blamed):
                self.regroups.append((blamed, res.regroup))  # split into fewer pieces instead
                self.tainted.add(node)
            else:
                self.conflicts.append((blamed or src, f"{describe(node)}: {why}"))
                self.doomed.update(blamed or src)
                if (blamed or src) != src:
                    self.tainted.add(node)
        if why:
            res = Result(_replicated_like(res.out), [Want(w.node, REPLICATE) for w in res.wants])
        return res

    def record(self, node: Node, res: Result, src: frozenset) -> None:
        """Write the node's placement and layout; note its parameter uses and its origins."""
        for p, sl in res.params.items():
            self.requests.setdefault(p.target, {}).setdefault(sl, set()).add(node)
        node.meta["tp_placement"] = res.out
        node.meta["tp_layout"] = Layout(res.role, res.wants, res.localize)
        if res.note:
            self.ctx.notes[node] = res.note
        if _sharded(res.out) and not is_seq(res.out):
            self.origins[node] = src | (frozenset([node]) if res.role in SEED_ROLES else frozenset())

    def settle_parameters(self) -> None:
        """One slice per parameter; a parameter used both split and whole blames its split users."""
        self.ctx.param_slices, self.ctx.param_seeds = {}, {}
        for target, by_slice in self.requests.items():
            if len(by_slice) > 1:
                users = frozenset().union(*(s for sl, s in by_slice.items() if sl is not None))
                self.conflicts.append((users, f"parameter {target} is used both split and whole"))
            sl = next(iter(by_slice)) if len(by_slice) == 1 else None
            self.ctx.param_slices[target] = sl
            if sl is not None:
                self.ctx.param_seeds[target] = frozenset(by_slice[sl])
        for node in self.gm.graph.nodes:  # reads outside the weight ops must see the cut they will get
            if node.op == "get_attr" and self.ctx.param_slices.get(node.target) != self.assumed.get(node.target):
                seeds = self.ctx.param_seeds.get(node.target, frozenset())
                if any(u not in seeds for u in node.users):
                    self.unsettled[node.target] = seeds or self.assumed_seeds.get(node.target, frozenset())


def _weight_args(node: Node) -> set:
    """The weight and bias arguments of a weight op (it cuts them itself), else nothing."""
    spec = node.meta.get("tp_rule")
    if node.op != "call_function" or spec is None or spec.rule not in SEED_RULES:
        return set()
    positions = [spec.get("weight"), spec.get("bias")] if spec.rule == "weight_matmul" else [0]
    args = [node.args[i] for i in positions if i is not None and i < len(node.args)]
    return {w for w in (weight_view(a)[0] for a in args) if w is not None} | \
        {a for a in args if isinstance(a, Node) and a.op == "call_function" and weight_view(a)[0] is not None}


def _gathering_seq(node: Node, rules: RuleContext, placement: Any, res: Result, why: str, blame: Any) -> tuple:
    """Retry an op that cannot take token-split inputs with those inputs gathered first."""
    gathered = {i for i in node.all_input_nodes if is_seq(placement(i))}

    def view(n: Any) -> Any:
        return REPLICATE if n in gathered else placement(n)
    retry = _result(node, rules.seeing(view), view)
    again = retry.conflict or _check_wants(retry, view)[0]
    return (res, why, blame) if again else (retry, None, None)


def _sharded(p: Any) -> bool:
    """True for a Shard, or a tuple of placements (a split's outputs) holding one."""
    return isinstance(p, Shard) or (isinstance(p, tuple) and any(isinstance(q, Shard) for q in p))


def _is_user_input(node: Node) -> bool:
    """A model input, possibly reshaped or converted (token ids reaching an embedding)."""
    for _ in range(8):
        if node.op == "placeholder":
            return True
        spec = node.meta.get("tp_rule")
        if node.op != "call_function" or spec is None or spec.rule not in _INPUT_LIKE:
            return False
        if not isinstance(node.args[0], Node):
            return False
        node = node.args[0]
    return False


def _result(node: Node, rules: RuleContext, placement: Any) -> Result:
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


def _check_wants(res: Result, placement: Any, own: Collection[Node] = ()) -> tuple[Optional[str], Optional[list[Node]]]:
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


def _replicated_like(out: Any) -> Any:
    return tuple(REPLICATE for _ in out) if isinstance(out, tuple) else (None if out is None else REPLICATE)


def _output(node: Node, placement: Any, src: frozenset, ctx: PassContext) -> list:
    """Sharded results are gathered once at the end (or left sharded when the plan says so)."""
    keep = bool(src) and all(ctx.override_for(seed_path(o) or "") == "sharded_output" for o in src)
    node.meta["tp_layout"] = Layout("output", [], gather_output=not keep)
    node.meta["tp_placement"] = REPLICATE
    for n in node.all_input_nodes:
        p = placement(n)
        if isinstance(p, Shard) and (p.segments is not None and len(p.segments) > 1 or p.outer is not None):
            return [(src, f"output {n.name} is split in segments {p.segments}; cannot gather it in order")]
        if isinstance(p, Shard) and p.pieces is not None:
            return [(src, f"output {n.name} is {p.pieces} pieces shared among {ctx.world_size} ranks; "
                          f"a gather would repeat them")]
    return []


def _requires_grad(node: Node, ctx: PassContext, grad: dict[Node, bool]) -> bool:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()):
        return False
    if node.op == "get_attr":
        t = ctx.tensors.get(node.target)
        return bool(t is not None and t.requires_grad)
    if node.op == "placeholder":
        return True
    return any(grad.get(i, False) for i in node.all_input_nodes)
