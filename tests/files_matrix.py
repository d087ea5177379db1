"""Checkpoints in every direction (tests/test_files.py): stock DCP of the plain model, parallelize at 2 ranks,
parallelize_train at (dp, tp, pp) = (1, 2, 1), in one 2-rank gloo launch per set of models.

Models: the bundled GPT with manual attention (a persistent mask buffer), Buffered (an MLP with a persistent
and a non-persistent buffer) and a small HF Llama (non-persistent rotary inv_freq; the slow tests).
"""
from __future__ import annotations

import functools
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as stock_dcp
from torch import nn

import tpcompile
from tpcompile import dcp
from tpcompile.passes.rank_module import local_tensor

DIRECTIONS = ["stock->parallelize", "parallelize->train", "train->parallelize"]
GPT = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
LLAMA = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, vocab_size=64, max_position_embeddings=32)
TABLE = torch.arange(16.0) / 16  # Buffered's non-persistent buffer
_DIR = tempfile.TemporaryDirectory(prefix="tpcompile-files-")  # removed when the test process exits


class Buffered(nn.Module):
    """An MLP with a persistent buffer (scale) and a non-persistent one (table, computed like rotary inv_freq)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))
        self.register_buffer("table", torch.arange(16.0) / 16, persistent=False)  # meta under a meta device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * self.scale + self.table.to(x.device)


def buffered(seed: int = 0, meta: bool = False) -> Buffered:
    """Buffered with seeded weights, or built on the meta device."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        return Buffered()


def model(name: str, seed: int, meta: bool = False) -> nn.Module:
    """One of the three models with seeded weights (seed 0 is the one saved), or built on meta."""
    if name == "buffered":
        return buffered(seed, meta)
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        if name == "gpt":
            from tpcompile.models import GPT as Gpt, GPTConfig
            return Gpt(GPTConfig(attention="manual", **GPT)).eval()
        import transformers
        transformers.logging.set_verbosity_error()
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()


def args(name: str, meta: bool = False) -> tuple[tuple, dict]:
    """Example inputs (on meta for a meta model)."""
    device = "meta" if meta else "cpu"
    if name == "buffered":
        return (torch.zeros(4, 16, device=device),), {}
    ids = torch.randint(0, 64, (2, 8), device=device)
    return ((ids,), {}) if name == "gpt" else ((), {"input_ids": ids, "use_cache": False})


def full(name: str) -> dict[str, torch.Tensor]:
    """Every tensor of the seed-0 model by every name (tied ones and non-persistent buffers included)."""
    m = model(name, 0)
    return dict(list(m.named_parameters(remove_duplicate=False)) + list(m.named_buffers(remove_duplicate=False)))


def rank_wrong(gm: torch.fx.GraphModule, want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose rank-module tensor is not exactly this rank's slice of `want`'s."""
    sm, rank = gm.meta["tpcompile"], gm.meta["tpcompile_rank"]
    return [n for n, t in gm.state_dict().items()
            if not torch.equal(t, local_tensor(want[n], sm.slice_for(n), rank, sm.world_size))]


def hybrid_wrong(hm: Any, want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose chunks in the HybridModel are not exactly `want`'s, its non-persistent buffers included."""
    wrong, state = [], hm.dcp_state()
    for name, chunks in state.items():
        for offsets, view in chunks.chunks:
            if not torch.equal(view, want[name][tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))]):
                wrong.append(name)
    for stage in hm.stages.values():
        names = stage.meta["names"]
        wrong += [n for n, t in stage.named_buffers() if names.get(n, n) in want
                  and names.get(n, n) not in state and not torch.equal(t, want[names.get(n, n)])]
    return wrong


def plain_wrong(name: str, path: str) -> list[str]:
    """Stock DCP load of `path` into the plain seed-1 model: names unlike seed 0's, or written though unsaved."""
    state = model(name, 1).state_dict()
    stock_dcp.load(state, checkpoint_id=path, no_dist=True)
    wrong = [k for k, t in model(name, 0).state_dict().items() if not torch.equal(state[k], t)]
    saved = set(stock_dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    return wrong + sorted(saved ^ set(state))  # exactly the state dict's names: no non-persistent buffer


def train(name: str, mesh: Any, weights: Any, m: nn.Module, meta: bool = False) -> Any:
    """parallelize_train of `m` loaded from `weights` (no step is taken, so the loss is never called)."""
    a, k = args(name, meta)
    return tpcompile.parallelize_train(m, mesh, loss_fn=lambda out, target: out.sum(), example_inputs=a,
                                       example_kwargs=k, weights=weights)


def _error(fn: Any) -> str:
    """fn()'s TPCompileError message ('' when it returns)."""
    try:
        fn()
    except tpcompile.TPCompileError as e:
        return str(e)
    return ""


def _directions(name: str, d: str, mesh: Any, out: dict) -> None:
    """The three directions for one model; train -> parallelize fills parallelize's module again (its loader)."""
    want, (a, k) = full(name), args(name)
    gm = tpcompile.parallelize(model(name, 1), example_inputs=a, example_kwargs=k, weights=f"{d}/stock", check=False)
    out[f"{name} stock->parallelize"] = rank_wrong(gm, want)
    dcp.save(gm, f"{d}/parallelize")
    hm = train(name, mesh, f"{d}/parallelize", model(name, 1))
    out[f"{name} parallelize->train"] = hybrid_wrong(hm, want)
    dcp.save(hm, f"{d}/train")
    saved = dcp.rank_state(gm)
    with torch.no_grad():  # what the checkpoint holds is zeroed; the non-persistent buffers keep their values
        for n, t in gm.state_dict().items():
            if n in saved:
                t.zero_()
    dcp.load(gm, f"{d}/train")  # what parallelize(weights=checkpoint) runs, without capturing again
    out[f"{name} train->parallelize"] = rank_wrong(gm, want)


def _meta(name: str, d: str, mesh: Any, out: dict) -> None:
    """Models built on meta with a non-persistent buffer: the error naming it, and the way out (built real)."""
    if name == "buffered":
        out["buffered train on meta"] = _error(lambda: train(name, mesh, f"{d}/stock", buffered(1, True), True))
        real = buffered(1, meta=True)
        real.table = TABLE.clone()  # the way out: that buffer built on a real device
        out["buffered train on meta, table real"] = hybrid_wrong(train(name, mesh, f"{d}/stock", real, True),
                                                                 full(name))
    elif name == "llama":
        am, km = args(name, meta=True)
        meta = functools.partial(tpcompile.parallelize, example_inputs=am, example_kwargs=km, weights=f"{d}/train")
        out["llama parallelize on meta"] = _error(lambda: meta(model(name, 1, meta=True)))
        out["llama train on meta"] = _error(lambda: train(name, mesh, f"{d}/parallelize", model(name, 1, True), True))
        real = model(name, 1, meta=True)
        real.model.rotary_emb = type(real.model.rotary_emb)(real.config)  # the way out: that module built real
        out["llama parallelize on meta, rotary real"] = rank_wrong(meta(real), full(name))


def _rank(rank: int, base: str, names: tuple[str, ...]) -> dict:
    """Every rank: the directions and meta checks of each model; checkpoints under base/<model>/."""
    torch.set_num_threads(1)
    mesh = tpcompile.init_mesh(tp=2)
    out: dict[str, Any] = {}
    for name in names:
        _directions(name, f"{base}/{name}", mesh, out)
        _meta(name, f"{base}/{name}", mesh, out)
    return out


@functools.cache
def launch_matrix(names: tuple[str, ...]) -> tuple[list[dict], str]:
    """Stock checkpoints of the seed-0 models written here, then one 2-rank gloo launch: (per-rank results, base)."""
    from tpcompile.runtime import launch
    base = tempfile.mkdtemp(dir=_DIR.name)
    for name in names:
        stock_dcp.save(model(name, 0).state_dict(), checkpoint_id=f"{base}/{name}/stock", no_dist=True)
    return launch(2, _rank, base, names, timeout=240), base
