"""One 2-rank gloo launch of every startup-agreement case (tests/test_agreement.py reads its results).

Each case runs on both ranks with one rank's model, code or inputs made different on purpose, and
records on each rank either what it computed or the TPCompileError it raised, with the seconds it
took: parallelize (unseeded init, another head count with equal shapes, another activation, an
extra layer, unequal inputs on the first call and with check_inputs="always", comm=True),
shard_generation (unseeded init, unequal prompts) and parallelize_train (unseeded init under FSDP,
an extra layer at pp 2, another head count at tp 2, unequal batches at tp 2, a length-dependent
branch and a GPT past its position table, stepped at a length the capture excluded).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.models import GPT, GPTConfig

TINY = dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32)


def gpt(seed: int, **changes: Any) -> GPT:
    """The tiny GPT built after torch.manual_seed(seed), with config changes."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(GPTConfig(**{**TINY, **changes})).eval()


class Mlp(nn.Module):
    """Two linears with an activation between them, chosen by name."""

    def __init__(self, act: str = "gelu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.act = nn.Linear(16, 64), nn.Linear(64, 16), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)) if self.act == "gelu" else F.relu(self.up(x)))


class Branchy(nn.Module):
    """A token model that takes another path for sequences longer than 16 tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.blocks = nn.Embedding(64, 32), nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if ids.shape[1] > 16:
            h = h * 0.5
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def ids(seed: int, shape: tuple[int, int] = (4, 12)) -> torch.Tensor:
    """Token ids drawn from their own generator."""
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), target[:, 1:].reshape(-1))


def attempt(fn: Callable[[], Any]) -> dict:
    """{'value': fn()} or {'error': the TPCompileError's message}, with the seconds it took."""
    start = time.monotonic()
    try:
        out: dict = {"value": fn()}
    except tpcompile.TPCompileError as e:
        out = {"error": str(e)}
    return {**out, "s": time.monotonic() - start}


class Lines(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _parallelize_cases(rank: int) -> dict:
    """The parallelize cases."""
    x = ids(0)
    out: dict[str, Any] = {}
    lines = Lines()
    logging.getLogger("tpcompile").addHandler(lines)
    try:
        def unseeded() -> float:
            gm = tpcompile.parallelize(gpt(100 + rank), example_inputs=(x,))
            with torch.no_grad():
                return float((gm(ids(5, (3, 9))) - gpt(100)(ids(5, (3, 9)))).abs().max())
        out["unseeded"] = attempt(unseeded)
        out["unseeded_log"] = list(lines.lines)
    finally:
        logging.getLogger("tpcompile").removeHandler(lines)
    out["heads"] = attempt(lambda: tpcompile.parallelize(gpt(0, **({"n_head": 2} if rank else {})),
                                                         example_inputs=(x,)) and None)
    out["activation"] = attempt(lambda: tpcompile.parallelize(Mlp("relu" if rank else "gelu"),
                                                              example_inputs=(torch.randn(2, 16),)) and None)
    out["extra_layer"] = attempt(lambda: tpcompile.parallelize(gpt(0, n_layer=3 if rank else 2),
                                                               example_inputs=(x,)) and None)
    gm = tpcompile.parallelize(gpt(0), example_inputs=(x,))
    out["inputs"] = attempt(lambda: gm(ids(rank)) and None)
    always = tpcompile.parallelize(gpt(0), example_inputs=(x,), check_inputs="always")

    def second_call() -> None:
        with torch.no_grad():
            always(ids(7))
            always(ids(7 + rank))
    out["inputs_always"] = attempt(second_call)
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(20):
            always(ids(7))
        out["always_call_s"] = (time.perf_counter() - start) / 20
        bare = tpcompile.parallelize(gpt(0), example_inputs=(x,), check_inputs="never")
        start = time.perf_counter()
        for _ in range(20):
            bare(ids(7))
        out["never_call_s"] = (time.perf_counter() - start) / 20
    comm = tpcompile.parallelize(gpt(0), example_inputs=(x,), comm=True)
    with torch.no_grad():
        out["comm"] = float((comm(ids(3)) - gpt(0)(ids(3))).abs().max())
    return out


def _generation_cases(rank: int) -> dict:
    """The shard_generation cases (the bundled GPT with its cache)."""
    from tpcompile.generate.reference import reference_generate
    out: dict[str, Any] = {}
    prompt, mask = ids(1, (1, 5)), torch.ones(1, 5, dtype=torch.long)

    def unseeded() -> bool:
        gen = tpcompile.shard_generation(gpt(200 + rank), 2, max_seq_len=12)
        return bool(torch.equal(gen.rank(rank).generate(prompt, max_new_tokens=4),
                                reference_generate(gpt(200), prompt, mask, 4)))
    out["unseeded"] = attempt(unseeded)
    gen = tpcompile.shard_generation(gpt(0), 2, max_seq_len=12)
    out["prompts"] = attempt(lambda: gen.rank(rank).generate(ids(10 + rank, (1, 5)), max_new_tokens=3) and None)
    return out


def _train(rank: int, model: nn.Module, dims: dict, batch: torch.Tensor, *, steps: int = 1,
           example: torch.Tensor | None = None, **kw: Any) -> list[float]:
    """parallelize_train on the given mesh, then `steps` steps of `batch`; the losses."""
    mesh = tpcompile.init_mesh(**dims)
    hm = tpcompile.parallelize_train(model, mesh, loss_fn=loss_fn, example_inputs=(ids(0) if example is None
                                                                                    else example,), **kw)
    return [float(hm.step(batch, target=batch)) for _ in range(steps)]


def _train_cases(rank: int) -> dict:
    """The parallelize_train cases, one mesh each."""
    out: dict[str, Any] = {}
    batch = ids(4)
    with torch.no_grad():
        out["unseeded_reference"] = float(loss_fn(gpt(300).train()(batch), batch))
    out["unseeded_fsdp"] = attempt(lambda: _train(rank, gpt(300 + rank).train(), dict(dp=2), batch[2 * rank:][:2]))
    out["extra_layer_pp"] = attempt(lambda: _train(rank, gpt(0, n_layer=3 if rank else 2).train(), dict(pp=2),
                                                   batch))
    out["heads_tp"] = attempt(lambda: _train(rank, gpt(0, **({"n_head": 2} if rank else {})).train(), dict(tp=2),
                                             batch))
    out["inputs_tp"] = attempt(lambda: _train(rank, gpt(0).train(), dict(tp=2), ids(20 + rank)))
    out["branch_pp"] = attempt(lambda: _train(rank, Branchy(), dict(pp=2), ids(6, (4, 20)), example=ids(0)))
    out["past_table_pp"] = attempt(lambda: _train(rank, gpt(0).train(), dict(pp=2), ids(6, (4, 40))))
    return out


def rank_cases(rank: int) -> dict:
    """Every case on this rank."""
    torch.manual_seed(1234 + rank)  # the global RNG differs per rank, as in an unseeded script
    return {"parallelize": _parallelize_cases(rank), "generate": _generation_cases(rank),
            "train": _train_cases(rank)}


@functools.cache
def results() -> list[dict]:
    """Both ranks' results, from one launch per test process."""
    from tpcompile.runtime import launch
    return launch(2, rank_cases, timeout=300)
