"""Never silently wrong: each class of model code that once sharded to wrong results, now exact or refused.

Every case shards at world sizes 2 and 4 and runs on another batch and sequence length than it
was captured with; it either equals the original on every rank or raises a TPCompileError that
names the value and the way out.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import tpcompile

V, D = 64, 32


def _shard(model: nn.Module, ws: int, *args: torch.Tensor, **kwargs: torch.Tensor) -> tpcompile.ShardedModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tpcompile.TPCompileWarning)
        return tpcompile.shard(model, ws, example_inputs=args, example_kwargs=kwargs or None)


def _flat(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _equal_on_every_rank(model: nn.Module, sm: tpcompile.ShardedModel, *args: torch.Tensor, **kwargs: object) -> None:
    with torch.no_grad():
        ref = _flat(model(*args, **kwargs))
        outs = tpcompile.simulate(sm, *args, **kwargs)
    for out in outs:
        for got, want in zip(_flat(out), ref, strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def _held(sm: tpcompile.ShardedModel, model: nn.Module) -> float:
    """The fraction of the model's parameter elements rank 0 holds."""
    return sum(p.numel() for p in sm.rank(0).parameters()) / sum(p.numel() for p in model.parameters())


# --- 1. a parameter read in more than one way ---

class Body(nn.Module):
    """Embedding, an MLP block and a norm: the weights the heads below read again."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.proj, self.norm = nn.Embedding(V, D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D), \
            nn.LayerNorm(D)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.norm(x + self.proj(torch.relu(self.fc(x))))


class TiedMatmulHead(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.hidden(ids) @ self.emb.weight.t()) * 0.5


class TiedTransposeHead(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.hidden(ids), self.emb.weight.T)


class TiedEinsumHead(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btd,vd->btv", self.hidden(ids), self.emb.weight)


class WeightNormPenalty(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids) + self.fc.weight.pow(2).sum() * 1e-3


class WeightMeanBias(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids) + self.fc.weight.mean(0)


class WeightRowsAsVectors(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids) * self.proj.weight[:, 0] + self.fc.weight[0]


class WeightReturned(Body):
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden(ids), self.fc.weight


class NormalisedWeight(Body):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.fc.weight / self.fc.weight.norm(dim=1, keepdim=True)
        return self.proj(torch.relu(nn.functional.linear(self.emb(ids), w)))


READS = [TiedMatmulHead, TiedTransposeHead, TiedEinsumHead, WeightNormPenalty, WeightMeanBias, WeightRowsAsVectors,
         WeightReturned, NormalisedWeight]


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("cls", READS, ids=lambda c: c.__name__)
def test_a_parameter_read_more_than_one_way(cls: type, ws: int) -> None:
    """Each read of a split weight sees the split it gets (or the weight is kept whole): exact on every rank."""
    torch.manual_seed(0)
    model = cls().eval()
    sm = _shard(model, ws, torch.randint(0, V, (2, 5)))
    _equal_on_every_rank(model, sm, torch.randint(0, V, (3, 7)))
    if cls in (TiedMatmulHead, TiedTransposeHead, TiedEinsumHead):  # the tied head is the column-parallel head
        assert sm.plan.modules["emb"] == "vocab" and sm.plan.parameters["emb.weight"].dim == 0


def test_every_read_of_a_split_parameter_is_checked() -> None:
    """The verifier names a reader of a split parameter that was not planned for the split."""
    from dataclasses import replace
    from types import MappingProxyType

    from tpcompile.passes.verify_plan import verify_pass
    sm = _shard(TiedMatmulHead().eval(), 2, torch.randint(0, V, (2, 5)))
    weight = next(n for n in sm.captured.graph.nodes if n.op == "get_attr" and n.target == "emb.weight")
    reader = next(u for u in weight.users if u.target is torch.ops.aten.t.default)
    assert verify_pass(sm.captured, sm.decisions) is sm.captured
    planned = sm.decisions.nodes[reader]
    unplanned = replace(planned, layout=replace(planned.layout, wants=()))  # as if its rule had not seen the split
    decided = replace(sm.decisions, nodes=MappingProxyType({**sm.decisions.nodes, reader: unplanned}))
    with pytest.raises(tpcompile.TPCompileError, match=r"parameter emb\.weight is split on dim 0 .* aten\.t"):
        verify_pass(sm.captured, decided)


# --- 2. in-place updates of a split parameter ---

class RenormedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(V, D, max_norm=1.0), nn.Linear(D, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


@pytest.mark.parametrize("ws", [2, 4])
def test_in_place_renorm_of_a_split_embedding(ws: int) -> None:
    """max_norm renormalises rows in place: the embedding is kept whole, named in the warning, and exact."""
    torch.manual_seed(0)
    model = RenormedEmbedding().eval()
    with pytest.warns(tpcompile.TPCompileWarning, match=r"updates parameter emb\.weight in place"):
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randint(0, V, (2, 5)),))
    assert sm.plan.modules["emb"] == "replicated"
    ids = torch.randint(0, V, (3, 7))
    with torch.no_grad():
        outs = tpcompile.simulate(sm, ids)
        ref = model(ids)
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --- 3. autocast ---

class UpcastingNorm(nn.Module):
    """An RMSNorm-like block that computes in float32 and returns its input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj, self.scale = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.relu(self.fc(x)))
        dtype = h.dtype
        h32 = h.to(torch.float32)
        return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale).to(dtype)


@pytest.mark.parametrize("ws", [2, 4])
def test_autocast_is_the_captured_one_or_refused(ws: int) -> None:
    """Captured in float32 and run under bfloat16 autocast: a TPCompileError naming both; captured under it: bfloat16 like the original."""
    torch.manual_seed(0)
    model = UpcastingNorm().eval()
    x = torch.randn(3, 7, D)
    sm = _shard(model, ws, torch.randn(2, 5, D))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            tpcompile.TPCompileError, match=r"captured without torch\.autocast and is now called under "
                                            r"torch\.autocast\('cpu', dtype=torch\.bfloat16\).*Shard in the same"):
        tpcompile.simulate(sm, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sm = _shard(model, ws, torch.randn(2, 5, D))
        with torch.no_grad():
            ref = model(x)
            outs = tpcompile.simulate(sm, x)
    assert ref.dtype == torch.bfloat16
    for out in outs:
        assert out.dtype == ref.dtype
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=2e-2)
    with pytest.raises(tpcompile.TPCompileError, match=r"captured under torch\.autocast.*now called without"):
        tpcompile.simulate(sm, x)


# --- 4. tensor literals in forward ---

class Literals(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x)) * torch.tensor(0.5)
        return self.proj(h * torch.linspace(0.5, 1.5, 4 * D))


@pytest.mark.parametrize("ws", [2, 4])
def test_tensor_literals_in_forward(ws: int) -> None:
    """Literals torch.export lifts to constants are carried into every rank, the MLP still split."""
    torch.manual_seed(0)
    model = Literals().eval()
    sm = _shard(model, ws, torch.randn(2, 5, D))
    _equal_on_every_rank(model, sm, torch.randn(3, 7, D))
    assert sm.plan.modules == {"fc": "column", "proj": "row"}


# --- 5. input dims the capture fixed ---

class LengthTable(nn.Module):
    """A position bias built in Python from the length: the capture fixes the length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(V, D), nn.Linear(D, D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        bias = torch.tensor([float(i) / 10 for i in range(ids.shape[1])]).unsqueeze(-1)
        return self.fc(self.emb(ids) + bias)


@pytest.mark.parametrize("ws", [2, 4])
def test_fixed_input_dims_are_said_and_checked(ws: int) -> None:
    """A size-1 batch and a length fixed by the model's code: warned at shard(); another size is captured again
    (equal) in the simulator, and refused with the way out by a rank graph called directly."""
    torch.manual_seed(0)
    model = LengthTable().eval()
    with pytest.warns(tpcompile.TPCompileWarning) as caught:
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randint(0, V, (1, 6)),))
    said = " ".join(str(w.message) for w in caught)
    assert "input 'ids' dim 0 is fixed at 1 (the example has size 1 there" in said
    assert "input 'ids' dim 1 is fixed at 6 (the model's code needs this exact size)" in said
    _equal_on_every_rank(model, sm, torch.randint(0, V, (1, 6)))
    with pytest.raises(tpcompile.TPCompileError, match=r"input 'ids' has size 3 in dim 0, but the capture fixed "
                                                       r"that dim at 1"):
        tpcompile.simulate_ranks(ws, lambda r: sm.rank(r)(torch.randint(0, V, (3, 6))))
    with pytest.warns(tpcompile.TPCompileWarning, match=r"input 'ids' has size 9 in dim 1.*fixed that dim at 6"):
        _equal_on_every_rank(model, sm, torch.randint(0, V, (1, 9)))


# --- 6. forwards taking **kwargs ---

class KeywordScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        if "gate" in kwargs:
            h = h * kwargs["gate"]
        return self.proj(h)


@pytest.mark.parametrize("ws", [2, 4])
def test_forward_with_kwargs(ws: int) -> None:
    """forward(x, **kwargs) called with gate=...: captured, split, exact with other sizes."""
    torch.manual_seed(0)
    model = KeywordScale().eval()
    sm = _shard(model, ws, torch.randn(2, 5, D), gate=torch.rand(2, 5, 4 * D))
    assert sm.plan.modules == {"fc": "column", "proj": "row"}
    _equal_on_every_rank(model, sm, torch.randn(3, 7, D), gate=torch.rand(3, 7, 4 * D))


# --- 7. capture leaves the model as it was ---

class CachesInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.cached = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cached is None:
            self.cached = torch.ones(x.shape[-1]) * 0.5
        return self.fc(x) * self.cached


def test_shard_leaves_the_model_as_it_found_it() -> None:
    """A module that caches a tensor in forward still holds nothing after shard() and runs as before."""
    torch.manual_seed(0)
    model = CachesInForward().eval()
    x = torch.randn(3, 7, D)
    sm = _shard(model, 2, torch.randn(2, 5, D))
    assert model.cached is None
    with torch.no_grad():
        ref = model(x)
    assert isinstance(model.cached, torch.Tensor) and not isinstance(model.cached, torch._subclasses.FakeTensor)
    model.cached = None
    _equal_on_every_rank(model, sm, x)
    torch.testing.assert_close(ref, model(x))


# --- 8. token ids outside the vocabulary ---

@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("bad", [V, V + 37, -1])
def test_token_ids_outside_the_vocabulary(ws: int, bad: int) -> None:
    """The original raises on ids past its vocabulary; the vocabulary-split ranks raise a TPCompileError naming it."""
    torch.manual_seed(0)
    model = TiedMatmulHead().eval()
    sm = _shard(model, ws, torch.randint(0, V, (2, 5)))
    ids = torch.randint(0, V, (3, 7))
    ids[1, 2] = bad
    with pytest.raises(IndexError):
        model(ids)
    with pytest.raises(tpcompile.TPCompileError, match=rf"token id {bad} at aten\.embedding.*outside the "
                                                       rf"vocabulary of {V} ids"):
        tpcompile.simulate(sm, ids)


# --- warnings name the root cause ---

class HeadsNotDivisible(nn.Module):
    """4 heads at 3 ranks, q/k/v each LayerNorm'd (without a weight) over all its heads: padded by whole heads for
    the view, the normalised padding would not be zero, so they stay whole and the output projection sees a whole
    input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.wo = (nn.Linear(48, 48) for _ in range(4))
        self.qn, self.kn, self.vn = (nn.LayerNorm(48, elementwise_affine=False) for _ in range(3))
        self.norm, self.fc, self.proj = nn.RMSNorm(48), nn.Linear(48, 192), nn.Linear(192, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (n(p(x)).view(B, T, 4, 12).transpose(1, 2)
                   for p, n in ((self.q, self.qn), (self.k, self.kn), (self.v, self.vn)))
        x = x + self.wo(nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, 48))
        return x + self.proj(torch.relu(self.fc(self.norm(x))))


def test_a_warning_names_the_upstream_root_cause() -> None:
    """The output projection blamed at the next norm is said to follow from q/k/v being replicated, and why."""
    torch.manual_seed(0)
    model = HeadsNotDivisible().eval()
    with pytest.warns(tpcompile.TPCompileWarning) as caught:
        sm = tpcompile.shard(model, 3, example_inputs=(torch.randn(2, 5, 48),))
    wo = next(str(w.message) for w in caught if "replicating wo" in str(w.message))
    assert "its input is whole only because k, q, v are replicated (the root cause: " in wo
    assert "normalises over the sharded dim 2 (split as S(2~72)" in wo
    assert sm.plan.modules["fc"] == "column" and sm.plan.modules["proj"] == "row"
    _equal_on_every_rank(model, sm, torch.randn(3, 7, 48))
