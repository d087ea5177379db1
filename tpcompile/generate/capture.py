"""Capture of the model with its cache: one graph for prefill (any prompt length) and decode (one token).

The CachedLM is exported with the batch (1..max_batch_size) and the number of new tokens
(1..max_seq_len) as named dynamic dims, so the same graph takes a whole prompt and then one token
per step; the masks' last dim, how many cached positions attention reads, is a third one. The
passes then shard it like any model: projections by column and row, the cache buffers by heads
(sharding_rules/state.py).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.export import Dim

from tpcompile.api import ShardedModel, shard
from tpcompile.errors import TPCompileError, TPCompileWarning
from tpcompile.generate.cache import Adapter, CachedLM
from tpcompile.generate.hf import is_hf_causal_lm
from tpcompile.generate.locality import Locality
from tpcompile.generate.masks import step_masks
from tpcompile.generate.processors import hf_decoding
from tpcompile.generate.support import PROBE_NEW, agree_with_generate, probe_lengths, run_or_refuse

CACHE_PREFIX = "kv."  # where the cache buffers live in the captured module (model paths gain "model.")
MIN_SEQ_LEN = 4  # the capture's example prompt (3 tokens) must be shorter than the cache


@dataclass(frozen=True)
class GenerationSpec:
    """What a rank needs to run the captured graph: sizes, masks, stop tokens, the cache's names."""

    max_seq_len: int
    max_batch_size: int
    windows: dict[str, Locality]  # mask name -> what its layers see (generate/locality.py)
    mask_kind: str
    dtype: torch.dtype
    eos: tuple[int, ...]
    pad: Optional[int]
    vocab_size: Optional[int]
    unsharded_cache_bytes: int
    group: str
    decoding: Any = None  # processors.HFDecoding: the model's generation_config per call (None: the bundled GPT)


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter that runs `model` with a cache; a TPCompileError for a model without one."""
    from tpcompile.generate.gpt import GPTAdapter, is_bundled_gpt
    from tpcompile.generate.hf import HFAdapter, is_hf_causal_lm
    if not isinstance(model, nn.Module):
        raise TPCompileError(f"shard_generation expects a torch.nn.Module, got {type(model).__name__}")
    if is_bundled_gpt(model):
        return GPTAdapter()
    if is_hf_causal_lm(model):
        return HFAdapter(model)
    raise TPCompileError(
        f"shard_generation does not know how {type(model).__name__} keeps keys and values: it takes Hugging Face "
        f"*ForCausalLM models (their forward takes a cache) and the bundled GPT; for another model, shard its "
        f"forward with tpcompile.shard and run the whole sequence again for each new token (no cache)")


def capture_generation(model: nn.Module, world_size: int, *, max_seq_len: int, max_batch_size: int,
                       plan: Any, group: Any) -> tuple[ShardedModel, GenerationSpec]:
    """Shard `model` with a static cache for up to max_batch_size rows of max_seq_len tokens."""
    _check_sizes(max_seq_len, max_batch_size)
    adapter = adapter_for(model)
    windows = adapter.locality(model, max_seq_len)
    decoding = hf_decoding(model) if is_hf_causal_lm(model) else None
    shapes, tables = _layers_and_position_tables(model, adapter, windows)
    _check_positions(model, tables, max_seq_len)
    dtype = shapes[0].dtype if shapes else torch.float32
    device = next(model.parameters()).device
    if decoding is not None and device.type != "meta":  # the cache and masks must give generate's own logits
        probe = CachedLM(model, adapter, shapes, 2, probe_lengths(windows) + PROBE_NEW + 1)
        agree_with_generate(model, probe, windows, adapter.mask_kind, dtype)
        del probe
    wrapper = CachedLM(model, adapter, shapes, max_batch_size, max_seq_len)
    example, dynamic = _examples(windows, adapter.mask_kind, dtype, max_seq_len, max_batch_size, device)
    with warnings.catch_warnings():  # fixed on purpose: the masks' head dim of 1, a batch of 1
        warnings.filterwarnings("ignore", message=r".*input 'masks.*' dim \d is fixed", category=TPCompileWarning)
        if max_batch_size == 1:
            warnings.filterwarnings("ignore", message=r".*input '\w+' dim 0 is fixed at 1", category=TPCompileWarning)
        sm = shard(wrapper, world_size, example_inputs=example, dynamic_shapes=dynamic,
                   plan=_prefixed({**_whole_embeddings(model, adapter), **_user_plan(plan)}), group=group)
    eos, pad = adapter.stop_tokens(model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    spec = GenerationSpec(max_seq_len, max_batch_size, windows, adapter.mask_kind, dtype, tuple(eos), pad,
                          vocab, wrapper.kv.nbytes(), sm.group, decoding=decoding)
    return sm, spec


def _examples(windows: dict, kind: str, dtype: torch.dtype, max_seq_len: int, max_batch_size: int,
              device: torch.device) -> tuple[tuple, tuple]:
    """Example inputs (a 3-token prompt) and their dynamic dims: batch, new tokens and the attended cache length
    vary, down to 1."""
    batch = min(2, max_batch_size)
    tokens = 3
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    cache_position = torch.arange(tokens, device=device)
    keep = torch.ones(batch, max_seq_len - 1, dtype=torch.bool, device=device)
    masks = step_masks(keep, cache_position, windows, kind, dtype)
    b = Dim("batch", min=1, max=max_batch_size) if max_batch_size > 1 else None
    t = Dim("new_tokens", min=1, max=max_seq_len)
    # How much of the cache attention reads. Never all of it: the token at the last position is never fed
    # back (it is the last one generated), and a length below the buffer's keeps every read a strict slice,
    # so the model's reshapes of it take one path at every length.
    attended = Dim("attended", min=1, max=max_seq_len - 1)
    row = {0: b, 1: t} if b is not None else {1: t}
    mask_dims = {0: b, 2: t, 3: attended} if b is not None else {2: t, 3: attended}
    dynamic = (row, dict(row), {0: t}, {name: dict(mask_dims) for name in masks})
    return (ids, cache_position.expand(batch, tokens).clone(), cache_position, masks), dynamic


def _whole_embeddings(model: nn.Module, adapter: Adapter) -> dict[str, str]:
    """Embeddings kept whole on every rank: a step looks up one row per prompt, so a vocabulary split saves
    memory at the price of one all-reduce per step. Position tables always; the token embedding unless its
    weight is tied to another module's (a tied head is split by vocabulary, and the two must be cut alike)."""
    token = adapter.token_embedding(model)
    whole = {name: "replicate" for name, mod in model.named_modules()
             if isinstance(mod, nn.Embedding) and mod is not token and name}
    weight = getattr(token, "weight", None)
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is weight]
    path = next((name for name, mod in model.named_modules() if mod is token), None)
    if path and len(names) == 1:
        whole[path] = "replicate"
    return whole


def _layers_and_position_tables(model: nn.Module, adapter: Adapter, windows: dict) -> tuple[list, dict]:
    """The layers' cache shapes, and the embeddings that read positions (name -> module): those the shape probe
    (token ids 0 at positions 0 and 1) looked up at an index above 0; every embedding but the token one when
    no probe ran or the model is on the meta device (token-type tables read 0 and are not position tables)."""
    token = adapter.token_embedding(model)
    others = {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Embedding) and mod is not token}
    read: dict[str, int] = {}

    def hook(name: str) -> Any:
        def record(mod: nn.Module, args: tuple, out: Any) -> None:
            if args and isinstance(args[0], torch.Tensor) and not args[0].is_meta and args[0].numel():
                read[name] = max(read.get(name, 0), int(args[0].max()))
        return record
    handles = [mod.register_forward_hook(hook(name)) for name, mod in others.items()]
    try:
        shapes = run_or_refuse(model, "its forward", lambda: adapter.layers(model, windows))
    finally:
        for h in handles:
            h.remove()
    if not read:
        return shapes, others
    return shapes, {name: others[name] for name, top in read.items() if top > 0}


def _check_positions(model: nn.Module, tables: dict[str, nn.Module], max_seq_len: int) -> None:
    """A learned position table bounds the sequence: say so before anything is captured."""
    for name, mod in tables.items():
        if mod.num_embeddings < max_seq_len:
            raise TPCompileError(f"max_seq_len={max_seq_len} is longer than {type(model).__name__}'s position table "
                                 f"{name} ({mod.num_embeddings} positions); pass max_seq_len <= {mod.num_embeddings}")


def _user_plan(plan: Any) -> dict:
    """The user's plan as a dict (a YAML plan file read)."""
    if plan is None:
        return {}
    if isinstance(plan, (str, os.PathLike)):
        from tpcompile.overrides import load_overrides
        plan = load_overrides(plan)
    if not isinstance(plan, dict):
        raise TPCompileError(f"plan must be a dict of module path -> mode or a YAML file, got {type(plan).__name__}")
    return dict(plan)


def _prefixed(plan: dict) -> Optional[dict]:
    """The plan's paths (paths in the user's model) as paths in the CachedLM, where the model is `model`."""
    return {f"model.{k}" if k else "model": v for k, v in plan.items()} or None


def _check_sizes(max_seq_len: Any, max_batch_size: Any) -> None:
    for name, value, least in (("max_seq_len", max_seq_len, MIN_SEQ_LEN), ("max_batch_size", max_batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise TPCompileError(f"{name} must be an int >= {least}, got {value!r}; pass the longest prompt plus "
                                 f"new tokens (max_seq_len) and the most prompts per call (max_batch_size)")
