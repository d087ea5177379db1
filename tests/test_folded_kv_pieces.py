"""kv heads in pieces (fewer kv heads than ranks) folded with the batch into one dim, `(B * kv, T, d)`: the placement
is the pieces repeated per sequence (`piece_shard(0, kv, 2, outer=B)`), and a whole value meeting it is cut per
repetition, at run-time sizes."""
from __future__ import annotations

import warnings

import torch
from torch import nn

import tpcompile


class FoldedKeys(nn.Module):
    """Grouped-query attention (4 query heads on 2 kv heads of 8) whose keys are folded to (B * kv, T, d) and added
    to a whole bias of that shape before the kv repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, t, 2, 8).transpose(1, 2)
        v = self.v(x).view(b, t, 2, 8).transpose(1, 2)
        k = (k.reshape(b * 2, t, 8) + bias).view(b, 2, t, 8)
        k = k[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8)
        v = v[:, :, None].expand(b, 2, 2, t, 8).reshape(b, 4, t, 8)
        a = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, 32))


def test_a_whole_value_meets_kv_pieces_folded_with_the_batch() -> None:
    """At 4 ranks the kv heads are 2 pieces, each held by 2 ranks; the bias is cut to each rank's kv head in every
    sequence: forward and gradients equal the model's on another batch and length, without a warning."""
    torch.manual_seed(0)
    model = FoldedKeys().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, 4, example_inputs=(torch.randn(3, 5, 32), torch.randn(6, 5, 8)))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    assert sm.plan.parameters["k.weight"].pieces == 2 and sm.plan.parameters["q.weight"].local_shape == (8, 32)
    x, bias = torch.randn(2, 7, 32), torch.randn(4, 7, 8)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x, bias):
            torch.testing.assert_close(out, model(x, bias), atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model, sm, x, bias)
    assert report.ok, str(report)


def test_the_fallback_check_takes_each_repetitions_piece() -> None:
    """The positions a rank holds of kv pieces repeated per sequence (what a DTensor fallback's answer is checked
    on): its piece in every repetition, not one run of the whole dim."""
    from tpcompile.placement import piece_shard
    from tpcompile.sharding_rules.fallback_check import positions
    assert positions(piece_shard(0, 8, 2), 8, 3, 4) == [4, 5, 6, 7]
    assert positions(piece_shard(0, 4, 2, outer=3), 12, 2, 4, outer=3) == [2, 3, 6, 7, 10, 11]
    assert positions(piece_shard(0, 4, 1, outer=2), 8, 3, 4, outer=2) == list(range(8))
