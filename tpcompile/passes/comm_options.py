"""CommOptions: which communication passes run on each rank graph (`shard(..., comm=...)`).

`comm=None` (every entry point's default) runs DEFAULT_COMM: the passes the fuzzer and the Hugging Face
matrix prove equal to the plain split (in-place all-reduces and gradient buckets); `comm=False` runs none.
The asynchronous passes and the lowering stay opt-in (docs/communication.md says why, with measurements).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tpcompile.errors import TPCompileError

DEFAULT_BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's bucket_cap_mb=25


@dataclass(frozen=True)
class CommOptions:
    """The communication passes after rewrite(r); `comm=None` and `comm=True` mean these defaults.

    inplace: an all-reduce whose input is a dead temporary sums into it (passes/comm_inplace.py).
    bucket_bytes: per-parameter gradient syncs are flattened into buckets of at most this many
    bytes and reduced once per bucket in backward (passes/comm_bucket.py); 0 turns it off.
    asynchronous: the linears reading one grad_all_reduce(x) are fused so x's gradient all-reduce
    overlaps the weight gradients in backward (passes/comm_linear_grads.py); each in-place
    all-reduce is split into a start right after its input and a wait right before its first
    reader (passes/comm_async.py; needs inplace).
    lower_c10d: after the per-rank verifier, the collectives become torch.ops._c10d_functional
    calls (passes/comm_lower.py) for torch.compile; needs torch.distributed initialised.
    """

    inplace: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    asynchronous: bool = False
    lower_c10d: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise TPCompileError(f"CommOptions.bucket_bytes must be an int >= 0 (0 turns bucketing off), "
                                 f"got {self.bucket_bytes!r}")


DEFAULT_COMM = CommOptions()  # comm=None: in place and buckets on, asynchronous and lower_c10d off


def comm_options(value: Any) -> Optional[CommOptions]:
    """`shard`'s comm= argument as CommOptions: None -> DEFAULT_COMM, True -> CommOptions(), False -> None
    (no pass), a CommOptions -> itself."""
    if value is None:
        return DEFAULT_COMM
    if value is False:
        return None
    if value is True:
        return CommOptions()
    if isinstance(value, CommOptions):
        return value
    raise TPCompileError(f"comm={value!r} ({type(value).__name__}): pass True, False, None or "
                         f"tpcompile.CommOptions(inplace=..., bucket_bytes=...)")
