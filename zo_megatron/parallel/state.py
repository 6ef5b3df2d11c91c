"""Parallel state in one place: torch.distributed + megatron-core TP/DP groups + seeds.

Rank layout is megatron-core's: TP groups are runs of consecutive ranks ([0,1], [2,3] at TP=2),
so a TP group stays inside a node; DP groups stride across them ([0,2], [1,3]).

Mixture-of-experts layers (docs/moe.md) have a second layout, megatron-core's expert groups over
the same ranks: expert TP (ETP, --expert-tensor-parallel-size, default TP) x expert model parallel
(EP, --expert-model-parallel-size) x expert data parallel (EDP = world / (ETP x EP)), ETP fastest
then EP. At 4 ranks, TP 1, EP 2: EP groups [0,1], [2,3], EDP groups [0,2], [1,3]; the dense
parameters are replicated over DP (all 4 ranks), each expert only over its EDP group. At 2 ranks,
TP 2, ETP 1, EP 1: DP is 1 but EDP is 2: each rank holds every expert whole and trains it on its
own sequence-parallel tokens.
"""
from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from zo_megatron.errors import ConfigError
from zo_megatron.parallel import collectives
from zo_megatron.parallel.collectives import default_backend


@dataclass(frozen=True)
class ParallelState:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    tp_group: object
    dp_group: object
    device: torch.device
    # the expert layout (megatron-core's expert groups): EP, expert TP and expert DP; EP 1 and
    # expert TP = TP (the defaults) make the expert groups the TP / DP groups' members
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    etp_rank: int = 0
    etp_size: int = 1
    etp_group: object = None
    edp_rank: int = 0
    edp_size: int = 1
    edp_group: object = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def experts_apart(self) -> bool:
        """Whether the routed experts are replicated over another group than the dense parameters (EP > 1,
        or an expert TP other than TP): then the experts need their own optimizer partition over expert DP."""
        return self.ep_size > 1 or self.etp_size != self.tp_size


_STATE: ParallelState | None = None


def validate_parallel_config(world_size: int, tensor_parallel: int, num_attention_heads: int | None = None,
                             hidden_size: int | None = None, expert_parallel: int = 1,
                             expert_tensor_parallel: int | None = None) -> None:
    """Refuse impossible layouts before any process-group work, with the fix in the message."""
    tp = tensor_parallel
    if tp < 1:
        raise ConfigError(f"--tensor-parallel must be >= 1 (got {tp})")
    if world_size % tp != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by --tensor-parallel {tp}: "
            f"launch a multiple of {tp} processes or pick a TP size that divides {world_size}")
    if num_attention_heads is not None:
        if tp > num_attention_heads:
            raise ConfigError(
                f"--tensor-parallel {tp} exceeds --num-attention-heads {num_attention_heads}: "
                f"TP splits whole heads, so use TP <= {num_attention_heads}")
        if num_attention_heads % tp != 0:
            raise ConfigError(
                f"--num-attention-heads {num_attention_heads} is not divisible by --tensor-parallel {tp}: "
                f"choose a TP size that divides the head count")
    if hidden_size is not None and num_attention_heads is not None and hidden_size % num_attention_heads != 0:
        raise ConfigError(
            f"--hidden-size {hidden_size} is not divisible by --num-attention-heads {num_attention_heads}: "
            f"pick hidden = heads x head_dim")
    _validate_expert_layout(world_size, tp, expert_parallel, expert_tensor_parallel)


def _validate_expert_layout(world_size: int, tp: int, ep: int, etp: int | None) -> None:
    """megatron-core's rule: expert TP x EP divides the world (the rest is expert DP)."""
    etp = tp if etp is None else etp
    if ep < 1 or etp < 1:
        raise ConfigError(f"--expert-model-parallel-size {ep} and --expert-tensor-parallel-size {etp} must be >= 1")
    if world_size % (ep * etp):
        raise ConfigError(
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} does not divide the "
            f"world size {world_size}: launch a multiple of {ep * etp} processes or use smaller expert sizes")


def _default_device(local_rank: int, local_world_size: int | None = None) -> torch.device:
    """This rank's device: GPU LOCAL_RANK of the node's visible ones (never two ranks on one GPU)."""
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if local_rank >= n:
            procs = f" of {local_world_size} processes on this node" if local_world_size else ""
            err = ConfigError(
                f"LOCAL_RANK {local_rank}{procs} but only {n} CUDA device(s) visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): ranks would share a GPU; launch at most {n} "
                f"processes per node (torchrun --nproc-per-node {n}) or check CUDA_VISIBLE_DEVICES")
            err.every_rank = True       # rank 0 (local rank 0) has its GPU: the ranks that do not say why
            raise err
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_parallel(tensor_parallel: int = 1, *, seed: int = 1234, num_attention_heads: int | None = None,
                  hidden_size: int | None = None, backend: str | None = None,
                  timeout_s: float = 600.0, expert_parallel: int = 1,
                  expert_tensor_parallel: int | None = None, device: torch.device | None = None) -> ParallelState:
    """Initialise torch.distributed from the launcher's environment, then megatron's TP/DP groups.

    torchrun, Open MPI, MPICH/PMI and SLURM variables are all understood (parallel.launch_env).
    Backend: `collectives.default_backend` -- "cpu:gloo,cuda:nccl" on CUDA, so CPU tensors (the
    small host-side agreements) and CUDA tensors (buckets, parameters) each have a backend in every
    group; megatron-core's TP/DP subgroups inherit that map. Validation happens before any group
    is created.

    Device: GPU LOCAL_RANK of the node's visible ones, refused where there are fewer GPUs than local
    ranks (ranks would share a GPU without knowing it). `device` places this rank explicitly instead,
    as a caller that runs torch.cuda.set_device itself would: the GPU tests put two gloo ranks on one
    GPU on purpose (NCCL refuses that).
    """
    global _STATE
    from zo_megatron.parallel import megatron_cpu
    from zo_megatron.parallel.launch_env import discover_launch_env, export_torch_env

    # megatron-core imported first: a port the launch environment picks (MPI without MASTER_PORT)
    # is bound at init_process_group, and the seconds of this import must not lie in between
    megatron_cpu.apply()
    from megatron.core import parallel_state as mpu

    env = discover_launch_env()
    validate_parallel_config(env.world_size, tensor_parallel, num_attention_heads, hidden_size, expert_parallel,
                             expert_tensor_parallel)

    device = torch.device(device) if device is not None else _default_device(env.local_rank, env.local_world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type == "cuda":
        # A dead or hung peer under NCCL: the survivors' host waits on a device collective
        # (DeviceLayer) end at 90% of the timeout with a lost-peer error -- one line naming the rank
        # and the last completed iteration, exit 1 (training/faults.py). NCCL's watchdog stays the
        # backstop at the full timeout for any other blocking point: torch documents
        # TORCH_NCCL_ASYNC_ERROR_HANDLING=3 (its default) as "tearing down the process" when it
        # observes a timeout, so nothing is left running either way.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        collectives.set_host_wait_timeout(0.9 * timeout_s)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if env.world_size == 1 and not os.environ.get("MASTER_PORT", "").strip():
            # One process and no port asked for: its store binds port 0 itself. A port chosen
            # first (find_free_port) and bound later can be taken in between by any other job
            # on the host (EADDRINUSE: two single-GPU jobs, or a parallel test run, starting at once).
            store = dist.TCPStore(env.master_addr, 0, 1, is_master=True, timeout=timeout)
            export_torch_env(replace(env, master_port=store.port))
            dist.init_process_group(backend=backend or default_backend(device), store=store,
                                    rank=0, world_size=1, timeout=timeout)
        else:
            export_torch_env(env)
            dist.init_process_group(backend=backend or default_backend(device), init_method="env://",
                                    rank=env.rank, world_size=env.world_size, timeout=timeout)
    if not mpu.model_parallel_is_initialized():
        # The subgroups get the same timeout (megatron-core's default would be 30 minutes).
        mpu.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                      expert_model_parallel_size=expert_parallel,
                                      expert_tensor_parallel_size=expert_tensor_parallel,
                                      distributed_timeout_minutes=timeout_s / 60)
    _STATE = ParallelState(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        local_rank=env.local_rank, local_world_size=env.local_world_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(), tp_size=mpu.get_tensor_model_parallel_world_size(),
        dp_rank=mpu.get_data_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
        tp_group=mpu.get_tensor_model_parallel_group(), dp_group=mpu.get_data_parallel_group(),
        device=device, **_expert_groups(mpu))
    set_seed(seed)
    return _STATE


def _expert_groups(mpu) -> dict:
    return dict(ep_rank=mpu.get_expert_model_parallel_rank(), ep_size=mpu.get_expert_model_parallel_world_size(),
                ep_group=mpu.get_expert_model_parallel_group(),
                etp_rank=mpu.get_expert_tensor_parallel_rank(), etp_size=mpu.get_expert_tensor_parallel_world_size(),
                etp_group=mpu.get_expert_tensor_parallel_group(),
                edp_rank=mpu.get_expert_data_parallel_rank(), edp_size=mpu.get_expert_data_parallel_world_size(),
                edp_group=mpu.get_expert_data_parallel_group())


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("zo_megatron.parallel.init_parallel() has not been called")
    return _STATE


def set_seed(seed: int) -> None:
    """Seed like Megatron: the default stream is shared by a TP group (same data order, same
    dropout outside TP regions); the 'model-parallel-rng' stream differs per TP rank."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mpu_random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        mpu_random.model_parallel_cuda_manual_seed(seed)
        return
    tp_rank = mpu.get_tensor_model_parallel_rank() if mpu.model_parallel_is_initialized() else 0
    mpu_random.initialize_rng_tracker(force_reset=True)
    tracker = mpu_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mpu_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mpu_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mpu_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)


def destroy_parallel() -> None:
    global _STATE
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = None
