"""Heads cut into chunks of a padded, dynamic length (chunked linear attention: gated delta rules, chunked
scans): the reshape whose chunk sizes are dynamic expressions keeps the heads split, and tril / triu over the
last two dims keep any split of the dims before them."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tpcompile


class ChunkedHeads(nn.Module):
    """Per-head attention within chunks of `chunk` positions of a length padded to a multiple of it."""

    def __init__(self, dim: int = 32, heads: int = 4, head_dim: int = 8, chunk: int = 4, upper: bool = False) -> None:
        super().__init__()
        self.heads, self.head_dim, self.chunk, self.upper = heads, head_dim, chunk, upper
        self.qkv, self.out = nn.Linear(dim, 3 * heads * head_dim), nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        pad = (self.chunk - t % self.chunk) % self.chunk
        q, k, v = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v))
        q, k, v = (z.reshape(z.shape[0], z.shape[1], -1, self.chunk, z.shape[-1]) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2)
        scores = scores.triu() if self.upper else scores.tril()
        o = (scores @ v).reshape(b, self.heads, -1, self.head_dim)[:, :, :t]
        return self.out(o.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("ws", [2, 4])
def test_chunked_heads_stay_split(ws: int, upper: bool) -> None:
    torch.manual_seed(0)
    model = ChunkedHeads(upper=upper).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, ws, example_inputs=(torch.randn(2, 10, 32),))
    assert [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)] == []
    assert sm.plan.parameters["qkv.weight"].local_shape == (96 // ws, 32)
    assert sm.plan.parameters["out.weight"].local_shape == (32, 32 // ws)
    for b, t in ((3, 7), (2, 12)):  # 12 needs no padding: a guard of the capture, so it is captured again
        x = torch.randn(b, t, 32)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", tpcompile.TPCompileWarning)  # the re-capture's note
            ref = model(x)
            for out in tpcompile.simulate(sm, x):
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    report = tpcompile.check_gradients(model, sm, torch.randn(2, 9, 32))
    assert report.ok, str(report)


def test_tril_over_a_split_dim_replicates_with_the_op_named() -> None:
    """Split along the last dim, tril would need whole rows: the split is given up, with the op named."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(self.up(x).tril())

    torch.manual_seed(0)
    model = Masked().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sm = tpcompile.shard(model, 2, example_inputs=(torch.randn(8, 8),))
    texts = [str(w.message) for w in caught if issubclass(w.category, tpcompile.TPCompileWarning)]
    assert any("aten.tril" in t and "last 2 dims" in t for t in texts), texts
    x = torch.randn(8, 8)
    with torch.no_grad():
        for out in tpcompile.simulate(sm, x):
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=0)
