"""A Hugging Face model's generation_config in the generate loop: transformers' own logits processors, or a refusal.

Every rank holds the same logits, so every logits processor runs on every rank alike. For each call
the model's generation config is merged with the call's arguments and prepared as `generate`
prepares it (`_prepare_generation_config`, `_prepare_special_tokens`, `_prepare_generated_length`),
and `_get_logits_processor` builds the list `generate` would apply, in its order: sequence_bias,
encoder_repetition_penalty, repetition_penalty, no_repeat_ngram_size, encoder_no_repeat_ngram_size,
bad_words_ids, min_length, min_new_tokens, forced_bos_token_id, forced_eos_token_id,
remove_invalid_values, exponential_decay_length_penalty, suppress_tokens, begin_suppress_tokens;
when sampling temperature, top_h, top_k, top_p, min_p, typical_p, epsilon_cutoff, eta_cutoff; then
watermarking_config and renormalize_logits. The processors read the whole sequence so far.

Fields that choose another decoding method than greedy or multinomial sampling, or that need
something the ranks do not have (a tokenizer, a second model, a wall clock they agree on), are
refused at shard_generation time when the model's generation_config sets them (REFUSED).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from tpcompile.errors import TPCompileError, TPCompileWarning


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != ()


# generation_config field -> (does this value change the decoding?, what it does)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "num_beams": (lambda v: v > 1, "beam search"),
    "num_beam_groups": (lambda v: v > 1, "group beam search"),
    "penalty_alpha": (lambda v: v > 0, "contrastive search"),
    "constraints": (_set, "constrained beam search"),
    "force_words_ids": (_set, "constrained beam search"),
    "num_return_sequences": (lambda v: v > 1, "several sequences per prompt; repeat the prompt rows instead"),
    "guidance_scale": (lambda v: v != 1, "classifier-free guidance, a second forward without the prompt"),
    "prompt_lookup_num_tokens": (_set, "assisted generation by prompt lookup"),
    "assistant_early_exit": (_set, "assisted generation by early exit"),
    "use_mtp": (_set, "assisted generation by multi-token prediction"),
    "dola_layers": (_set, "DoLa decoding, logits contrasted across layers"),
    "max_time": (_set, "a wall-clock limit, which the ranks would reach at different steps"),
    "stop_strings": (_set, "stop strings, which need the tokenizer"),
    "token_healing": (_set, "token healing, which needs the tokenizer"),
    "cache_implementation": (lambda v: "quantized" in str(v), "a quantized key/value cache"),
}


def refuse_generation_config(model: nn.Module) -> None:
    """A TPCompileError for the first field of model.generation_config in REFUSED set to a value that matters."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    for field, (matters, what) in REFUSED.items():
        value = getattr(config, field, None)
        if value is not None and matters(value):
            raise TPCompileError(
                f"{type(model).__name__}.generation_config.{field}={value!r} asks for {what}; generation on "
                f"sharded ranks decodes greedily or by sampling one token per row: set "
                f"model.generation_config.{field} = None before shard_generation, or generate with the unsharded "
                f"model")


@dataclass(frozen=True)
class Prepared:
    """One call's decoding: sample or not, the processors (a LogitsProcessorList), the ids that end a row, and
    the id that fills a row after its end (the generation_config's pad token, else the first eos id)."""

    do_sample: bool
    processors: Any
    eos: list[int]
    pad: Optional[int]


class HFDecoding:
    """Per generate call: whether to sample, and the logits processors Hugging Face generate would apply."""

    def __init__(self, model: nn.Module) -> None:
        refuse_generation_config(model)
        if getattr(model.generation_config, "do_sample", False):
            warnings.warn(f"{type(model).__name__}.generation_config.do_sample=True is not the default here: "
                          f"generate() decodes greedily unless called with do_sample=True (then the "
                          f"generation_config's temperature, top_k and top_p apply unless given)", TPCompileWarning,
                          stacklevel=3)
        self.model = model
        try:  # what generate would refuse or fail on, said now rather than at the first call
            self.prepare(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 1)
            self.prepare(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 1, do_sample=True)
        except TPCompileError:
            raise
        except Exception as e:  # noqa: BLE001  transformers' own validation, in its words
            raise TPCompileError(f"{type(model).__name__}.generation_config cannot be applied as generate applies "
                                 f"it: {type(e).__name__}: {str(e).strip().splitlines()[0]}; fix the model's "
                                 f"generation_config") from e

    def prepare(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, **call: Any) -> Prepared:
        """What generate would do for prompts `ids` (B, P) with `mask`; `call` holds the generate arguments given
        (None: the model's generation_config, read now, decides, as in generate)."""
        from transformers import LogitsProcessorList

        model = self.model
        given = {k: v for k, v in call.items() if v is not None}
        has_default_max = model.generation_config.max_length is None
        has_default_min = model.generation_config.min_length is None and "min_length" not in given
        config, _ = model._prepare_generation_config(None, max_new_tokens=max_new_tokens, **given)
        model._prepare_special_tokens(config, True, device=ids.device, batch_size=ids.shape[0])
        config = model._prepare_generated_length(config, has_default_max, has_default_min, "input_ids",
                                                 ids.shape[1], ids)
        processors = model._get_logits_processor(config, ids.shape[1], ids, None, LogitsProcessorList(),
                                                 ids.device, {"attention_mask": mask})
        eos = config._eos_token_tensor
        pad = config._pad_token_tensor
        return Prepared(bool(config.do_sample), processors, [] if eos is None else [int(e) for e in eos.tolist()],
                        None if pad is None else int(pad))


def hf_decoding(model: nn.Module) -> Optional[HFDecoding]:
    """The decoding rules of a Hugging Face model (None for a model without a generation_config)."""
    if getattr(model, "generation_config", None) is None or not hasattr(model, "_get_logits_processor"):
        return None
    return HFDecoding(model)
