"""`tpcompile.dcp.save` / `tpcompile.dcp.load`: sharded checkpoints (tpcompile.checkpoint.dcp)."""
from tpcompile.checkpoint.dcp import load, rank_state, save

__all__ = ["load", "rank_state", "save"]
