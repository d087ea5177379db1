"""Dropout masks that do not depend on the parallel layout: tpcompile_rng.dropout_mask and its state.

Every element's keep / drop decision is a pure function of (the seed, a step number, the dropout
site, the element's index in the unsharded tensor), hashed as ops/rng_hash.py says. A rank computes
the decisions of exactly the elements it holds, so the ranks' masks put together are the unsharded
tensor's mask at any tensor-parallel degree, with or without sequence parallelism, and at any
data-parallel and pipeline layout once the runtime says which rows of the global batch a call holds.

- The site is the captured graph's node name: a module called twice in one forward is two nodes,
  so two masks.
- The step: inside `with step(n):` it is n (HybridModel.step sets it to the number of the train
  step, `next_step()`, a count of the process kept in state() so that a checkpoint resumes it);
  outside, each site counts its own calls on each rank (every rank calls every site once per
  forward, so the counts agree), so every forward draws new masks.
- The rows: inside `with rows(offset):` the batch's first row is that row of the global batch
  (HybridModel.step: the data-parallel rank's offset; its pipeline stages add each microbatch's
  through `chunk(k)`); 0 outside.
- `seed(s)` sets the seed (0 by default) and clears the counts; `state()` / `load_state()` save
  and restore seed and counts exactly (plain ints), for checkpoints.
"""
from __future__ import annotations

import threading
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from tpcompile.errors import TPCompileError
from tpcompile.ops.rng_hash import EVEN, MERGED, RUNS, keep_mask, mix

__all__ = ["EVEN", "MERGED", "RUNS", "chunk", "dropout_mask", "load_state", "next_step", "rows", "seed", "state",
           "step"]

_GOLDEN = 0x9E3779B97F4A7C15
_lock = threading.Lock()
_seed = 0
_steps = 0  # train steps numbered by next_step()
_calls: dict[tuple[int, str], int] = {}  # (rank, site) -> its calls since seed() / load_state()
_base: dict[str, int] = {}  # site -> the calls load_state() restored
_local = threading.local()  # each thread (a simulated rank) has its own context


@dataclass
class _Context:
    """What the runtime says about the calls of this thread: their step and the global row of their first row."""

    step: Optional[int] = None
    rows: int = 0
    chunk_rows: int = 0  # rows per microbatch, for chunk()


def _context() -> _Context:
    if not hasattr(_local, "ctx"):
        _local.ctx = _Context()
    return _local.ctx


def seed(value: int) -> None:
    """Set the dropout seed of every rank and start every count again from zero."""
    global _seed, _steps
    with _lock:
        _seed, _steps = int(value), 0
        _calls.clear()
        _base.clear()


def state() -> dict[str, Any]:
    """The seed and the counts as plain ints: {"seed", "step" (next_step's), "calls": {site: calls}}."""
    with _lock:
        calls = dict(_base)
        for (_, site), n in _calls.items():  # (every rank of a simulation has the same counts)
            calls[site] = max(calls.get(site, 0), n)
        return {"seed": _seed, "step": _steps, "calls": dict(sorted(calls.items()))}


def load_state(saved: dict[str, Any]) -> None:
    """Restore what state() returned, so that the next masks are those an uninterrupted run draws."""
    global _seed, _steps
    try:
        new_seed, new_steps = int(saved["seed"]), int(saved["step"])
        calls = {str(k): int(v) for k, v in dict(saved.get("calls", {})).items()}
    except (KeyError, TypeError, ValueError) as e:
        raise TPCompileError(f"tpcompile.ops.rng.load_state: {saved!r} is not what rng.state() returns ({e!r}); "
                             f"pass the dict rng.state() gave, with int 'seed' and 'step' and a 'calls' dict") from e
    with _lock:
        _seed, _steps = new_seed, new_steps
        _calls.clear()
        _base.clear()
        _base.update(calls)


def next_step() -> int:
    """The number of the next train step (0, 1, ...): a count of this process, kept in state()."""
    global _steps
    with _lock:
        _steps += 1
        return _steps - 1


@contextmanager
def step(n: int) -> Iterator[None]:
    """Masks drawn inside belong to step `n` (the sites do not count these calls)."""
    ctx = _context()
    old, ctx.step = ctx.step, int(n)
    try:
        yield
    finally:
        ctx.step = old


@contextmanager
def rows(offset: int, *, chunk_rows: int = 0) -> Iterator[None]:
    """Inside, the batch's first row is row `offset` of the global batch; chunk(k) adds k * chunk_rows."""
    ctx = _context()
    old = ctx.rows, ctx.chunk_rows
    ctx.rows, ctx.chunk_rows = int(offset), int(chunk_rows)
    try:
        yield
    finally:
        ctx.rows, ctx.chunk_rows = old


@contextmanager
def chunk(k: int) -> Iterator[None]:
    """Inside, the rows are those of microbatch `k` of the batch that rows() described."""
    ctx = _context()
    with rows(ctx.rows + int(k) * ctx.chunk_rows, chunk_rows=ctx.chunk_rows):
        yield


def _site_key(site: str) -> int:
    """A 64-bit key of a site's name, the same in every process (unlike hash())."""
    data = site.encode()
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


def _step_of(rank: int, site: str) -> int:
    """The step of this call: the runtime's, or this site's count of calls on this rank."""
    ctx = _context()
    if ctx.step is not None:
        return ctx.step
    with _lock:
        n = _calls.get((rank, site), _base.get(site, 0))
        _calls[(rank, site)] = n + 1
        return n


@torch.library.custom_op("tpcompile_rng::dropout_mask", mutates_args=())
def dropout_mask(x: torch.Tensor, p: float, site: str, rank: int, split: list[int], rows_of: list[int],
                 batch: int) -> torch.Tensor:
    """A mask of 0 and 1/(1-p) shaped like x, each element kept or dropped by the hash of its global position.

    `split` says where this rank's positions lie along the dims its layout splits (rng_hash's RUNS,
    EVEN, MERGED); `rows_of[d]` is 1 where dim d's size is a multiple of the batch, `batch` rows here.
    """
    if p >= 1.0:
        return torch.zeros_like(x)
    key = mix(mix(_seed) ^ mix(_step_of(int(rank), site) * _GOLDEN) ^ _site_key(site))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        keep_mask(out, key, float(p), list(split), list(rows_of), int(batch), _context().rows)
    return out


@dropout_mask.register_fake
def _dropout_mask_fake(x: torch.Tensor, p: float, site: str, rank: int, split: list[int], rows_of: list[int],
                       batch: int) -> torch.Tensor:
    return torch.empty_like(x)


def _no_grad(ctx: object, grad: torch.Tensor) -> tuple:
    return None, None, None, None, None, None, None


dropout_mask.register_autograd(_no_grad)
