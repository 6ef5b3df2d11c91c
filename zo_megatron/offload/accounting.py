"""Bytes on the device, on the host, and on the wire: what the engine holds and moves per step.

Wire bytes are the algorithmic volume a rank sends (and receives) in a ring collective:
reduce-scatter and all-gather of S bytes over N ranks each move (N-1)/N * S, so one step moves
2 (N-1)/N * S -- exactly a DDP all-reduce of the same gradients.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Accounting:
    device_param_bytes: int = 0        # the flat 16-bit parameter buffer
    device_bucket_bytes: int = 0       # the (at most two) gradient bucket buffers + narrowing scratch
                                       # (baseline: all grads)
    device_optimizer_bytes: int = 0    # baseline only: fp32 Adam moments on the device
    host_master_bytes: int = 0         # fp32 master partition
    host_optimizer_bytes: int = 0      # exp_avg + exp_avg_sq partitions
    host_staging_bytes: int = 0        # gradient/param staging partition(s) (pinned on CUDA)
    host_accumulator_bytes: int = 0    # fp32 gradient accumulator (accumulate_on_host only)
    host_dpu_pending_bytes: int = 0    # DPU: the second landing set (gradient [+ accumulator])
    host_overlap_bytes: int = 0        # --overlap-cpu-step: the rollback backup of the speculated
                                       # prefix (master + moments [+ the gradient the output overwrites])
    host_nvme_buffer_bytes: int = 0    # --optimizer-nvme-path: the I/O ring (offload/nvme_store.py)
    nvme_disk_bytes: int = 0           # --optimizer-nvme-path: the state files of this rank
    # Per step (reset by the engine at the start of each step's gradient sync):
    sent_bytes: int = 0
    received_bytes: int = 0
    d2h_bytes: int = 0
    h2d_bytes: int = 0

    @property
    def device_model_state_bytes(self) -> int:
        return self.device_param_bytes + self.device_bucket_bytes + self.device_optimizer_bytes

    @property
    def host_bytes(self) -> int:
        return (self.host_master_bytes + self.host_optimizer_bytes + self.host_staging_bytes
                + self.host_accumulator_bytes + self.host_dpu_pending_bytes
                + self.host_overlap_bytes + self.host_nvme_buffer_bytes)

    def ring(self, nbytes: int, group_size: int) -> None:
        moved = (group_size - 1) * nbytes // group_size
        self.sent_bytes += moved
        self.received_bytes += moved

    def reset_step(self) -> None:
        self.sent_bytes = self.received_bytes = self.d2h_bytes = self.h2d_bytes = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["device_model_state_bytes"] = self.device_model_state_bytes
        d["host_bytes"] = self.host_bytes
        return d
