"""One fuzz case: capture a generated model, shard it at several world sizes, compare every rank with it."""
from __future__ import annotations

import contextlib
import copy
import traceback
import warnings
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from fuzz_models import FuzzConfig, build_model
from torch import nn

import tpcompile
from tpcompile.api import shard_captured
from tpcompile.capture import Captured, capture


COMM = {"off": False, "default": None, "async": tpcompile.CommOptions(asynchronous=True)}  # FuzzConfig.comm


@dataclass
class Outcome:
    """How one case ended: sharded (equal numerics), replicated parts (equal, with warnings), error, or a failure."""

    kind: str  # sharded | partly_replicated | error | mismatch | crash
    detail: str = ""

    @property
    def failed(self) -> bool:
        """True for the outcomes the product promises never to produce."""
        return self.kind in ("mismatch", "crash")


def said(e: tpcompile.TPCompileError) -> Outcome:
    """A TPCompileError as an outcome: an error the product may give, unless it reports a bug of its own (the
    verifiers' "this is a tpcompile bug; please report it with the model"), which fails the property."""
    text = str(e)
    return Outcome("crash" if "please report it" in text else "error", text.splitlines()[0])


def _autocast(cfg: FuzzConfig) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16) if cfg.autocast else contextlib.nullcontext()


def run_case(cfg: FuzzConfig, world_sizes: Sequence[int], *, tol: float = 1e-4) -> dict[int, Outcome]:
    """Capture once; per world size shard, build every rank, simulate, compare with the original."""
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    example = torch.randint(0, cfg.vocab, cfg.capture_shape, generator=gen)
    x = torch.randint(0, cfg.vocab, cfg.run_shape, generator=gen)
    bias = {"bias": torch.randn(cfg.width, generator=gen)} if cfg.kwargs_forward else {}
    with torch.no_grad(), _autocast(cfg):
        ref = model(x, **bias)
    try:
        with warnings.catch_warnings(), _autocast(cfg):
            warnings.simplefilter("ignore", tpcompile.TPCompileWarning)  # fixed input dims are said; checked below
            cap = capture(model, (example,), bias or None)
    except tpcompile.TPCompileError as e:
        return {ws: said(e) for ws in world_sizes}
    out = {}
    for ws in world_sizes:
        with warnings.catch_warnings():  # copying the graph's pytree spec warns about a torch-internal alias
            warnings.simplefilter("ignore", FutureWarning)
            gm = copy.deepcopy(cap.gm)  # each world size its own copy: the passes annotate the graph in place
        scale_tol = 5e-2 if cfg.autocast else tol  # bfloat16 sums in another order differ in the 3rd digit
        out[ws] = _run_world(replace(cap, gm=gm), cfg, model, ws, (x, bias), ref, scale_tol)
    return out


def _run_world(cap: Captured, cfg: FuzzConfig, model: nn.Module, ws: int, inputs: tuple, ref: torch.Tensor,
               tol: float) -> Outcome:
    """One (model, world size) case: TPCompileError, or every rank equal to `ref`."""
    x, kwargs = inputs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tpcompile.TPCompileWarning)
        try:
            sm = shard_captured(cap, ws, comm=COMM[cfg.comm])
            for r in range(ws):
                sm.rank(r)
        except tpcompile.TPCompileError as e:
            return said(e)
        except Exception:  # noqa: BLE001  anything but TPCompileError before running is a defect
            return Outcome("crash", "shard: " + traceback.format_exc(limit=-3))
    replicated = any(issubclass(w.category, tpcompile.TPCompileWarning) for w in caught)
    try:
        with torch.no_grad(), _autocast(cfg):
            outs = tpcompile.simulate(sm, x, **kwargs)
    except tpcompile.TPCompileError as e:
        if "the capture fixed that dim" in str(e):  # a size-1 (or code-fixed) dim run at another size: said
            return Outcome("error", str(e).splitlines()[0])
        return Outcome("crash", "simulate: " + traceback.format_exc(limit=-3))
    except Exception:  # noqa: BLE001  a sharded model that built cleanly must run
        return Outcome("crash", "simulate: " + traceback.format_exc(limit=-3))
    scale = max(1.0, float(ref.abs().max()))
    for r, out in enumerate(outs):
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return Outcome("mismatch", f"rank {r} output {tuple(out.shape)} {out.dtype}, original "
                                       f"{tuple(ref.shape)} {ref.dtype}")
        diff = float((out.float() - ref.float()).abs().max())
        if not diff <= tol * scale:  # also catches NaN
            return Outcome("mismatch", f"rank {r} max abs diff {diff:.3g} (limit {tol * scale:.3g})")
    return Outcome("partly_replicated" if replicated else "sharded")


def describe_failure(cfg: FuzzConfig, ws: int, outcome: Outcome) -> Optional[str]:
    """A report line for a failed case (None when it did not fail)."""
    return None if not outcome.failed else f"{outcome.kind} at world size {ws}: {outcome.detail}\n  case: {cfg!r}"
