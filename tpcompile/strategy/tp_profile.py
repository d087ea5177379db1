"""What tensor parallelism at degree t does to each block: tpcompile's own plan and rank-0 collectives, read as costs.

For each degree the captured graph goes through tpcompile's passes (`shard_captured`, the
plan shard() would make) and rank 0's graph is rewritten (the graph alone, as the rank
verifier's reference is: no GraphModule, no weight slices); costs are read from what they wrote:
the frozen plan (`ShardedModel.decisions`) says which matmuls and activations are split, the plan
gives each parameter's per-rank shape, and each collective node carries its per-rank input shape
(node.meta['tp_shape']). The passes run on the one captured graph, one degree after another; each
degree's decision is its own frozen value, which the next degree's propagation does not touch.

A *unit* is what the planner may split or replicate: the module holding a group of split
weights (an attention or MLP module, or the block itself), or a split weight module on its own
when its parent spans several blocks (an embedding, an LM head); tied weights join their units.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from tpcompile.api import shard_captured
from tpcompile.errors import TPCompileWarning
from tpcompile.ops.schedule import graph_schedule
from tpcompile.passes.pass_context import module_path
from tpcompile.placement import Shard
from tpcompile.strategy import node_costs as nc
from tpcompile.strategy.profile import CAPTURE_BATCH, ModelProfile

SPLIT_ROLES = ("column", "row", "vocab")


@dataclass(frozen=True)
class Collective:
    """One tensor-parallel collective per microbatch: its op and its per-rank input elements per sample."""

    op: str  # all_reduce | all_gather | reduce_scatter | all_gather_replicated | grad_all_reduce | scatter
    elems: float


@dataclass
class Unit:
    """A group of split weights that the planner may keep split or replicate."""

    name: str
    paths: tuple[str, ...]  # module paths to replicate (tpcompile plan= keys)
    block: int
    flops_full: float = 0.0  # forward matmul FLOPs per sample, unsplit
    flops_rank: float = 0.0  # the same on one rank when split
    moved_full: float = 0.0
    moved_rank: float = 0.0
    act_full: float = 0.0
    act_rank: float = 0.0
    params_full: int = 0
    params_rank: int = 0
    collectives: list[Collective] = field(default_factory=list)


@dataclass
class BlockTP:
    """One block at degree t, all units split (per sample; parameters in elements)."""

    flops: float = 0.0
    moved: float = 0.0  # memory-bound elements of split values (already divided)
    moved_whole: float = 0.0  # memory-bound elements every rank moves whole (sequence parallelism divides them)
    act_split: float = 0.0  # activation elements that are split across the t ranks (already divided)
    act_whole: float = 0.0  # activation elements every rank holds whole (sequence parallelism divides them)
    params: int = 0
    collectives: list[Collective] = field(default_factory=list)  # not in any unit


@dataclass
class TPProfile:
    """The model at tensor-parallel degree t."""

    degree: int
    blocks: list[BlockTP]
    units: list[Unit]
    replicated: dict[str, str]  # module path -> why tpcompile itself replicated it


def _split(p: Any) -> bool:
    """True for a placement that splits a value across ranks (not a token split, not replicated)."""
    ps = p if isinstance(p, tuple) else (p,)
    return any(isinstance(x, Shard) and not x.seq for x in ps)


def _find_units(profile: ModelProfile, sm: Any, rank0: Any) -> tuple[list[Unit], dict[str, Unit]]:
    """Units from the plan's split weight modules, tied weights and the modules whose pending sums one all-reduce
    reduces (token and position embeddings) merged; module path -> unit."""
    modules = [m for m, role in sm.plan.modules.items() if role in SPLIT_ROLES]
    key: dict[str, str] = {}
    for m in modules:
        parent = m.rpartition(".")[0]
        inside = profile.block_of_path(m)
        key[m] = parent if parent and inside is not None and profile.block_of_path(parent) == inside else m
        if inside is None and len([b for b in profile.blocks]) == 1 and parent:
            key[m] = parent  # a model without repeated layers: one unit per parent module
    joined = [[n.rpartition(".")[0] for n in (pp.name, *pp.tied)] for pp in sm.plan.parameters.values()]
    joined += [list(n.meta["tp_sum_of"]) for n in rank0.nodes if n.meta.get("tp_sum_of")]
    for owners in joined:  # tied weights, summands of one sum: one decision for all their modules
        owners = [o for o in owners if o in key]
        for o in owners[1:]:
            old, new = key[o], key[owners[0]]
            for m in key:
                if key[m] == old:
                    key[m] = new
    groups: dict[str, list[str]] = {}
    for m in modules:
        groups.setdefault(key[m], []).append(m)
    units: list[Unit] = []
    by_path: dict[str, Unit] = {}
    for name, members in groups.items():
        paths = (name,) if all(m == name or m.startswith(name + ".") for m in members) else tuple(members)
        block = min((_block_of(profile, m) for m in members), default=0)
        unit = Unit(name, paths, block)
        units.append(unit)
        for m in members:
            by_path[m] = unit
        by_path[name] = unit
    return units, by_path


def _block_of(profile: ModelProfile, path: str) -> int:
    """The block a module path belongs to (its repeated layer, else the block of its first node)."""
    b = profile.block_of_path(path)
    if b is not None:
        return b
    return profile.module_blocks.get(path, 0)


def _unit_of(path: str, by_path: dict[str, Unit]) -> Any:
    """The unit covering a module path (longest matching prefix), or None."""
    while path:
        if path in by_path:
            return by_path[path]
        path = path.rpartition(".")[0]
    return None


def tp_profile(profile: ModelProfile, degree: int) -> TPProfile:
    """Run tpcompile's passes at `degree` on the captured graph and read the per-rank costs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TPCompileWarning)
        sm = shard_captured(profile.captured, degree)
        rank0 = sm.rank_graph(0)  # the graph sm.rank(0) wraps
    units, by_path = _find_units(profile, sm, rank0)
    blocks = [BlockTP() for _ in profile.blocks]
    live = nc.input_dependent(sm.captured.graph.nodes)
    per = 1.0 / CAPTURE_BATCH
    facts = profile.node_costs  # what no degree changes, read off each node once
    for node, b in profile.node_block.items():
        if node not in live:
            continue
        if node not in facts:
            facts[node] = _node_facts(node)
        path, view, matmul, cost, size = facts[node]
        if view:
            continue
        unit = _unit_of(path, by_path)
        placed = _split(sm.decisions.placement(node))
        split = placed or any(_split(sm.decisions.placement(a)) for a in node.all_input_nodes)
        div = degree if split else 1
        if matmul:
            field_full, field_rank, block_field = "flops_full", "flops_rank", "flops"
        else:
            field_full, field_rank, block_field = "moved_full", "moved_rank", "moved" if div != 1 else "moved_whole"
        setattr(blocks[b], block_field, getattr(blocks[b], block_field) + cost / div)
        if size is not None:
            if placed:
                blocks[b].act_split += size / degree
            else:
                blocks[b].act_whole += size
        if unit is not None:
            setattr(unit, field_full, getattr(unit, field_full) + cost)
            setattr(unit, field_rank, getattr(unit, field_rank) + cost / div)
            if size is not None:
                unit.act_full += size
                unit.act_rank += size / degree if placed else size
    for name, pp in sm.plan.parameters.items():
        b = _block_of_param(profile, name, pp.tied)
        full, local = math.prod(pp.global_shape), math.prod(pp.local_shape)
        blocks[b].params += local
        unit = _unit_of(name.rpartition(".")[0], by_path)
        if unit is not None:
            unit.params_full += full
            unit.params_rank += local
    for call, node in graph_schedule(rank0):
        elems = math.prod(int(s) for s in call.shape if str(s).isdigit()) * per
        source = node.args[0] if node.args and hasattr(node.args[0], "meta") else node
        path = module_path(node) or module_path(source)
        # a pending sum joined outside the modules that split it (token plus position embeddings) is theirs
        unit = next((u for p in (path, *node.meta.get("tp_sum_of", ())) if (u := _unit_of(p, by_path))), None)
        coll = Collective(call.op, elems)
        if unit is not None:
            unit.collectives.append(coll)
        else:
            blocks[_block_of(profile, path) if path else len(blocks) - 1].collectives.append(coll)
    replicated = dict(sm.plan.replicated)
    if profile.copies:
        units = _copy_layers(profile, blocks, units, replicated)
    return TPProfile(degree, blocks, units, replicated)


def _copy_layers(profile: ModelProfile, blocks: list[BlockTP], units: list[Unit],
                 replicated: dict[str, str]) -> list[Unit]:
    """Blocks the capture left out (profile.copies) as copies of their template: costs, units and reasons renamed."""
    def renamed(path: str, old: str, new: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + ".") else path

    out = list(units)
    for i, (t, old, new) in profile.copies.items():
        blocks[i] = copy.deepcopy(blocks[t])
        for u in units:
            if u.block == t and all(p == old or p.startswith(old + ".") for p in u.paths):
                out.append(dataclasses.replace(copy.deepcopy(u), name=renamed(u.name, old, new), block=i,
                                               paths=tuple(renamed(p, old, new) for p in u.paths)))
        for path, why in list(replicated.items()):
            if path == old or path.startswith(old + "."):
                replicated[renamed(path, old, new)] = why
    return sorted(out, key=lambda u: u.block)  # stable: within a block, the plan's order


def _node_facts(node: Any) -> tuple[str, bool, bool, float, float | None]:
    """(module path, view, matmul, FLOPs or elements moved per sample, float elements per sample or None)."""
    if nc.is_view(node):
        return "", True, False, 0.0, None
    per = 1.0 / CAPTURE_BATCH
    matmul = nc.is_matmul(node)
    cost = (nc.matmul_flops(node) if matmul else nc.moved_elements(node)) * per
    size = nc.numel(node.meta.get("val")) * per if nc.is_float(node) else None
    return module_path(node), False, matmul, cost, size


def _block_of_param(profile: ModelProfile, name: str, tied: tuple[str, ...]) -> int:
    """The block a parameter was assigned to when profiling (first use)."""
    for n in (name, *tied):
        if n in profile.param_block:
            return profile.param_block[n]
    return 0
