"""Bucket bookkeeping of the engine on a hand-built model (one process, no process group).

The case that matters: with gradient accumulation, parameters unused in the last micro-batch still
carry what earlier micro-batches accumulated, while other buckets are open and incomplete when
backward ends. Every accumulated gradient must reach the host partition exactly once.
"""
import torch

from zo_megatron.offload.engine import ZeroOffloadEngine


class FiveWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        sizes = {"w1": 4, "w2": 4, "w3": 4, "w4": 4, "w5": 8}
        for name, n in sizes.items():
            setattr(self, name, torch.nn.Parameter(torch.randn(n)))

    def forward(self, xs: dict, names):
        return sum((getattr(self, n) * xs[n]).sum() for n in names)


def test_accumulated_grads_of_params_unused_in_the_last_micro_batch_are_kept():
    model = FiveWeights()
    # Backward order w5 | w4 w3 | w2 w1: three buckets of >= 8 elements each.
    engine = ZeroOffloadEngine(model, precision="fp32", bucket_size=8)
    assert [[s.name for s in b.slots] for b in engine.layout.buckets] == [["w5"], ["w4", "w3"], ["w2", "w1"]]
    first = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    last = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    engine.backward(model(first, ["w1", "w2", "w3", "w4", "w5"]), last_micro_batch=False)
    # The last micro-batch touches w3 and w1 only: buckets 1 and 2 open but incomplete, 0 never opens.
    engine.backward(model(last, ["w3", "w1"]), last_micro_batch=True)
    engine.finish_grad_sync()
    expected = {n: first[n] + (last[n] if n in ("w3", "w1") else 0) for n in first}
    got = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for slot, host, pstart, n in engine.layout.host_fragments():
        got[slot.name][pstart:pstart + n] = engine.host16[host:host + n]
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert all(p.grad is None for p in model.parameters())
