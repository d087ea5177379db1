"""Alike repeated layers are captured three times and the middle ones priced as copies, with the same result."""
from __future__ import annotations

import torch
from torch import nn

from tpcompile.passes.pass_context import module_path
from tpcompile.strategy.alike_layers import alike
from tpcompile.strategy.profile import build_profile
from tpcompile.strategy.tp_profile import tp_profile

D = 32


class Layer(nn.Module):
    def __init__(self, idx: int, window: int | None = None) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.layer_idx, self.window = idx, window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.window is not None:  # a layer that computes differently from the others
            h = h * h
        return x + self.fc2(h)


class Stack(nn.Module):
    def __init__(self, n: int = 6, windows: list | None = None, by_index: bool = False) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        self.layers = nn.ModuleList(Layer(i, (windows or [None] * n)[i]) for i in range(n))
        self.n, self.by_index = n, by_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.by_index:  # reads layers by position: a shortened container cannot run it
            for i in range(self.n):
                x = self.layers[i](x)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.out(x)


X = (torch.zeros(2, 8, D),)


def _facts(profile) -> dict:
    """Everything the search reads from a profile and its tp profiles."""
    out = {"blocks": [(b.name, b.index, b.repeated, b.params, sorted(b.param_names), b.flops, b.moved, b.ops, b.act,
                       b.out, b.inp) for b in profile.blocks], "params": sorted(profile.param_block.items())}
    for t in (1, 2, 4):
        tpp = tp_profile(profile, t)
        out[t] = (repr(tpp.blocks), [repr(u) for u in tpp.units], sorted(tpp.replicated.items()))
    return out


def _captured_layers(profile) -> set[str]:
    return {module_path(n).split(".")[1] for n in profile.captured.gm.graph.nodes
            if module_path(n).startswith("layers.")}


def test_alike_layers_are_captured_three_times_with_the_same_costs() -> None:
    """Layers 0, 1 and 5 are captured; 2-4 copy layer 1 under their own names, units and parameters included."""
    model = Stack()
    short = build_profile(model, example_inputs=X, seq_len=8)
    assert _captured_layers(short) == {"0", "1", "5"}
    assert short.copies == {i + 1: (2, "layers.1", f"layers.{i}") for i in (2, 3, 4)}
    full = build_profile(model, example_inputs=X, seq_len=8, copy_alike=False)
    assert not full.copies and _captured_layers(full) == {str(i) for i in range(6)}
    assert _facts(short) == _facts(full)
    units = {u.name for u in tp_profile(short, 2).units}
    assert {f"layers.{i}" for i in range(6)} <= units
    assert list(model.layers._modules) == [str(i) for i in range(6)]  # the container is restored


def test_layers_that_differ_are_all_captured() -> None:
    """A plain attribute that differs (other than the layer's own position) keeps every layer captured."""
    model = Stack(windows=[None, 4, None, 4, None, 4])
    assert not alike(list(model.layers))
    profile = build_profile(model, example_inputs=X, seq_len=8)
    assert not profile.copies and _captured_layers(profile) == {str(i) for i in range(6)}
    assert profile.blocks[2].ops != profile.blocks[1].ops  # the layers do cost differently


def test_alike_checks() -> None:
    """Positions may differ; a repeated layer object or a different shape may not."""
    layers = list(Stack().layers)
    assert alike(layers)
    assert not alike([layers[0], layers[0], layers[1]])
    other = Layer(3)
    other.fc1 = nn.Linear(D, 2 * D)
    assert not alike(layers[:3] + [other])


def test_a_model_that_cannot_run_shortened_is_captured_whole() -> None:
    """A forward that reads layers by position fails on the shortened container: every layer is captured instead."""
    model = Stack(by_index=True)
    profile = build_profile(model, example_inputs=X, seq_len=8)
    assert not profile.copies and _captured_layers(profile) == {str(i) for i in range(6)}
    assert _facts(profile) == _facts(build_profile(model, example_inputs=X, seq_len=8, copy_alike=False))
