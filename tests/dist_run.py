"""One 2-rank gloo launch shared by the distributed-runtime tests (starting ranks is the slow part).

Each rank, in order: loads a ~1 GB GPT built on meta from safetensors and measures its peak
resident memory (first, so nothing else has raised the high-water mark); parallelizes a small
GPT and saves a DCP checkpoint of it; parallelizes the small GPT built on meta from that
checkpoint; parallelizes mismatching models (rank 1 has an extra block); runs
examples/generate.py in-process.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import os
import runpy
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch

import tpcompile
from tpcompile.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
BIG = GPTConfig(vocab_size=256, block_size=64, n_layer=5, n_head=16, n_embd=2048)  # 1.01 GB float32
SMALL = GPTConfig(attention="manual", vocab_size=250)
_DIR = tempfile.TemporaryDirectory(prefix="tpcompile-dist-")  # removed when the test process exits


def gpt_layout(cfg: GPTConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the GPT's tensors in state-dict order, tied ones once, made on meta."""
    with torch.device("meta"):
        state = GPT(cfg).state_dict(keep_vars=True)
    seen: set[int] = set()
    return [(n, tuple(t.shape)) for n, t in state.items() if not (id(t) in seen or seen.add(id(t)))]


def gpt_tensors(cfg: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The GPT's tensors, generated one at a time from a seed per tensor (norm weights near 1)."""
    for i, (name, shape) in enumerate(gpt_layout(cfg)):
        t = torch.empty(shape).uniform_(-0.04, 0.04, generator=torch.Generator().manual_seed(i))
        yield name, t + 1.0 if len(shape) == 1 and name.endswith(".weight") else t


def write_safetensors(path: Path, cfg: GPTConfig) -> int:
    """Write the GPT's float32 tensors to a safetensors file, one tensor in memory at a time; bytes."""
    header, offset = {}, 0
    for name, shape in gpt_layout(cfg):
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in gpt_tensors(cfg):
            t.numpy().tofile(f)
    return offset


def reference_logits(cfg: GPTConfig, path: Path, idx: torch.Tensor) -> torch.Tensor:
    """The unsharded model's logits with the weights in `path`."""
    from safetensors.torch import load_file
    with torch.device("meta"):
        model = GPT(cfg).eval()
    model.load_state_dict(load_file(str(path)), assign=True, strict=False)
    model.lm_head.weight = model.transformer.wte.weight
    with torch.no_grad():
        return model(idx)


def big_input() -> torch.Tensor:
    """The token ids the memory check runs."""
    return torch.randint(0, BIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))


def small_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Example ids for capture, and other ids (another batch and length) to compare outputs on."""
    gen = torch.Generator().manual_seed(2)
    return torch.randint(0, 250, (2, 16), generator=gen), torch.randint(0, 250, (3, 11), generator=gen)


def small_model() -> GPT:
    """The small GPT every rank and the tests build alike."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(SMALL).eval()


def _hwm() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _memory_check(path: str) -> dict:
    """Peak resident memory above the baseline while loading the big model on meta."""
    import psutil
    gc.collect()
    baseline = psutil.Process().memory_info().rss
    try:  # writing 5 to clear_refs resets the peak to the current RSS, so the peak is this load's
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then the peak since start-up counts: an overestimate, never an underestimate
    with torch.device("meta"):
        model = GPT(BIG).eval()
    gm = tpcompile.parallelize(model, example_inputs=(big_input(),), weights=path)
    with torch.no_grad():
        logits = gm(big_input())
    peak = _hwm()
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in gm.state_dict().values()}.values())
    meta = [n for n, t in gm.state_dict().items() if t.is_meta]
    del gm, model
    gc.collect()
    return {"baseline": baseline, "peak_above_baseline": peak - baseline, "held": held,
            "meta_left": meta, "logits": logits}


def _run_example(name: str, *args: str) -> str:
    """Run examples/<name> in this process (the group is already up); its standard output."""
    buf, argv = io.StringIO(), sys.argv
    sys.argv = [name, *args]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    except SystemExit as e:  # an example's exit status: 0 is success
        if e.code not in (0, None):
            raise
    finally:
        sys.argv = argv
    return buf.getvalue()


def _rank_checks(rank: int, big: str, ckpt: str) -> dict:
    """Every per-rank check, in an order that keeps the memory measurement first."""
    from tpcompile import dcp
    out: dict[str, Any] = {"memory": _memory_check(big)}
    idx, other = small_inputs()
    gm = tpcompile.parallelize(small_model(), example_inputs=(idx,))
    dcp.save(gm, ckpt)
    with torch.device("meta"):
        meta = GPT(SMALL).eval()
    try:
        tpcompile.parallelize(meta, example_inputs=(idx,))  # meta, and no weights
    except tpcompile.TPCompileError as e:
        out["no_weights"] = str(e)
    gm = tpcompile.parallelize(meta, example_inputs=(idx,), weights=ckpt, check=False)
    with torch.no_grad():
        out["from_dcp"] = {"out": gm(other), "shapes": {n: tuple(t.shape) for n, t in gm.state_dict().items()},
                           "devices": sorted({str(t.device) for t in gm.state_dict().values()})}
    start = time.monotonic()
    try:
        cfg = SMALL if rank == 0 else GPTConfig(attention="manual", vocab_size=250, n_layer=3)
        tpcompile.parallelize(GPT(cfg), example_inputs=(idx,))
        out["mismatch"] = None
    except tpcompile.TPCompileError as e:
        out["mismatch"] = str(e)
    out["mismatch_s"] = time.monotonic() - start
    out["generate"] = _run_example("generate.py", "--tokens", "6")
    out["torchrun_gpt"] = _run_example("torchrun_gpt.py")
    return out


@functools.cache
def results() -> dict:
    """Run the launch once per test process: {'ranks': per-rank dicts, paths, reference logits}."""
    from tpcompile.runtime import launch
    base = Path(_DIR.name)
    big, ckpt = base / "big.safetensors", base / "ckpt"
    start = time.monotonic()
    big_bytes = write_safetensors(big, BIG)
    big_ref = reference_logits(BIG, big, big_input())
    gc.collect()
    written = time.monotonic() - start
    ranks = launch(2, _rank_checks, str(big), str(ckpt), timeout=240)
    os.remove(big)
    return {"ranks": ranks, "big_bytes": big_bytes, "big_reference": big_ref, "ckpt": ckpt,
            "write_s": written, "launch_s": time.monotonic() - start - written}
