"""Hardware quantities as people write them: '80GB', '450GB/s', '400Gb/s', '989TFLOPS', '5us'.

Decimal prefixes (k, M, G, T, P) are powers of 1000 and binary ones (Ki, Mi, Gi, Ti) powers of
1024; an upper-case B is bytes and a lower-case b bits, so '400Gb/s' is 50 GB/s. Parsing errors
are TPCompileErrors naming the field, the text and a valid example.
"""
from __future__ import annotations

import re
from typing import Union

from tpcompile.errors import TPCompileError

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
_BYTES = re.compile(_NUMBER + r"(?P<pre>Ki|Mi|Gi|Ti|[kKMGTP]?)(?P<unit>B|b|bit|bits)?$")
_RATE = re.compile(_NUMBER + r"(?P<pre>Ki|Mi|Gi|Ti|[kKMGTP]?)(?P<unit>B|b|bit|bits)(?:/s|ps)$")
_FLOPS = re.compile(_NUMBER + r"(?P<pre>[kKMGTP]?)(?:FLOPS|FLOP/s|flops|flop/s)?$")
_TIME = re.compile(_NUMBER + r"(?P<unit>s|ms|us|µs|ns)?$")
_TIME_SCALE = {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

Quantity = Union[str, int, float]


def _number(field: str, value: Quantity, pattern: re.Pattern, example: str) -> re.Match | float:
    """A plain number as it is, else the pattern's match of the text, else a TPCompileError."""
    if isinstance(value, bool):
        raise TPCompileError(f"{field}: {value!r} is not a quantity; write it like {example!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise TPCompileError(f"{field}: {value!r} is negative; write it like {example!r}")
        return float(value)
    match = pattern.match(str(value).strip())
    if match is None:
        raise TPCompileError(f"{field}: cannot read {value!r}; write it like {example!r}")
    return match


def _bits(unit: str | None) -> float:
    """1/8 for a bit unit, 1 for bytes (or no unit)."""
    return 0.125 if unit in ("b", "bit", "bits") else 1.0


def parse_bytes(field: str, value: Quantity) -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, 1e9 -> 1e9."""
    m = _number(field, value, _BYTES, "80GB")
    if isinstance(m, float):
        return m
    return float(m["num"]) * _PREFIX[m["pre"]] * _bits(m["unit"])


def parse_rate(field: str, value: Quantity) -> float:
    """'450GB/s' -> 450e9 bytes per second, '400Gb/s' -> 50e9."""
    m = _number(field, value, _RATE, "450GB/s")
    if isinstance(m, float):
        return m
    return float(m["num"]) * _PREFIX[m["pre"]] * _bits(m["unit"])


def parse_flops(field: str, value: Quantity) -> float:
    """'989TFLOPS' -> 989e12 floating-point operations per second."""
    m = _number(field, value, _FLOPS, "989TFLOPS")
    return m if isinstance(m, float) else float(m["num"]) * _PREFIX[m["pre"]]


def _plausible(field: str, value: Quantity, amount: float, least: float, unit: str, example: str) -> float:
    """`amount`, or a TPCompileError when it is below `least`: a number written without its unit ('80')."""
    if amount < least:
        raise TPCompileError(f"{field}: {value!r} reads as {amount:g} {unit}, far too little for a GPU; write the "
                             f"unit, like {example!r}")
    return amount


def parse_memory(field: str, value: Quantity) -> float:
    """A GPU's memory: parse_bytes, refusing under a megabyte ('80' is 80 bytes; '80GB' was meant)."""
    return _plausible(field, value, parse_bytes(field, value), 1e6, "bytes", "80GB")


def parse_peak(field: str, value: Quantity) -> float:
    """A GPU's peak: parse_flops, refusing under a megaFLOPS ('989' is 989 FLOPS; '989TFLOPS' was meant)."""
    return _plausible(field, value, parse_flops(field, value), 1e6, "FLOPS", "989TFLOPS")


def parse_seconds(field: str, value: Quantity) -> float:
    """'5us' -> 5e-6, '2ms' -> 2e-3, 0.1 -> 0.1."""
    m = _number(field, value, _TIME, "5us")
    return m if isinstance(m, float) else float(m["num"]) * _TIME_SCALE[m["unit"] or ""]


def parse_fraction(field: str, value: Quantity) -> float:
    """A number in [0, 1], or a percentage such as '45%'."""
    text = str(value).strip()
    try:
        number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise TPCompileError(f"{field}: cannot read {value!r}; write a fraction like 0.45 or 45%") from None
    if isinstance(value, bool) or not 0.0 <= number <= 1.0:
        raise TPCompileError(f"{field}: {value!r} is not between 0 and 1; write a fraction like 0.45 or 45%")
    return number


def format_seconds(s: float) -> str:
    """12.3 s / 45.6 ms / 7.8 us."""
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def format_rate(bps: float) -> str:
    """450 GB/s."""
    for scale, name in ((1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s")):
        if bps >= scale:
            return f"{bps / scale:.3g} {name}"
    return f"{bps:.3g} B/s"


def format_flops(f: float) -> str:
    """989 TFLOPS."""
    for scale, name in ((1e15, "PFLOPS"), (1e12, "TFLOPS"), (1e9, "GFLOPS")):
        if f >= scale:
            return f"{f / scale:.3g} {name}"
    return f"{f:.3g} FLOPS"
