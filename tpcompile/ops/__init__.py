"""Every operator sharded graphs call: torch.ops.tpcompile.* (collectives, piece gradients) and
torch.ops.tpcompile_rng.dropout_mask. Importing this package registers them all."""
from tpcompile.ops import collectives, piece_grads, rng  # noqa: F401  (registers the ops)
