"""Buffers in checkpoints: non-persistent ones are never saved nor required; a tensor with no value is named."""
from __future__ import annotations

from typing import Iterable

from torch import nn

from tpcompile.errors import TPCompileError

__all__ = ["no_value_error", "non_persistent"]


def non_persistent(module: nn.Module) -> set[str]:
    """Dotted names of the module's non-persistent buffers (those its state_dict() leaves out)."""
    return {f"{prefix}.{leaf}" if prefix else leaf
            for prefix, mod in module.named_modules(remove_duplicate=False)
            for leaf in getattr(mod, "_non_persistent_buffers_set", ())}


def no_value_error(names: Iterable[str], skipped: set[str], source: str) -> TPCompileError:
    """The error for tensors built on the meta device that `source` does not hold, non-persistent ones explained."""
    names = list(dict.fromkeys(names))
    listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    transient = [n for n in names if n in skipped]
    msg = (f"{source} lacks {len(names)} tensor(s) that the model holds on the meta device, so they have no "
           f"value: {listed}")
    if transient:
        owners = sorted({n.rpartition(".")[0] or "the model" for n in transient})
        msg += (f". {', '.join(transient[:5])} {'is a' if len(transient) == 1 else 'are'} non-persistent "
                f"buffer{'s' if len(transient) > 1 else ''} (computed by the model, e.g. rotary inv_freq), which "
                f"no state_dict(), safetensors file or DCP checkpoint holds: build the module(s) owning "
                f"{'it' if len(transient) == 1 else 'them'} ({', '.join(owners[:5])}) on a real device (build the "
                f"model on meta, then replace those modules with ones built outside torch.device('meta')), or "
                f"build the whole model on a real device, or pass a state dict that adds the buffer")
    else:
        msg += "; load weights of this model, or build those modules on a real device"
    return TPCompileError(msg)
