"""Propagate pass: a placement for every node, column/row/vocab roles for the weight ops.

Every weight matmul fed a replicated value starts as a column split, every one fed a value
sharded on its contracted dim becomes a row split. A round is one `Sweep` over the graph in
order. When a sharded value reaches an op that cannot take it (a norm over the sharded dim, a
head count the world size does not divide, an op with no rule), the sweep *blames* the splits
it came from (its origins): the next round *demotes* them (replicates them), or *regroups* them
into fewer pieces than ranks when that is what the op needs, or *unpieces* them: heads fewer than the ranks, in
pieces each shared by several ranks, go one to a rank, zero-padded, when a row split reads them (it would count a
shared piece once per rank holding it). The words are defined once in
docs/architecture.md ("How propagation decides").

A parameter is a value like any other: where it is read outside the weight ops that cut it (a
tied head as `h @ W.t()`, a norm of the weight, a row of it, the weight returned), the reader
sees it split as the previous round cut it, and the rules place or blame that read as they do
any split value. A round that only changes how such a parameter is cut is *resettled*: the next
round reads it anew.

Bound: each round but the last demotes, regroups or unpieces at least one seed, or resettles a parameter
(never twice in a row: a second resettle without progress demotes that parameter's seeds); a
seed is demoted, regrouped and unpieced at most once each, so there are at most 6 * seeds + 2
rounds, one more for each parameter kept whole by the fallback below, and one more for each projection whose
heads were cut within their kv groups (a blame there gives the cut up for the whole groups or the kv-head
replication head_groups.py would have chosen, instead of a demotion: `give_up_group_cuts`); reaching that is a
compiler bug and raises.

Fallback: a conflict whose seeds are all replicated already can still be kept alive by parameters cut
by wishes (param_cuts.py) that feed each other's splits (`w1 * x + w2`, each wished split because the
other was read split). Those parameters are kept whole (`ctx.unwished`) and the round is judged again;
only when none is left does the conflict raise.
"""
from __future__ import annotations

import logging
import warnings

from torch.fx import GraphModule, Node

from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.passes.head_groups import give_up_group_cuts
from tpcompile.passes.param_cuts import cut_unread, wished_upstream
from tpcompile.passes.pass_context import PassContext
from tpcompile.passes.sweep import SEED_RULES, Layout, Sweep, seed_path, weight_args
from tpcompile.placement import REPLICATE, slice_placement
from tpcompile.sharding_rules.rule_context import Choice

__all__ = ["SEED_RULES", "Layout", "propagate_pass", "seed_path"]

log = logging.getLogger("tpcompile")


def propagate_pass(gm: GraphModule, ctx: PassContext) -> GraphModule:
    """Write node.meta['tp_placement'] and ['tp_layout'], replicating regions that cannot be split."""
    seeds = [n for n in gm.graph.nodes if seed_path(n) is not None]
    for n in seeds:
        if ctx.override_for(seed_path(n)) == "replicate" or _kept_whole(n, ctx):
            ctx.demoted[n] = "replicated by the plan"
    params = {n.target for n in gm.graph.nodes if n.op == "get_attr"}  # each kept whole at most once (unwished)
    bound = 6 * len(seeds) + 2 + len(params) + len(ctx.group_cuts)
    resettled = False
    for ctx.iterations in range(1, bound + 1):
        sweep = Sweep(gm, ctx)
        sweep.run()
        log.info("propagate round %d: %d conflicts", ctx.iterations, len(sweep.conflicts))
        fresh = {o: _depthwise_choice(o, why) for origins, why in sweep.conflicts for o in origins
                 if o not in ctx.demoted}
        regrouped = {o: n for origins, n in sweep.regroups for o in origins if o not in ctx.pieces}
        ctx.pieces.update(regrouped)
        unpieced = frozenset().union(*sweep.unpieces) - ctx.unpieced  # heads one to a rank instead of in pieces
        ctx.unpieced |= unpieced
        undone = give_up_group_cuts(set(fresh), ctx)  # blamed heads cut within their groups: whole groups instead
        fresh = {} if undone else fresh
        changed = regrouped or unpieced or undone
        if sweep.unsettled and not fresh and not changed:
            if resettled:  # a second change in a row without progress: the splits chase each other
                fresh = {o: f"parameter {t} is read in ways whose splits disagree" for t, seeds in
                         sweep.unsettled.items() for o in seeds if o not in ctx.demoted}
            else:
                resettled = True
                continue  # read the parameters as this round cut them
        resettled = False
        if not fresh and not changed:
            unwished = wished_upstream(sweep) - ctx.unwished if sweep.conflicts else set()
            if unwished:  # nothing left to blame but parameters cut by wishes: keep them whole and judge again
                log.info("propagate round %d: keeping %s whole", ctx.iterations, ", ".join(sorted(unwished)))
                ctx.unwished |= unwished
                continue
            if sweep.conflicts:
                raise TPCompileError(
                    "cannot place these ops on split inputs: " + "; ".join(why for _, why in sweep.conflicts)
                    + ". Replicate the modules involved with plan={'module.path': 'replicate'}"
                    + (" or shard without sequence_parallel" if ctx.sequence_parallel else ""))
            break
        ctx.demoted.update(fresh)
    else:
        raise TPCompileError(f"propagate did not settle in {bound} rounds for {len(seeds)} weight ops; this is a "
                             f"tpcompile bug, please report it with the model")
    ctx.unread = cut_unread(gm, ctx)
    for node in gm.graph.nodes:  # weights read only by the ops that cut them: say how the last round cut them
        if node.op == "get_attr":
            sl = ctx.param_slices.get(node.target)
            node.meta["tp_placement"] = REPLICATE if sl is None else slice_placement(sl)
    _warn(ctx)
    return gm


def _depthwise_choice(seed: Node, why: str) -> str:
    """`why`, as a choice (no warning) for a depthwise convolution fed a whole input: its split would only save
    its kernel of a few values per channel, and its output (a residual stream's short convolution) is read
    whole further on."""
    layout, spec = seed.meta.get("tp_layout"), seed.meta.get("tp_rule")
    w = spec.get("weight") if spec is not None and spec.rule == "weight_conv" else None
    val = seed.args[w].meta.get("val") if w is not None and isinstance(seed.args[w], Node) else None
    if layout is None or layout.role != "column" or val is None or val.dim() < 3 or val.shape[1] != 1 \
            or isinstance(why, Choice):
        return why
    return Choice(f"{why}; a depthwise convolution fed a whole input is kept whole (its kernel is "
                  f"{val.numel()} values)")


def _kept_whole(seed: Node, ctx: PassContext) -> bool:
    """Every weight the seed reads is in ctx.whole (a row split's bias is whole while its weight is split)."""
    weights = weight_args(seed)
    return bool(ctx.whole) and bool(weights) and all(w.target in ctx.whole for w in weights)


def _warn(ctx: PassContext) -> None:
    by_reason: dict[str, list[str]] = {}
    for seed, why in ctx.demoted.items():
        if why != "replicated by the plan" and not isinstance(why, Choice):  # a choice is shown in the plan
            by_reason.setdefault(_root_cause(seed, why, ctx), []).append(seed_path(seed) or seed.name)
    for why, paths in by_reason.items():
        names = sorted(set(paths))
        msg = (f"{why}; replicating {', '.join(names)} (results stay exact, this part is not split; "
               f"plan={{{names[0]!r}: 'replicate'}} says so explicitly and silences this)")
        ctx.warnings.append(msg)
        warnings.warn(msg, TPCompileWarning, stacklevel=4)


def _root_cause(seed: Node, why: str, ctx: PassContext) -> str:
    """`why`, and the upstream replication it follows from when the seed was a row split before that.

    4 heads at 3 ranks replicate q/k/v; the output projection then sees a whole input, becomes a
    column split, and is blamed at the next norm. The warning names q/k/v and their reason too.
    """
    upstream = [o for o in ctx.row_inputs.get(seed, ()) if o in ctx.demoted and o is not seed]
    if not upstream:
        return why
    names = sorted({seed_path(o) or o.name for o in upstream})
    cause = ctx.demoted[min(upstream, key=lambda o: seed_path(o) or o.name)]
    return (f"{why}; its input is whole only because {', '.join(names)} {'is' if len(names) == 1 else 'are'} "
            f"replicated (the root cause: {cause})")
