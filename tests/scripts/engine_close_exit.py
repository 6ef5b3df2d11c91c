"""Build, step and close a ZeroOffloadEngine many times on a DP=2 gloo world, then exit.

Run under torchrun (2 ranks) by tests/test_engine_close.py, which checks the exit status: close()
must leave nothing in flight (no async collective whose Work was never waited for, no thread), or
the process can abort at exit ("terminate called without an active exception") after printing
correct results. Each round: ten small parameters, two micro-batches; in the last one rank 1 leaves
the last three parameters unused, so their buckets are completed from what the first micro-batch
accumulated. The update is checked against torch's AdamW on the DP-averaged gradient.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/scripts/engine_close_exit.py ROUNDS SEED
"""
import sys

import torch
import torch.distributed as dist

from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine

SIZES = (3, 5, 8, 2, 7, 4, 6, 9, 1, 5)
UNUSED_ON_RANK1 = range(7, 10)          # parameters rank 1 does not use in its last micro-batch
LR = 0.05


def _weights(seed: int, rnd: int, rank: int, micro: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000003 + rnd * 101 + rank * 11 + micro)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _used(rank: int, micro: int) -> list[bool]:
    return [not (rank == 1 and micro == 1 and i in UNUSED_ON_RANK1) for i in range(len(SIZES))]


def _reference(init: list[torch.Tensor], seed: int, rnd: int) -> list[torch.Tensor]:
    """One torch AdamW step on the gradient averaged over both ranks (loss = sum <w, p>)."""
    params = [torch.nn.Parameter(p.clone().double()) for p in init]
    for p in params:
        p.grad = torch.zeros_like(p)
    for rank in range(2):
        for micro in range(2):
            for p, w, used in zip(params, _weights(seed, rnd, rank, micro), _used(rank, micro)):
                if used:
                    p.grad += w.double() / 2
    torch.optim.AdamW(params, lr=LR, weight_decay=0.0).step()
    return [p.detach().float() for p in params]


def main(rounds: int, seed: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    worst = 0.0
    for rnd in range(rounds):
        gen = torch.Generator().manual_seed(seed + rnd)
        init = [torch.randn(n, generator=gen) for n in SIZES]
        model = torch.nn.Module()
        model.ps = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in init])
        with ZeroOffloadEngine(model, precision="fp32", bucket_size=8, clip_grad=0.0, dp_group=dist.group.WORLD,
                               adam=AdamConfig(lr=LR, weight_decay=0.0)) as engine:
            for micro in range(2):
                ws, used = _weights(seed, rnd, rank, micro), _used(rank, micro)
                loss = sum((p * w).sum() for p, w, u in zip(model.ps, ws, used) if u)
                engine.backward(loss, last_micro_batch=micro == 1)
            engine.step()
            got = [p.detach().clone() for p in model.ps]
        ref = _reference(init, seed, rnd)
        worst = max(worst, max((g - r).abs().max().item() for g, r in zip(got, ref)))
    ok = worst <= 1e-5
    print(f"rank {rank}: {rounds} rounds, max |param - torch AdamW| = {worst:.2e} {'ok' if ok else 'WRONG'}",
          flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 3)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
