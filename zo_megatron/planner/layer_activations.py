"""What one transformer layer keeps for backward on one TP rank, by part (Korthikanti et al. 2022,
built from the parts so precision, architecture and options change it consistently; measured with
saved-tensor hooks in tests/test_planner_validation.py and tests/test_planner_moe.py): the norms, the
attention block (standard, or multi-latent attention's latents and heads) and its scores, the MLP (or
an MoE layer's side, planner/moe.py), and what selective recompute (--recompute-modules) keeps and
holds again. memory.py composes these into the plan."""
from __future__ import annotations

from zo_megatron.planner.attention_sinks import (local_sink_extra, positions, sink_core_saved, sink_head_dims,
                                                 sink_proj_input, sink_sdpa)
from zo_megatron.planner.inputs import PlanInput
from zo_megatron.planner.mlp_activations import mlp_saved_widths
from zo_megatron.planner.moe import moe_mlp_saved, shared_expert_saved


def _bytes16(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _norm_saved(inp: PlanInput, elements: int, rows: int) -> tuple[int, bool]:
    """(bytes one norm keeps for backward, its input included when it keeps it; whether the tensor
    it keeps is its input itself, which may be a view of something larger).

    LayerNorm (one native op) keeps its input and per-row statistics (ignored, as in Korthikanti's
    count). RMSNorm is torch.nn.RMSNorm (megatron-core's WrappedTorchNorm), a composite computing in
    fp32: it keeps the fp32 input (the input itself in fp32 mode, an fp32 copy in 16-bit modes),
    the fp32 normalized tensor and the fp32 1/rms per row."""
    w = _bytes16(inp.precision)
    if inp.normalization == "LayerNorm":
        return w * elements, True
    return 8 * elements + 4 * rows, w == 4


def _qk_norm_saved(inp: PlanInput, elements: int, rows: int) -> tuple[int, bool]:
    """`_norm_saved` of a q/k norm (one row per head): with LayerNorm also its mean and 1/std per row
    (2 x 16 bits), not negligible next to a row of head_dim elements."""
    b, keeps = _norm_saved(inp, elements, rows)
    return b + (2 * _bytes16(inp.precision) * rows if inp.normalization == "LayerNorm" else 0), keeps


def _sdpa_math_path(inp: PlanInput) -> bool:
    """torch SDPA on the CPU with attention dropout: its CPU kernel has no dropout, the math path runs."""
    return inp.sdpa_math_path()


def _sdpa_pads(inp: PlanInput) -> bool:
    """The core attention pads the heads to one head dim before SDPA: on the CPU, where multi-latent
    attention's value head dim differs from its query/key head dim (DeepSeek-V3: 128 vs 192), since
    torch's CPU flash kernel takes one head dim (model/attention.py SDPAttention: zero channels, sliced
    off the output). CUDA's memory-efficient kernel takes the two dims as they are. (The attention sinks'
    operands are built at one width on the CPU already: attention_sinks.sink_head_dims.)"""
    return inp.attention_backend == "sdpa" and inp.device_is_host and inp.qk_dim() != inp.v_dim() \
        and not sink_sdpa(inp)


def _sdpa_head_dims(inp: PlanInput) -> tuple[int, int]:
    """(query/key, value) head dims of the tensors SDPA gets (`_sdpa_pads`: both the larger; with attention
    sinks the widths of their operands, attention_sinks.sink_head_dims)."""
    if sink_sdpa(inp):
        return sink_head_dims(inp)
    qk, v = inp.qk_dim(), inp.v_dim()
    return (max(qk, v),) * 2 if _sdpa_pads(inp) else (qk, v)


def _attention_saved(inp: PlanInput, checkpointed: bool | None = None) -> int:
    """Bytes the attention block of one layer keeps per token on one TP rank (besides the scores and
    its input, counted by the caller): what the core attention's matmuls save, with aliasing.
    `checkpointed` (default: --recompute-modules core_attn is on): the core attention runs under
    megatron-core's checkpoint, which keeps its inputs as given (q at the full head count, k and v at
    the rank's groups; new tensors only after RoPE or q/k norms, v always a view of the fused tensor)
    and nothing the core computes from them (measured: tests/test_planner_validation.py).

    q, k, v come out of linear_qkv as views of one fused tensor of (heads + 2G)·head_dim per token
    (per query group: its q heads, its k, its v). The core attention saves q, k and v at full head
    count (GQA's k/v are repeat_interleaved to every head: new tensors); RoPE (the unfused path,
    rope_utils._apply_rotary_pos_emb_bshd) returns new rotated q and k and keeps only its cos/sin
    tables (counted per layer by the caller); q is reshaped to heads (a view with MHA or one group)
    and flattened by the core attention (a view with MHA, or one group at micro-batch 1). The fused
    tensor stays alive as long as any saved tensor is a view of it (GPT-2: all three; MHA + RoPE:
    v). qk_layernorm normalizes q and k per head first (its inputs: q's reshape, k's view of the
    fused tensor). Heads and groups are this TP rank's (G/t groups: one group per rank at G = t)."""
    if inp.multi_latent_attention:
        return _mla_attention_saved(inp, checkpointed)
    w = _bytes16(inp.precision)
    t = inp.tensor_parallel
    a, g, d = inp.num_attention_heads // t, inp.query_groups() // t, inp.head_dim()
    rope, qk_norm = inp.position_embedding_type in ("rope", "yarn"), inp.qk_layernorm
    q_is_view = g == a or g == 1                  # q's reshape to heads needs no copy
    if checkpointed is None:
        checkpointed = "core_attn" in inp.selective_modules()
    if checkpointed:
        q_new, k_new = rope or qk_norm or not q_is_view, rope or qk_norm
        v_new, kv_heads = False, g
    elif inp.attention_backend == "sdpa":
        # SDPA reads q, k, v as strided views (no flatten). k/v stay grouped (enable_gqa) in the CPU
        # kernel and CUDA's flash (16-bit); CUDA's memory-efficient kernel (fp32, or any dtype with a
        # document or window mask: flash takes no mask) gets them repeated (with --window-attn-skip-freq and
        # no documents the full-attention layers keep flash's grouped k/v: counted repeated, an upper bound).
        grouped = inp.sdpa_grouped_kv()
        q_new = rope or qk_norm or not q_is_view
        k_new = rope or qk_norm or (g < a and not grouped)
        v_new = g < a and not grouped
        kv_heads = g if grouped else a
    else:
        # the core attention flattens q to [s, b·heads, d]: a view of the fused tensor with MHA, or
        # with one group at micro-batch 1 (merging a size-1 dimension needs no copy)
        q_new = rope or qk_norm or not (g == a or (g == 1 and inp.micro_batch_size == 1))
        k_new = rope or qk_norm or g < a
        v_new = g < a
        kv_heads = a
    # the core attention's new inputs
    saved_bytes = w * d * sum(n for new, n in ((q_new, a), (k_new, kv_heads), (v_new, kv_heads)) if new)
    fused_kept = not (q_new and k_new and v_new)
    if (_sdpa_math_path(inp) or sink_sdpa(inp)) and not checkpointed:
        # the math path saves fp32 copies of q, k, v (counted with its scores, `_scores_saved`), and the
        # attention sinks' path copies them into its own operands (attention_sinks.sink_core_saved), not
        # the tensors it was given: neither they nor the fused tensor they are views of stay alive
        saved_bytes, fused_kept = 0, False
    if qk_norm:                                   # per token: a·d and g·d elements, a and g rows
        q_bytes, keeps_input = _qk_norm_saved(inp, a * d, a)
        k_bytes, _ = _qk_norm_saved(inp, g * d, g)
        if keeps_input:                           # k's input, a view of the fused tensor, keeps it alive
            fused_kept = True                     # (and q's too when q is a view)
            k_bytes -= w * g * d
            q_bytes -= w * a * d if q_is_view else 0
        saved_bytes += q_bytes + k_bytes
    if fused_kept:
        saved_bytes += w * (a + 2 * g) * d
    return saved_bytes


def _mla_attention_saved(inp: PlanInput, checkpointed: bool | None = None) -> int:
    """`_attention_saved` of multi-latent attention (megatron-core's MLASelfAttention, unfused path,
    get_query_key_value_tensors): bytes per token on one TP rank of what its core attention keeps of
    its inputs, at the rank's n = a/t heads. query = cat(q_nope, rope(q_pe)) and key = cat(k_nope,
    rope(k_pe) for every head) are new tensors of n·d_qk, value a contiguous copy of n·d_v (its slice of
    the kv up projection); the up projections' outputs they come from are not kept (cat, rope and
    contiguous save nothing of them). SDPA's fused kernels keep the three as they get them; where the
    heads are padded to one dim first (`_sdpa_pads`, on a CPU) the padded tensors (the unpadded ones are
    freed: a pad saves nothing) and SDPA's padded output beside linear_proj's input (a copy of its first
    d_v channels, counted by the caller). The CPU math path (`_sdpa_math_path`) keeps fp32 copies
    instead (`_scores_saved`); under --recompute-modules core_attn the checkpoint keeps query, key and
    value as given."""
    if checkpointed is None:
        checkpointed = "core_attn" in inp.selective_modules()
    n, w = inp.num_attention_heads // inp.tensor_parallel, _bytes16(inp.precision)
    if checkpointed:
        return w * n * (2 * inp.qk_dim() + inp.v_dim())
    if _sdpa_math_path(inp) or sink_sdpa(inp):      # their own copies, counted with the scores
        return 0
    qk, v = _sdpa_head_dims(inp)
    return w * n * (2 * qk + v + (v if _sdpa_pads(inp) else 0))


def _mla_latents_saved(inp: PlanInput) -> int:
    """Bytes per token (split over TP by sequence parallelism) of what multi-latent attention keeps of its
    two latents, the same on every TP rank (measured:
    tests/test_planner_validation.py's -mla cases):

      q latent   linear_q_down_proj's column-parallel output, all-gathered over TP to q_lora_rank (with
                 SP scattered back to this rank's tokens, as a copy of its own: model/mla.py), then
                 q_layernorm, then linear_q_up_proj, which keeps its input;
      kv latent  linear_kv_down_proj's output [kv_lora_rank + qk_pos_emb_head_dim] (replicated weight:
                 this rank's tokens with SP), whose first kv_lora_rank channels (a view, keeping all of
                 it) go through kv_layernorm to linear_kv_up_proj, which keeps its input.

    Without --qk-layernorm the up projection keeps the view itself, so the whole tensor. With it the
    norm keeps what `_qk_norm_saved` says (RMSNorm in 16 bits: an fp32 copy, the fp32 normalized tensor,
    1/rms; a LayerNorm or an fp32 RMSNorm: its input itself, the view, plus its own) and the up
    projection its output (a new tensor). The rotated key part is consumed by rope and freed."""
    w = _bytes16(inp.precision)
    split = 0
    for rank, extra in ((inp.q_lora_rank, 0), (inp.kv_lora_rank, inp.qk_pos_emb_head_dim)):
        if not rank:
            continue
        stored = w * (rank + extra)               # the tensor the latent is (a view of)
        kept_input = stored
        if inp.qk_layernorm:
            norm, keeps_input = _qk_norm_saved(inp, rank, 1)
            split += norm - (w * rank if keeps_input else 0) + w * rank    # its own + its output
            kept_input = stored if keeps_input else 0
        split += kept_input
    return split


def _layer_saved(inp: PlanInput, moe_layer: bool = False) -> tuple[int, int, int]:
    """(replicated, split, scores) bytes one transformer layer keeps for backward on one TP rank.

    Korthikanti et al. 2022 for GPT-2 (16-bit, dropout, no SP): s·b·h·(10 + 24/t + 5·a·s/(h·t));
    here built from its parts so precision, options and the architecture change it consistently.
    moe_layer: a mixture-of-experts layer, whose MLP keeps `moe.moe_mlp_saved` (in `split`)."""
    s, b, h = inp.seq_length, inp.micro_batch_size, inp.hidden_size
    t, f = inp.tensor_parallel, inp.ffn()
    w = _bytes16(inp.precision)
    sb, sbh = s * b, s * b * h
    mask = 1 if inp.dropout else 0
    # replicated over TP (split along the sequence with SP): what the two norms keep (LayerNorm: its
    # 16-bit input; RMSNorm: fp32 input, fp32 normalized, 1/rms), the inputs of qkv and of fc1 (b16
    # each) + 2 dropout masks
    replicated = 2 * _norm_saved(inp, sbh, sb)[0] + (2 * w + 2 * mask) * sbh
    # multi-latent attention: its q and kv latents (the same on every TP rank; `_mla_latents_saved`)
    latents = _mla_latents_saved(inp) if inp.multi_latent_attention else 0
    replicated += sb * latents
    # split over TP: q, k, v (+ the fused qkv output they may be views of), proj input (heads x the value
    # head dim), the MLP:
    # GELU keeps fc1's output and fc2's input (2f); SwiGLU keeps fc1's [gate; up] output (2f), silu(gate),
    # up + 0 (megatron's glu_linear_offset makes it a new tensor) and their product, fc2's input (5f); a
    # clamp and quick GeGLU keep more (mlp_activations.mlp_saved_widths: GPT-OSS's 7f)
    mlp = 0 if moe_layer else mlp_saved_widths(inp) * f // t
    split = sb * (_attention_saved(inp) + w * mlp) + _proj_input_saved(inp)
    if moe_layer:
        split += moe_mlp_saved(inp)
    if inp.sp():
        # sequence parallel: norms, dropouts and the qkv / fc1 inputs (each linear saves its local
        # [s/t, b, h] input and re-gathers it in backward) hold 1/t of the sequence
        replicated //= t
    if inp.multi_latent_attention or inp.position_embedding_type in ("rope", "yarn"):
        # cos and sin tables for q and for k, per layer (MLA: its own rotary embedding on qk_pos_emb_head_dim
        # channels, over the whole sequence also with SP; a model-level rope is not built under MLA)
        replicated += 4 * w * s * inp.rotary_dim()
    return replicated, split, _scores_saved(inp)


def _proj_input_saved(inp: PlanInput) -> int:
    """Bytes per layer of linear_proj's saved input, the context [s, b, heads/t x the value head dim]
    (the core attention's output; on the attention sinks' path a copy or a view of SDPA's s + 1 rows:
    attention_sinks.sink_proj_input)."""
    if sink_sdpa(inp):
        return sink_proj_input(inp)
    return _bytes16(inp.precision) * inp.seq_length * inp.micro_batch_size * inp.num_attention_heads * \
        inp.v_dim() // inp.tensor_parallel


def _selective_layer(inp: PlanInput, moe_layer: bool) -> tuple[int, int]:
    """(bytes one layer keeps for backward, the most one of its recomputed modules holds again in
    backward) under selective recompute of `inp.selective_modules()` (megatron-core's, as the local
    spec runs it; measured in tests/test_planner_validation.py and tests/test_planner_moe.py):

      core_attn       the attention core's scores (`_scores_saved`) are recomputed;
      layernorm       each norm keeps only its input (16-bit): what it saved itself (`_norm_saved`) is
                      gone and its output, the qkv / fc1 (router) input, is freed after forward and
                      recomputed into the same storage when backward reaches it;
      mlp             a dense layer's MLP keeps only its input (the pre-MLP norm's output, kept anyway);
      moe             an MoE layer's whole MLP side (`moe.moe_mlp_saved`) likewise;
      shared_experts  only the shared expert's part of it (`moe.shared_expert_saved`);
      mla_up_proj     multi-latent attention's query, key and value (`_mla_up_proj_dropped`) are dropped
                      after the core attention's forward and recomputed from the latents before its
                      backward, the up projections' outputs alive beside them then."""
    replicated, split, scores = _layer_saved(inp, moe_layer)
    mods = inp.selective_modules()
    s, b, t = inp.seq_length, inp.micro_batch_size, inp.tensor_parallel
    w, sbh = _bytes16(inp.precision), inp.seq_length * inp.micro_batch_size * inp.hidden_size
    kept, recomputed, norm_again = replicated + split + scores, [0], 0

    def recompute(dropped: int, again: int | None = None) -> None:
        nonlocal kept
        kept -= dropped
        recomputed.append(dropped if again is None else again)

    if "core_attn" in mods:
        # kept: the core's inputs (`_attention_saved`, checkpointed); again in backward: the scores and
        # what the core keeps of q, k and v beyond its inputs (GQA's repeated k/v, flattened copies)
        extra = max(0, _attention_saved(inp, checkpointed=False) - _attention_saved(inp, checkpointed=True))
        recompute(scores, scores + s * b * extra)
        # and the attention mask's type, which megatron-core passes through its checkpoint as an int32 [1]
        # tensor (attention.py _checkpointed_attention_forward)
        kept += 4
    if "layernorm" in mods:
        # again: one norm's internals and output, restored by a hook on its block's output before that
        # block's backward and held until the norm's own: beside the block's recomputed activations
        norm, seq_split = _norm_saved(inp, sbh, s * b)[0], t if inp.sp() else 1
        kept -= 2 * norm // seq_split
        norm_again = (norm + w * sbh) // seq_split
    if moe_layer and "moe" in mods:
        recompute(moe_mlp_saved(inp))
    elif moe_layer and "shared_experts" in mods:
        recompute(shared_expert_saved(inp))
    if not moe_layer and "mlp" in mods:
        recompute(w * s * b * mlp_saved_widths(inp) * inp.ffn() // t)
    if "mla_up_proj" in mods:
        dropped = s * b * _mla_up_proj_dropped(inp)
        n = inp.num_attention_heads // t
        recompute(dropped, dropped + s * b * w * n * (inp.qk_dim() + inp.qk_head_dim + inp.v_dim()))
        kept += _mla_up_proj_checkpoint(inp)
    return kept, max(recomputed) + norm_again


def _mla_up_proj_checkpoint(inp: PlanInput) -> int:
    """Bytes per layer that --recompute-modules mla_up_proj's checkpoint changes besides the dropped query, key
    and value (measured: tests/test_planner_validation.py's -rcupproj cases). It keeps its inputs: the rotary
    frequencies (fp32 [s, d_r]) and the rotated key's input k_pe, which is, under sequence parallelism, the
    whole sequence's gathered [s, b, d_r], otherwise a view of the key/value down projection's output (so all
    of it, where nothing kept it already: `_mla_latents_saved`); and its rope runs without autograd, so the
    cos/sin tables `_layer_saved` counts are not kept."""
    s, b, w, d_r = inp.seq_length, inp.micro_batch_size, _bytes16(inp.precision), inp.rotary_dim()
    if inp.sp():
        k_pe = w * s * b * d_r
    else:
        norm_keeps_latent = not inp.qk_layernorm or _qk_norm_saved(inp, inp.kv_lora_rank, 1)[1]
        k_pe = 0 if norm_keeps_latent else w * s * b * (inp.kv_lora_rank + inp.qk_pos_emb_head_dim)
    return 4 * s * d_r + k_pe - 4 * w * s * d_r


def _mla_up_proj_dropped(inp: PlanInput) -> int:
    """Bytes per token that --recompute-modules mla_up_proj drops of what the core attention keeps
    (`_mla_attention_saved`): megatron-core's CheckpointWithoutOutput frees the storage of the query, key
    and value it computed, so whatever the core saved as those tensors or views of them: all three as the
    core_attn checkpoint keeps them, SDPA's q and k (and v where it is not padded: on a GPU); nothing of the
    CPU math path's fp32 copies or of a padded value head (new tensors)."""
    n, w = inp.num_attention_heads // inp.tensor_parallel, _bytes16(inp.precision)
    if "core_attn" in inp.selective_modules():
        return w * n * (2 * inp.qk_dim() + inp.v_dim())
    if _sdpa_math_path(inp) or sink_sdpa(inp):      # the core keeps copies of its own
        return 0
    return w * n * (2 * inp.qk_dim() + (0 if _sdpa_pads(inp) else inp.v_dim()))


def _core_attention_backward(inp: PlanInput, moe_layer: bool = False) -> int:
    """Bytes above the stored activations while one layer's core attention runs its backward on torch
    SDPA's CPU math path (`_sdpa_math_path`; 0 elsewhere: the fused kernels' backward is smaller than
    the MLP's, phase B). Read from torch's math path and measured (tests/test_planner_validation.py's
    -attndrop cases at seq 512, where this phase is the peak: GPT-2 6.3% under the peak without it,
    -0.4% with it; MLA -0.7%):

      new         two fp32 [b, a/t, s, s] gradients at once (of the dropout's output and of the
                  probabilities at the dropout's backward; without dropout of the probabilities and of
                  the scores at the softmax's), the fp32 gradients of the output and of v [b, a/t, s, d_v];
      freed       what that layer's backward has released by then: its MLP side (the pre-MLP norm and
                  the fc1 input, both bias-dropout-add masks, the MLP's or MoE side's activations, as far
                  as selective recompute had kept them), linear_proj's input, the fp32 v of the
                  probabilities @ v product, with dropout the dropout's output.

    Net of the two, at least 0."""
    if not _sdpa_math_path(inp):
        return 0
    b, h, a, t = inp.micro_batch_size, inp.hidden_size, inp.num_attention_heads, inp.tensor_parallel
    w, sb, mask = _bytes16(inp.precision), inp.seq_length * inp.micro_batch_size, 1 if inp.dropout else 0
    mods = inp.selective_modules()
    n = positions(inp)                              # s, or s + 1 with attention sinks
    square, value = 4 * a * n * n * b // t, 4 * a * n * b * _sdpa_head_dims(inp)[1] // t
    new = 2 * square + 2 * value
    norm = 0 if "layernorm" in mods else _norm_saved(inp, sb * h, sb)[0]
    freed = (norm + (w + 2 * mask) * sb * h) // (t if inp.sp() else 1)
    if moe_layer:
        freed += 0 if "moe" in mods else moe_mlp_saved(inp) - (shared_expert_saved(inp) if "shared_experts" in mods
                                                              else 0)
    elif "mlp" not in mods:
        freed += w * sb * mlp_saved_widths(inp) * inp.ffn() // t
    freed += value + _proj_input_saved(inp) + (square if inp.attention_dropout_on() else 0)
    return max(0, new - freed)


def attention_mask_bytes(inp: PlanInput) -> tuple[int, bool]:
    """(bytes of one micro-batch's attention mask, whether it lives through backward); (0, False) without
    one. model/gpt.py builds one mask per forward, over the whole sequence on every TP rank (also with
    sequence parallelism), and hands the same tensor to every layer: per-document attention's [b, 1, s, s],
    bool (1 byte) for the local attention, additive in the activation dtype (w) for SDPA; with a sliding
    window that binds, SDPA's [b or 1, C, s, s], one channel per distinct mask (planner/window.py
    sdpa_mask_layout: the window layers', and with documents and full-attention layers theirs), each layer
    saving a view of its channel (one storage). SDPA's masks with attention sinks are [.., s + 1, s + 1]
    (model/masks.py's sink layout); on CUDA every SDPA mask's rows are padded to a multiple of 8 elements
    (model/masks.padded_mask: the memory-efficient kernel's strides), a view of the wider storage.

    Kept for backward (one storage, however many layers save it; measured with saved-tensor hooks in
    tests/test_planner_validation.py's -docmask cases): by the local attention's masked_fill_, by SDPA's
    fused kernels (torch's CPU flash kernel, CUDA's memory-efficient one) and by any recompute
    checkpoint that takes it as an input (full recompute, --recompute-modules core_attn). SDPA's CPU
    math path (attention dropout) adds it to its scores without keeping it: there it lives through the
    forward only. Nothing else a layer keeps changes with it (measured)."""
    layout = inp.attention_mask_layout()
    if layout is None:
        return 0, False
    rows = inp.micro_batch_size if layout.batched else 1
    local = inp.attention_backend == "local"
    n = positions(inp)                              # s, or s + 1 in the attention sinks' layout
    width = n if local or inp.device_is_host else -(-n // 8) * 8
    per_element = 1 if local else _bytes16(inp.precision)
    kept = (not _sdpa_math_path(inp) or inp.normalized_recompute() == "full"
            or "core_attn" in inp.selective_modules())
    return per_element * rows * layout.channels * n * width, kept


def _scores_saved(inp: PlanInput) -> int:
    """Bytes the core attention keeps per layer on one TP rank beyond q, k, v and its output.

    local (megatron's DotProductAttention), a·s·s·b/t elements: the probabilities saved by the
    softmax (+ fp32 probabilities and a 16-bit copy if unfused), with dropout its mask and output.
    sdpa (torch SDPA, causal): only the fp32 row logsumexp [b, a/t, s] -- no s² term (CUDA's flash
    and memory-efficient kernels, torch's fused CPU kernel). With attention dropout the CPU kernel
    falls back to the math path: three fp32 [b, a/t, s, s] tensors (softmax output, dropout mask
    and output) and fp32 q·scale, k·scale and v at the full head count, instead of the q, k, v it
    was given (measured with saved-tensor hooks, torch 2.13 CPU; tests/test_planner_validation.py's
    `-sdpa-attndrop` case in bf16; in fp32 v may stay a view of the fused qkv tensor instead).

    Attention sinks (planner/attention_sinks.py): on SDPA, what its path keeps of its own at s + 1
    positions (sink_core_saved: its copies of q, k, v, the logsumexp, an output wider than linear_proj's
    input); on the local attention the unfused softmax (the fused kernel takes no offset) with its fp32
    output one sink column wider (local_sink_extra)."""
    s, b, a, t = inp.seq_length, inp.micro_batch_size, inp.num_attention_heads, inp.tensor_parallel
    w = _bytes16(inp.precision)
    if sink_sdpa(inp):
        return sink_core_saved(inp)
    if inp.attention_backend == "sdpa":
        if _sdpa_math_path(inp):
            # fp32: scores, probabilities, dropout output [b, a/t, s, s]; scaled q, scaled k, v [b, a/t,
            # s, d] (MLA's heads padded to one d first on the CPU: `_sdpa_head_dims`)
            qk, v = _sdpa_head_dims(inp)
            return 3 * 4 * a * s * s * b // t + 4 * a * s * b * (2 * qk + v) // t
        return 4 * a * s * b // t
    mask = 1 if inp.dropout else 0
    # attention scores a·s·s·b: probs saved by softmax (+ fp32 probs and a 16-bit copy if unfused)
    fused = inp.fused_softmax and not inp.sinks()
    probs = w if (fused or w == 4) else 4 + w
    scores_per_elem = probs + (mask + w if inp.dropout else 0)  # dropout mask + dropout output
    return scores_per_elem * a * s * s * b // t + local_sink_extra(inp)
