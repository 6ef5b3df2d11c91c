#!/usr/bin/env python
"""What keeping the old state for --overlap-cpu-step costs next to the CPU Adam kernel (docs/overlap.md).

    python tools/bench_rollback_cost.py [--elements 4194304] [--threads 1] [--repeats 7]

Times, best of --repeats, on one partition of --elements (fp32 master and moments, bf16 gradient
in, bf16 parameters out: the engine's default bf16 call):
  - the CPU Adam kernel in place (the synchronous step),
  - the kernel out of place (reads master + moments from one set, writes them into another: what
    the overlap did with alternate state buffers, 2026-11-24 to 11-27),
  - the backup copy of master + moments the overlap takes before each speculated in-place kernel
    (issue 34: the speculated share is bounded by memory; a rollback is a restore copy + a redo).
Sets alternate between the timed repeats as in the engine, so no call finds its output in cache.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--threads", type=int, default=1, help="kernel and torch threads")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    import torch

    from zo_megatron.offload import cpu_adam

    cpu_adam.set_num_threads(a.threads)
    torch.set_num_threads(a.threads)
    n = a.elements
    master, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    grad, out = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    backup = [torch.empty(n) for _ in range(3)]
    sets = [[master, m, v], [t.clone() for t in (master, m, v)]]
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, param16_out=out)

    def kernel():
        cpu_adam.adam_step_segments(master, grad, m, v, [(0, n, 0.1)], **kw)

    def kernel_out_of_place():
        (p0, m0, v0), (p1, m1, v1) = sets
        cpu_adam.adam_step_segments(p0, grad, m0, v0, [(0, n, 0.1)], param_out=p1, exp_avg_out=m1,
                                    exp_avg_sq_out=v1, **kw)
        sets.reverse()                    # the next call reads what this one wrote, as the engine's next step

    def save():
        for b, t in zip(backup, (master, m, v)):
            b.copy_(t)

    def best(f):
        f()
        ts = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    k, o, b = best(kernel), best(kernel_out_of_place), best(save)
    print(f"{n} elements, {a.threads} thread(s), isa {cpu_adam.info()['isa']}, load {os.getloadavg()[0]:.1f}: "
          f"kernel in place {k * 1e3:.2f} ms ({28 * n / k / 1e9:.1f} GB/s at 28 B/element); out of place "
          f"{o * 1e3:.2f} ms ({o / k:.2f}x); backup copy of master + moments {b * 1e3:.2f} ms ({b / k:.2f}x the "
          f"kernel; backup + in-place kernel {(b + k) / k:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
