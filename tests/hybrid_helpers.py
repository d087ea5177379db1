"""What the hybrid-parallelism tests share: tiny 4-layer models, batches, the plain reference, one rank's run."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

TINY_GPT = dict(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=32)
TINY_LLAMA = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, vocab_size=64, max_position_embeddings=32)
# a fused q|k|v projection (Phi-3's qkv_proj): at tp 4 its k and v rows are in 2 pieces, each held by 2 ranks
TINY_PHI3 = dict(TINY_LLAMA, pad_token_id=0)
VOCAB, BATCH, SEQ = 64, 8, 12
TIED = "lm_head.weight"  # the GPT's LM head shares the token embedding: one copy in the first and last stage


def build(name: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A tiny 4-layer model, the same on every call (seed 0), in training mode (no dropout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "gpt":
            from tpcompile.models import GPT, GPTConfig
            model = GPT(GPTConfig(**TINY_GPT))
        else:
            import transformers
            transformers.logging.set_verbosity_error()
            model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY_PHI3)) if name == "phi3" else \
                transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    return model.to(dtype).train()


def batches(steps: int, seed: int = 1) -> list[torch.Tensor]:
    """`steps` random (BATCH, SEQ) batches of token ids."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(steps)]


def loss_fn(output: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on the logits (a tensor or a ModelOutput's .logits)."""
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def inputs(name: str, ids: torch.Tensor) -> tuple[tuple, dict]:
    """The model's arguments for a batch."""
    return ((ids,), {}) if name == "gpt" else ((), {"input_ids": ids, "use_cache": False})


def reference(name: str, steps: int, clip: Optional[float] = None, lr: float = 1e-2) -> dict:
    """Plain single-process AdamW training: losses, gradient norms (with clip) and the final state dict."""
    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for ids in batches(steps):
        opt.zero_grad()
        a, k = inputs(name, ids)
        loss = loss_fn(model(*a, **k), ids)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def hybrid_rank(rank: int, run: dict) -> dict:
    """One rank of a hybrid run (under tpcompile.runtime.launch): its losses, norms, bytes and tied-weight chunks.

    `run`: layout (dp, tp, pp), name, steps, and optionally clip, data_parallel, schedule, microbatches,
    save and load (checkpoint directories), lr.
    """
    import tpcompile
    import tpcompile.dcp
    (dp, tp, pp), name, steps = run["layout"], run["name"], run["steps"]
    clip, save, lr = run.get("clip"), run.get("save"), run.get("lr", 1e-2)
    mesh = tpcompile.init_mesh(dp=dp, tp=tp, pp=pp)
    data = batches(max(steps, 1))
    d, per = mesh["dp"].get_local_rank(), BATCH // dp
    a, k = inputs(name, data[0][:per])
    hm = tpcompile.parallelize_train(build(name), mesh, loss_fn=loss_fn, example_inputs=a, example_kwargs=k,
                                     microbatches=run.get("microbatches", 2), schedule=run.get("schedule", "1F1B"),
                                     data_parallel=run.get("data_parallel", "fsdp"), weights=run.get("load"))
    opt = torch.optim.AdamW(hm.parameters(), lr=lr)
    losses, norms = [], []
    for ids in data[:steps]:
        mine = ids[d * per:(d + 1) * per]
        opt.zero_grad()
        a, k = inputs(name, mine)
        losses.append(hm.step(*a, target=mine, **k).item())
        if clip is not None:
            norms.append(hm.clip_grad_norm_(clip).item())
        opt.step()
    if save is not None:
        tpcompile.dcp.save(hm, save)
    state = hm.dcp_state()
    tied = [(tuple(o), v.clone()) for o, v in state[TIED].chunks] if TIED in state else []
    unsharded = sum(p.numel() * p.element_size() for p in hm.parameters())  # a DTensor's numel: before FSDP
    return {"losses": losses, "norms": norms, "param_bytes": hm.parameter_bytes(), "tp_local_bytes": unsharded,
            "stages": hm.stage_indices,
            "tied": tied, "coords": {dim: mesh[dim].get_local_rank() for dim in ("pp", "dp", "tp")}}


def load_plain(name: str, path: str) -> dict[str, torch.Tensor]:
    """A checkpoint directory read into the plain model's state dict with stock torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    model = build(name)
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return {k: v.detach().clone() for k, v in state.items()}


def relative(a: float, b: float) -> float:
    """|a - b| / |b|."""
    return abs(a - b) / abs(b) if b else abs(a - b)


def model_bytes(name: str) -> int:
    """The plain model's parameter bytes (tied weights once)."""
    return sum(p.numel() * p.element_size() for p in build(name).parameters())


def meta_rank(rank: int, weights: str, data_parallel: str) -> list[float]:
    """One rank at (dp, tp, pp) = (2, 1, 2) training the tiny GPT built on meta, its weights read from `weights`."""
    import tpcompile
    from tpcompile.models import GPT, GPTConfig
    mesh = tpcompile.init_mesh(dp=2, pp=2)
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY_GPT)).to(torch.float64).train()
    data, d, per = batches(3), mesh["dp"].get_local_rank(), BATCH // 2
    hm = tpcompile.parallelize_train(model, mesh, loss_fn=loss_fn, example_inputs=(data[0][:per],), microbatches=2,
                                     data_parallel=data_parallel, weights=weights)
    opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
    losses = []
    for ids in data:
        mine = ids[d * per:(d + 1) * per]
        opt.zero_grad()
        losses.append(hm.step(mine, target=mine).item())
        opt.step()
    return losses


def hybrid_runs(rank: int, runs: list[dict]) -> list[dict]:
    """Several hybrid runs one after another in the same rank processes (starting processes is the slow part)."""
    return [hybrid_rank(rank, run) for run in runs]
