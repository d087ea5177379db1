"""The unsharded model's tokens, to check the ranks against, and the prompts the CLI, example and bench use.

For a Hugging Face model the reference is its own `generate(do_sample=False)`. The bundled GPT has
no generate: each row's prompt, without its padding, is extended one argmax at a time by running
the whole sequence again (no cache at all), and the padding put back in front.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def example_prompts(vocab_size: int, batch: int, prompt_len: int, *,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` prompts of prompt_len, prompt_len - 2, ... tokens (at least 1), left-padded, and their mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, prompt_len), generator=gen)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    for row in range(batch):
        pad = min(2 * row, prompt_len - 1)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


@torch.no_grad()
def reference_generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                       max_new_tokens: int) -> torch.Tensor:
    """Greedy prompt + new tokens from the unsharded model, as the ranks must produce them."""
    if hasattr(model, "generate") and hasattr(model, "generation_config"):
        return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=False)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    rows = []
    for ids, keep in zip(input_ids, mask.bool()):
        seq = ids[keep][None]
        for _ in range(max_new_tokens):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        rows.append(torch.cat([ids[~keep], seq[0]]))
    return torch.stack(rows)
