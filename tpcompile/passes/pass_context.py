"""State shared by the passes of one shard() call."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.fx import Node

from tpcompile.errors import TPCompileError
from tpcompile.overrides import override_for
from tpcompile.placement import ParamSlice


@dataclass
class PassContext:
    """World size, user choices, and what the passes decided."""

    world_size: int
    group: str = "default"
    overrides: dict[str, str] = field(default_factory=dict)  # module path -> replicate | sharded_output | auto
    sequence_parallel: bool = False
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # get_attr target -> param/buffer
    demoted: dict[Node, str] = field(default_factory=dict)  # seed -> why it is replicated
    pieces: dict[Node, int] = field(default_factory=dict)  # seed -> pieces, when fewer than ranks
    # seeds whose heads, fewer than the ranks, go one to a rank, zero-padded, not in pieces shared by ranks (a row
    # split reads them: it would count a shared piece once per rank holding it)
    unpieced: set[Node] = field(default_factory=set)
    # query, key and value projection -> (the three, the kv repeats, the whole groups to fall back on, fused, the
    # gates of the merged heads and biases of the scores with their head sizes, the projections of values per kv
    # head beside k and v): a kv group's query heads cut among the ranks sharing its kv head
    # (passes/head_groups.py), until propagation blames them
    group_cuts: dict[Node, tuple] = field(default_factory=dict)
    param_slices: dict[str, Optional[ParamSlice]] = field(default_factory=dict)
    param_seeds: dict[str, frozenset] = field(default_factory=dict)  # split parameter -> the seeds that cut it
    notes: dict[Node, str] = field(default_factory=dict)  # weight op left whole by choice -> why (last round)
    row_inputs: dict[Node, frozenset] = field(default_factory=dict)  # seed -> its input's origins, as a row split
    unread: list[str] = field(default_factory=list)  # parameters no op reads, cut along dim 0 for storage
    unwished: set[str] = field(default_factory=set)  # parameters whose wished cut reached a conflict: kept whole
    whole: frozenset[str] = frozenset()  # parameters kept whole from the start (a first capture kept them whole)
    warnings: list[str] = field(default_factory=list)
    iterations: int = 0
    _names: Optional[dict[int, list[str]]] = field(default=None, repr=False)  # id(tensor) -> names

    def slice_for(self, name: str) -> Optional[ParamSlice]:
        """How the parameter or buffer `name` is cut, looking through tied aliases."""
        if name in self.param_slices:
            return self.param_slices[name]
        return next((self.param_slices[n] for n in self.aliases(name) if self.param_slices.get(n)), None)

    def aliases(self, name: str) -> list[str]:
        """Every name of the tensor called `name` (tied parameters have several), itself included."""
        if self._names is None:
            self._names = {}
            for n, t in self.tensors.items():
                self._names.setdefault(id(t), []).append(n)
        t = self.tensors.get(name)
        return self._names.get(id(t), [name]) if t is not None else [name]

    def override_for(self, module_path: str) -> str:
        """The user's override covering a module path (tpcompile.overrides.override_for)."""
        return override_for(self.overrides, module_path)


def module_path(node: Node) -> str:
    """The dotted path of the innermost module a node was traced in ('' for the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and not v[0].startswith("_empty")]
    return paths[-1] if paths else ""


def owner_path(target: str) -> str:
    """'blocks.0.attn.c_attn.weight' -> 'blocks.0.attn.c_attn'."""
    return target.rpartition(".")[0]


def internal_error(pass_name: str, node: Node, err: Exception) -> TPCompileError:
    """A failure inside a pass, naming the pass and the node it was working on."""
    return TPCompileError(f"{pass_name} pass failed on {node.format_node()} ({describe(node)}): "
                          f"{type(err).__name__}: {err}. Replicating the module with "
                          f"plan={{'{module_path(node) or 'its module'}': 'replicate'}} avoids it; "
                          f"please report it with the model")


def describe(node: Node) -> str:
    """'aten.view at blocks.0.attn' for messages."""
    from tpcompile.sharding_rules import op_name
    where = module_path(node) or "the top-level module"
    return f"{op_name(node.target)} ({node.name}) at {where}"
