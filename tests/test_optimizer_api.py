"""Both optimizer engines implement the written interface the loop and checkpoints rely on."""
import inspect

import torch

from zo_megatron.optimizer_api import TrainingOptimizer


def test_both_engines_implement_the_protocol():
    from zo_megatron.offload.engine import ZeroOffloadEngine
    from zo_megatron.training.plain_optimizer import PlainDDPOptimizer

    for cls, master in ((ZeroOffloadEngine, True), (PlainDDPOptimizer, False)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        kw = dict(pin_memory=False, device="cpu") if cls is ZeroOffloadEngine else {}
        opt = cls(model, precision="fp32", **kw)
        try:
            assert isinstance(opt, TrainingOptimizer), cls
            assert opt.holds_master_weights is master
            for name, member in inspect.getmembers(TrainingOptimizer, inspect.isfunction):
                if not name.startswith("_"):
                    assert inspect.signature(getattr(cls, name)).parameters.keys() == \
                        inspect.signature(member).parameters.keys(), (cls.__name__, name)
            assert opt.flush() is None          # nothing pending without DPU
        finally:
            opt.close()
