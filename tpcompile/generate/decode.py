"""The generate loop: prefill the prompt, then one token per step from inputs kept on the device.

A decode step's inputs (the token, its position, its cache position, the masks) live in tensors
allocated once per batch size and changed in place (`DecodeInputs.advance`): no mask, position or
index is rebuilt on the host, and every step has the same shapes for a given attended length,
the filled part of the cache rounded up to `bucket` positions. On a CUDA device each attended
length is captured once as a CUDA graph and replayed in every later step and call
(`StepRunner`); elsewhere, and if a capture fails, the graph module runs eagerly.
End-of-sequence tokens are checked on the host every step on the CPU (a free read) and every
`SYNC_EVERY` steps on a GPU, the extra steps dropped afterwards: the tokens are those of a loop
that stops as soon as every row has finished, as Hugging Face's does.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import torch
from torch.fx import GraphModule

from tpcompile.errors import TPCompileWarning
from tpcompile.generate.capture import GenerationSpec
from tpcompile.generate.masks import advance, bucketed, left_padding, step_masks
from tpcompile.generate.sampling import Sampling, next_tokens

BUCKET = 64  # attended positions are a multiple of this: at most 63 read that hold nothing yet
SYNC_EVERY = 8  # steps between end-of-sequence checks on an accelerator (each one waits for the device)


class DecodeInputs:
    """A decode step's inputs on the device for a batch of B rows, kept from call to call (a CUDA graph reads
    them where they are); `start` sets them for a new prompt, `advance` for the next token."""

    def __init__(self, batch: int, spec: GenerationSpec, device: torch.device) -> None:
        self.spec, self.position = spec, 0
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)  # padding not counted
        self.cache_position = torch.zeros(1, dtype=torch.long, device=device)
        self.first = torch.zeros(batch, dtype=torch.long, device=device)  # each row's first real position
        keep = torch.ones(batch, spec.max_seq_len, dtype=torch.bool, device=device)
        # (B, 1, 1, max_seq_len), for the whole cache; a step reads the first `length` positions
        self.masks = step_masks(keep, self.cache_position, spec.windows, spec.mask_kind, spec.dtype)

    def start(self, chosen: torch.Tensor, position_ids: torch.Tensor, position: int, keep: torch.Tensor) -> None:
        """The inputs of the first generated token, at cache position `position` (the prompt's length)."""
        self.position = position
        self.tokens.copy_(chosen[:, None])
        self.position_ids.copy_(position_ids)
        self.cache_position.fill_(position)
        self.first.copy_(left_padding(keep))
        fresh = step_masks(keep, self.cache_position, self.spec.windows, self.spec.mask_kind, self.spec.dtype,
                           self.first)
        for name, m in self.masks.items():
            m.copy_(fresh[name])

    def args(self, length: int) -> tuple:
        """The graph's arguments, the masks cut to `length` cached positions (views of the same memory)."""
        return (self.tokens, self.position_ids, self.cache_position,
                {name: m[..., :length] for name, m in self.masks.items()})

    def advance(self, chosen: torch.Tensor) -> None:
        """The inputs of the next token, in place."""
        self.position += 1
        self.tokens.copy_(chosen[:, None])
        self.position_ids.add_(1)
        self.cache_position.add_(1)
        advance(self.masks, self.position, self.spec.windows, self.spec.mask_kind, self.spec.dtype, self.first)


class StepRunner:
    """Runs a decode step: through one CUDA graph per attended length on a CUDA device, else eagerly."""

    def __init__(self, module: GraphModule, inputs: DecodeInputs) -> None:
        self.module, self.inputs = module, inputs
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.failed = False  # a capture failed once: eager from then on

    def __call__(self, length: int, cuda_graphs: bool) -> torch.Tensor:
        """(B, vocab) logits of the current token, reading `length` cached positions."""
        if not cuda_graphs or self.failed or self.inputs.tokens.device.type != "cuda":
            return self.module(*self.inputs.args(length))
        if length in self.graphs:
            graph, logits = self.graphs[length]
            graph.replay()
            return logits
        return self._capture(length)

    def _capture(self, length: int) -> torch.Tensor:
        """The step run eagerly on a side stream (warming it up), then captured for the next steps at length."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self.module(*self.inputs.args(length))
        torch.cuda.current_stream().wait_stream(stream)
        try:
            graph = torch.cuda.CUDAGraph()
            # the capture only records: the step above already wrote this token's keys and values
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                out = self.module(*self.inputs.args(length))
            self.graphs[length] = (graph, out)
        except Exception as e:  # noqa: BLE001  any failure to capture leaves the eager step, which is correct
            torch.cuda.synchronize()
            self.failed = True
            warnings.warn(f"tpcompile.generate: the decode step could not be captured as a CUDA graph ({e}); "
                          f"decoding eagerly", TPCompileWarning, stacklevel=3)
        return logits


class StepClock:
    """Seconds per step: the host clock on the CPU, CUDA events on a GPU (read once, at the end)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        """The end of a step (and the start of the next)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def laps(self) -> list[float]:
        """Each step's seconds, in order."""
        if not self.cuda:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]


def sync_interval(device: torch.device) -> int:
    """Steps between end-of-sequence checks: every step on the CPU (reading a flag costs nothing there)."""
    return 1 if device.type == "cpu" else SYNC_EVERY


def decode(module: GraphModule, spec: GenerationSpec, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
           how: Sampling, generator: Optional[torch.Generator], eos: list[int], pad: int, stats: Any, *,
           called: float, runners: dict[int, StepRunner], bucket: int = BUCKET,
           cuda_graphs: bool = True) -> torch.Tensor:
    """(B, P) left-padded prompt ids and mask -> (B, P + n) ids, n <= max_new_tokens; `stats` (GenerationStats)
    filled in, its time to the first token counted from `called` (the host clock when generate was called).
    `runners` holds a StepRunner per batch size, kept by the caller from call to call."""
    if max_new_tokens == 0:
        return ids
    device, (batch, prompt) = ids.device, ids.shape
    longest = spec.max_seq_len - 1  # the last position's token is never fed back
    keep = torch.ones(batch, spec.max_seq_len, dtype=torch.bool, device=device)
    keep[:, :prompt] = mask.bool()
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate derives them
    length = bucketed(prompt, bucket, longest)
    cache_position = torch.arange(prompt, device=device)
    masks = step_masks(keep[:, :length], cache_position, spec.windows, spec.mask_kind, spec.dtype)
    clock = StepClock(device)
    setup_s = time.perf_counter() - called
    logits = module(ids, position_ids, cache_position, masks)
    out, unfinished = [ids], torch.ones(batch, dtype=torch.bool, device=device)
    sequence = None  # the tokens so far, which the logits processors read
    if how.processors is not None and len(how.processors):
        sequence = torch.empty(batch, prompt + max_new_tokens, dtype=torch.long, device=device)
        sequence[:, :prompt] = ids
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    finished: list[torch.Tensor] = []  # per step: every row has finished (device bools, read in batches)
    sync_every, read = sync_interval(device), 0
    if batch not in runners:
        runners[batch] = StepRunner(module, DecodeInputs(batch, spec, device))
    runner = runners[batch]
    for step in range(max_new_tokens):
        if step:
            logits = runner(bucketed(runner.inputs.position + 1, bucket, longest), cuda_graphs)
        chosen = next_tokens(logits, how, generator, None if sequence is None else sequence[:, :prompt + step])
        if eos:
            chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad))
            unfinished &= ~torch.isin(chosen, eos_t)
            finished.append(~unfinished.any())
        out.append(chosen[:, None])
        if sequence is not None:
            sequence[:, prompt + step] = chosen
        clock.mark()
        if eos and (len(finished) - read >= sync_every or step + 1 == max_new_tokens):
            hit = torch.stack(finished[read:]).nonzero()
            if len(hit):
                out = out[:read + int(hit[0]) + 2]  # the prompt, then every token up to the step that finished
                break
            read = len(finished)
        if step + 1 == max_new_tokens:
            break
        if step:
            runner.inputs.advance(chosen)
        else:
            runner.inputs.start(chosen, position_ids[:, -1:] + 1, prompt, keep)
    laps = clock.laps()[: len(out) - 1]
    stats.new_tokens = len(out) - 1
    stats.prefill_s, stats.decode_s = laps[0], laps[1:]
    stats.first_token_s = setup_s + laps[0]
    return torch.cat(out, dim=1)
