"""Placement notation in words, and warnings shortened for one line of terminal output.

Placements print as `R`, `S(2)`, `S(0|64+64+64)`, `S(2~66)` in node tables and in the
warnings propagation writes; a reader of `tpcompile plan` gets "whole on every rank" and
"split along dim 2 (padded to 66)" instead. The long forms stay in `sm.plan.warnings` and
behind the command line's --debug.
"""
from __future__ import annotations

import re

# S(dim[|seg+seg...][~padded][xouter][/pieces[+split_next]])[seq], as placement.Shard.__str__ writes it
_SHARD = re.compile(r"S\((?P<dim>\d+)(?:\|(?P<segs>\d+(?:\+\d+)*))?(?:~(?P<pad>\d+(?:\+\d+)*))?(?:x(?P<outer>[^)/]+))?"
                    r"(?:/(?P<pieces>\d+)(?:\+(?P<next>\d+))?)?\)(?P<seq>seq)?")
# R only where it stands for a placement: "is R", "(R, S(0))", "needs R"
_REPLICATE = re.compile(r"(?<=\bis )R\b|(?<=\bneeds it )R\b|(?<=[(,] )R\b|(?<=\()R(?=[,)])")
_OP = re.compile(r"\baten\.(\w+)\.\w+ \((\w+)\)")
_TAIL = re.compile(r" \(results stay exact, this part is not split; plan=\{.*?\} says so explicitly and "
                   r"silences this\)$")
_REPLICATING = re.compile(r"; replicating (.+?)(?: \(results stay exact|$)")


def shard_in_words(m: re.Match) -> str:
    """One Shard placement, matched by _SHARD, in words."""
    dim = m["dim"]
    text = f"split by tokens along dim {dim}" if m["seq"] else f"split along dim {dim}"
    extra = []
    if m["segs"]:
        extra.append(f"each of the segments {', '.join(m['segs'].split('+'))} split")
    if m["pad"]:
        pads = m["pad"].split("+")
        extra.append(f"padded to {pads[0]}" if len(pads) == 1 else f"the segments padded to {', '.join(pads)}")
    if m["outer"]:
        extra.append(f"within each of {m['outer']} blocks")
    if m["pieces"]:
        extra.append(f"in {m['pieces']} pieces" + (f", dim {int(dim) + 1} split {m['next']} ways" if m["next"] else ""))
    return text + (f" ({'; '.join(extra)})" if extra else "")


def placements_in_words(text: str) -> str:
    """`text` with every placement (R, S(...)) written out: 'input x is R but the op needs S(2~66)' ->
    'input x is whole on every rank but the op needs it split along dim 2 (padded to 66)'."""
    text = re.sub(r"\bneeds (?=S\(|R\b)", "needs it ", text)
    text = _SHARD.sub(shard_in_words, text)
    return _REPLICATE.sub("whole on every rank", text)


def replicated_modules(warning: str) -> list[str]:
    """The modules a propagation warning says it replicates ('...; replicating a.b, c.d (...)')."""
    m = _REPLICATING.search(warning)
    return [] if m is None else [p.strip() for p in m.group(1).split(",") if p.strip()]


def short_reason(why: str) -> str:
    """A replication reason for one line: 'aten.add.Tensor (add_1) at h.0: input dropout is R but ...' ->
    'add_1 at h.0: input dropout is whole on every rank but ...'."""
    return placements_in_words(_OP.sub(_node_and_op, why))


def _node_and_op(m: re.Match) -> str:
    """'add_1' for aten.add.Tensor (add_1): the node's name already says the op; 'x (view)' when it does not."""
    op, node = m[1], m[2]
    return node if node == op or node.startswith(op + "_") else f"{node} ({op})"


def short_warning(warning: str) -> str:
    """A TPCompileWarning for one line: the reason in words, without the explanation of how to silence it."""
    text = _TAIL.sub("", warning.strip())
    reason, sep, modules = text.rpartition("; replicating ")
    if not sep:
        return short_reason(text)
    return f"replicating {modules}: {short_reason(reason)}"
