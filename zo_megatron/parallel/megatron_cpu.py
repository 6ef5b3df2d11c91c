"""Every shim megatron-core 0.16 needs to run on a CPU-only torch, in one place.

Applied only when CUDA is unavailable (`apply()` is a no-op otherwise), so a GPU run uses
megatron-core untouched -- except one that any host without Transformer Engine needs (the MoE
router's names, `_define_moe_names_without_transformer_engine`). Each shim has a one-line reason;
nothing else in zo_megatron patches megatron-core.
"""
from __future__ import annotations

import contextlib

import torch

_APPLIED = False


class CPURNGStatesTracker:
    """Megatron's named RNG streams, kept as CPU generator states.

    Same contract as megatron's CudaRNGStatesTracker (add / fork / get_states / set_states):
    `fork(name)` swaps the default CPU generator to the named stream, so dropout inside
    tensor-parallel regions differs across TP ranks exactly as on GPU.
    """

    def __init__(self, *args, **kwargs):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()
        self._current_state_name = "default-rng"

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already registered")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already registered")
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added")
        orig_state = torch.get_rng_state()
        orig_name = self._current_state_name
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def apply() -> None:
    """Install the shims (idempotent). Call before building any megatron-core module."""
    global _APPLIED
    _define_moe_names_without_transformer_engine()     # CPU or GPU: wherever Transformer Engine is absent
    _checkpoint_without_output_without_transformer_engine()
    _multi_latent_attention_without_transformer_engine()
    _recompute_under_the_forwards_autocast()          # any device: the plain baseline runs under autocast
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mpu_random

    # megatron allocates parameters and buffers with device=torch.cuda.current_device().
    torch.cuda.current_device = lambda: "cpu"
    # CudaRNGStatesTracker.add/fork call torch.cuda.get_rng_state(); keep the streams on the CPU.
    mpu_random.CudaRNGStatesTracker = CPURNGStatesTracker
    # Activation recompute saves/restores "the CUDA RNG state"; on CPU that is the default generator.
    mpu_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mpu_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # megatron's linear autograd Function restores autocast in backward for "cuda" only; under
    # CPU autocast (the DDP baseline) its backward would multiply a bf16 grad by an fp32 weight.
    _keep_cpu_autocast_in_linear_backward()
    _give_the_alltoall_dispatcher_a_host_stream()
    _APPLIED = True


_TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")


def _define_moe_names_without_transformer_engine() -> None:
    """Not a CPU shim but one for any host without Transformer Engine (the local spec's): megatron-core
    0.16.1's moe_utils imports these only with TE yet tests `te_general_gemm is not None` in the router's
    gating linear unconditionally (a NameError at the first MoE forward); None is what its checks expect,
    so the router takes its torch.mm path and a fused option fails with its own message."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False):
        for name in _TE_MOE_NAMES:
            if not hasattr(moe_utils, name):
                setattr(moe_utils, name, None)


def _checkpoint_without_output_without_transformer_engine() -> None:
    """Also for any host without Transformer Engine: megatron-core 0.16.1's CheckpointWithoutOutput (what
    --recompute-modules layernorm runs) sets `self.fp8 = fp8 is not None`, so its default fp8=False reads
    as FP8 on, and its forward then calls Transformer Engine's FP8GlobalStateManager (a NameError). FP8
    needs Transformer Engine, so without it the recompute is the plain one, as its fp8=False means."""
    from megatron.core.tensor_parallel import random as mpu_random

    cls = mpu_random.CheckpointWithoutOutput
    if getattr(mpu_random, "HAVE_TE", False) or getattr(cls, "zo_fp8_off", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.fp8 = False

    cls.__init__ = __init__
    cls.zo_fp8_off = True


def _multi_latent_attention_without_transformer_engine() -> None:
    """Also for any host without Transformer Engine: megatron-core 0.16.1's multi_latent_attention sets
    HAVE_TE from an import of its own TE extension module, which succeeds without TE (it stands in mock
    classes), so MLASelfAttention's constructor calls isinstance(linear_proj, <a mock>) and fails with a
    TypeError. Its HAVE_TE guards only TE's FP8/FP4 paths: without TE it is False, as it means."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _autocast_state() -> tuple:
    return tuple((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda"))


def _under_autocast(fn, state):
    """`fn` run under the autocast `state` (`_autocast_state`) of the forward it recomputes."""
    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for dev, enabled, dtype in state:
                if enabled or torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, enabled=enabled, dtype=dtype))
            return fn(*args, **kwargs)
    return run


def _recompute_under_the_forwards_autocast() -> None:
    """Not a CPU shim: megatron-core 0.16.1's activation checkpoints (CheckpointFunction: full recompute and
    --recompute-modules core_attn, mlp, moe, shared_experts; CheckpointWithoutOutput: layernorm) recompute
    the forward in backward without the autocast the forward ran under (torch.utils.checkpoint restores
    it; megatron-core expects 16-bit parameters instead). The plain DDP baseline runs bf16/fp16 under
    autocast, so its recompute met an fp32 weight with a bf16 activation ("expected scalar type Float but
    found BFloat16") or, where it ran, recomputed in another precision than the forward. Each recompute
    now runs under the forward's autocast state; without autocast (the offload engine) nothing changes."""
    from megatron.core.tensor_parallel import random as mpu_random

    fn = mpu_random.CheckpointFunction
    if getattr(fn, "zo_autocast", False):
        return
    fwd = fn.forward

    def forward(ctx, run_function, distribute_saved_activations, *args):
        out = fwd(ctx, run_function, distribute_saved_activations, *args)
        ctx.run_function = _under_autocast(run_function, _autocast_state())    # what backward recomputes
        return out

    fn.forward = staticmethod(forward)
    fn.zo_autocast = True
    without = mpu_random.CheckpointWithoutOutput
    checkpoint = without.checkpoint

    def checkpoint_under_autocast(self, run_function, *args):
        return checkpoint(self, _under_autocast(run_function, _autocast_state()), *args)

    without.checkpoint = checkpoint_under_autocast


class _HostStream:
    """What the MoE alltoall dispatcher asks of its device-to-host side stream, on a host where every
    tensor is on the CPU already: nothing to wait for, an event that is always complete."""

    def wait_stream(self, _other) -> None:
        pass

    def record_event(self, _event=None):
        return self

    def synchronize(self) -> None:
        pass


def _give_the_alltoall_dispatcher_a_host_stream() -> None:
    """megatron-core's MoEAlltoAllTokenDispatcher creates a torch.cuda.Stream for its token counts'
    device-to-host copy and compares it with torch.cuda.current_stream(): on a CPU the counts are host
    tensors already (maybe_move_tensor_to_cpu leaves them), so one host stream stands for both (on a
    CPU-only torch, current_stream only raises; torch.cuda.stream(s) is a no-op context)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    stream = _HostStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream
    torch.cuda.current_stream = lambda *a, **k: stream
    # ... and it hands the split sizes to all_to_all_single as the numpy arrays maybe_move_tensor_to_cpu
    # makes of CUDA tensors: a host tensor is left a tensor, which gloo's all_to_all_single refuses
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    def host_splits_as_numpy(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = host_splits_as_numpy


def _keep_cpu_autocast_in_linear_backward() -> None:
    from megatron.core.tensor_parallel import layers

    fn = layers.LinearWithGradAccumulationAndAsyncCommunication
    fwd, bwd = fn.forward, fn.backward

    def forward(ctx, *args, **kwargs):
        ctx._zo_cpu_autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        return fwd(ctx, *args, **kwargs)

    def backward(ctx, *grads):
        enabled, dtype = getattr(ctx, "_zo_cpu_autocast", (False, torch.bfloat16))
        with torch.autocast("cpu", enabled=enabled, dtype=dtype):
            return bwd(ctx, *grads)

    fn.forward, fn.backward = staticmethod(forward), staticmethod(backward)
