"""Partial offload: the tail of a rank's partition whose optimizer stays on the device.

    host partition of DP rank r (index space of FlatLayout.host_numel)
    |<------------- cut: CPU Adam on the host -------------->|<-- device tail: torch Adam -->|
    0                                                       cut                        host_numel

`--optimizer-offload-fraction F` (Megatron-core's name) keeps the first F of every rank's
partition on the host, as ZeRO-Offload does with all of it, and the contiguous tail 1 - F on the
device: fp32 master, both Adam moments and an fp32 gradient buffer there (16 bytes per element),
updated by torch's fused Adam(W), one call per weight-decay setting and learning rate (the
decoupled one of the word embedding and output layer, --decoupled-lr, apart). The tail is a run
of whole shards of the last buckets (and part of one), so its reduced gradients never leave the
device and its updated parameters are written into the flat buffer directly, before the usual
all-gather. On a GPU the device update's kernels are queued first and run while the CPU Adam
updates the head; on a CPU-only machine the "device" is the CPU and they run one after the other.
"""
from __future__ import annotations

import torch
# Two functionals, not adam(decoupled_weight_decay=...): that keyword is newer than the torch>=2.4
# floor (pyproject.toml); adam() and adamw() with the arguments below are in 2.4 and still in 2.13.
from torch.optim.adam import adam as torch_adam
from torch.optim.adamw import adamw as torch_adamw


class DeviceOptimizerTail:
    def __init__(self, layout, cut: int, device: torch.device, adam, flat: torch.Tensor, dp_rank: int):
        self.cut, self.adam, self.flat = cut, adam, flat
        n = layout.host_numel - cut
        self.master = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        self.grad = torch.zeros(n, dtype=torch.float32, device=device)
        # Runs of the tail with one weight-decay setting / norm rule / learning rate (offsets into
        # the tail): (start, end, decay, counted, decoupled).
        self.pieces = [(max(s.start, cut) - cut, s.end - cut, s.decay, s.counted, s.decoupled)
                       for s in layout.segments if s.end > cut]
        # the counted parameters' runs of the tail (no padding): what --log-num-zeros-in-grad counts
        self.zero_runs = [(max(a, cut) - cut, e - cut) for a, e in layout.counted_param_runs() if e > cut]
        # Where each piece of the tail lives in the flat parameter buffer.
        self.flat_runs = []
        for b in layout.buckets:
            lo, _ = b.shard_range(dp_rank)
            d0, d1 = max(b.host_start, cut), b.host_start + b.shard_numel
            if d0 < d1:
                self.flat_runs.append((lo + d0 - b.host_start, lo + d1 - b.host_start, d0 - cut, d1 - cut))
        self._steps = [torch.zeros((), dtype=torch.float32, device=device) for _ in self.pieces]
        # Everything a step reads is decided here, so a step makes no host sync on CUDA (issue 34):
        # the counted pieces' positions as an integer index built once (a boolean mask would call
        # nonzero, a device->host sync, every step), the pieces of each weight-decay setting, and
        # 1 / grad_scale in a persistent device scalar refilled with fill_ (a tensor built from a
        # Python float each step is a blocking pageable host->device copy).
        self._counted_idx = torch.tensor([i for i, p in enumerate(self.pieces) if p[3]], dtype=torch.long,
                                         device=device)
        self._groups = [((decay, dec), [i for i, p in enumerate(self.pieces) if (p[2], p[4]) == (decay, dec)])
                        for dec in (False, True) for decay in (True, False)]
        self._groups = [(key, idx) for key, idx in self._groups if idx]
        self._inv_scale = torch.ones((), dtype=torch.float32, device=device)
        self._inv_scale_value = 1.0

    @property
    def nbytes(self) -> int:
        return 4 * 4 * self.master.numel()

    def grad_sumsq_and_nonfinite(self, count_zeros: bool = False) -> torch.Tensor:
        """[sum of squares over the counted pieces, 1 if any element is inf/nan, exact zeros in the
        counted pieces (0 unless `count_zeros`)] (fp64, on the device).

        One multi-tensor pass and no copy of the gradient (as the baseline and Megatron's
        multi_tensor_l2norm): an fp32 norm per piece, their squares summed in float64. A NaN/inf
        anywhere makes its piece's norm, and so the verdict, non-finite; uncounted pieces (TP
        copies) are read for that verdict only."""
        norms = torch.stack(torch._foreach_norm([self.grad[a:e] for a, e, *_ in self.pieces])).double()
        sumsq = norms.index_select(0, self._counted_idx).square().sum()
        bad = (~torch.isfinite(norms.sum())).double()
        zeros = torch.zeros((), dtype=torch.float64, device=sumsq.device)
        if count_zeros:                 # numel - count_nonzero per run: no boolean copy of the gradient
            counted = [self.grad[a:e] for a, e in self.zero_runs]   # the counted parameters' runs (no padding)
            if counted:
                nonzero = torch.stack([torch.count_nonzero(g) for g in counted]).double().sum()
                zeros = float(sum(g.numel() for g in counted)) - nonzero
        return torch.stack([sumsq, bad, zeros])

    @torch.no_grad()
    def step(self, step: int, lr: float, grad_scale: float, decoupled_lr: float | None = None) -> None:
        """One Adam(W) update of the tail (torch's fused kernel), then its parameters into `flat`;
        the decoupled pieces at `decoupled_lr` (None: `lr`)."""
        a = self.adam
        inv = 1.0 / grad_scale
        if inv != self._inv_scale_value:       # rounded to fp32 by fill_ exactly as torch.tensor(inv) would be
            self._inv_scale.fill_(inv)
            self._inv_scale_value = inv
        for (decay, decoupled), idx in self._groups:
            sl = [slice(self.pieces[i][0], self.pieces[i][1]) for i in idx]
            steps = [self._steps[i].fill_(step - 1) for i in idx]      # the kernel adds one
            (torch_adamw if a.adamw else torch_adam)(
                [self.master[s] for s in sl], [self.grad[s] for s in sl], [self.exp_avg[s] for s in sl],
                [self.exp_avg_sq[s] for s in sl], [], steps, fused=True, grad_scale=self._inv_scale,
                amsgrad=False, beta1=a.beta1, beta2=a.beta2,
                lr=decoupled_lr if decoupled and decoupled_lr is not None else lr,
                weight_decay=a.weight_decay if decay else 0.0, eps=a.eps, maximize=False)
        self.write_params()

    @torch.no_grad()
    def write_params(self) -> None:
        for f0, f1, d0, d1 in self.flat_runs:
            self.flat[f0:f1].copy_(self.master[d0:d1])
