"""Whether a Hugging Face model runs with the generation cache: a reason when it cannot, checked before capture.

Two checks at shard_generation time, on the unsharded model:

- `run_or_refuse`: the model's own forward, with the callback cache and 4-D masks, must run; an
  exception from inside transformers becomes a TPCompileError with the reason (`reason_hint`: a
  recurrent or convolution state, ALiBi biases built from the 2-D mask, cross-attention).
- `agree_with_generate`: a short probe (two prompts, one left-padded, then PROBE_NEW tokens)
  through the cache and masks the ranks use must give the next-token logits of the model's own
  `generate`, step by step. A model that derives positions or masks from its own cache or 2-D
  mask (positions from the cache's length, ALiBi from the padding mask) is refused here instead
  of generating other tokens. Skipped for a model on the meta device (it has no values yet).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError

PROBE_NEW = 3  # tokens the probe generates (the prompt's step, then two decode steps)
PROBE_LONGEST = 24  # the probe's prompt covers windows and chunks up to this many tokens
# config fields of a recurrent (state-space) or convolution state
STATE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "d_state", "conv_kernel", "mamba_d_conv",
                "d_conv", "conv_L_cache", "lru_width", "rescale_every")


def reason_hint(model: nn.Module) -> Optional[str]:
    """Why a model may not run with a key/value cache and 4-D masks, from its config and code; None if nothing."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    state = [f for f in STATE_FIELDS if getattr(config, f, None) is not None]
    if state:
        return (f"it keeps a recurrent or convolution state (config.{state[0]}), which the key/value cache does "
                f"not hold")
    module = sys.modules.get(type(model).__module__)
    if getattr(config, "alibi", False) or any("alibi" in name.lower() for name in dir(module)):
        return "its ALiBi position biases are built from the 2-D attention mask, which the 4-D masks replace"
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return "it attends to an encoder's output (cross-attention), which the cache does not hold"
    return None


def run_or_refuse(model: nn.Module, what: str, run: Callable[[], Any]) -> Any:
    """run(), an exception from the model's code becoming a TPCompileError with the reason."""
    try:
        return run()
    except TPCompileError:
        raise
    except Exception as e:  # noqa: BLE001  any failure inside the model's code is a reason to refuse it
        hint = reason_hint(model)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TPCompileError(
            f"{type(model).__name__} cannot run with the generation cache ({what}: {type(e).__name__}: {first})"
            f"{': ' + hint if hint else ''}; generate with the unsharded model (model.generate)") from e


def probe_lengths(kinds: dict[str, Any]) -> int:
    """The probe's prompt length: past every window and chunk up to PROBE_LONGEST tokens."""
    reach = [n for loc in kinds.values() for n in (loc.window, loc.chunk) if n is not None and n <= PROBE_LONGEST]
    return max([5] + [n + 2 for n in reach])


@torch.no_grad()
def agree_with_generate(model: nn.Module, cached: nn.Module, kinds: dict[str, Any], mask_kind: str,
                        dtype: torch.dtype) -> None:
    """Raise a TPCompileError unless `cached` (the model with a KVCache of the probe's length) gives the logits of
    the model's own greedy generate at each of PROBE_NEW steps."""
    from tpcompile.generate.masks import step_masks

    device = next(model.parameters()).device
    prompt = probe_lengths(kinds)
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or 0)
    ids = torch.randint(1, max(vocab, 2), (2, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    hf = run_or_refuse(model, "its own generate", lambda: model.generate(
        ids, attention_mask=mask, max_new_tokens=PROBE_NEW, min_new_tokens=PROBE_NEW, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0))
    tokens, want = hf.sequences[:, prompt:], hf.logits
    total = cached.kv.k0.shape[2] if hasattr(cached.kv, "k0") else prompt + PROBE_NEW
    keep = torch.ones(2, total, dtype=torch.bool, device=device)
    keep[:, :prompt] = mask.bool()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    feed, at = ids, torch.arange(prompt, device=device)
    for step in range(len(want)):
        masks = step_masks(keep[:, :total - 1], at, kinds, mask_kind, dtype)  # more than the filled part, as a step
        got = run_or_refuse(model, "a forward with the static cache", lambda: cached(feed, positions, at, masks))
        ref = want[step].float()
        diff = float((got.float() - ref).abs().max())
        tol = max(1e-3, 4 * torch.finfo(dtype).eps) * float(ref.abs().max()) + 1e-4
        if not diff <= tol:
            hint = reason_hint(model) or ("it derives positions or masks from its own cache or 2-D attention mask, "
                                          "which the static cache and 4-D masks replace")
            raise TPCompileError(
                f"{type(model).__name__} computes other next-token logits with the generation cache than under its "
                f"own generate (step {step}, largest difference {diff:.3g} > {tol:.3g}): {hint}; generate with the "
                f"unsharded model (model.generate)")
        feed = tokens[:, step:step + 1]
        positions = positions[:, -1:] + 1
        at = at[-1:] + 1
