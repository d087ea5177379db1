"""The plan: what shard() decided, per weight op and per parameter, read off the frozen plan (passes/decisions.py).

`Plan` is the result users read (`ShardedModel.plan`); the user's own choices are the
overrides (tpcompile.overrides), and `tpcompile plan` renders a Plan (report/plan_table.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

from torch import nn
from torch.fx import GraphModule

from tpcompile.passes.decisions import Decisions
from tpcompile.passes.pass_context import PassContext, describe, owner_path
from tpcompile.passes.propagate import SEED_RULES, seed_path
from tpcompile.placement import Cuts, ParamSlice, is_seq, piece_cut, slice_shape
from tpcompile.sharding_rules.rule_context import RuleContext, not_token_split

SPLIT_ROLES = ("column", "row", "vocab", "channels")


@dataclass(frozen=True)
class ParamPlan:
    """What one parameter became: its split, and its global and per-rank shapes."""

    name: str
    role: str  # column | row | vocab | follows | unread | replicated
    dim: Optional[int]
    segments: Optional[tuple[int, ...]]
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    tied: tuple[str, ...] = ()  # other names of the same parameter
    padded: Optional[Union[int, tuple[int, ...]]] = None  # split as if zero-padded to this size (per segment: sizes)
    pieces: Optional[int] = None  # split into this many pieces, each shared by world_size/pieces ranks
    seg_pieces: Optional[tuple[int, ...]] = None  # per segment, its number of pieces (kv heads fewer than ranks)
    cuts: Optional[Cuts] = None  # per segment, the bounds of its pieces; a padded split's one cut (Shard.cuts)
    world_size: int = 1
    head: Optional[int] = None  # the features one head spans along the split dim (`tpcompile plan`: heads a rank)

    def slice(self) -> Optional[ParamSlice]:
        """How the parameter is cut (tpcompile.placement.rank_pieces; None: whole)."""
        if self.dim is None:
            return None
        return piece_cut(self.dim, self.global_shape[self.dim], self.pieces) if self.pieces \
            else ParamSlice(self.dim, self.segments, cuts=self.cuts)


def param_plan(name: str, role: str, sl: Optional[ParamSlice], shape: tuple, local: tuple, tied: tuple,
               world_size: int) -> ParamPlan:
    """The report of one parameter cut by `sl`: its padding per segment and pieces per segment spelled out."""
    if sl is None:
        return ParamPlan(name, role, None, None, shape, local, tied, world_size=world_size)
    if sl.pieces:  # one segment in pieces: spelled as their count
        return ParamPlan(name, role, sl.dim, None, shape, local, tied, None, sl.pieces, None, None, world_size)
    padded = tuple(sl.pads()) if sl.seg_padded else sl.padded
    counts = tuple(sl.counts(world_size)) if sl.shared(world_size) else None
    return ParamPlan(name, role, sl.dim, sl.segments, shape, local, tied, padded, None, counts, sl.cuts, world_size)


@dataclass
class Plan:
    """Every decision: per weight-owning module its role, per parameter its split."""

    world_size: int
    modules: dict[str, str] = field(default_factory=dict)
    parameters: dict[str, ParamPlan] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # reductions and norms over a split dim put together from partial statistics: op and place -> how, and why
    statistics: dict[str, str] = field(default_factory=dict)
    # with sequence_parallel=True: each row split or vocabulary embedding -> where its sum lands, and why
    sequence_parallel: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, module: str) -> str:
        return self.modules[module]


def build_plan(gm: GraphModule, decided: Decisions, ctx: PassContext) -> Plan:
    """The Plan of a propagated graph: module roles and slices from the frozen plan, what was kept whole and why
    (and the warnings) from the propagation's context."""
    plan = Plan(decided.world_size, warnings=list(ctx.warnings))
    for node in gm.graph.nodes:
        layout = decided.layout(node)
        spec = decided.rule(node)
        if layout is None or spec is None or spec.rule not in SEED_RULES:
            continue
        path = seed_path(node, decided)
        role = layout.role if layout.role in SPLIT_ROLES else "replicated"
        # a module read by several weight ops (an embedding whose weight is also the head `h @ W.t()`):
        # the first split role names it
        if path is not None and plan.modules.get(path, "replicated") == "replicated":
            plan.modules[path] = role
        if decided.sequence_parallel and role in ("row", "vocab") and path is not None:
            why = not_token_split(RuleContext.shape(node), decided.world_size)
            plan.sequence_parallel[path] = "reduce-scattered: split by tokens" if is_seq(decided.placement(node)) \
                else f"not split by tokens: {why or 'its sum is needed whole'}"
    for seed, why in [*ctx.demoted.items(), *ctx.notes.items()]:
        if seed_path(seed, decided) is not None:
            plan.replicated[seed_path(seed, decided)] = why
        elif decided.layout(seed).role == "stats":
            plan.statistics[describe(seed)] = why
    seen: set[int] = set()
    for name, t in decided.tensors.items():
        if not isinstance(t, nn.Parameter) or id(t) in seen:
            continue
        seen.add(id(t))
        sl = decided.slice_for(name)
        owners = [owner_path(n) for n in decided.aliases(name)]
        roles = [plan.modules[o] for o in owners if o in plan.modules]
        # "follows": cut like the split value it is combined with, by no weight op of its own (param_cuts.py)
        role = next((r for r in roles if r != "replicated"), "follows") if sl is not None else "replicated"
        if name in ctx.unread:  # no op reads it: cut for storage only (param_cuts.cut_unread)
            role = "unread"
        local = slice_shape(t.shape, sl, decided.world_size)
        tied = tuple(n for n in decided.aliases(name) if n != name)
        plan.parameters[name] = replace(param_plan(name, role, sl, tuple(t.shape), local, tied, decided.world_size),
                                        head=head_size(name, decided, ctx))
    return plan


def head_size(name: str, decided: Decisions, ctx: PassContext) -> Optional[int]:
    """The features one head spans along a parameter's split: its weight ops' head size (`heads`, a group cut's, or
    else the `unit` its padding keeps whole), a row split's from the column splits it reads; None unless they agree
    on one size."""
    users = ctx.param_seeds.get(name, frozenset())
    sizes: set = set()
    for seed in {*users, *(o for u in users for o in ctx.row_inputs.get(u, ()))}:
        spec = decided.rule(seed)
        if spec is None:
            continue
        groups = spec.get("kv_groups")
        found = (groups[2],) if groups else spec.get("heads") or spec.get("unit") or ()
        sizes |= {s for s in (found if isinstance(found, tuple) else (found,)) if isinstance(s, int) and s > 1}
    return sizes.pop() if len(sizes) == 1 else None

