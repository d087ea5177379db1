"""Activation checkpointing of a rank graph: per block, or a selective policy over every op.

- "blocks": the graph is cut (torch.fx split_module) into contiguous regions, each either one of the
  model's repeated blocks (hybrid.pieces.find_blocks) or the code between them; each block region
  becomes a submodule whose forward runs under torch.utils.checkpoint (non-reentrant), so backward
  recomputes it from its inputs instead of keeping its activations. Parameters stay where they were
  (the regions take them as arguments), so names, state dicts and checkpoints are unchanged.
- "selective": the whole forward runs under checkpoint with a selective policy: the outputs of
  matmuls, attention, convolutions, tpcompile's collectives and random masks are kept, everything
  else (pointwise ops, norms, softmax, reshapes) is recomputed in backward. No collective runs twice
  and no mask is drawn again. A kept matmul output is saved for backward, so no all-reduce may sum
  into it (passes/comm_inplace.py's own rule; torch's selective checkpoint raises on a mutated saved
  tensor): the in-place and asynchronous all-reduces of the default comm passes become functional
  all-reduces again in this mode (`_functional_sums`).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tpcompile.errors import TPCompileError

__all__ = ["RECOMPUTE", "checkpoint_blocks", "checkpoint_selective", "live_dropout", "recompute_mode"]

RECOMPUTE = ("blocks", "selective")
aten = torch.ops.aten
KEEP = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
        aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default}
KEEP_NAMESPACES = ("tpcompile", "tpcompile_rng", "tpcompile_async")  # collectives (never twice) and dropout masks


def recompute_mode(value: Union[bool, str, None]) -> Optional[str]:
    """None, "blocks" (also True) or "selective"; a TPCompileError for anything else."""
    if value is None or value is False:
        return None
    if value is True:
        return "blocks"
    if value not in RECOMPUTE:
        raise TPCompileError(f"activation_checkpointing={value!r} is not one of False, True / 'blocks' (recompute each "
                             f"block in backward) or 'selective' (keep matmul outputs, recompute pointwise ops)")
    return value


def live_dropout(gm: GraphModule) -> Optional[str]:
    """The first dropout that draws a mask in this graph (in words), or None."""
    for node in gm.graph.nodes:
        p = None
        if node.target in (aten.dropout.default, aten.native_dropout.default):
            training = node.args[2] if len(node.args) > 2 else True
            p = node.args[1] if training else None
        elif node.target is aten.scaled_dot_product_attention.default:
            p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        elif getattr(node.target, "namespace", None) == "tpcompile_rng":
            p = node.args[1] if len(node.args) > 1 else "?"
        if p:
            return f"{node.format_node()} (p={p})"
    return None


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep what is costly to recompute or must not run twice; recompute the rest."""
    if op in KEEP or getattr(op, "namespace", None) in KEEP_NAMESPACES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _functional_sums(gm: GraphModule) -> None:
    """Every all_reduce.inplace / all_reduce.start of gm back to the functional all_reduce (a start's wait
    dropped: the functional sum is complete), so no saved matmul output is overwritten."""
    reduce, changed = torch.ops.tpcompile.all_reduce, False
    for node in list(gm.graph.nodes):
        if node.target is torch.ops.tpcompile_async.wait.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
        elif node.target in (reduce.inplace, reduce.start):
            node.target, changed = reduce.default, True
            node.meta["tp_inplace"] = "selective activation checkpointing saves its input for backward"
    if changed:
        gm.graph.lint()
        gm.recompile()


def checkpoint_selective(gm: GraphModule) -> GraphModule:
    """Run gm's forward under checkpoint with the selective policy (module docstring)."""
    import tpcompile.ops.async_ops  # noqa: F401  (torch.ops.tpcompile_async, which _functional_sums reads)
    _functional_sums(gm)
    inner: Callable[..., Any] = gm.forward
    context = functools.partial(create_selective_checkpoint_contexts, _policy)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context, **kwargs)
    gm.forward = forward  # an instance attribute: hooks on the module still run around it
    return gm


def _block(node: Node, blocks: list[str]) -> Optional[str]:
    """The block (a module path of `blocks`) whose module traced `node`, if any."""
    for entry in (node.meta.get("nn_module_stack") or {}).values():
        path = entry[0] if isinstance(entry, tuple) else ""
        for b in blocks:
            if path == b or path.startswith(b + "."):
                return b
    return None


def _regions(gm: GraphModule, blocks: list[str]) -> dict[Node, int]:
    """Each computing node's region: a new one wherever the block (or its absence) changes, in graph order."""
    part, last, pid = {}, None, -1
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        key = _block(n, blocks)
        if pid < 0 or key != last:
            pid, last = pid + 1, key
        part[n] = pid
    return part


def checkpoint_blocks(gm: GraphModule, blocks: list[str]) -> GraphModule:
    """gm with every block region a submodule recomputed in backward (module docstring); gm itself, changed."""
    if not blocks:
        raise TPCompileError("activation_checkpointing='blocks' found no repeated blocks in the model (a ModuleList "
                             "or Sequential of one layer type); use activation_checkpointing='selective'")
    why = live_dropout(gm)
    if why is not None:
        raise TPCompileError(f"activation_checkpointing='blocks' with dropout: {why} would draw different masks when "
                             f"backward recomputes it; use activation_checkpointing='selective' (it keeps the masks), "
                             f"set the dropout to 0 or call model.eval()")
    part = _regions(gm, blocks)
    owner = {part[n]: _block(n, blocks) for n in part}
    split = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    for name, sub in split.named_children():
        if name.startswith("submod_"):
            if owner.get(int(name.removeprefix("submod_"))) is not None:
                _recomputed(sub)
            gm.add_submodule(name, sub)
    codegen = gm.graph._codegen
    gm.graph = split.graph  # its get_attr targets are gm's own paths: parameters stay where they are
    gm.graph._codegen = codegen  # the model's calling convention (pytree in and out)
    gm.recompile()
    return gm


def _recomputed(module: GraphModule) -> None:
    """Run the module's forward under non-reentrant checkpoint."""
    inner: Callable[..., Any] = module.forward

    def forward(*args: Any) -> Any:
        return inner(*args) if not torch.is_grad_enabled() else checkpoint(inner, *args, use_reentrant=False)
    module.forward = forward
