"""No pinned host buffer is rewritten while an asynchronous host->device copy may still read it.

On CUDA, DeviceLayer.copy_to_device queues a non-blocking copy of a host buffer (the 16-bit
parameters the CPU Adam wrote) on a side stream and returns; the host must not rewrite that buffer
(the next CPU Adam, a reload from the master) until the copy has read it. Here a fake layer plays
the GPU's part on the CPU: every host->device copy stays "in flight" until the host waits for it
(wait_host, wait_device_reads, or a copy later in the same stream order), and a host buffer that
changes meanwhile -- its contents or its version counter -- is recorded as a violation."""
import pytest
import torch

from tests.seeds import fresh_seed
from zo_megatron.offload import device as device_mod
from zo_megatron.offload import engine as engine_mod
from zo_megatron.offload.engine import AdamConfig, ZeroOffloadEngine


class _InFlightReads(device_mod.DeviceLayer):
    """A DeviceLayer whose host->device copies count as unfinished until the host waits for them."""

    violations: list[str] = []

    def __init__(self, device, pin_memory=True):
        super().__init__(device, pin_memory)
        self._in_flight: list[tuple[torch.Tensor, torch.Tensor, int, str]] = []
        self._copies = 0

    def _check(self, where: str) -> None:
        for src, snapshot, version, what in self._in_flight:
            if src._version != version or not torch.equal(src, snapshot):
                self.violations.append(f"{what} rewritten before the copy finished (seen at {where})")
        self._in_flight = [(s, s.clone(), s._version, w) for s, _, _, w in self._in_flight]

    def _finish(self, where: str) -> None:
        self._check(where)
        self._in_flight.clear()

    def copy_to_device(self, dst, src):
        self._check("copy_to_device")
        super().copy_to_device(dst, src)
        self._copies += 1
        self._in_flight.append((src, src.clone(), src._version, f"host->device copy #{self._copies}'s source"))

    def copy_home(self, work, dst, src, scratch=None):
        self._finish("copy_home")          # one side stream: later copies run after earlier ones
        return super().copy_home(work, dst, src, scratch)

    def wait_host(self):
        self._finish("wait_host")
        super().wait_host()

    def wait_device_reads(self):           # absent on the old layer: then nothing ever waits
        self._finish("wait_device_reads")
        getattr(super(), "wait_device_reads", lambda: None)()

    def close(self):
        self._finish("close")
        super().close()


@pytest.fixture
def fake_layer(monkeypatch):
    _InFlightReads.violations = []
    monkeypatch.setattr(engine_mod, "DeviceLayer", _InFlightReads)
    return _InFlightReads


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _backward(engine, model, seed: int, *, last: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=gen).to(engine.dtype)
    engine.backward(model(x).float().square().mean(), last_micro_batch=last)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_step_after_a_backward_that_did_not_sync(fake_layer, precision):
    """step(), then step() again with no syncing backward in between (finish_grad_sync returns at
    once): the second CPU Adam must wait for the first step's copies to the device."""
    seed = fresh_seed(f"host reuse step {precision}")
    model = _model(seed)
    with ZeroOffloadEngine(model, precision=precision, clip_grad=0.0, bucket_size=16,
                           adam=AdamConfig(lr=0.1, weight_decay=0.0)) as engine:
        _backward(engine, model, seed)
        engine.step()
        _backward(engine, model, seed + 1, last=False)    # accumulates on the device, no sync
        engine.step()                                     # updates from the host gradient again
    assert not fake_layer.violations, fake_layer.violations


def test_reload_from_master_after_a_step(fake_layer):
    """reload_params_from_master (after a checkpoint load) rewrites host_param: the copies of the
    previous step's parameters to the device must have read it first."""
    seed = fresh_seed("host reuse reload")
    model = _model(seed)
    with ZeroOffloadEngine(model, precision="bf16", clip_grad=0.0, bucket_size=16,
                           adam=AdamConfig(lr=0.1, weight_decay=0.0)) as engine:
        _backward(engine, model, seed)
        engine.step()
        engine.master.add_(0.25)                          # as a checkpoint load would change it
        engine.reload_params_from_master()
        assert torch.equal(engine.host_param, engine.master.to(torch.bfloat16))
    assert not fake_layer.violations, fake_layer.violations
