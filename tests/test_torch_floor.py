"""The device tail of a partial offload calls torch's functional Adam/AdamW with only the arguments
torch 2.4 (the floor in pyproject.toml) accepts: here the functionals are wrapped in 2.4's
signatures (torch 2.4 torch/optim/adam.py and adamw.py: no `decoupled_weight_decay`), and the
update must still equal torch.optim.AdamW's."""
import pytest
import torch
from torch.optim.adam import adam as _adam_functional
from torch.optim.adamw import adamw as _adamw_functional

from tests.seeds import fresh_seed
from zo_megatron.offload import device_optimizer
from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine


def _as_in_torch_2_4(fn):
    def functional(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, foreach=None,
                   capturable=False, differentiable=False, fused=None, grad_scale=None, found_inf=None,
                   has_complex=False, *, amsgrad, beta1, beta2, lr, weight_decay, eps, maximize):
        fn(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, foreach=foreach,
           capturable=capturable, differentiable=differentiable, fused=fused, grad_scale=grad_scale,
           found_inf=found_inf, has_complex=has_complex, amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr,
           weight_decay=weight_decay, eps=eps, maximize=maximize)
    return functional


@pytest.mark.parametrize("adamw", [True, False])
def test_device_tail_uses_only_torch_2_4_arguments(monkeypatch, adamw):
    monkeypatch.setattr(device_optimizer, "torch_adam", _as_in_torch_2_4(_adam_functional))
    if hasattr(device_optimizer, "torch_adamw"):
        monkeypatch.setattr(device_optimizer, "torch_adamw", _as_in_torch_2_4(_adamw_functional))
    seed = fresh_seed(f"torch floor adamw={adamw}")
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    ref = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    x = torch.randn(5, 7)
    lr, wd = 0.01, 0.1
    with ZeroOffloadEngine(model, precision="fp32", clip_grad=0.0, optimizer_offload_fraction=0.0,
                           adam=AdamConfig(lr=lr, weight_decay=wd, adamw=adamw)) as engine:
        for _ in range(3):
            engine.backward(model(x).square().mean())
            engine.step()
        got = [p.detach().clone() for p in model.parameters()]
    decay = [p for p in ref if p.dim() > 1]
    no_decay = [p for p in ref if p.dim() <= 1]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    ref_model = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    for _ in range(3):
        torch.nn.utils.vector_to_parameters(torch.cat([p.detach().reshape(-1) for p in ref]), ref_model.parameters())
        for rp, p in zip(ref_model.parameters(), ref):
            rp.grad = None
        ref_model(x).square().mean().backward()
        for rp, p in zip(ref_model.parameters(), ref):
            p.grad = rp.grad.clone()
        opt.step()
    for g, r in zip(got, ref):
        assert torch.allclose(g, r.detach(), rtol=1e-5, atol=1e-6), (g - r).abs().max()
