"""Which stored dtypes load into which model dtypes: the same one, or a cast that loses nothing."""
from __future__ import annotations

import torch

from tpcompile.errors import TPCompileError

# Floats by what they hold: each entry's values are all exactly representable in the later ones.
_FLOAT_WIDER = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}
_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)
_UNSIGNED = (torch.uint8,)

# safetensors' dtype names (safe_open(...).get_slice(name).get_dtype())
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


def lossless(stored: torch.dtype, wanted: torch.dtype) -> bool:
    """True when every value of `stored` is exactly a value of `wanted` (a widening cast, or none)."""
    if stored == wanted:
        return True
    if wanted in _FLOAT_WIDER.get(stored, ()):
        return True
    if stored in _SIGNED and wanted in _SIGNED:
        return _SIGNED.index(wanted) > _SIGNED.index(stored)
    if stored in _UNSIGNED and wanted in _SIGNED:
        return wanted != torch.int8
    return False


def cast_problem(stored: torch.dtype, wanted: torch.dtype, *, tensor: str, where: str) -> str:
    """'' when `stored` loads into `wanted`, else the sentence that says why not and the way out."""
    if lossless(stored, wanted):
        return ""
    kind = ("would change floats into integers" if wanted.is_floating_point != stored.is_floating_point
            else "would lose precision or range")
    name = str(wanted).removeprefix("torch.")
    return (f"{where}: tensor {tensor!r} is stored as {stored} but the model holds {wanted}; casting it {kind}. "
            f"Build the model in the stored dtype (model.to({stored})) before loading, or convert the "
            f"file to {name}; only lossless casts (float16/bfloat16 -> float32/float64, float32 -> float64, "
            f"a wider integer) load")


def check_cast(stored: torch.dtype, wanted: torch.dtype, *, tensor: str, where: str) -> None:
    """Raise a TPCompileError naming the tensor and both dtypes unless `stored` loads into `wanted`."""
    problem = cast_problem(stored, wanted, tensor=tensor, where=where)
    if problem:
        raise TPCompileError(problem)
