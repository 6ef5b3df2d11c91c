"""Learning-rate schedules with Megatron's names and semantics (linear warmup, then decay)."""
from __future__ import annotations

import math

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def learning_rate(iteration: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                  style: str) -> float:
    """LR for 0-based `iteration` (the update about to happen is iteration + 1)."""
    step = iteration + 1
    if warmup_iters > 0 and step <= warmup_iters:
        return lr * step / warmup_iters
    if style == "constant":
        return lr
    if style == "inverse-square-root":
        return max(min_lr, lr * math.sqrt(max(warmup_iters, 1)) / math.sqrt(step))
    if step >= decay_iters:
        return min_lr
    frac = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    if style == "linear":
        coeff = 1.0 - frac
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    elif style == "WSD":  # warmup-stable-decay: flat, then linear decay over the last 10%
        coeff = 1.0 if frac < 0.9 else (1.0 - frac) / 0.1
    else:
        raise ValueError(f"unknown --lr-decay-style {style!r} (choose from {', '.join(DECAY_STYLES)})")
    return min_lr + coeff * (lr - min_lr)
