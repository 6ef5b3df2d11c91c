"""Core attention through torch.nn.functional.scaled_dot_product_attention (--use-flash-attn).

A drop-in for megatron-core's local DotProductAttention in the layer spec: same constructor and
forward signature (megatron's SelfAttention passes q [s, b, heads/t, d] and k, v
[s, b, groups/t, d] and expects [s, b, heads/t * d] back), same softmax scale (1/sqrt(d), or
config.softmax_scale), attention dropout (config.attention_dropout, training only, drawn from
megatron's model-parallel RNG stream as the local module does), causal masking -- but through
SDPA's `is_causal=True`, so no [b, heads, s, s] score, probability or dropout-mask tensor is
ever materialised (the local module keeps all three for backward: ~5 bytes x b·heads·s² per
layer in 16 bits).

The attention mask megatron passes down is None for plain causal self-attention (GPT pretraining:
`is_causal=True`, nothing s x s exists). Per-document attention (--reset-attention-mask, --sft) passes
model/gpt.py's document mask: an additive float [b, 1, s, s] in the attention's dtype (0 where a
token may attend, -inf where not; causality included), built once per forward and shared by every
layer; it goes to SDPA as `attn_mask` with `is_causal=False`. (A bool mask in megatron's convention,
True = masked, is converted here, per call: torch's bool convention is the opposite.)
Sliding-window attention (config.window_size, Megatron-LM's --window-size L,0; window_attn_skip_freq says which
layers slide) rides on the same mask: where the window binds, GPTModelTP hands every layer one [b or 1, C, s, s]
tensor, one channel per distinct mask (model/masks.py), and each layer takes its channel's view: a sliding
layer the window's, a full-attention layer the documents' or none (is_causal).

Which kernel runs:
  CUDA   flash (FlashAttention-2; fp16/bf16) or, where flash cannot run (fp32, head_dim, an
         attention mask: flash takes none), memory-efficient attention (takes the mask). Exactly
         one of them is allowed per call (torch.nn.attention.sdpa_kernel), chosen with torch's own
         checks (torch.backends.cuda.can_use_flash_attention / can_use_efficient_attention, given
         the mask), so torch can never fall back to the math path silently; if neither can run,
         one error line.
         GQA: flash takes the grouped k/v as they are (enable_gqa); memory-efficient attention
         does not support GQA in torch, so there k/v are repeated per query head first, as
         megatron-core's local module does.
  CPU    whatever SDPA picks: its fused CPU flash kernel (GQA included, a float or bool mask
         included) when dropout is 0; with attention dropout torch's CPU kernel falls back to the
         math path, which materialises the probabilities like the local module.
What SDPA keeps for backward (fused kernels): q, k, v, the output and the row logsumexp,
fp32 [b, heads/t, s] -- no s² term; with a document mask also the mask itself (the one shared
tensor, not a copy per layer; the math path does not keep it).

Attention sinks (config.softmax_type "off-by-one" / "learnable": megatron-core's softmax_offset, GPT-OSS's sinks):
exactly megatron-core's softmax with one more logit per head, through the same kernels: SDPA runs on s + 1 positions
with a dummy query and a sink key at position 0 and, for "learnable", the offset in extra head-dim channels of q
(model/sinks.py). Masks then come in the sink layout, built once per forward by model/gpt.py and model/masks.py
([.., s + 1, s + 1]); a mask of the plain [.., s, s] layout is converted per call.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from zo_megatron.errors import ConfigError
from zo_megatron.model.masks import layer_mask, sink_layout
from zo_megatron.model.sinks import sink_operands
from zo_megatron.planner.params import SOFTMAX_TYPES
from zo_megatron.planner.window import (is_window_layer, normalize_skip_freq, normalize_window_size, window_binds,
                                        window_layers)

BACKENDS = ("local", "sdpa")


def sdpa_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                enable_gqa: bool, attn_mask: Optional[torch.Tensor] = None) -> tuple[str, bool]:
    """(kernel, enable_gqa) for SDPA on these [b, n, s, d] tensors: causal (is_causal=True) without
    `attn_mask`, with it the mask (is_causal=False), as SDPAttention will call it.

    CUDA: "flash" or "efficient" (ConfigError if neither can run; enable_gqa False means the
    caller must repeat k/v per query head). CUDA's flash kernel takes no mask, so with one it is
    the memory-efficient kernel or nothing. CPU: the kernel torch picks ("flash" or "math")."""
    causal = attn_mask is None
    if query.device.type != "cuda":
        try:
            from torch.nn.attention import SDPBackend

            kind = torch._fused_sdp_choice(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                           is_causal=causal, enable_gqa=enable_gqa)
            return {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.MATH: "math"}.get(
                SDPBackend(kind), SDPBackend(kind).name.lower()), enable_gqa
        except (AttributeError, TypeError, RuntimeError, ValueError):
            return "auto", enable_gqa
    return _cuda_sdpa_choice(query, key, value, dropout_p, enable_gqa, attn_mask)


def _cuda_sdpa_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float,
                      enable_gqa: bool, attn_mask: Optional[torch.Tensor]) -> tuple[str, bool]:
    """sdpa_choice on CUDA: torch's own checks, asked with the mask SDPA will get."""
    from torch.backends import cuda as cuda_backends

    causal = attn_mask is None

    def params(k, v, gqa, mask=attn_mask):
        try:
            return cuda_backends.SDPAParams(query, k, v, mask, dropout_p, mask is None, gqa)
        except TypeError:           # torch < 2.5: no enable_gqa argument (and no GQA in SDPA)
            return None if gqa else cuda_backends.SDPAParams(query, k, v, mask, dropout_p, mask is None)

    if enable_gqa:                   # flash takes grouped k/v as they are (torch >= 2.5)
        p = params(key, value, True)
        if p is not None and cuda_backends.can_use_flash_attention(p):
            return "flash", True
        # memory-efficient attention has no GQA: the caller repeats k/v per query head for it
        rep = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    p = params(key, value, False)
    if cuda_backends.can_use_flash_attention(p):
        return "flash", False
    if cuda_backends.can_use_efficient_attention(p):
        return "efficient", False
    device = torch.cuda.get_device_name(query.device)
    if not causal and cuda_backends.can_use_efficient_attention(params(key, value, False, None)):
        # the mask is what stops it: flash takes none, and this memory-efficient kernel not this one
        raise ConfigError(
            f"an attention mask (per-document attention: --reset-attention-mask / --sft; a sliding window: "
            f"--window-size): torch's memory-efficient attention kernel, the only one that takes a mask, refuses "
            f"the {attn_mask.dtype} {list(attn_mask.shape)} mask here (dtype {query.dtype}, head dim "
            f"{query.size(-1)}, device {device}): use --attention-backend local (documents; a window has no "
            "other path)")
    if value.size(-1) != query.size(-1):          # multi-latent attention: no local attention to fall back to
        raise ConfigError(
            f"multi-latent attention's head dims (query/key {query.size(-1)}, value {value.size(-1)}, {query.dtype}) "
            f"are ones neither torch's flash nor its memory-efficient kernel takes on "
            f"{device}: choose --qk-head-dim + --qk-pos-emb-head-dim and "
            "--v-head-dim that are multiples of 8 (DeepSeek's 192 and 128 are)")
    raise ConfigError(
        f"--use-flash-attn: neither torch's flash nor its memory-efficient attention kernel can run here "
        f"(dtype {query.dtype}, head dim {query.size(-1)}, dropout {dropout_p}, "
        f"{'causal' if causal else 'an attention mask (documents or a window): flash takes none'}, device "
        f"{device}): use --attention-backend local")


def additive_mask(attention_mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The mask SDPA gets: None (causal), or an additive float mask in the attention's dtype.

    model/gpt.py hands every layer the same float mask already in that dtype (returned as is: SDPA saves
    that one tensor, not a copy per layer). Anything else is converted per call: a float mask of another
    dtype is cast; a bool mask is megatron's convention (True = masked, the opposite of torch's bool
    attn_mask), so it becomes 0 / -inf rather than being passed as it is."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill_(
            attention_mask, float("-inf"))
    if not attention_mask.is_floating_point():
        raise ConfigError(f"SDPA attention takes a float (additive) or bool (True = masked) attention mask, "
                          f"got {attention_mask.dtype}")
    return attention_mask if attention_mask.dtype == dtype else attention_mask.to(dtype)


def _sdpa_kernel_context(kind: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[kind]
    return sdpa_kernel([backend])


def _megatron_module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SDPAttention(_megatron_module_base()):
    """megatron-core core attention (DotProductAttention's interface) over torch SDPA: causal, or causal
    within each document when given model/gpt.py's document mask."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.utils import divide

        self.config = config
        if config.context_parallel_size != 1:
            raise ConfigError("context parallelism is not supported: use --context-parallel-size 1")
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ConfigError(f"softmax type {self.softmax_type!r}: choose one of {', '.join(SOFTMAX_TYPES)}")
        try:
            window = normalize_window_size(getattr(config, "window_size", None))
            freq = normalize_skip_freq(getattr(config, "window_attn_skip_freq", None), window, config.num_layers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if attn_mask_type != AttnMaskType.causal:
            raise ConfigError(f"SDPA attention is causal self-attention only (got mask type {attn_mask_type})")
        self.layer_number = max(1, layer_number)
        # megatron-core's rule on its 1-indexed layer number; the model slides if any layer does
        self.window_size = window if any(window_layers(window, freq, config.num_layers)) else None
        self.window_layer = is_window_layer(window, freq, self.layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = pg_collection.tp.size()
        # multi-latent attention (megatron-core's MLASelfAttention) passes its query/key head dim and its
        # value head dim, which differ (DeepSeek-V3: 192 and 128); the output is heads x the value's
        self.hidden_size_per_attention_head = k_channels or config.kv_channels
        self.hidden_size_per_partition = divide((v_channels or config.kv_channels) * config.num_attention_heads, tp)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # apply_query_key_layer_scaling only changes how the local module computes the same scale
        # (divide by layer_number, multiply back inside the fp32 softmax): 1/sqrt(d) either way.
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self._init_softmax_offset(config)
        self.current_max_attn_logits = None
        self.last_kernel: str | None = None      # what the latest forward ran ("flash", "efficient", ...)
        self._choice: dict = {}

    def _init_softmax_offset(self, config) -> None:
        """megatron-core's DotProductAttention's: for "learnable" a Parameter `softmax_offset` [heads/t] (the
        name checkpoints and Megatron-LM use), of params_dtype, on megatron's device, TP-split with the heads;
        for "off-by-one" a fixed zero tensor (not a parameter: in no state dict); else None."""
        heads = self.num_attention_heads_per_partition
        # where megatron-core's layers put their parameters: the host with use_cpu_initialization (the model's
        # builder moves it all after), else the current GPU; never CUDA on a machine without one
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else \
            torch.cuda.current_device()
        if self.softmax_type == "vanilla":
            self.softmax_offset = None
        elif self.softmax_type == "off-by-one":     # (not read by the kernels: the sink key alone scores 0)
            self.softmax_offset = torch.zeros(heads, device=device, dtype=config.params_dtype)
        else:
            offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
            offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride = True, 0, 1
            self.register_parameter("softmax_offset", offset)
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.softmax_offset)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params is not None:
            raise ConfigError("packed sequences are not supported by SDPA attention")
        if attention_bias is not None:
            raise ConfigError("an attention bias is not supported by SDPA attention")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ConfigError(f"SDPA attention is causal only (got mask type {attn_mask_type})")
        sq, b = query.shape[0], query.shape[1]
        # [s, b, n, d] -> [b, n, s, d] as strided views: the CPU kernel then writes its output in
        # [s, b, n, d] order, so the reshape below is free and linear_proj's saved input is the
        # very tensor SDPA saved (no second copy of the context).
        sink = self.softmax_type != "vanilla"
        v_dim = value.size(-1)
        if sink:
            # s + 1 positions: a dummy query and the sink key at 0, the offset in q's extra channels (model/sinks.py)
            q, k, v = sink_operands(query, key, value, self.softmax_offset, self.softmax_type, self.softmax_scale)
        else:
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if q.device.type == "cpu" and v.size(-1) != q.size(-1):
            # multi-latent attention's value head dim differs from the query/key's, which torch's CPU flash
            # kernel does not take (its math path would store the s x s probabilities): zero channels make the
            # dims equal without changing a score (explicit scale) or an output channel, then are sliced off.
            # (CUDA's memory-efficient kernel takes the two dims as they are.)
            width = max(v_dim, q.size(-1))
            q, k, v = (F.pad(t, (0, width - t.size(-1))) if t.size(-1) < width else t for t in (q, k, v))
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        if window_binds(self.window_size, sq):          # a windowed forward's mask: this layer's channel
            attention_mask = layer_mask(attention_mask, self.window_layer)
        mask = additive_mask(attention_mask, q.dtype)
        if sink:
            mask = sink_layout(mask, sq)
        sig = (q.device.type, q.dtype, q.size(-1), v.size(-1), dropout_p, gqa,
               None if mask is None else tuple(mask.shape))
        choice = self._choice.get(sig)
        if choice is None:
            choice = self._choice[sig] = sdpa_choice(q, k, v, dropout_p, gqa, attn_mask=mask)
        kind, enable_gqa = choice
        if gqa and not enable_gqa:
            rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        self.last_kernel = kind
        with contextlib.ExitStack() as stack:
            if q.device.type == "cuda":
                stack.enter_context(_sdpa_kernel_context(kind))
            # Dropout: as megatron's local module, from the model-parallel RNG stream (each TP
            # rank holds other heads) unless sequence parallelism runs the whole block in it.
            if dropout_p > 0 and not self.config.sequence_parallel:
                stack.enter_context(tensor_parallel.get_cuda_rng_tracker().fork())
            # no mask: causal by construction, nothing s x s is read; a document or window mask carries causality
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                     is_causal=mask is None, scale=self.softmax_scale,
                                                     **(dict(enable_gqa=True) if enable_gqa else {}))
        if sink:
            context = context[:, :, 1:]            # the dummy query's row
        # [b, n, s, d] -> [s, b, n*d]
        return context[..., :v_dim].permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron-core's DotProductAttention's: the learnable softmax_offset, TP-split on dim 0; else nothing."""
        if self.softmax_type != "learnable":
            return {}
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp_cp = (metadata or {}).get("dp_cp_group") or \
            parallel_state.get_data_parallel_group(with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                   {"softmax_offset": 0}, sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=dp_cp)


def describe_kernel(num_heads: int, num_query_groups: int, head_dim: int, tp: int, dtype: torch.dtype,
                    device: torch.device, dropout_p: float, v_head_dim: int | None = None,
                    document_mask: bool = False, window: str = "", unmasked_layers: bool = False,
                    softmax_type: str = "vanilla") -> str:
    """The SDPA kernel a training forward will run with this shape, for the banner (v_head_dim: MLA's
    value head dim where it differs; on a CPU the forward pads it to head_dim, as here; document_mask:
    per-document attention, an additive [b, 1, s, s] mask in place of is_causal; window: the sliding window's
    description, its layers take an additive mask too; unmasked_layers: the full-attention layers beside a
    window then run is_causal without a mask, which on CUDA may be another kernel; softmax_type: attention sinks
    widen the head dim and add a position, model/sinks.py)."""
    h, g = num_heads // tp, max(1, num_query_groups // tp)
    s = 16
    if softmax_type != "vanilla":
        zeros = [torch.zeros(s, 1, n, d, dtype=dtype, device=device)
                 for n, d in ((h, head_dim), (g, head_dim), (g, v_head_dim or head_dim))]
        q, kv, v = sink_operands(*zeros, torch.zeros(h, dtype=dtype, device=device), softmax_type,
                                 1.0 / math.sqrt(head_dim))
        s += 1
    else:
        q = torch.zeros(1, h, s, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(1, g, s, head_dim, dtype=dtype, device=device)
        v = kv if device.type == "cpu" or v_head_dim is None else torch.zeros(1, g, s, v_head_dim, dtype=dtype,
                                                                             device=device)
    mask = torch.zeros(1, 1, s, s, dtype=dtype, device=device) if document_mask or window else None
    kind, enable_gqa = sdpa_choice(q, kv, v, dropout_p, h != g, attn_mask=mask)
    names = {"flash": "flash attention", "efficient": "memory-efficient attention", "math": "math"}
    text = f"torch SDPA, {names.get(kind, kind)} kernel ({device.type})"
    if window and unmasked_layers:
        causal, _ = sdpa_choice(q, kv, v, dropout_p, h != g)
        if causal != kind:
            text = (f"torch SDPA, {names.get(kind, kind)} kernel in the sliding-window layers, "
                    f"{names.get(causal, causal)} in the others ({device.type})")
    if document_mask:
        text += ", per-document mask"
    if window:
        text += f", {window} (an additive mask)"
    if softmax_type != "vanilla":
        text += ", attention sinks (learned softmax offsets)" if softmax_type == "learnable" else ", softmax off-by-one"
    if device.type == "cpu" and kind == "math" and dropout_p > 0:
        text += " -- torch's CPU flash kernel has no dropout: the probabilities are materialised"
    if h != g and not enable_gqa:
        text += ", k/v repeated per query head"
    return text
