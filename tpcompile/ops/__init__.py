"""Every operator sharded graphs call: torch.ops.tpcompile.* (collectives, piece gradients, the in-place all-reduce, gradient buckets) and
torch.ops.tpcompile_rng.dropout_mask. Importing this package registers them all."""
from tpcompile.ops import buckets, collectives, inplace, piece_grads, rng  # noqa: F401  (registers the ops)
