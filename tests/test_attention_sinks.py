"""Attention sinks (megatron-core's softmax_type "off-by-one" / "learnable", GPT-OSS's sinks) on torch SDPA.

p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(softmax_offset_h)): SDPAttention runs it through SDPA's fused kernels
with a dummy query and a sink key at position 0 and the offset in extra channels of q (zo_megatron/model/sinks.py).
Each draw is a fresh seed, printed (tests/seeds.py); every element is compared.

- SDPAttention, learnable and off-by-one, GQA, causal / per-document mask / sliding window (masks in the sink layout,
  and a plain mask converted per call) == an explicit float64 softmax with the sink column written here (output,
  grads of q, k, v and softmax_offset) == megatron-core's local DotProductAttention given the same offsets; multi-
  latent attention's two head dims too; nothing s x s is saved; bf16's split offset is good to ~fp32;
- whole models (softmax_type learnable, float64): attention_backend sdpa == local, logits, loss and every gradient
  (softmax_offset's included), with and without documents, at TP 1 and TP 2;
- vanilla is the path before: SDPA gets [b, n, s, d] views and is_causal / the [.., s, s] mask, bit for bit; no
  softmax_offset parameter; the masks' vanilla layout unchanged.
"""
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_world
from tests.seeds import fresh_seed

HEADS, GROUPS, D, SEQ, BATCH, LEFT = 4, 2, 8, 13, 2, 3


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _segments(gen, batch, seq):
    cuts = torch.sort(torch.randint(1, seq, (batch, 2), generator=gen), dim=1).values
    return (torch.arange(seq)[None, :, None] >= cuts[:, None, :]).sum(-1)


def _allowed(s, segments, window):
    """[b or 1, 1, s, s] bool: query i may see key j (causal, same document, within the window)."""
    i = torch.arange(s)
    ok = (i[None, :] <= i[:, None])[None, None]
    if window is not None:
        ok = ok & (i[:, None] - i[None, :] <= window)
    if segments is not None:
        ok = ok & (segments[:, None, :, None] == segments[:, None, None, :])
    return ok


def _reference(q, k, v, offset, scale, allowed):
    """softmax([q k^T * scale masked, offset_h]) without the sink column, @ v: float64, GPT-OSS's eager form."""
    s, b, n, _ = q.shape
    rep = n // k.size(2)
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("ibnd,jbnd->bnij", q, kk) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = offset.reshape(1, -1, 1, 1).expand(b, -1, s, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bnij,jbnd->ibnd", probs, vv).reshape(s, b, -1)


def _config(softmax_type, window=None, dtype=torch.float64, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HEADS * D, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, kv_channels=D, softmax_type=softmax_type, params_dtype=dtype,
                             use_cpu_initialization=True, perform_initialization=False, masked_softmax_fusion=False,
                             apply_query_key_layer_scaling=False, attention_softmax_in_fp32=True,
                             attention_dropout=0.0, hidden_dropout=0.0, window_size=window, **kw)


def _grads(module, q, k, v, out, weight):
    tensors = [q, k, v] + ([module.softmax_offset] if isinstance(module.softmax_offset, torch.nn.Parameter) else [])
    return torch.autograd.grad((out * weight).sum(), tensors)


# ------------------------------------------------------------------ the core attention against two references
def _core_world(rank, seed):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    import zo_megatron.model.gpt as G
    from zo_megatron.model.attention import SDPAttention
    from zo_megatron.model.masks import window_attention_mask
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seg = _segments(gen, BATCH, SEQ)
    causal = AttnMaskType.causal
    out = {}
    for softmax_type in ("learnable", "off-by-one"):
        for case in ("causal", "documents", "window", "window+documents"):
            window = LEFT if "window" in case else None
            segments = seg if "documents" in case else None
            ours = SDPAttention(_config(softmax_type, None if window is None else (window, 0)), 1, causal, "self")
            theirs = DotProductAttention(_config(softmax_type), 1, causal, "self")
            offset = torch.randn(HEADS, generator=gen, dtype=torch.float64) * 2
            if softmax_type == "learnable":
                with torch.no_grad():
                    ours.softmax_offset.copy_(offset)
                    theirs.softmax_offset.copy_(offset)
            else:
                offset = torch.zeros(HEADS, dtype=torch.float64)
            q = torch.randn(SEQ, BATCH, HEADS, D, generator=gen, dtype=torch.float64, requires_grad=True)
            k = torch.randn(SEQ, BATCH, GROUPS, D, generator=gen, dtype=torch.float64, requires_grad=True)
            v = torch.randn(SEQ, BATCH, GROUPS, D, generator=gen, dtype=torch.float64, requires_grad=True)
            weight = torch.randn(SEQ, BATCH, HEADS * D, generator=gen, dtype=torch.float64)
            allowed = _allowed(SEQ, segments, window)
            # the model's masks (sink layout, built once per forward) and a plain one converted per call
            if window is not None:
                masks = {"sink layout": window_attention_mask(SEQ, window, 1, torch.float64, "cpu", segments, True),
                         "plain": window_attention_mask(SEQ, window, 1, torch.float64, "cpu", segments)}
            elif segments is not None:
                masks = {"sink layout": G.document_attention_mask(segments, "sdpa", torch.float64, sink=True),
                         "plain": G.document_attention_mask(segments, "sdpa", torch.float64),
                         "bool": G.document_attention_mask(segments, "local", torch.bool)}
            else:
                masks = {"none": None}
            scale = ours.softmax_scale
            ref_offset = offset.clone().requires_grad_(softmax_type == "learnable")
            ref = _reference(q, k, v, ref_offset, scale, allowed)
            tensors = [q, k, v] + ([ref_offset] if softmax_type == "learnable" else [])
            runs = {"reference": (ref, torch.autograd.grad((ref * weight).sum(), tensors))}
            for name, mask in masks.items():
                o = ours(q, k, v, mask)
                runs[f"sdpa, {name} mask"] = (o, _grads(ours, q, k, v, o, weight))
            o = theirs(q, k, v, ~allowed)             # megatron's bool convention: True = masked
            runs["megatron local"] = (o, _grads(theirs, q, k, v, o, weight))
            control = _reference(q, k, v, torch.full_like(offset, -torch.inf), scale, allowed)   # no sink
            out[(softmax_type, case)] = dict(runs=runs, kernel=ours.last_kernel, control=control.detach())
    return out


def test_sdpa_sinks_equal_an_explicit_softmax_and_megatron_core():
    """Output and the gradients of q, k, v and softmax_offset: SDPAttention (sink-layout masks, plain masks
    converted, megatron's bool one) == the explicit float64 softmax with a sink column == megatron-core's
    DotProductAttention (SoftmaxOne), to 1e-12; the fused CPU kernel ran; a control without the sink differs."""
    seed = fresh_seed("attention sinks: core attention")
    out = run_world(_core_world, 1, seed, timeout=120)[0]
    for case, o in out.items():
        assert o["kernel"] == "flash", (case, o["kernel"])
        ref_out, ref_grads = o["runs"]["reference"]
        assert _rel(o["control"], ref_out) > 1e-3, case              # the sink changes these outputs
        assert len(ref_grads) == (4 if case[0] == "learnable" else 3)
        for name, (got, grads) in o["runs"].items():
            assert _rel(got, ref_out) <= 1e-12, (case, name, _rel(got, ref_out))
            assert len(grads) == len(ref_grads), (case, name)
            for i, (g, r) in enumerate(zip(grads, ref_grads)):
                assert _rel(g, r) <= 1e-11, (case, name, "qkvo"[i], _rel(g, r))


def _mla_bf16_world(rank, seed):
    from megatron.core.transformer.enums import AttnMaskType

    from zo_megatron.model.attention import SDPAttention
    from zo_megatron.model.sinks import _offset_pieces
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    # multi-latent attention: query/key head dim 12, value 6 (the CPU pads v; the output drops the padding)
    core = SDPAttention(_config("learnable"), 1, AttnMaskType.causal, "self", k_channels=12, v_channels=6)
    offset = torch.randn(HEADS, generator=gen, dtype=torch.float64) * 2
    with torch.no_grad():
        core.softmax_offset.copy_(offset)
    q = torch.randn(SEQ, BATCH, HEADS, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(SEQ, BATCH, GROUPS, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(SEQ, BATCH, GROUPS, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(SEQ, BATCH, HEADS * 6, generator=gen, dtype=torch.float64)
    ref_offset = offset.clone().requires_grad_(True)
    ref = _reference(q, k, v, ref_offset, core.softmax_scale, _allowed(SEQ, None, None))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        o = core(q, k, v, None)
    out["mla"] = dict(out=o, grads=_grads(core, q, k, v, o, weight), ref=ref,
                      ref_grads=torch.autograd.grad((ref * weight).sum(), [q, k, v, ref_offset]),
                      largest_saved=max(saved))
    # CUDA's layout, run on the CPU: q/k widened to a multiple of 8, MLA's value kept at its own width (SDPA's math
    # path here: the CPU flash kernel takes one head dim); the same softmax
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from zo_megatron.model.sinks import sink_operands

    qq, kk, vv = sink_operands(q, k, v, core.softmax_offset, "learnable", core.softmax_scale, cuda=True)
    widths = (qq.size(-1), kk.size(-1), vv.size(-1))
    o = sdpa(qq, kk.repeat_interleave(2, dim=1), vv.repeat_interleave(2, dim=1), is_causal=True,
             scale=core.softmax_scale)[:, :, 1:].permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1)
    out["cuda layout"] = dict(out=o, grads=_grads(core, q, k, v, o, weight), widths=widths)
    # bf16 attention, fp32 offsets, head dim 8 (scale 1/sqrt(8): no power of 2): 3 channels carry offset / scale
    core = SDPAttention(_config("learnable", dtype=torch.float32), 1, AttnMaskType.causal, "self")
    offset = torch.randn(HEADS, generator=gen) * 2
    with torch.no_grad():
        core.softmax_offset.copy_(offset)
    pieces = _offset_pieces(offset, core.softmax_scale, torch.bfloat16, 3)
    q, k, v = (torch.randn(SEQ, BATCH, n, D, generator=gen) for n in (HEADS, GROUPS, GROUPS))
    o = core(q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    ref = _reference(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), offset.double(),
                     core.softmax_scale, _allowed(SEQ, None, None))
    out["bf16"] = dict(pieces=pieces, offset=offset, scale=core.softmax_scale, out=o, ref=ref)
    return out


def test_mla_head_dims_bf16_offset_and_no_s_squared():
    """Multi-latent attention (q/k head dim 12, v 6) with learnable sinks == the explicit softmax (output and all
    four gradients), also in CUDA's layout run here (q/k 12 + 1 -> 16 channels, v 6), and nothing it saves for
    backward has (s+1)^2 elements (s=13: every saved tensor is [b, n, s+1, d'] or smaller); in bf16 the offset's 3 bf16 pieces sum to offset / scale to fp32's precision (one
    bf16 piece is ~1e-3 off) and the output stays within bf16's rounding of the float64 reference."""
    seed = fresh_seed("attention sinks: MLA, bf16")
    out = run_world(_mla_bf16_world, 1, seed, timeout=120)[0]
    m = out["mla"]
    assert _rel(m["out"], m["ref"]) <= 1e-12
    for i, (g, r) in enumerate(zip(m["grads"], m["ref_grads"])):
        assert _rel(g, r) <= 1e-11, ("qkvo"[i], _rel(g, r))
    assert m["largest_saved"] <= BATCH * HEADS * (SEQ + 1) * 13 < BATCH * HEADS * (SEQ + 1) ** 2
    c = out["cuda layout"]
    assert c["widths"] == (16, 16, 6)
    assert _rel(c["out"], m["ref"]) <= 1e-12
    for i, (g, r) in enumerate(zip(c["grads"], m["ref_grads"])):
        assert _rel(g, r) <= 1e-11, ("cuda layout", "qkvo"[i], _rel(g, r))
    b = out["bf16"]
    exact = b["offset"].double() / b["scale"]
    summed = b["pieces"].double().sum(-1)
    assert ((summed - exact).abs() / exact.abs()).max() <= 2 ** -22
    assert ((b["pieces"][:, 0].double() - exact).abs() / exact.abs()).max() > 2 ** -22   # one piece would not do
    assert _rel(b["out"].double(), b["ref"]) <= 2 ** -6, _rel(b["out"].double(), b["ref"])


# ------------------------------------------------------------------------- whole models: sdpa == megatron local
def _model_world(rank, tp, seed):
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(tp, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    vocab, seq, layers = 256, 16, 2
    tokens = torch.randint(0, vocab, (BATCH, seq), generator=gen)
    labels = torch.randint(0, vocab, (BATCH, seq), generator=gen)
    segments = _segments(gen, BATCH, seq)
    offsets = torch.randn(layers, HEADS, generator=gen, dtype=torch.float64) * 2      # the full [heads] per layer
    local = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
    out = {}
    for backend in ("local", "sdpa"):
        cfg = GPTConfig(num_layers=layers, hidden_size=HEADS * D, num_attention_heads=HEADS, num_query_groups=GROUPS,
                        vocab_size=vocab, max_position_embeddings=seq, precision="fp32", position_embedding_type="rope",
                        normalization="RMSNorm", swiglu=True, ffn_hidden_size=48, add_bias_linear=False,
                        softmax_type="learnable", attention_backend=backend)
        model = build_gpt_model(cfg, rank, tp, seed).double()
        with torch.no_grad():
            for i, layer in enumerate(model.gpt.decoder.layers):
                layer.self_attention.core_attention.softmax_offset.copy_(offsets[i, local])
        # what megatron-core's dist checkpointing sees of the offset (a ShardedTensor split on dim 0 over TP)
        prefix = "decoder.layers.1.self_attention.core_attention."
        sharded = model.gpt.decoder.layers[1].self_attention.core_attention.sharded_state_dict(
            prefix, metadata=dict(dp_cp_group=mpu.get_data_parallel_group(with_context_parallel=True)))
        out[(backend, "sharded")] = {k: (v.key, v.data.tolist(), v.global_shape, v.global_offset,
                                         v.axis_fragmentations, v.replica_id) for k, v in sharded.items()}
        for docs in (None, segments):
            logits = model(tokens, None, docs)
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels).mean()
            loss.backward()
            shards = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(shards, logits.detach().contiguous())
            # this rank's shards: the two backends have the same names and layouts
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            out[(backend, docs is not None)] = dict(logits=torch.cat(shards, -1), loss=loss.detach(), grads=grads)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_sdpa_sinks_model_equals_megatron_local(tp):
    """A Llama-like GQA model with learnable sinks (offsets ~N(0, 4), each rank its heads' slice), float64:
    SDPA == megatron-core's local attention, logits, loss and every gradient on every rank (the offsets' among
    them), plain causal and with per-document segment_ids; the offset's sharded_state_dict entry is megatron-core's
    (key, values, global shape [heads], this rank's offset, TP fragments, replica id)."""
    seed = fresh_seed(f"attention sinks: model TP{tp}")
    ranks = run_world(_model_world, tp, tp, seed, timeout=180)
    for rank, out in enumerate(ranks):
        local = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
        name = "decoder.layers.1.self_attention.core_attention.softmax_offset"
        ours, theirs = out[("sdpa", "sharded")], out[("local", "sharded")]
        assert ours == theirs, (ours, theirs)
        key, _, shape, offset, fragments, _ = ours[name]
        assert (key, shape, offset, fragments) == (name, (HEADS,), (local.start,), (tp,))
        for docs in (False, True):
            local, sdpa = out[("local", docs)], out[("sdpa", docs)]
            assert _rel(sdpa["logits"], local["logits"]) <= 1e-12, docs
            assert abs(sdpa["loss"] - local["loss"]) <= 1e-12 * local["loss"], docs
            assert set(sdpa["grads"]) == set(local["grads"])
            sinks = [n for n in local["grads"] if n.endswith("core_attention.softmax_offset")]
            assert len(sinks) == 2 and all(local["grads"][n].shape == (HEADS // tp,) for n in sinks), sinks
            for n, g in local["grads"].items():
                assert _rel(sdpa["grads"][n], g) <= 1e-10, (docs, n, _rel(sdpa["grads"][n], g))


# ------------------------------------------------------------------------------------ vanilla: the path before
def _vanilla_world(rank, seed):
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnMaskType

    import zo_megatron.model.gpt as G
    from zo_megatron.model.attention import SDPAttention
    from zo_megatron.model.masks import padded_mask, window_attention_mask
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seg = _segments(gen, BATCH, SEQ)
    core = SDPAttention(_config("vanilla"), 1, AttnMaskType.causal, "self")
    q, k, v = (torch.randn(SEQ, BATCH, n, D, generator=gen) for n in (HEADS, GROUPS, GROUPS))
    doc = G.document_attention_mask(seg, "sdpa", torch.float32)
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append((a, kw))
        return sdpa(*a, **kw)

    F.scaled_dot_product_attention = spy
    try:
        results = [core(q, k, v, None), core(q, k, v, doc)]
    finally:
        F.scaled_dot_product_attention = sdpa
    # what the code before called: the permuted views, is_causal or the mask, enable_gqa
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    before = [sdpa(qq, kk, vv, attn_mask=m, is_causal=m is None, scale=core.softmax_scale, enable_gqa=True)
              .permute(2, 0, 1, 3).reshape(SEQ, BATCH, -1) for m in (None, doc)]
    # the masks' vanilla layout, as before: [.., s, s], -inf where not allowed
    old_doc = padded_mask(BATCH, 1, SEQ, torch.float32, "cpu").masked_fill_(~_allowed(SEQ, seg, None), float("-inf"))
    old_win = padded_mask(1, 1, SEQ, torch.float32, "cpu").masked_fill_(~_allowed(SEQ, None, LEFT), float("-inf"))
    return dict(results=results, before=before, calls=[(tuple(tuple(t.shape) for t in a), kw.get("is_causal"),
                                                        kw["attn_mask"] is doc) for a, kw in calls],
                params=[n for n, _ in core.named_parameters()], offset=core.softmax_offset,
                masks=(torch.equal(doc, old_doc), torch.equal(window_attention_mask(SEQ, LEFT, 1, torch.float32,
                                                                                   "cpu"), old_win)))


def test_vanilla_is_the_path_before():
    """softmax_type vanilla: SDPA gets the [b, n, s, d] views (no dummy row, no extra channel), is_causal without
    a mask and the very [b, 1, s, s] mask with one; the output equals that call's bit for bit; no softmax_offset
    (parameter or tensor); the vanilla masks as before."""
    seed = fresh_seed("attention sinks: vanilla")
    o = run_world(_vanilla_world, 1, seed, timeout=120)[0]
    shapes = ((BATCH, HEADS, SEQ, D), (BATCH, GROUPS, SEQ, D), (BATCH, GROUPS, SEQ, D))
    assert o["calls"] == [(shapes, True, False), (shapes, False, True)], o["calls"]
    assert all(torch.equal(a, b) for a, b in zip(o["results"], o["before"]))
    assert o["params"] == [] and o["offset"] is None
    assert o["masks"] == (True, True)
