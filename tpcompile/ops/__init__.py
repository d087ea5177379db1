"""Every operator sharded graphs call: torch.ops.tpcompile.* (collectives, piece gradients, the in-place all-reduce, gradient buckets, the async start, overlapped linears) and
torch.ops.tpcompile_rng.dropout_mask, torch.ops.tpcompile_async.wait. Importing this package registers them all."""
from tpcompile.ops import async_ops, buckets, collectives, inplace, linear_grads, piece_grads, rng  # noqa: F401  (registers the ops)
