"""How sizes are written everywhere tpcompile prints them."""
from __future__ import annotations


def format_bytes(n: float) -> str:
    """1,234 B / 12.0 KiB / 3.40 MiB / 1.25 GiB."""
    if n < 1024:
        return f"{n:,.0f} B"
    if n < 1024 ** 2:
        return f"{n / 1024:.1f} KiB"
    if n < 1024 ** 3:
        return f"{n / 1024 ** 2:.2f} MiB"
    return f"{n / 1024 ** 3:.2f} GiB"
