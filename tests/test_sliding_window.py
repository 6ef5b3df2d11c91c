"""Sliding-window attention: Megatron-LM's --window-size L,0 and --window-attn-skip-freq on torch SDPA.

What the flags mean is megatron-core's (planner/window.py quotes the source): query i attends key j iff
i - L <= j <= i; --window-attn-skip-freq N makes layers N, 2N, ... (1-indexed) full attention, a list says it
per layer (1 = window). Each draw is a fresh seed, printed (tests/seeds.py); every element is compared.

- the rules against megatron-core's own functions and transformers' mask (independent implementations);
- Hugging Face Mistral (sliding_window 8, every layer) and Qwen2 (layer_types: some layers) converted by
  from-hf == transformers' forward at seq 40 (logits, loss, every gradient, float64), at TP 1, TP 2 and TP 2
  + sequence parallelism; a control without the window differs;
- skip-freq models, with and without per-document segment_ids == the model with every core attention
  replaced by an explicit float64 softmax written here, whose mask follows the rule above;
- full and selective (core_attn) recompute bit for bit == no recompute (TP 1; TP 2 + SP in the HF world); one
  mask storage per forward, [rows, distinct masks, s, s], shared by the layers;
- no window, a window that does not bind, and full-attention layers without documents: SDPA is_causal, no mask;
- the flags' one-line refusals, the banner's attention line, the planner's mask bytes, checkpoints (job flags,
  to-hf, Megatron-LM's args, an older from-hf record).
"""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, GROUPS, FFN, VOCAB, POS, SEQ, BATCH, WINDOW = 32, 4, 2, 48, 256, 64, 40, 2, 8


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def quiet(_line):
    pass


# ------------------------------------------------------------------------------ the rules themselves
def _megatron_mask(sq, window, monkeypatch):
    """megatron-core's get_sliding_window_causal_mask (True = masked), whose torch.ones(device="cuda") is run
    on the CPU here."""
    from megatron.core.transformer import utils

    ones = torch.ones
    monkeypatch.setattr(utils.torch, "ones", lambda *a, device=None, **k: ones(*a, **k))
    try:
        return utils.get_sliding_window_causal_mask(sq, sq, window)
    finally:
        monkeypatch.setattr(utils.torch, "ones", ones)


def test_the_rules_are_megatron_cores_and_transformers(monkeypatch):
    """Our mask (model/masks.py) == megatron-core's get_sliding_window_causal_mask for (L, 0), and == transformers'
    sliding-window causal mask for W = L + 1 (from-hf's mapping); our layer rule == is_layer_window_attention
    for None, N and list values; the flag's text as Megatron-LM's tuple_type reads it."""
    from megatron.core.transformer.utils import is_layer_window_attention
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    from zo_megatron.model.masks import window_attention_mask
    from zo_megatron.planner.window import (from_hf_window, hf_window, is_window_layer, normalize_window_size,
                                            parse_window_size)

    gen = torch.Generator().manual_seed(fresh_seed("window rules"))
    for _ in range(6):
        s = int(torch.randint(2, 48, (1,), generator=gen))
        left = int(torch.randint(0, s + 2, (1,), generator=gen))
        ours = torch.isinf(window_attention_mask(s, left, 1, torch.float32, "cpu")[0, 0])
        assert torch.equal(ours, _megatron_mask(s, (left, 0), monkeypatch)), (s, left)
        size, _ = from_hf_window(left + 1, range(3), 3)
        assert size == [left, 0]
        hf = and_masks(sliding_window_overlay(left + 1), causal_mask_function)
        i = torch.arange(s)
        allowed = hf(torch.tensor(0), torch.tensor(0), i[:, None], i[None, :])
        assert torch.equal(~ours, allowed), (s, left)
    layers = 8
    for freq in (None, 1, 2, 3, 8, [1, 0, 1, 1, 0, 0, 1, 0]):
        for n in range(1, layers + 1):
            assert is_window_layer((4, 0), freq, n) == is_layer_window_attention((4, 0), freq, n), (freq, n)
        assert is_window_layer(None, freq, 1) == is_layer_window_attention(None, freq, 1) is False
    assert parse_window_size("(7,0)") == parse_window_size("7,0") == [7, 0]
    assert parse_window_size("-1,-1") is None and normalize_window_size((-1, 0)) is None
    assert hf_window([7, 0], [0, 1, 1], 3) == {"tokens": 8, "layers": [1, 2]} and hf_window([7, 0], 1, 3) is None


# ------------------------------------------------------- Hugging Face models through from-hf == transformers
def _hf_world(rank, tp, cks, tokens, labels):
    """Each checkpoint's model (float64; at TP > 1 also with sequence parallelism and, SP, with full recompute):
    gathered logits, the float64 cross-entropy and every gathered gradient; at TP 1 also the model without its
    window (the control)."""
    from megatron.core import tensor_parallel

    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.config import ARCH_FIELDS
    from zo_megatron.model.sharding import gather_full, load_full_params, model_shard_infos
    from zo_megatron.parallel import collectives, init_parallel

    ps = init_parallel(tp, seed=1)
    out = {}
    variants = {"plain": {}, "sp": dict(sequence_parallel=True),
                "sp-recompute": dict(sequence_parallel=True, recompute="full")} if tp > 1 else \
        {"plain": {}, "no-window": dict(window_size=None, window_attn_skip_freq=None)}
    for name, ck in cks.items():
        reader = CheckpointReader(ck)
        meta, weights = reader.model_meta, reader.read_weights()
        for variant, kw in variants.items():
            cfg = GPTConfig(**{**{k: meta[k] for k in ARCH_FIELDS}, **kw}, precision="fp32", attention_backend="sdpa")
            model = build_gpt_model(cfg, ps.tp_rank, tp, 1)
            load_full_params(model, weights, ps.tp_rank, tp, cfg.vocab_size)
            model.double()
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(tokens))[..., :cfg.vocab_size]
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1))
            loss.backward()
            infos = model_shard_infos(model, ps.tp_rank, tp, cfg.vocab_size)
            grads = {}
            for n, p in model.named_parameters():
                g = p.grad.clone()
                if getattr(p, "sequence_parallel", False):      # what the optimizers do: sum over TP
                    collectives.all_reduce(g, group=ps.tp_group)
                grads[n] = gather_full(g, infos[n], ps.tp_group, tp)
            out[(name, variant)] = dict(logits=logits.detach(), loss=loss.detach(), grads=grads)
    return out if rank == 0 else None


def _hf_reference(directory, tokens, labels, meta):
    """transformers' forward in float64 (its SDPA attention: a float64 softmax; eager's runs in fp32; its RMSNorm
    and rotary tables compute in fp32 whatever the dtype) and every gradient, under our names (from-hf's mapping
    of the names, on the gradients)."""
    from zo_megatron.checkpoint.hf.llama import from_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float64,
                                                              attn_implementation="sdpa")
    logits = model(tokens).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    loss.backward()
    grads = from_hf({n: p.grad for n, p in model.named_parameters()}, meta)
    if "gpt.output_layer.weight" not in grads and meta["untie_embeddings_and_output_weights"]:
        grads["gpt.output_layer.weight"] = model.lm_head.weight.grad
    return logits.detach(), loss.detach(), grads


def test_mistral_and_qwen2_windows_equal_transformers(tmp_path):
    """Mistral's sliding_window on every layer and Qwen2's on the layers layer_types names, converted by from-hf
    (window_size W-1,0; Qwen2's as the list form) == transformers at 40 tokens with a window of 8: logits, loss,
    every gradient, float64 models (to 1e-6 / 2e-6: transformers' norms and rotary tables are fp32; measured
    ~1e-7), at TP 1, 2 and 2 + SP (+ full recompute: bit for bit the same as without). On the code before (the
    window recorded beside the model, full attention here) the logits were off, as the control without the
    window still is (~3e-2)."""
    from tests.test_convert_llama import make_hf_model
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("sliding window vs transformers")
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                  num_key_value_heads=GROUPS, max_position_embeddings=POS, rms_norm_eps=1e-5, bos_token_id=0,
                  eos_token_id=1, attention_dropout=0.0, tie_word_embeddings=False)
    configs = {"mistral": transformers.MistralConfig(**common, num_hidden_layers=2, sliding_window=WINDOW),
               "qwen2": transformers.Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True,
                                                 sliding_window=WINDOW, layer_types=[
                                                     "sliding_attention", "full_attention", "sliding_attention"])}
    cks, metas = {}, {}
    for i, (name, cfg) in enumerate(configs.items()):
        src = make_hf_model(tmp_path / name, cfg, seed + i, tokenizer=False)
        cks[name] = str(tmp_path / f"{name}_ck")
        convert.from_hf(src, cks[name], tensor_parallel=1, log=quiet)
        metas[name] = CheckpointReader(cks[name]).model_meta
    assert (metas["mistral"]["window_size"], metas["mistral"]["window_attn_skip_freq"]) == ([WINDOW - 1, 0], None)
    assert (metas["qwen2"]["window_size"], metas["qwen2"]["window_attn_skip_freq"]) == ([WINDOW - 1, 0], [1, 0, 1])
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    one = run_world(_hf_world, 1, 1, cks, tokens, labels, timeout=240)[0]
    two = run_world(_hf_world, 2, 2, cks, tokens, labels, timeout=300)[0]
    for name in cks:
        logits, loss, grads = _hf_reference(str(tmp_path / name), tokens, labels, metas[name])
        assert _rel(one[(name, "no-window")]["logits"], logits) > 1e-3, name       # the window matters here
        for case, o in ((("tp1",), one[(name, "plain")]), (("tp2",), two[(name, "plain")]),
                        (("tp2", "sp"), two[(name, "sp")])):
            # (transformers computes RMSNorm and its rotary tables in fp32 whatever the dtype: ~1e-7 apart)
            assert _rel(o["logits"], logits) <= 1e-6, (name, case, _rel(o["logits"], logits))
            assert abs(o["loss"] - loss) <= 1e-6 * loss, (name, case)
            assert set(o["grads"]) == set(grads), (name, case, set(o["grads"]) ^ set(grads))
            for n, g in grads.items():
                assert _rel(o["grads"][n], g) <= 2e-6, (name, case, n, _rel(o["grads"][n], g))
        plain, recomputed = two[(name, "sp")], two[(name, "sp-recompute")]
        assert torch.equal(plain["logits"], recomputed["logits"]) and torch.equal(plain["loss"], recomputed["loss"])
        assert all(torch.equal(g, recomputed["grads"][n]) for n, g in plain["grads"].items()), name


# ------------------------------------------------ skip-freq and documents against an explicit float64 softmax
LAYERS = 4
ARCHS = {"gpt2": {},
         "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
                       ffn_hidden_size=64, untie_embeddings_and_output_weights=True, add_bias_linear=False)}
SKIP_FREQS = (None, 2, [0, 1, 1, 0])


def _window_by_rule(freq, layer_number: int) -> bool:
    """Which layers slide, as megatron-core's is_layer_window_attention reads --window-attn-skip-freq (written
    here again: 1-indexed layers; N: every N-th attends fully; a list: 1 slides)."""
    if freq is None:
        return True
    if isinstance(freq, int):
        return layer_number % freq != 0
    return freq[layer_number - 1] == 1


def _reference_core(module, segments, left, freq):
    """A forward for SDPAttention `module`: softmax(q k^T * scale + mask) v in float64 over the keys j of query
    i with j <= i, i - j <= left where the rule makes the layer a window layer, and the same segment."""
    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        s, b, n, d = query.shape
        rep = n // key.size(2)
        k, v = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
        scores = torch.einsum("ibnd,jbnd->bnij", query, k).double() * module.softmax_scale
        i = torch.arange(s)
        allowed = (i[None, :] <= i[:, None])[None, None].expand(b, 1, s, s)
        if _window_by_rule(freq, module.layer_number):
            allowed = allowed & (i[:, None] - i[None, :] <= left)
        if segments is not None:
            allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("bnij,jbnd->ibnd", probs, v.double()).to(query.dtype).reshape(s, b, n * d)
    return forward


def _segments(gen, batch, seq):
    cuts = torch.sort(torch.randint(1, seq, (batch, 3), generator=gen), dim=1).values
    return (torch.arange(seq)[None, :, None] >= cuts[:, None, :]).sum(-1)


def _model(arch, freq, seed, **kw):
    from zo_megatron.model import GPTConfig, build_gpt_model

    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                    max_position_embeddings=POS, precision="fp32", attention_backend="sdpa",
                    **{"window_size": (WINDOW - 1, 0), "window_attn_skip_freq": freq, **ARCHS[arch], **kw})
    return build_gpt_model(cfg, 0, 1, seed)


def _run(model, tokens, labels, segments):
    logits = model(tokens, None, segments)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach(), loss.detach(), grads


def _reference_world(rank, seed):
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    segments = _segments(gen, BATCH, SEQ)
    out = {}
    for arch in ARCHS:
        for freq in SKIP_FREQS:
            for seg in (None, segments):
                model = _model(arch, freq, seed).double()
                ours = _run(model, tokens, labels, seg)
                for layer in model.gpt.decoder.layers:
                    core = layer.self_attention.core_attention
                    core.forward = _reference_core(core, seg, WINDOW - 1, freq)
                ref = _run(model, tokens, labels, seg)
                full = _model(arch, freq, seed, window_size=None, window_attn_skip_freq=None).double()
                control = full(tokens, None, seg).detach()
                out[(arch, str(freq), seg is not None)] = dict(ours=ours, ref=ref, control=control)
    return out


def test_skip_freq_and_documents_equal_an_explicit_softmax():
    """Every (GPT-2, Llama with GQA) x (skip freq None, 2, [0,1,1,0]) x (segment_ids or not): logits, loss and
    every gradient == the same model with each core attention an explicit float64 softmax under the rule's
    mask (layers N, 2N, ... full; the list's 1s slide; causal, i - j <= L, same document)."""
    seed = fresh_seed("sliding window vs explicit softmax")
    out = run_world(_reference_world, 1, seed, timeout=240)[0]
    for case, o in out.items():
        (logits, loss, grads), (r_logits, r_loss, r_grads) = o["ours"], o["ref"]
        assert _rel(logits, r_logits) <= 1e-12, case
        assert abs(loss - r_loss) <= 1e-12 * r_loss, case
        for n, g in r_grads.items():
            assert _rel(grads[n], g) <= 1e-10, (case, n, _rel(grads[n], g))
        assert _rel(o["control"], r_logits) > 1e-3, case          # the window changes these logits


# ------------------------------------------------------------------ recompute, and one mask per forward
class _Saved:
    """Storages of the s x s tensors saved for backward (the mask: its views share one storage)."""

    def __init__(self, seq):
        self.seq, self.storages = seq, {}

    def pack(self, t):
        if t.dim() == 4 and tuple(t.shape[-2:]) == (self.seq, self.seq):
            st = t.untyped_storage()
            self.storages[st.data_ptr()] = st.nbytes()
        return t


def _recompute_world(rank, seed):
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    segments = _segments(gen, BATCH, SEQ)
    recomputes = {"none": {}, "full": dict(recompute="full"),
                  "selective": dict(recompute="selective", recompute_modules=("core_attn",))}
    out = {}
    for freq in (None, 2):
        for seg in (None, segments):
            for name, kw in recomputes.items():
                saved = _Saved(SEQ)
                model = _model("llama", freq, seed, **kw)
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                    result = _run(model, tokens, labels, seg)
                out[(str(freq), seg is not None, name)] = dict(result=result, storages=sorted(saved.storages.values()))
    return out


def test_recompute_is_bit_for_bit_and_one_mask_is_kept():
    """Full and selective (core_attn) recompute == no recompute, bit for bit (logits, loss, every gradient): the
    checkpoints take the one mask as an input. What backward keeps of s x s: one storage, [rows, C, s, s] fp32
    (rows b with documents, else 1; C 2 with documents and full-attention layers, else 1)."""
    seed = fresh_seed("sliding window recompute")
    out = run_world(_recompute_world, 1, seed, timeout=240)[0]
    for freq in ("None", "2"):
        for docs in (False, True):
            base = out[(freq, docs, "none")]
            channels = 2 if docs and freq == "2" else 1
            expected = [4 * (BATCH if docs else 1) * channels * SEQ * SEQ]
            for name in ("none", "full", "selective"):
                o = out[(freq, docs, name)]
                case = (freq, docs, name)
                assert o["storages"] == expected, (case, o["storages"], expected)
                (logits, loss, grads), (b_logits, b_loss, b_grads) = o["result"], base["result"]
                assert torch.equal(logits, b_logits) and torch.equal(loss, b_loss), case
                assert all(torch.equal(grads[n], g) for n, g in b_grads.items()), case


# ----------------------------------------------------- is_causal where no mask is needed; without a window
def _causal_world(rank, seed):
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    calls, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append(None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.untyped_storage().data_ptr(),
                                                      is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = spy
    out = {}
    with torch.no_grad():
        for name, kw in {"no window": dict(window_size=None, window_attn_skip_freq=None),
                         "window of s - 1": dict(window_size=(SEQ - 1, 0)),
                         "skip freq 2": dict(window_attn_skip_freq=2)}.items():
            calls.clear()
            logits = _model("llama", None, seed, **kw)(tokens)
            out[name] = dict(calls=list(calls), logits=logits)
    return out


def test_without_a_binding_window_sdpa_is_causal_and_unchanged():
    """No window, or one that does not bind (L >= s - 1): every layer is_causal with no mask, logits bit for bit
    the model without a window; skip freq 2 without documents: the full-attention layers is_causal, the window
    layers one [1, 1, s, s] view of one storage."""
    seed = fresh_seed("sliding window: causal path")
    out = run_world(_causal_world, 1, seed, timeout=240)[0]
    assert out["no window"]["calls"] == [None] * LAYERS
    assert out["window of s - 1"]["calls"] == [None] * LAYERS
    assert torch.equal(out["window of s - 1"]["logits"], out["no window"]["logits"])
    calls = out["skip freq 2"]["calls"]
    assert [c is None for c in calls] == [False, True, False, True], calls
    assert {c for c in calls if c is not None} == {((1, 1, SEQ, SEQ), calls[0][1], False)}, calls


# --------------------------------------------------------------------------------------- flags, banner
def _args(*flags):
    from zo_megatron.training.arguments import parse_args

    return parse_args(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "32", "--lr", "1e-3", "--train-iters", "5", *flags])


@pytest.mark.parametrize("flags, words", [
    (["--window-size", "7,0", "--attention-backend", "local"], "add --use-flash-attn"),
    (["--window-size", "7,2", "--use-flash-attn"], "only causal windows are supported"),
    (["--window-size=-3,0", "--use-flash-attn"], "LEFT must be >= 0"),
    (["--window-size", "1,2,3", "--use-flash-attn"], "give LEFT,RIGHT"),
    (["--window-attn-skip-freq", "2", "--use-flash-attn"], "add --window-size"),
    (["--window-size", "7,0", "--window-attn-skip-freq", "0", "--use-flash-attn"], "use N >= 1"),
    (["--window-size", "7,0", "--window-attn-skip-freq", "[1,0]", "--use-flash-attn"], "4 entries"),
])
def test_the_flags_refuse_in_one_line(flags, words):
    from zo_megatron.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _args(*flags)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_a_window_without_a_backend_named_runs_on_sdpa():
    """As under multi-latent attention: megatron-core's local attention cannot run a window, so with no backend
    named the job takes torch SDPA (planner.params.flags_need_sdpa), and the planner plans the same."""
    from types import SimpleNamespace

    from zo_megatron.planner.inputs import _core_attention

    args = _args("--window-size", "7,0")
    assert args.core_attention == "sdpa"
    assert _core_attention(SimpleNamespace(window_size="7,0")) == "sdpa"
    assert _core_attention(SimpleNamespace(window_size="-1,-1")) == "local"      # full attention: no window
    assert _args().core_attention == "local"


def test_the_flags_reach_the_model_and_the_banner(capsys):
    """Megatron-LM's forms ("L,R", "(L,R)", a list expression for the skip freq) reach GPTConfig; -1 is full
    attention; the banner's attention line names the window, its layers, and where it does not bind."""
    from types import SimpleNamespace

    from zo_megatron.model import GPTConfig
    from zo_megatron.training.model_flags import architecture_kwargs
    from zo_megatron.training.user_report import attention_line

    args = _args("--window-size", "(7,0)", "--window-attn-skip-freq", "([1]*3+[0])", "--use-flash-attn")
    assert (args.window_size, args.window_attn_skip_freq) == ([7, 0], [1, 1, 1, 0])
    cfg = GPTConfig(**architecture_kwargs(args), vocab_size=100, attention_backend=args.core_attention)
    assert cfg.window_size == (7, 0) and cfg.window_layers() == [True, True, True, False]
    assert cfg.architecture_name() == "window(7,0, 3 of 4 layers)"
    assert cfg.arch_meta()["window_size"] == [7, 0]
    ps = SimpleNamespace(tp_size=1, device=torch.device("cpu"))
    line = attention_line(cfg, ps, seq_length=32)
    assert "flash attention kernel (cpu), sliding window 7,0 (8 tokens) on 3 of 4 layers (an additive mask)" in line
    assert "does not bind at --seq-length 8" in attention_line(cfg, ps, seq_length=8)
    assert _args("--window-size=-1,-1").window_size is None and _args("--window-size=-1,0").window_size is None


# ------------------------------------------------------------------------------------------- the planner
def test_the_planner_counts_one_mask_per_distinct_mask():
    """One additive mask per micro-batch: [1, 1, s, s] (window), [b, 1, s, s] (window and documents, every layer
    sliding), [b, 2, s, s] (documents with full-attention layers beside); none where the window does not bind;
    the job's flags carry the window; the local attention with a window is refused."""
    import argparse

    from zo_megatron import planner as P
    from zo_megatron.planner import plan_input_from_flags
    from zo_megatron.planner.layer_activations import attention_mask_bytes

    gen = torch.Generator().manual_seed(fresh_seed("sliding window: planner"))
    s, b = int(torch.randint(16, 1024, (1,), generator=gen)), int(torch.randint(2, 5, (1,), generator=gen))
    left = int(torch.randint(0, s - 1, (1,), generator=gen))
    base = P.PlanInput(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=s, micro_batch_size=b,
                       vocab_size=1024, dropout=False, fused_softmax=False, device_overhead_bytes=0,
                       attention_backend="sdpa", precision="bf16", device_is_host=True, window_size=(left, 0))
    for kw, rows, channels in ((dict(), 1, 1), (dict(document_attention_mask=True), b, 1),
                               (dict(window_attn_skip_freq=2), 1, 1),
                               (dict(window_attn_skip_freq=2, document_attention_mask=True), b, 2),
                               (dict(window_attn_skip_freq=[1, 0, 0, 0], document_attention_mask=True), b, 2)):
        inp = base.replace(**kw)
        assert attention_mask_bytes(inp) == (2 * rows * channels * s * s, True), kw
        assert P.plan(inp).device_items["activations_attention_mask"] == 2 * rows * channels * s * s, kw
    assert attention_mask_bytes(base.replace(window_size=(s - 1, 0))) == (0, False)
    assert attention_mask_bytes(base.replace(window_attn_skip_freq=1)) == (0, False)     # no layer slides
    with pytest.raises(ValueError, match="SDPA only"):
        P.plan(base.replace(attention_backend="local"))
    args = vars(_args("--window-size", f"{left},0", "--window-attn-skip-freq", "2", "--use-flash-attn"))
    flags = plan_input_from_flags(argparse.Namespace(**args), data_parallel=1, vocab_size=1000)
    assert (flags.window_size, flags.window_attn_skip_freq) == ([left, 0], 2)


# ------------------------------------------------------------------------------------------- checkpoints
def test_checkpoints_carry_the_window(tmp_path):
    """from-hf's job flags rebuild the model with its window (and --use-checkpoint-args takes it); to-hf writes
    Qwen2's layer_types back and refuses a
    family without windows in one line; Megatron-LM's args carry it both ways; an older from-hf checkpoint's
    "attention_window" record is read into the model."""
    from tests.hf_tokenizer import HF_VOCAB_SIZE
    from tests.test_convert_llama import make_hf_model
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.megatron_args import megatron_args, meta_from_args
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.errors import UserError
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.model_flags import architecture_kwargs

    seed = fresh_seed("sliding window checkpoints")
    cfg = transformers.Qwen2Config(vocab_size=HF_VOCAB_SIZE, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                                   max_position_embeddings=POS, use_sliding_window=True, sliding_window=WINDOW,
                                   max_window_layers=1, tie_word_embeddings=False)
    src = make_hf_model(tmp_path / "hf", cfg, seed)        # with a tokenizer: to-hf writes it back
    ck = str(tmp_path / "ck")
    lines = []
    convert.from_hf(src, ck, tensor_parallel=1, log=lines.append)
    meta = CheckpointReader(ck).model_meta
    assert (meta["window_size"], meta["window_attn_skip_freq"]) == ([WINDOW - 1, 0], [0, 1, 1])
    flags = job_flags(meta)
    assert f"--window-size {WINDOW - 1},0 --window-attn-skip-freq [0,1,1] --use-flash-attn" in flags, flags
    assert any(f"--window-size {WINDOW - 1},0" in ln for ln in lines), lines
    args = parse_args([*flags.split(), "--seq-length", str(SEQ), "--lr", "1e-3", "--train-iters", "1"])
    assert GPTConfig(**architecture_kwargs(args), vocab_size=HF_VOCAB_SIZE, precision="fp32").arch_meta() == meta
    # --use-checkpoint-args takes the window (and agrees with the same one typed)
    run = ["--load", ck, "--use-checkpoint-args", "--use-flash-attn", "--seq-length", str(SEQ), "--lr", "1e-3",
           "--train-iters", "1"]
    for typed in ([], ["--window-size", f"{WINDOW - 1},0", "--window-attn-skip-freq", "[0,1,1]"]):
        taken = parse_args([*run, *typed])
        assert (taken.window_size, taken.window_attn_skip_freq) == ([WINDOW - 1, 0], [0, 1, 1]), typed
    back = str(tmp_path / "back")
    convert.to_hf(ck, back, log=quiet)
    written = json.load(open(os.path.join(back, "config.json")))
    assert written["use_sliding_window"] and written["sliding_window"] == WINDOW and written["max_window_layers"] == 1
    assert written["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(UserError, match="MistralForCausalLM's sliding window limits every layer"):
        convert.to_hf(ck, str(tmp_path / "as_mistral"), architecture="MistralForCausalLM", log=quiet)
    ns = megatron_args(meta, tp=1, iteration=0, divisible_by=128, seq_length=SEQ, precision="fp32")
    assert (ns.window_size, ns.window_attn_skip_freq) == ((WINDOW - 1, 0), [0, 1, 1])
    assert meta_from_args(ns, HF_VOCAB_SIZE, "x") == meta
    # an older from-hf checkpoint: the window recorded beside the model, not in it
    path = os.path.join(ck, "iter_0000000", "checkpoint.json")
    manifest = json.load(open(path))
    for k in ("window_size", "window_attn_skip_freq"):
        manifest["model"].pop(k)
    manifest["attention_window"] = {"tokens": WINDOW, "layers": [1, 2], "architecture": "Qwen2ForCausalLM"}
    json.dump(manifest, open(path, "w"))
    assert CheckpointReader(ck).model_meta == meta
