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


def parse_bytes(text: str) -> int:
    """'64GiB', '500MB', '1.5TiB', '123' (bytes) -> bytes (> 0); ValueError naming the form."""
    t = text.strip().upper().replace(" ", "")
    for suffix, mult in (("TIB", 1 << 40), ("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("TB", 10**12),
                         ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(suffix):
            num = t[: -len(suffix)]
            break
    else:
        num, mult = t, 1
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r} is not a size such as 64GiB, 500MB or 1TiB") from None
    if not value > 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return int(value * mult)
