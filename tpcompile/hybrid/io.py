"""The model's calling convention around the pipeline: step()'s arguments in, the model's output structure out.

The first stage takes the captured model's tensor inputs, flattened in capture order; the last
stage returns the flat output tensors. `InputLayout` binds step()'s arguments to the model's
forward signature as the capture did (example keyword arguments such as use_cache=False kept),
and rebuilds the model's output (a tensor, a tuple, a Hugging Face ModelOutput) for the loss.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from tpcompile.errors import TPCompileError


_TENSOR = object()  # marks an output leaf the last stage returns (others are constants of the model)


def graph_io(gm: GraphModule) -> tuple[list[Node], list[Node]]:
    """The captured graph's tensor inputs (placeholders) and the values it returns, in order."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    return inputs, [v for v in _leaves(gm) if isinstance(v, Node)]


def _leaves(gm: GraphModule) -> list[Any]:
    """The flat output values of the captured graph (nodes, or constants the model returns)."""
    leaves = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(leaves) if isinstance(leaves, (tuple, list)) else [leaves]


class InputLayout:
    """How step(*inputs, **kwargs) maps to the first stage's tensors, and the last stage's to the output.

    It keeps no reference to the captured graph (whose tensors are the full-size model's).
    """

    def __init__(self, model: nn.Module, gm: GraphModule, args: tuple, kwargs: dict) -> None:
        self.signature = inspect.signature(model.forward)
        self.example = self.signature.bind(*args, **kwargs).arguments
        self.n_args, self.kw_names = len(args), list(kwargs)
        self.spec = pytree.tree_structure((tuple(args), dict(kwargs)))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.tensor_positions = [i for i, n in enumerate(placeholders) if isinstance(n.meta.get("val"), torch.Tensor)]
        self.leaf_names = [n.name for n in placeholders]  # the captured graph's flat input names
        self.tensor_names = [name for name, v in self.example.items() if _has_tensor(v)]
        info = getattr(gm.graph._codegen, "pytree_info", None)
        self.out_spec = info.out_spec if info is not None else None
        self.out_leaves = [_TENSOR if isinstance(v, Node) else v for v in _leaves(gm)]
        vals = [v.meta.get("val") for v in _leaves(gm) if isinstance(v, Node)]
        self.output_dtype = next((v.dtype for v in vals if isinstance(v, torch.Tensor)), torch.float32)

    def first_stage_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """step()'s arguments as the first stage's tensors, in capture order."""
        leaves = self.flat_inputs(args, kwargs)
        return [leaves[i] for i in self.tensor_positions]

    def flat_inputs(self, args: tuple, kwargs: dict) -> list[Any]:
        """step()'s arguments as the captured graph's flat inputs (its placeholders' values), in capture order."""
        try:
            given = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError as e:
            raise TPCompileError(f"step() arguments do not fit forward{self.signature}: {e}") from e
        unknown = [k for k in given if k not in self.example]
        if unknown:
            raise TPCompileError(f"step() got {', '.join(unknown)}, which the model was not captured with; pass "
                                 f"them in example_inputs/example_kwargs of parallelize_train too")
        absent = [k for k in self.tensor_names if k not in given]
        if absent:
            raise TPCompileError(f"step() lacks the tensor input(s) {', '.join(absent)} the model was captured "
                                 f"with; pass every tensor input on every step")
        merged = {**self.example, **given}
        names = list(self.example)
        call_args = tuple(merged[n] for n in names[:self.n_args])
        call_kwargs = {k: merged[k] for k in self.kw_names}
        leaves, spec = pytree.tree_flatten((call_args, call_kwargs))
        if spec != self.spec:
            raise TPCompileError(f"step() inputs have the structure {spec}, but the model was captured with "
                                 f"{self.spec}; pass inputs shaped like example_inputs")
        return leaves

    def model_output(self, last: Any) -> Any:
        """The last stage's output tensors put back into the model's output structure."""
        tensors = list(last) if isinstance(last, (tuple, list)) else [last]
        it = iter(tensors)
        flat = [next(it) if v is _TENSOR else v for v in self.out_leaves]
        if self.out_spec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return pytree.tree_unflatten(flat, self.out_spec)


def _has_tensor(value: Any) -> bool:
    """True when value is, or contains, a tensor."""
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))
