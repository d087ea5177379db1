"""`tpcompile.dcp`: sharded checkpoints of the whole training state, loadable at any layout (tpcompile.checkpoint)."""
from tpcompile.checkpoint.dcp import rank_state
from tpcompile.checkpoint.steps import latest, prune, resume, save_step, step_dir
from tpcompile.checkpoint.train_state import load, save

__all__ = ["latest", "load", "prune", "rank_state", "resume", "save", "save_step", "step_dir"]
