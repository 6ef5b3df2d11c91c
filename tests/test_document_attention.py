"""Per-document causal attention: GPTModelTP.forward / .loss with segment_ids (--reset-attention-mask, --sft).

A packed row holds several documents; token j may attend to token i iff i <= j and both are in the same
document. The reference is independent of the mask code: each document run on its own, through the same
model, on the plain causal path (no segment_ids), in float64. Every check compares every element, and each
draw (a fresh seed, printed) gives every row its own documents of random lengths, one of them one token long.

- packed == separate runs: logits, per-token loss (torch's cross-entropy in float64), every parameter's
  gradient; local and SDPA attention; GPT-2 (learned positions, reset per document as the data gives them),
  Llama (RoPE, GQA; positions not reset: RoPE is relative) and multi-latent attention; also under full and
  selective recompute (their checkpoints take the mask as an input). Controls on the same
  draw show the comparison can fail: without segment_ids, or GPT-2 without its positions reset, it does.
- TP 2 and TP 2 + sequence parallelism (gloo) == TP 1, every gathered gradient.
- segment_ids=None is the old path bit for bit (SDPA called with is_causal=True and no mask, none built).
- SDPAttention and megatron-core's DotProductAttention given the mask == an explicit softmax written here
  (fails on the code before this change: SDPA ignored any mask).
- attention dropout: no token sees another document under dropout either; CUDA's kernel choice with a mask
  (torch's checks faked: no GPU here); one-line refusals.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.harness import run_world
from tests.seeds import fresh_seed

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 2, 32, 4, 256, 24, 3       # VOCAB: unpadded at TP 1 and 2
_COMMON = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
               max_position_embeddings=SEQ, precision="fp32")
ARCHS = {
    "gpt2": {},
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                  ffn_hidden_size=64, untie_embeddings_and_output_weights=True, add_bias_linear=False),
    # DeepSeek-V3's attention in small: q latent, latent norms, YaRN; value head 6 against query/key 8 + 4
    "mla": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, ffn_hidden_size=64,
                untie_embeddings_and_output_weights=True, add_bias_linear=False, qk_layernorm=True,
                multi_latent_attention=True, attention_backend="sdpa", q_lora_rank=16, kv_lora_rank=14,
                qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn", rotary_scaling_factor=4.0,
                yarn_original_max_position_embeddings=8, mscale=0.9, mscale_all_dim=0.8),
}


def draw_segments(gen: torch.Generator, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    """[batch, seq] int64 document ids, non-decreasing, counted from 0 in each row: 2 to 5 documents of
    random lengths per row, rows all different, row 1 with a one-token document."""
    while True:
        rows = []
        for r in range(batch):
            n = int(torch.randint(1, 5, (1,), generator=gen))                 # cuts: 2..5 documents
            cuts = set(torch.randperm(seq - 1, generator=gen)[:n].add(1).tolist())
            if r == 1:
                c = int(torch.randint(1, seq - 1, (1,), generator=gen))
                cuts |= {c, c + 1}                                            # document [c, c+1): one token
            rows.append((torch.arange(seq)[:, None] >= torch.tensor(sorted(cuts))[None, :]).sum(1))
        seg = torch.stack(rows)
        if len({tuple(r.tolist()) for r in seg}) == batch:
            return seg


def documents(seg: torch.Tensor):
    """(row, start, end) of every document."""
    for r in range(seg.size(0)):
        for d in seg[r].unique().tolist():
            idx = (seg[r] == d).nonzero().flatten()
            yield r, int(idx[0]), int(idx[-1]) + 1


def positions(seg: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document (what --reset-position-ids gives)."""
    pos = torch.empty_like(seg)
    for r, a, b in documents(seg):
        pos[r, a:b] = torch.arange(b - a)
    return pos


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element difference over the reference's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _config(arch: str, backend: str, **kw):
    from zo_megatron.model import GPTConfig

    return GPTConfig(**{**_COMMON, "attention_backend": backend, **ARCHS[arch], **kw})


# ------------------------------------------------------------------ packed == each document on its own
def _packed_vs_separate_world(rank, cases, seed):
    """For each (arch, backend, reset positions, recompute): the packed batch with segment_ids, and each
    document on its own through the same float64 model without them."""
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seg = draw_segments(gen)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    loss_mask = (torch.rand(BATCH, SEQ, generator=gen) > 0.2).float()
    n = BATCH * SEQ
    out = {}
    for arch, backend, reset, recompute in cases:
        model = build_gpt_model(_config(arch, backend, recompute=recompute), 0, 1, seed).double()
        pos = positions(seg) if reset else None
        ids = seg.to(torch.int32) if backend == "local" else seg             # both integer dtypes
        logits = model(tokens, pos, ids)
        per_token = F.cross_entropy(logits.reshape(n, -1), labels.reshape(n), reduction="none").view(BATCH, SEQ)
        per_token.mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        with torch.no_grad():
            api_loss = model.loss(tokens, labels, loss_mask, pos, ids).item()      # the positional interface
            unmasked = model(tokens, pos)                                          # controls: no segment_ids,
            unreset = model(tokens, None, ids)                                     # no positions reset
        ref_logits, ref_per_token = torch.empty_like(logits), torch.empty_like(per_token)
        for r, a, b in documents(seg):
            doc_pos = torch.arange(b - a)[None] if reset else None
            lg = model(tokens[r:r + 1, a:b], doc_pos)
            pt = F.cross_entropy(lg[0], labels[r, a:b], reduction="none")
            (pt.sum() / n).backward()
            ref_logits[r, a:b], ref_per_token[r, a:b] = lg[0].detach(), pt.detach()
        kernels = {getattr(layer.self_attention.core_attention, "last_kernel", None)
                   for layer in model.gpt.decoder.layers}
        out[(arch, backend, reset, recompute)] = dict(
            logits=logits.detach(), per_token=per_token.detach(), grads=grads, api_loss=api_loss,
            ref_logits=ref_logits, ref_per_token=ref_per_token, unmasked=unmasked, unreset=unreset,
            ref_grads={name: p.grad.clone() for name, p in model.named_parameters()}, kernels=kernels,
            expected_api_loss=((ref_per_token * loss_mask).sum() / loss_mask.sum()).item())
    return out, seg


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mla"])
def test_packed_documents_equal_separate_runs(arch):
    seed = fresh_seed(f"document attention {arch}")
    backends = ("sdpa",) if arch == "mla" else ("local", "sdpa")
    # GPT-2's learned positions must restart per document; RoPE's are relative: not reset (also reset for Llama)
    resets = (True,) if arch == "gpt2" else (False, True) if arch == "llama" else (False,)
    cases = [(arch, be, reset, None) for be in backends for reset in resets]
    # recompute: the block's checkpoints (full) and the attention core's (selective) take the mask as an input
    cases += [(arch, be, resets[0], rc) for be, rc in zip(backends * 2, ("full", "selective"))]
    out, seg = run_world(_packed_vs_separate_world, 1, cases, seed)[0]
    later = seg > 0                                        # tokens with an earlier document in their row
    for case in cases:
        o = out[case]
        assert o["kernels"] == ({None} if case[1] == "local" else {"flash"}), (case, o["kernels"])
        # float64, but RoPE's (and YaRN's) tables are fp32: the rotation at a packed position rounds otherwise
        # than at the same relative position run alone (~1e-7 of the largest gradient at most; a token that
        # saw another document would be off by 1e-3 and more: the controls below)
        assert _rel(o["logits"], o["ref_logits"]) <= 1e-6, (case, _rel(o["logits"], o["ref_logits"]))
        assert _rel(o["per_token"], o["ref_per_token"]) <= 1e-6, case
        # model.loss computes its cross-entropy in fp32
        assert abs(o["api_loss"] - o["expected_api_loss"]) <= 1e-6 * abs(o["expected_api_loss"]), case
        assert set(o["grads"]) == set(o["ref_grads"]), case
        for name, g in o["ref_grads"].items():
            assert (o["grads"][name] - g).abs().max() <= 1e-6 * g.abs().max() + 1e-13, (case, name)
        # the controls: the same comparison fails where documents see each other or positions run on
        ref_later = o["ref_logits"][later]
        assert _rel(o["unmasked"][later], ref_later) > 1e-3, case
        if arch == "gpt2":
            assert _rel(o["unreset"][later], ref_later) > 1e-3, case
        else:
            assert _rel(o["unreset"], o["ref_logits"]) <= 1e-6, case


# ------------------------------------------------------------------------------ TP 2 (+ SP) == TP 1
TP_CASES = [("gpt2", "local"), ("gpt2", "sdpa"), ("llama", "local"), ("llama", "sdpa"), ("mla", "sdpa")]


def _tp_world(rank, tp, seed):
    from zo_megatron.model import build_gpt_model
    from zo_megatron.model.sharding import gather_full, model_shard_infos
    from zo_megatron.parallel import collectives, init_parallel

    ps = init_parallel(tp, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seg = draw_segments(gen)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = positions(seg)
    out = {}
    for arch, backend in TP_CASES:
        for sp in ((False, True) if tp > 1 else (False,)):
            model = build_gpt_model(_config(arch, backend, sequence_parallel=sp), ps.tp_rank, tp, seed).double()
            infos = model_shard_infos(model, ps.tp_rank, tp, VOCAB)
            logits = model(tokens, pos, seg)
            loss = model.loss(tokens, labels, None, pos, seg)
            loss.backward()
            shards = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(shards, logits.detach().contiguous(), group=ps.tp_group)
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad.clone()
                if getattr(p, "sequence_parallel", False):     # what the optimizers do: sum over TP
                    collectives.all_reduce(g, group=ps.tp_group)
                grads[name] = gather_full(g, infos[name], ps.tp_group, tp)
            out[(arch, backend, sp)] = dict(logits=torch.cat(shards, dim=-1), loss=loss.item(), grads=grads)
    return out if rank == 0 else None


def test_tensor_and_sequence_parallel_equal_tp1():
    seed = fresh_seed("document attention TP")
    one = run_world(_tp_world, 1, 1, seed)[0]
    two = run_world(_tp_world, 2, 2, seed, timeout=300)[0]
    for arch, backend in TP_CASES:
        ref = one[(arch, backend, False)]
        for sp in (False, True):
            o = two[(arch, backend, sp)]
            case = (arch, backend, sp)
            assert _rel(o["logits"], ref["logits"]) <= 1e-9, case
            assert abs(o["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"]), case
            assert set(o["grads"]) == set(ref["grads"]), case
            for name, g in ref["grads"].items():
                # the loss's cross-entropy runs in fp32 (model.loss)
                assert (o["grads"][name] - g).abs().max() <= 1e-6 * g.abs().max() + 1e-12, (case, name)


# ------------------------------------------------------------- segment_ids=None: the old path, bit for bit
def _old_path_world(rank, seed):
    from megatron.core import tensor_parallel

    import zo_megatron.model.gpt as G
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    seg = draw_segments(gen)
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = spy
    out = {}
    for arch in ("gpt2", "llama"):
        for backend in ("local", "sdpa"):
            for precision in ("fp32", "bf16"):
                model = build_gpt_model(_config(arch, backend, precision=precision), 0, 1, seed)
                model.to(model.cfg.dtype)
                build = G.document_attention_mask
                G.document_attention_mask = None        # the None path must not build a document mask
                calls.clear()
                logits = model(tokens)
                loss = model.loss(tokens, labels)
                loss.backward()
                new_grads = [p.grad.clone() for p in model.parameters()]
                G.document_attention_mask = build
                none_calls, cached = list(calls), len(model._mask_cache)
                model.zero_grad()
                # the path before segment_ids existed (GPTModelTP.forward/loss at the parent commit)
                pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
                old_mask = None if backend == "sdpa" else G.causal_attention_mask(SEQ, "cpu")
                old_logits = model.gpt(tokens, pos, old_mask)
                old_loss = tensor_parallel.vocab_parallel_cross_entropy(model.gpt(tokens, pos, old_mask).float(),
                                                                       labels).mean()
                old_loss.backward()
                calls.clear()
                model(tokens, None, seg)
                doc_calls = list(calls)
                out[(arch, backend, precision)] = dict(
                    same_logits=torch.equal(logits, old_logits), same_loss=torch.equal(loss, old_loss),
                    same_grads=all(torch.equal(a, p.grad) for a, p in zip(new_grads, model.parameters())),
                    none_calls=[(m is None, c) for m, c in none_calls], cached=cached,
                    doc_calls=[(None if m is None else (m.dtype, tuple(m.shape), m.data_ptr()), c)
                               for m, c in doc_calls])
    return out


def test_no_segment_ids_is_the_old_path_bit_for_bit():
    seed = fresh_seed("document attention: None path")
    out = run_world(_old_path_world, 1, seed)[0]
    for (arch, backend, precision), o in out.items():
        case = (arch, backend, precision)
        assert o["same_logits"] and o["same_loss"] and o["same_grads"], case
        if backend == "local":
            assert o["none_calls"] == [] and o["doc_calls"] == [], case
            continue
        assert o["cached"] == 0, case                            # SDPA builds no causal mask either
        assert o["none_calls"] == [(True, True)] * (2 * LAYERS), case     # forward and loss: is_causal, no mask
        # with segment_ids: one additive [b, 1, s, s] mask in the model's dtype, the same tensor in every layer
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        assert len(o["doc_calls"]) == LAYERS and len({m for m, _ in o["doc_calls"]}) == 1, case
        (mask_dtype, shape, _), causal = o["doc_calls"][0]
        assert mask_dtype == dtype and shape == (BATCH, 1, SEQ, SEQ) and causal is False, case


# ----------------------------------------------------- the core attentions given the mask, against softmax
def _reference_attention(q, k, v, seg, scale):
    """q [s, b, n, d], k/v [s, b, g, d] -> [s, b, n * d_v]: an explicit softmax over each token's earlier
    tokens of its own document (float64)."""
    s, b, n, _ = q.shape
    rep = n // k.size(2)
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) * scale
    i = torch.arange(s)
    allowed = (seg[:, None, :, None] == seg[:, None, None, :]) & (i[None, :] <= i[:, None])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("bnij,jbnd->ibnd", probs, v).reshape(s, b, -1)


def _core_world(rank, seed):
    import zo_megatron.model.gpt as G
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seg = draw_segments(gen, batch=2, seq=SEQ)
    results = []
    for arch, backend in (("gpt2", "local"), ("llama", "local"), ("gpt2", "sdpa"), ("llama", "sdpa"),
                          ("mla", "sdpa")):
        model = build_gpt_model(_config(arch, backend), 0, 1, seed).double()
        core = model.gpt.decoder.layers[0].self_attention.core_attention
        n, g = core.num_attention_heads_per_partition, getattr(core, "num_query_groups_per_partition", None)
        g = g or n
        d_qk = core.hidden_size_per_attention_head
        d_v = core.hidden_size_per_partition // n
        q = torch.randn(SEQ, 2, n, d_qk, generator=gen, dtype=torch.float64)
        k = torch.randn(SEQ, 2, g, d_qk, generator=gen, dtype=torch.float64)
        v = torch.randn(SEQ, 2, g, d_v, generator=gen, dtype=torch.float64)
        # 1/sqrt(d), except under YaRN, whose mscale scales the softmax (MLA passes it to its core)
        scale = 1.0 / d_qk ** 0.5 if arch != "mla" else core.softmax_scale
        ref = _reference_attention(q, k, v, seg, scale)
        masks = {"model's": G.document_attention_mask(seg, backend, torch.float64)}
        if backend == "sdpa":     # megatron's bool convention (True = masked), converted by SDPAttention
            masks["bool"] = G.document_attention_mask(seg, "local", torch.float64)
        for kind, mask in masks.items():
            out = core(q, k, v, mask)
            results.append((arch, backend, kind, _rel(out, ref)))
    return results


def test_core_attention_takes_the_document_mask():
    """Fails before this change: SDPAttention ignored the mask and ran is_causal=True."""
    seed = fresh_seed("document attention: core modules")
    for arch, backend, kind, err in run_world(_core_world, 1, seed)[0]:
        assert err <= 1e-12, (arch, backend, kind, err)


# ----------------------------------------------------------------------------------- attention dropout
def _dropout_world(rank, seed):
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel
    from zo_megatron.parallel.state import set_seed

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seg = draw_segments(gen)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    other = tokens.clone()
    first = seg[0] == 0                                   # row 0's first document gets new tokens
    other[0, first] = torch.randint(0, VOCAB, (int(first.sum()),), generator=gen)
    out = {}
    for arch, backend in (("gpt2", "local"), ("gpt2", "sdpa"), ("llama", "sdpa")):
        model = build_gpt_model(_config(arch, backend, attention_dropout=0.3), 0, 1, seed).double()
        pos = positions(seg)
        runs, core = {}, model.gpt.decoder.layers[0].self_attention.core_attention
        for name, toks, train in (("a", tokens, True), ("b", other, True), ("eval", tokens, False)):
            model.train(train)
            set_seed(seed)
            runs[name] = model(toks, pos, seg).detach()
            if name == "a":
                kernel = getattr(core, "last_kernel", None)
        out[(arch, backend)] = dict(runs=runs, kernel=kernel)
    return out, seg


def test_no_token_sees_another_document_under_attention_dropout():
    seed = fresh_seed("document attention: dropout")
    out, seg = run_world(_dropout_world, 1, seed)[0]
    rest = torch.ones_like(seg, dtype=torch.bool)
    rest[0] = seg[0] != 0                                 # every token outside the changed document
    for case, o in out.items():
        a, b, ev = o["runs"]["a"], o["runs"]["b"], o["runs"]["eval"]
        assert _rel(a[~rest], b[~rest]) > 1e-3, case      # the change reaches its own document
        assert _rel(b[rest], a[rest]) <= 1e-12, case      # and no other
        assert _rel(a, ev) > 1e-3, case                   # dropout was applied
        assert o["kernel"] == ("math" if case[1] == "sdpa" else None), case   # torch's CPU kernel has no dropout


# ------------------------------------------------------------------------ CUDA's kernel choice, faked
class _FakeParams:
    def __init__(self, query, key, value, attn_mask, dropout, is_causal, enable_gqa=False):
        self.attn_mask, self.is_causal, self.enable_gqa, self.heads = attn_mask, is_causal, enable_gqa, key.size(1)


def test_cuda_choice_asks_torch_with_the_mask(monkeypatch):
    """torch's own checks decide (no GPU here: faked with torch's rules -- flash takes no mask, the
    memory-efficient kernel takes one but no GQA); what is checked is that they are asked with the mask
    SDPA will get and is_causal=False, and that a refusal is one line."""
    from torch.backends import cuda as cuda_backends

    from zo_megatron.errors import ConfigError
    from zo_megatron.model.attention import _cuda_sdpa_choice

    asked = []
    efficient_takes_masks = [True]

    def can_flash(p):
        asked.append(("flash", p.attn_mask is not None, p.is_causal, p.enable_gqa))
        return p.attn_mask is None

    def can_efficient(p):
        asked.append(("efficient", p.attn_mask is not None, p.is_causal, p.enable_gqa))
        return not p.enable_gqa and (p.attn_mask is None or efficient_takes_masks[0])

    monkeypatch.setattr(cuda_backends, "SDPAParams", _FakeParams)
    monkeypatch.setattr(cuda_backends, "can_use_flash_attention", can_flash)
    monkeypatch.setattr(cuda_backends, "can_use_efficient_attention", can_efficient)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a faked GPU")
    q = torch.empty(2, 4, 16, 8, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 2, 16, 8, device="meta", dtype=torch.bfloat16)
    mask = torch.empty(2, 1, 16, 16, device="meta", dtype=torch.bfloat16)
    assert _cuda_sdpa_choice(q, kv, kv, 0.0, True, None) == ("flash", True)
    assert asked == [("flash", False, True, True)]
    asked.clear()
    assert _cuda_sdpa_choice(q, kv, kv, 0.0, True, mask) == ("efficient", False)      # k/v repeated for it
    assert asked == [("flash", True, False, True), ("flash", True, False, False), ("efficient", True, False, False)]
    efficient_takes_masks[0] = False
    with pytest.raises(ConfigError, match="per-document attention.*use --attention-backend local") as e:
        _cuda_sdpa_choice(q, kv, kv, 0.0, True, mask)
    assert "\n" not in str(e.value)


def test_bad_segment_ids_are_refused_in_one_line():
    seed = fresh_seed("document attention: refusals")
    for message in run_world(_refusal_world, 1, seed)[0]:
        assert message.startswith("segment_ids must be") and "\n" not in message, message


def _refusal_world(rank, seed):
    from zo_megatron.errors import ConfigError
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    model = build_gpt_model(_config("gpt2", "sdpa"), 0, 1, seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    messages = []
    for bad in (torch.zeros(BATCH, SEQ), torch.zeros(BATCH, SEQ - 1, dtype=torch.long),
                torch.zeros(SEQ, dtype=torch.long)):
        try:
            model(tokens, None, bad)
        except ConfigError as e:
            messages.append(str(e))
        else:
            messages.append(f"accepted {bad.dtype} {list(bad.shape)}")
    return messages


# ------------------------------------------------------------------------------------------ the planner
def _activations(p) -> int:
    return sum(v for k, v in p.device_items.items() if k.startswith(("activations", "logits")))


def test_the_planner_counts_one_mask_per_micro_batch():
    """One [b, 1, s, s] mask: 1 byte per element (local), w (SDPA's additive mask), live in every phase where
    something keeps it for backward; SDPA's CPU math path keeps it only when recompute takes it as an input.
    (What the layers really keep is measured in tests/test_planner_validation.py's -docmask cases.)"""
    from zo_megatron import planner as P
    from zo_megatron.planner.layer_activations import _attention_saved, attention_mask_bytes

    gen = torch.Generator().manual_seed(fresh_seed("document attention: planner"))
    s, b = int(torch.randint(16, 1024, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
    shape = dict(num_layers=3, hidden_size=256, num_attention_heads=8, seq_length=s, micro_batch_size=b,
                 vocab_size=1024, dropout=False, fused_softmax=False, device_overhead_bytes=0)
    for backend, precision, per in (("local", "bf16", 1), ("sdpa", "bf16", 2), ("sdpa", "fp32", 4),
                                    ("local", "fp32", 1)):
        for host in (True, False):
            off = P.PlanInput(**shape, attention_backend=backend, precision=precision, device_is_host=host)
            on = off.replace(document_attention_mask=True)
            # (CUDA's SDPA mask: rows padded to a multiple of 8 elements, model/masks.padded_mask)
            mask = per * b * s * (s if backend == "local" or host else -(-s // 8) * 8)
            assert attention_mask_bytes(on) == (mask, True) and attention_mask_bytes(off) == (0, False)
            p_on, p_off = P.plan(on), P.plan(off)
            assert p_on.device_items["activations_attention_mask"] == mask
            assert "activations_attention_mask" not in p_off.device_items
            if backend == "local" or host:       # (a GPU's SDPA with a mask runs another kernel: below)
                assert _activations(p_on) - _activations(p_off) == mask, (backend, precision, host)
    # SDPA's CPU math path (attention dropout) adds the mask to its scores without keeping it ...
    math = P.PlanInput(**{**shape, "dropout": True}, attention_backend="sdpa", precision="bf16", device_is_host=True,
                       document_attention_mask=True)
    assert attention_mask_bytes(math) == (2 * b * s * s, False)
    assert _activations(P.plan(math)) == _activations(P.plan(math.replace(document_attention_mask=False)))
    # ... unless a recompute checkpoint takes it as an input
    for recompute in (dict(recompute="full"), dict(recompute="selective", recompute_modules=("core_attn",))):
        assert attention_mask_bytes(math.replace(**recompute)) == (2 * b * s * s, True), recompute
    assert attention_mask_bytes(math.replace(recompute="selective", recompute_modules=("mlp",)))[1] is False
    # on a GPU CUDA's flash kernel takes no mask: the memory-efficient one runs, with GQA's k/v repeated (rope:
    # new q, k, v of a heads each) instead of grouped (new q and k of a and G heads, the fused qkv kept)
    a, g, d, w = 8, 2, 32, 2
    gqa = P.PlanInput(**shape, attention_backend="sdpa", precision="bf16", num_query_groups=g,
                      position_embedding_type="rope")
    assert _attention_saved(gqa) == w * d * (a + g + (a + 2 * g))
    assert _attention_saved(gqa.replace(document_attention_mask=True)) == w * d * 3 * a
    assert _attention_saved(gqa.replace(document_attention_mask=True, device_is_host=True)) == _attention_saved(
        gqa.replace(device_is_host=True))


def test_the_jobs_flags_plan_the_mask():
    """plan_input_from_flags: --reset-attention-mask or --sft (read with getattr: a namespace without them
    plans no mask)."""
    import argparse

    from zo_megatron.planner import plan_input_from_flags
    from zo_megatron.training.arguments import parse_args

    args = vars(parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "32", "--lr", "1e-3", "--train-iters", "5"]))
    for flags, expected in ((dict(reset_attention_mask=True, sft=False), True),
                            (dict(reset_attention_mask=False, sft=True), True),
                            (dict(reset_attention_mask=False, sft=False), False)):
        ns = argparse.Namespace(**{**args, **flags})
        assert plan_input_from_flags(ns, data_parallel=1, vocab_size=1000).document_attention_mask is expected, flags
    bare = argparse.Namespace(**{k: v for k, v in args.items() if k not in ("reset_attention_mask", "sft")})
    assert plan_input_from_flags(bare, data_parallel=1, vocab_size=1000).document_attention_mask is False
