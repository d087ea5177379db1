"""The hash behind tpcompile's dropout masks: each element's keep / drop decision from its global position.

A value's position in the unsharded tensor is hashed one dim at a time: the global index along
dim d, plus a salt of the mask's key and d, through murmur3's fmix64; the per-dim hashes are summed
(mod 2**64) and mixed once more. So a rank needs, along each dim, only the global indices of the
positions it holds, never the global sizes: `split` describes them for the dims the layout splits
(kinds below), and `rows_of` marks the dims that are multiples of the batch, whose global rows start
`offset` rows into the global batch. All of it is int64 tensor arithmetic, so any device computes the
same bits.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpcompile.layouts import token_shares

__all__ = ["CHUNK", "EVEN", "MERGED", "RUNS", "keep_mask", "mix", "signed"]

# kinds of a split dim in the `split` list: [dim, kind, *fields] per split dim
RUNS = 0  # [dim, RUNS, stride, n, a1, b1, ..., an, bn]: runs [a, b) of every block of `stride` global positions
EVEN = 1  # [dim, EVEN, rank, world, reps, total, inner]: tokens (sequence parallelism) in `reps` blocks of `total`
# tokens of `inner` entries, split in layouts/token_shares.py's shares (total 0: not known, an even split)
MERGED = 2  # [dim, MERGED, start, next_size]: dims dim, dim+1 hold one contiguous run of their merged positions
_FIELDS = {EVEN: 5, MERGED: 2}

CHUNK = 1 << 16  # elements per chunk of the hash on one CPU thread (docs/architecture.md has the measurement)
_M64 = (1 << 64) - 1
_C1, _C2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # murmur3's fmix64 multipliers
_GOLDEN = 0x9E3779B97F4A7C15


def mix(v: int) -> int:
    """splitmix64 of one Python int (64 bits)."""
    v = (v + _GOLDEN) & _M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _M64
    return v ^ (v >> 31)


def signed(v: int) -> int:
    """A 64-bit pattern as the int64 torch stores."""
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


def _xorshift33(x: torch.Tensor, tmp: torch.Tensor) -> None:
    """x ^= x >> 33 as a logical shift (torch shifts int64 arithmetically), in place."""
    torch.bitwise_right_shift(x, 33, out=tmp)
    tmp.bitwise_and_((1 << 31) - 1)
    x.bitwise_xor_(tmp)


def _fmix(x: torch.Tensor, tmp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """murmur3's fmix64 on an int64 tensor, in place, without its last xorshift (only the top bits are read)."""
    tmp = torch.empty_like(x) if tmp is None else tmp
    _xorshift33(x, tmp)
    x.mul_(signed(_C1))
    _xorshift33(x, tmp)
    return x.mul_(signed(_C2))


def _arange(a: int, b: int, device: torch.device) -> torch.Tensor:
    return torch.arange(int(a), int(b), dtype=torch.int64, device=device)


def _parse(split: list[int]) -> dict[int, tuple[int, list[int]]]:
    """dim -> (kind, fields) from the flat `split` list."""
    out, i = {}, 0
    while i < len(split):
        d, kind = int(split[i]), int(split[i + 1])
        n = 2 + 2 * int(split[i + 3]) if kind == RUNS else _FIELDS[kind]
        out[d] = (kind, [int(v) for v in split[i + 2:i + 2 + n]])
        i += 2 + n
    return out


def _blocks(reps: int, stride: int, within: torch.Tensor, first: int, device: torch.device) -> torch.Tensor:
    """Global positions of `reps` blocks of `stride` positions, the first one block `first`, each holding `within`."""
    rep = _arange(first, first + reps, device)
    return (rep[:, None] * stride + within[None, :]).flatten()


def _global_index(shape: list[int], d: int, split: dict, rows_of: list[int], batch: int, offset: int,
                  device: torch.device) -> torch.Tensor:
    """The global positions along dim d (dims d and d+1 merged, for MERGED) of this rank's elements."""
    n = shape[d]

    def first(size: int) -> int:  # the global index of this call's first row along d (batch rows times their size)
        return offset * (size // batch) if rows_of[d] and offset and batch else 0
    if d not in split:
        return _arange(0, n, device) + first(n)
    kind, f = split[d]
    if kind == RUNS:
        stride, runs = f[0], [_arange(a, b, device) for a, b in zip(f[2::2], f[3::2])]
        within = runs[0] if len(runs) == 1 else torch.cat(runs)
        reps = n // within.numel()
        return _blocks(reps, stride, within, first(reps), device)
    if kind == EVEN:
        rank, world, reps, total, inner = f
        local = n // reps
        at, stride = (token_shares.start(total, rank, world) * inner, total * inner) if total else \
            (rank * local, local * world)
        return _blocks(reps, stride, _arange(at, at + local, device), first(reps), device)
    start, _ = f  # MERGED
    return _arange(start, start + n * shape[d + 1], device)


def _parts(shape: list[int], key: int, split: dict, rows_of: list[int], batch: int, offset: int,
           device: torch.device) -> list[tuple[list[int], torch.Tensor]]:
    """(dims, the hashes of this rank's global positions along them), per dim (two dims for MERGED)."""
    out, d = [], 0
    while d < len(shape):
        idx = _global_index(shape, d, split, rows_of, batch, offset, device)
        merged = split.get(d, (None,))[0] == MERGED
        dims = [d, d + 1] if merged else [d]
        indices = [idx // split[d][1][1], idx % split[d][1][1]] if merged else [idx]
        part: Optional[torch.Tensor] = None
        for k, g in zip(dims, indices):
            h = _fmix(g.add_(signed(mix(key + k))))
            part = h if part is None else part.add_(h)
        out.append((dims, part))
        d += len(dims)
    return out


def _sum(parts: list[tuple[list[int], torch.Tensor]], dims: range, shape: list[int], start: int,
         device: torch.device) -> torch.Tensor:
    """start plus the parts of `dims`, as a tensor of those dims' sizes."""
    out = torch.full([shape[d] for d in dims], start, dtype=torch.int64, device=device)
    for ds, t in parts:
        if ds[0] in dims:
            out = out + t.view([shape[d] if d in ds else 1 for d in dims])
    return out


def _numel(sizes: list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _chunk(numel: int) -> int:
    """Elements per chunk on the CPU: CHUNK on one thread; with several, at most 4 chunks (every op of a chunk
    wakes every thread, which a busy machine makes slow; measured in docs/architecture.md)."""
    threads = torch.get_num_threads()
    return CHUNK if threads == 1 else max(CHUNK * threads, -(-numel // 4))


def keep_mask(out: torch.Tensor, key: int, p: float, split: list[int], rows_of: list[int], batch: int,
              offset: int) -> torch.Tensor:
    """Fill `out` with 1/(1-p) where an element is kept and 0 where it is dropped; return it.

    An element's final hash h, read as the uniform (h + 2**63) / 2**64, keeps it when >= p. On the CPU
    the full-size work goes in chunks (_chunk) whose int64 temporaries (8 bytes an element) are allocated
    once and stay in cache; other devices take the whole tensor at once.
    """
    shape, device = list(out.shape), out.device
    parts = _parts(shape, key, _parse(split), rows_of, batch, offset, device)
    limit = _chunk(_numel(shape)) if device.type == "cpu" else 1 << 62
    c = next((c for c in range(len(shape) + 1) if _numel(shape[c:]) <= limit), len(shape))
    c = min(c, max(len(shape) - 1, 0))  # the last dim goes whole into a chunk
    if any(len(ds) == 2 and c == ds[1] for ds, _ in parts):  # a merged pair stays on one side of the cut
        c -= 1
    outer = _sum(parts, range(c), shape, signed(mix(key)), device).reshape(-1, 1)  # (the key alone for 0-d)
    inner = _sum(parts, range(c, len(shape)), shape, 0, device).reshape(1, -1)
    flat = out.view(outer.shape[0], inner.shape[1])
    rows = max(1, limit // max(inner.shape[1], 1))
    threshold = signed(min(round(p * 2.0 ** 64), _M64) - (1 << 63))
    h = torch.empty((min(rows, outer.shape[0]), inner.shape[1]), dtype=torch.int64, device=device)
    tmp, keep = torch.empty_like(h), torch.empty(h.shape, dtype=torch.bool, device=device)
    for r in range(0, outer.shape[0], rows):
        n = min(rows, outer.shape[0] - r)
        torch.add(outer[r:r + n], inner, out=h[:n])
        torch.ge(_fmix(h[:n], tmp[:n]), threshold, out=keep[:n])
        flat[r:r + n].copy_(keep[:n]).mul_(1.0 / (1.0 - p))
    return out
