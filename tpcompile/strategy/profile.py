"""The model as the planner sees it: a chain of blocks with their FLOPs, bytes, ops and parameters.

The model is captured once with torch.export at the planning sequence length and a batch of
`CAPTURE_BATCH`, shapes static (about four times faster to capture than symbolic ones, and the
sequence length is known when planning). Samples are independent (what data parallelism already
assumes), so per-sample costs are the captured costs divided by the capture batch.

Blocks follow the model's repeated layers: the largest ModuleList / Sequential of one module
type ("model.layers.0" ... "model.layers.31"), with "pre" before the first and "post" after the
last; code between two layers belongs to the layer before it. A model without repeated layers
is one block.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from tpcompile.capture import Captured, auto_dynamic_shapes, capture, infer_example_inputs
from tpcompile.errors import TPCompileError
from tpcompile.passes.pass_context import module_path
from tpcompile.strategy import node_costs as nc

CAPTURE_BATCH = 2


@dataclass
class Block:
    """One link of the block chain; costs are per sample of the planning sequence length."""

    name: str
    index: int
    repeated: bool  # one of the model's repeated layers (checkpointed under recompute)
    params: int = 0  # parameter elements first used here (tied parameters counted once)
    param_names: list[str] = field(default_factory=list)
    flops: float = 0.0  # forward matmul FLOPs per sample
    moved: float = 0.0  # elements read and written by memory-bound ops per sample
    ops: int = 0  # computing ops per forward (each costs the cluster's op_overhead)
    act: float = 0.0  # floating-point activation elements kept for backward, per sample
    out: float = 0.0  # activation elements handed to later blocks, per sample
    inp: float = 0.0  # activation elements received from earlier blocks, per sample


@dataclass
class ModelProfile:
    """The captured model and its block chain."""

    name: str
    captured: Captured
    blocks: list[Block]
    seq_len: int  # tokens per sample (1 for inputs without a sequence dim)
    capture_s: float = 0.0
    node_block: dict = field(default_factory=dict)  # captured node -> block index
    param_block: dict = field(default_factory=dict)  # parameter name -> block index (first use)
    node_costs: dict = field(default_factory=dict)  # node -> its costs no tp degree changes (tp_profile fills it)
    # block index -> (the block it copies, that block's module path, its own): alike layers not captured
    copies: dict = field(default_factory=dict)

    @property
    def params(self) -> int:
        """Parameter elements of the whole model."""
        return sum(b.params for b in self.blocks)

    @cached_property
    def module_blocks(self) -> dict[str, int]:
        """Module path -> the block of the first node (in graph order) inside that module."""
        out: dict[str, int] = {}
        for node, block in self.node_block.items():
            path = module_path(node)
            parts = path.split(".") if path else []
            for k in range(1, len(parts) + 1):
                out.setdefault(".".join(parts[:k]), block)
        return out

    def block_of_path(self, path: str) -> Optional[int]:
        """The index of the repeated block whose module path covers `path`."""
        for b in self.blocks:
            if b.repeated and (path == b.name or path.startswith(b.name + ".")):
                return b.index
        return None


def find_layers(model: nn.Module) -> list[str]:
    """Module paths of the repeated layers: the largest ModuleList / Sequential of one module type."""
    best: tuple[int, list[str]] = (0, [])
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.named_children())
        if len(kids) < 2 or len({type(m) for _, m in kids}) != 1:
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best[0]:
            best = (size, [f"{name}.{k}" if name else k for k, _ in kids])
    return best[1]


def planning_inputs(model: nn.Module, args: tuple, kwargs: dict, seq_len: Optional[int]) -> tuple[tuple, dict, int]:
    """The example inputs at batch CAPTURE_BATCH and `seq_len` tokens, on the model's device; and the tokens per sample.

    Integer inputs of two or more dims and float inputs of three or more are read as
    (batch, sequence, ...); others as (batch, ...). Integer inputs are ones (valid token ids, a
    full attention mask), float inputs zeros: only shapes matter to the planner.
    """
    if not args and not kwargs:
        args, kwargs = infer_example_inputs(model, "tpcompile.plan_parallel")
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    seen_seq: list[int] = []

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        shape = list(t.shape)
        shape[0] = CAPTURE_BATCH
        has_seq = t.dim() >= (2 if not t.dtype.is_floating_point else 3)
        if has_seq:
            seen_seq.append(shape[1])
            if seq_len is not None:
                shape[1] = seq_len
        make = torch.zeros if t.dtype.is_floating_point else torch.ones
        return make(shape, dtype=t.dtype, device=device)

    args, kwargs = pytree.tree_map(resize, (tuple(args), dict(kwargs or {})))
    tokens = (seq_len if seq_len is not None else seen_seq[0]) if seen_seq else 1
    return args, kwargs, int(tokens)


def static_shapes(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """torch.export's dynamic_shapes with every input static."""
    auto = auto_dynamic_shapes(model, args, kwargs)
    is_spec = lambda x: isinstance(x, dict) and all(isinstance(k, int) for k in x)  # noqa: E731
    return pytree.tree_map(lambda x: None, auto, is_leaf=lambda x: x is None or is_spec(x))


def capture_for_planning(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    """torch.export of the model at the planning shapes, static; the user's warnings about fixed dims held back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            shapes = static_shapes(model, args, kwargs)
        except TypeError as e:
            raise TPCompileError(f"example inputs do not match {type(model).__name__}.forward"
                                 f"{inspect.signature(model.forward)}: {e}; pass example_inputs / example_kwargs "
                                 "that forward accepts") from e
        return capture(model, args, kwargs, dynamic_shapes=shapes)


def _assign_blocks(cap: Captured, layers: list[str]) -> tuple[list[Block], dict]:
    """Every node to a block index: its layer's, else 'pre' before the first layer, else the block before it."""
    layer_index = {p: i + 1 for i, p in enumerate(layers)}
    blocks = [Block("pre" if layers else "model", 0, False)]
    blocks += [Block(p, i + 1, True) for i, p in enumerate(layers)]
    nodes = [n for n in cap.gm.graph.nodes if n.op == "call_function"]

    def layer_of(path: str) -> Optional[int]:
        for p, i in layer_index.items():
            if path == p or path.startswith(p + "."):
                return i
        return None

    owner = {n: layer_of(module_path(n)) for n in nodes}
    last_layer = max((i for i, n in enumerate(nodes) if owner[n] is not None), default=-1)
    has_post = layers and any(owner[n] is None for n in nodes[last_layer + 1:])
    if has_post:
        blocks.append(Block("post", len(blocks), False))
    where: dict = {}
    current = 0
    for i, n in enumerate(nodes):
        if owner[n] is not None:
            current = owner[n]
        elif layers and i > last_layer:
            current = len(blocks) - 1
        where[n] = current
    return blocks, where


def build_profile(model: nn.Module, *, example_inputs: Any = (), example_kwargs: Optional[dict] = None,
                  seq_len: Optional[int], copy_alike: bool = True) -> ModelProfile:
    """Capture `model` at the planning shapes and read its block chain off the graph.

    With `copy_alike`, repeated layers that are alike are captured three times and the middle
    ones priced as copies (strategy/alike_layers.py); the result is the same, sooner.
    """
    import time
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    args, kwargs, tokens = planning_inputs(model, args, dict(example_kwargs or {}), seq_len)
    layers = find_layers(model)
    start = time.perf_counter()
    profile = _shortened_profile(model, layers, args, kwargs, tokens) if copy_alike else None
    if profile is None:
        cap = capture_for_planning(model, args, kwargs)
        blocks, where, params = _read_blocks(cap, layers)
        profile = ModelProfile(cap.model_name, cap, blocks, tokens, 0.0, where, params)
    profile.capture_s = time.perf_counter() - start
    return profile


def _read_blocks(cap: Captured, layers: list[str]) -> tuple[list[Block], dict, dict[str, int]]:
    """The block chain of a captured graph with its costs; node -> block index; parameter name -> block index."""
    blocks, where = _assign_blocks(cap, layers)
    graph = cap.gm.graph
    live = nc.input_dependent(graph.nodes)
    per = 1.0 / CAPTURE_BATCH
    for n, b in where.items():
        block = blocks[b]
        if not nc.is_view(n):
            block.ops += 1
        if n not in live or nc.is_view(n):
            continue
        if nc.is_matmul(n):
            block.flops += nc.matmul_flops(n) * per
        else:
            block.moved += nc.moved_elements(n) * per
        if nc.is_float(n):
            block.act += nc.numel(n.meta.get("val")) * per
        later = {where[u] for u in n.users if u in where and where[u] > b}
        if later and nc.is_float(n):
            # a value used by later blocks crosses every boundary up to the last of them
            size = nc.numel(n.meta.get("val")) * per
            for k in range(b, max(later)):
                blocks[k].out += size
            for k in later:
                blocks[k].inp += size
    return blocks, where, _assign_params(cap, blocks, where)


def _shortened_profile(model: nn.Module, layers: list[str], args: tuple, kwargs: dict,
                       tokens: int) -> Optional[ModelProfile]:
    """The profile from a capture with the first, second and last layer only, middle layers copied; None when the
    layers are not alike, the shortened model does not capture, or its layers do not cost alike."""
    from tpcompile.strategy.alike_layers import KEPT, alike, container_of, shortened
    if len(layers) <= KEPT:
        return None
    container = container_of(model, layers)
    modules = [model.get_submodule(p) for p in layers]
    if container is None or list(container._modules.values()) != modules or not alike(modules):
        return None
    parent = layers[0].rpartition(".")[0]
    with shortened(container) as kept:
        paths = [f"{parent}.{k}" if parent else k for k in kept]
        try:
            cap = capture_for_planning(model, args, kwargs)
        except TPCompileError:
            return None
    blocks, where, params = _read_blocks(cap, paths)
    first, template, last = blocks[1:4]  # blocks[0] is "pre"
    if any(not p.startswith(paths[1] + ".") for p in template.param_names):
        return None  # a parameter outside the layer first read there: it would not repeat
    cost = lambda b: (b.flops, b.params, len(b.param_names))  # noqa: E731
    if cost(first) != cost(template) or cost(last) != cost(template) or (first.ops, first.moved) != (
            template.ops, template.moved):
        return None
    return expand_copies(ModelProfile(cap.model_name, cap, blocks, tokens, 0.0, where, params), layers)


def expand_copies(profile: ModelProfile, layers: list[str]) -> ModelProfile:
    """The profile of a capture that kept layers 0, 1 and n-1 (blocks 1-3), with layers 2 .. n-2 as copies of 1."""
    from tpcompile.strategy.alike_layers import KEPT
    n, template = len(layers), 2  # blocks: pre, layer 0, layer 1 (the template), layer n-1, ...
    shift = n - KEPT  # blocks from the last layer on move this far
    old = layers[1]
    copies: dict[int, tuple[int, str, str]] = {}
    made = []
    for i in range(2, n - 1):
        t = profile.blocks[template]
        rename = lambda name, new=layers[i]: new + name[len(old):]  # noqa: E731
        made.append(dataclasses.replace(t, name=layers[i], index=i + 1,
                                        param_names=[rename(p) for p in t.param_names]))
        copies[i + 1] = (template, old, layers[i])
    blocks = profile.blocks[:3] + made + profile.blocks[3:]
    for k, b in enumerate(blocks):
        b.index = k
    remap = lambda b: b + shift if b >= KEPT else b  # noqa: E731
    params = {name: remap(b) for name, b in profile.param_block.items()}
    for blk in made:
        params.update({p: blk.index for p in blk.param_names})
    return dataclasses.replace(profile, blocks=blocks, node_block={nd: remap(b) for nd, b in profile.node_block.items()},
                               param_block=params, copies=copies)


def _assign_params(cap: Captured, blocks: list[Block], where: dict) -> dict[str, int]:
    """Each parameter to the block of its first use (a tied parameter counts once); name -> block."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for n in cap.gm.graph.nodes:
        if n.op != "get_attr":
            continue
        try:
            t = cap.gm.get_submodule("").get_parameter(n.target)
        except AttributeError:
            continue
        if id(t) in seen:
            continue
        users = [where[u] for u in n.users if u in where]
        if not users:
            continue
        seen.add(id(t))
        block = blocks[min(users)]
        block.params += t.numel()
        block.param_names.append(str(n.target))
        out[str(n.target)] = block.index
    return out
