"""Every operator sharded graphs call: torch.ops.tpcompile.* (collectives, piece gradients, the in-place all-reduce) and
torch.ops.tpcompile_rng.dropout_mask. Importing this package registers them all."""
from tpcompile.ops import collectives, inplace, piece_grads, rng  # noqa: F401  (registers the ops)
