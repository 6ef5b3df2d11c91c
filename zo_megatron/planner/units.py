"""Units and formatting shared by the planner's modules."""
from __future__ import annotations

GiB = 1024 ** 3
MiB = 1024 ** 2


def format_bytes(n: int | float) -> str:
    return f"{n / GiB:,.2f} GiB"


def format_params(n: int | float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{int(n):,}"
