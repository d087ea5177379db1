"""Weights of sharded models: per-rank loading, DCP checkpoints at any world size, merging state dicts."""
