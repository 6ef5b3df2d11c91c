"""Fresh random seeds for tests, printed so a failure can be replayed.

Every randomized test draws its seed here: a new one each run (so repeated runs explore more
inputs), or the one in ZO_TEST_SEED to replay a failure. pytest shows the printed line with the
failure report.
"""
from __future__ import annotations

import os
import random


def fresh_seed(label: str = "") -> int:
    env = os.environ.get("ZO_TEST_SEED", "").strip()
    seed = int(env) if env else random.SystemRandom().randrange(2**31)
    print(f"[seed] {label or 'test'}: seed={seed} (replay with ZO_TEST_SEED={seed})")
    return seed
