"""Issue 35, "Hugging Face fidelity" (items 10-13, 15): what transformers does with a config is what
the conversion does, or the conversion refuses in one line.

Tiny random models that transformers builds from configs made here (nothing downloaded); the
reference is transformers' own forward pass (fp32, eager attention), compared element by element
with our model built from the converted checkpoint (its sliding window the model's own, on torch SDPA), at
a sequence length where a sliding window binds (SEQ > WINDOW).
"""
import json
import os

import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed

transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, POS, VOCAB = 32, 4, 2, 48, 2, 64, 97
WINDOW, SEQ = 16, 40


def quiet(_line):
    pass


def common(**over):
    return {**dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POS,
                   rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, attention_dropout=0.0,
                   tie_word_embeddings=False), **over}


def make_hf(directory, cfg, seed: int) -> str:
    """A transformers model of `cfg` with random weights, saved without a tokenizer."""
    from tests.test_convert_llama import make_hf_model

    return make_hf_model(directory, cfg, seed, tokenizer=False)


def edit_config(directory, **changes):
    """config.json of `directory` with `changes` (None deletes a key), as a file of another
    transformers version or hand-edited config would say it."""
    path = os.path.join(directory, "config.json")
    cfg = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(path, "w"))


def hf_logits(directory, tokens) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(tokens).logits


def models_logits(cks: dict, tokens) -> dict:
    """In a rank (TP 1, parallel state set up): our model's logits from each checkpoint `cks` names."""
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.config import ARCH_FIELDS
    from zo_megatron.model.sharding import load_full_params

    out = {}
    for name, ck in cks.items():
        reader = CheckpointReader(ck)
        cfg = GPTConfig(**{k: reader.model_meta[k] for k in ARCH_FIELDS}, precision="fp32")
        model = build_gpt_model(cfg, 0, 1, 1)
        load_full_params(model, reader.read_weights(), 0, 1, cfg.vocab_size)
        with torch.no_grad():
            out[name] = model(tokens).float()[..., :cfg.vocab_size].clone()
    return out


def _our_logits(rank, cks, tokens):
    from zo_megatron.parallel import init_parallel

    init_parallel(1)
    return models_logits(cks, tokens)


def our_logits(ck, tokens):
    """Our model's logits from the checkpoint `ck`, or {name: logits} for a dict of them (one process)."""
    out = run_world(_our_logits, 1, ck if isinstance(ck, dict) else {"": ck}, tokens, timeout=120)[0]
    return out if isinstance(ck, dict) else out[""]


def close(ours, ref):
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def tokens_for(seed, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, seq), generator=g)


# ---------------------------------------------------------------- item 10: layer_types


def test_layer_types_are_read_only_by_the_families_whose_model_reads_them(tmp_path):
    """transformers' Mistral ignores `layer_types` and slides every layer when sliding_window is set;
    Qwen2 reads it. A Mistral config whose layer_types say full attention with a window below
    max_position_embeddings is not a full-attention model (old code: converted as one, logits 1.29
    relative off at seq 40): every layer slides in the converted model (--window-size W-1,0, no skip
    freq); a Qwen2 config with use_sliding_window but only full-attention layer types is one (converted,
    no window, logits equal transformers')."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("layer_types")
    tokens = tokens_for(seed)
    full = ["full_attention"] * LAYERS

    mistral = make_hf(tmp_path / "mistral", transformers.MistralConfig(**common(sliding_window=WINDOW)), seed)
    edit_config(mistral, layer_types=full)
    assert transformers.AutoConfig.from_pretrained(mistral).layer_types == full     # the file says it; Mistral
    convert.from_hf(mistral, str(tmp_path / "mistral_ck"), tensor_parallel=1, log=quiet)   # slides anyway
    meta = CheckpointReader(str(tmp_path / "mistral_ck")).model_meta
    assert (meta["window_size"], meta["window_attn_skip_freq"]) == ([WINDOW - 1, 0], None), meta

    qwen2 = make_hf(tmp_path / "qwen2", transformers.Qwen2Config(**common(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0, layer_types=full)), seed + 1)
    convert.from_hf(qwen2, str(tmp_path / "qwen2_ck"), tensor_parallel=1, log=quiet)
    assert CheckpointReader(str(tmp_path / "qwen2_ck")).model_meta["window_size"] is None
    close(our_logits(str(tmp_path / "qwen2_ck"), tokens), hf_logits(qwen2, tokens))


# ---------------------------------------------------------------- item 12 (c): use_sliding_window


def test_a_qwen2_config_read_as_transformers_4x_reads_it_slides_only_with_use_sliding_window(tmp_path, monkeypatch):
    """transformers 4.x's Qwen2Config keeps sliding_window when use_sliding_window is false (and older
    4.x has no layer_types); its model does not slide then (DeepSeek-R1-Distill-Qwen's config:
    use_sliding_window false, sliding_window 4096). Old code: refused, with the advice to set
    use_sliding_window false, which the config already says. Here the installed transformers'
    config object is made to hold what 4.x's holds."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.hf import FAMILIES
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("qwen2 4.x use_sliding_window")
    qwen2 = make_hf(tmp_path / "qwen2", transformers.Qwen2Config(**common(use_sliding_window=False)), seed)
    edit_config(qwen2, sliding_window=WINDOW, max_window_layers=0, layer_types=None, transformers_version="4.45.0")
    family = FAMILIES["Qwen2ForCausalLM"]
    read = family.read_config

    def as_4x(cfg_json, where):
        cfg = read(cfg_json, where)
        cfg.sliding_window, cfg.layer_types = cfg_json["sliding_window"], None    # 4.x's attributes
        return cfg

    monkeypatch.setattr(family, "read_config", as_4x)
    convert.from_hf(qwen2, str(tmp_path / "ck"), tensor_parallel=1, log=quiet)
    tokens = tokens_for(seed)
    close(our_logits(str(tmp_path / "ck"), tokens), hf_logits(qwen2, tokens))
    assert CheckpointReader(str(tmp_path / "ck")).model_meta["window_size"] is None
    # with use_sliding_window true, 4.x's layers from max_window_layers on slide (the model's window, layer 1)
    edit_config(qwen2, use_sliding_window=True, max_window_layers=1)
    convert.from_hf(qwen2, str(tmp_path / "ck2"), tensor_parallel=1, log=quiet)
    meta = CheckpointReader(str(tmp_path / "ck2")).model_meta
    assert (meta["window_size"], meta["window_attn_skip_freq"]) == ([WINDOW - 1, 0], [0, 1]), meta


# ---------------------------------------------------------------- item 11: from-megatron's allow-list

# a Llama-shaped model as Megatron-LM's args describe it (to-megatron's args: Megatron's names)
MEGATRON_META = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                     vocab_size=VOCAB, max_position_embeddings=POS, position_embedding_type="rope",
                     rotary_base=10000, normalization="RMSNorm", swiglu=True, num_query_groups=GROUPS,
                     untie_embeddings_and_output_weights=True, add_bias_linear=False, layernorm_epsilon=1e-5)


def megatron_checkpoint(directory, seed, vocab=VOCAB, **arg_changes) -> str:
    """A Megatron-LM torch checkpoint (TP 2) of MEGATRON_META with random weights, whose saved args
    have `arg_changes` on top of what a core_v0.16.1 launch of a Llama script records."""
    import signal

    from megatron.core.transformer.enums import AttnBackend

    from zo_megatron.checkpoint import megatron_args, megatron_lm
    from zo_megatron.checkpoint.arch import full_meta, param_shapes

    meta = full_meta({**MEGATRON_META, "vocab_size": vocab})
    g = torch.Generator().manual_seed(seed)
    weights = {k: torch.randn(shape, generator=g) * 0.1 for k, shape in param_shapes(meta).items()}
    ns = megatron_args.megatron_args(meta, tp=2, iteration=7, divisible_by=128, seq_length=POS, precision="bf16")
    # what a real run's args hold besides the model: training, data, parallel layout, kernels, bookkeeping
    vars(ns).update(
        lr=3e-4, min_lr=3e-5, micro_batch_size=1, global_batch_size=8, train_iters=100, data_path=["/data/x_text"],
        save="/ckpt", load="/ckpt", attention_backend=AttnBackend.auto, transformer_impl="transformer_engine",
        sequence_parallel=True, recompute_granularity="selective", masked_softmax_fusion=True,
        apply_rope_fusion=True, world_size=8, rank=0, data_parallel_size=4, params_dtype=torch.bfloat16,
        fp8="hybrid", fp8_recipe="delayed", exit_signal=signal.SIGTERM, attention_dropout=0.0, hidden_dropout=0.0,
        init_method_std=0.008, weight_decay=0.1, clip_grad=1.0, seed=1234, context_parallel_size=2,
        use_distributed_optimizer=True, overlap_grad_reduce=True, tokenizer_type="NullTokenizer",
        norm_epsilon=1e-5, layernorm_zero_centered_gamma=False, softmax_type="vanilla", glu_linear_offset=0.0,
        moe_router_topk=2, kv_lora_rank=512, wandb_project="llama", iteration=7)
    vars(ns).update(arg_changes)
    megatron_lm.write(str(directory), weights, ns)
    return str(directory)


@pytest.mark.parametrize("arg,value", [
    ("qk_l2_norm", True), ("apply_residual_connection_post_layernorm", True), ("rotary_interleaved", True),
    ("no_rope_freq", 4), ("attention_output_gate", True),
    # an arg no Megatron-LM release from-megatron knows, not at a neutral value
    ("some_future_model_option", 3),
])
def test_from_megatron_refuses_every_arg_that_changes_the_model(tmp_path, capsys, arg, value):
    """Megatron-LM args that change what the weights compute and that zo_megatron's GPT does not build
    (the job refuses all of them as flags): one error line naming the arg, exit 2, nothing written.
    Old code (a deny-list of six other args) converted each of these and dropped its effect."""
    from tests.test_convert_llama import _cli

    seed = fresh_seed(f"megatron arg {arg}")
    src = megatron_checkpoint(tmp_path / "megatron", seed, **{arg: value})
    capsys.readouterr()
    rc = _cli().main(["from-megatron", "--input", src, "--output", str(tmp_path / "out"), "--tensor-parallel", "1"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "%" not in ln]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert f"args.{arg}={value!r}" in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("arg", ["layernorm_zero_centered_gamma", "apply_layernorm_1p"])
def test_from_megatron_reads_layernorm_1p(tmp_path, arg):
    """--apply-layernorm-1p (core_v0.16.1 saves it as layernorm_zero_centered_gamma, older releases as
    apply_layernorm_1p) is built now (tests/test_layernorm_1p.py): the checkpoint converts and records it
    (the parametrisation is Megatron's, so the weights convert as they are); old code refused it."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed(f"megatron 1p {arg}")
    src = megatron_checkpoint(tmp_path / "megatron", seed, **{arg: True})
    convert.from_megatron(src, str(tmp_path / "out"), tensor_parallel=1, log=lambda _: None)
    reader = CheckpointReader(str(tmp_path / "out"))
    assert reader.model_meta["layernorm_zero_centered_gamma"] is True
    assert "--apply-layernorm-1p" in convert.job_flags(reader.model_meta)


def test_from_megatron_converts_a_real_run_s_args_and_names_every_bad_one(tmp_path):
    """The args of a real run (training, data, layout, kernels, fp8 recipe, bookkeeping, Megatron's
    enums and signal) convert, the weights exactly; several non-neutral args are named together."""
    from zo_megatron.checkpoint import convert, megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.errors import UserError

    import subprocess
    import sys

    seed = fresh_seed("megatron real args")
    src = megatron_checkpoint(tmp_path / "megatron", seed, some_future_flag=None, another_future_flag=False)
    # the tool in a process of its own (in this one megatron-core's import registered its own safe globals)
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "convert_checkpoint.py")
    r = subprocess.run([sys.executable, tool, "from-megatron", "--input", src, "--output", str(tmp_path / "ck"),
                        "--tensor-parallel", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    full, _, _, _ = megatron_lm.read(src)
    got = CheckpointReader(str(tmp_path / "ck")).read_weights()
    assert set(got) == set(full) and all(torch.equal(got[k], full[k].float()) for k in full)
    bad = megatron_checkpoint(tmp_path / "bad", seed, qk_l2_norm=True, attention_output_gate=True)
    with pytest.raises(UserError) as e:
        convert.from_megatron(bad, str(tmp_path / "ck2"), tensor_parallel=1, log=quiet)
    assert "args.qk_l2_norm=True" in str(e.value) and "args.attention_output_gate=True" in str(e.value)


def test_every_megatron_default_is_neutral():
    """A run that sets no model option converts: every flag of Megatron-LM core_v0.16.1 at its default
    (training/megatron_flag_list.py) passes the allow-list, and each NEUTRAL arg's Megatron default
    is one of its neutral values."""
    import argparse

    from zo_megatron.checkpoint import megatron_allow as M
    from zo_megatron.training.megatron_flag_list import FLAGS

    defaults = {}
    for flag, _group, _takes, default in FLAGS:
        dest = M._DEST_OF.get(flag) or flag[2:].replace("-", "_")
        if dest not in M.READ and not default.startswith("<"):
            defaults.setdefault(dest, M._literal(default))
    assert M.non_neutral(argparse.Namespace(**defaults)) == []
    for name in M.NEUTRAL:
        if name in defaults:
            assert M.non_neutral(argparse.Namespace(**{name: defaults[name]})) == [], name


# ---------------------------------------------------------------- item 12 (a): the vocabulary of a HF tokenizer run


def test_from_megatron_takes_the_vocabulary_from_the_run_s_hugging_face_tokenizer(tmp_path, capsys):
    """Megatron-LM saves no vocab_size without --vocab-size; its HuggingFaceTokenizer's vocabulary is
    len(tokenizer) (Megatron's _HuggingFaceTokenizer.vocab_size), padded to the rows in the files.
    The tokenizer path in the args is read when it is a local directory (old code: refused, 'the
    model's real vocabulary size is unknown', no fix named); else the line names --tokenizer-model
    DIR and --vocab-size N, which both convert."""
    from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
    from tests.test_convert_llama import _cli
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("megatron hf tokenizer vocab")
    tok = make_hf_tokenizer(tmp_path / "tok")
    args = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=tok, vocab_size=None)
    src = megatron_checkpoint(tmp_path / "megatron", seed, vocab=HF_VOCAB_SIZE, **args)
    cli = _cli()
    capsys.readouterr()

    def convert(*extra, out, input=src):
        rc = cli.main(["from-megatron", "--input", input, "--output", str(tmp_path / out), "--tensor-parallel", "2",
                       *extra])
        return rc, "\n".join(ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln)

    rc, err = convert(out="ck")
    assert rc == 0, err
    full = megatron_lm.read(src, vocab_size=HF_VOCAB_SIZE)[0]
    assert full["gpt.embedding.word_embeddings.weight"].shape[0] == HF_VOCAB_SIZE
    reader = CheckpointReader(str(tmp_path / "ck"))
    assert reader.model_meta["vocab_size"] == HF_VOCAB_SIZE and reader.manifest.get("tokenizer_files")
    got = reader.read_weights()
    assert all(torch.equal(got[k], full[k].float()) for k in full)
    # the directory is not here: the line names both fixes; each converts
    moved = str(tmp_path / "tok_moved")
    os.rename(tok, moved)
    rc, err = convert(out="ck_missing")
    assert rc == 2 and err.count("\n") == 0 and "--tokenizer-model DIR" in err and "--vocab-size N" in err, err
    assert tok in err and not os.path.exists(tmp_path / "ck_missing")
    rc, err = convert("--tokenizer-model", moved, out="ck_flag")
    assert rc == 0, err
    assert CheckpointReader(str(tmp_path / "ck_flag")).manifest.get("tokenizer_files")
    rc, err = convert("--vocab-size", str(HF_VOCAB_SIZE), out="ck_vocab")
    assert rc == 0 and CheckpointReader(str(tmp_path / "ck_vocab")).model_meta["vocab_size"] == HF_VOCAB_SIZE, err
    # a vocabulary the rows cannot hold, another tokenizer type, a --vocab-size the args contradict
    rc, err = convert("--vocab-size", "99999", out="ck_big")
    assert rc == 2 and err.startswith("error: ") and "99999" in err and err.count("\n") == 0, err
    other = megatron_checkpoint(tmp_path / "sp", seed, vocab=HF_VOCAB_SIZE, tokenizer_type="SentencePieceTokenizer",
                                tokenizer_model="/nowhere/tokenizer.model", vocab_size=None)
    rc, err = convert(out="ck_sp", input=other)
    assert rc == 2 and "--vocab-size N" in err and err.count("\n") == 0, err
    with_vocab = megatron_checkpoint(tmp_path / "with_vocab", seed, vocab=HF_VOCAB_SIZE,
                                     **{**args, "vocab_size": HF_VOCAB_SIZE})
    rc, err = convert("--vocab-size", "1999", out="ck_wv", input=with_vocab)
    assert rc == 2 and "vocab_size=2000" in err and "--vocab-size 1999" in err and err.count("\n") == 0, err


# ---------------------------------------------------------------- item 13: what to-hf writes besides the weights

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)


def test_to_hf_writes_both_rope_schemas_and_keeps_generation_config_and_eos_lists(tmp_path):
    """Under transformers 5 to-hf wrote only rope_parameters, so a 4.x reader (rope_theta +
    rope_scaling) silently took theta 10000 and no scaling: both schemas are written, and each
    alone reads as the source's rope. The source's generation_config.json (sampling settings, an
    eos list) and config.json's multi-id eos_token_id (Llama-3.x Instruct's) come back through
    from-hf -> to-hf (old code: eos from the tokenizer, one id; a generation config made from it)."""
    from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("to-hf rope schemas and generation config")
    cases = {
        "llama": transformers.LlamaConfig(**common(vocab_size=HF_VOCAB_SIZE, max_position_embeddings=16384,
                                                   eos_token_id=[1, 2], rope_parameters=LLAMA3_ROPE)),
        "qwen2": transformers.Qwen2Config(**common(vocab_size=HF_VOCAB_SIZE, use_sliding_window=False,
                                                   rope_parameters=dict(rope_type="default", rope_theta=1e6))),
    }
    gen = dict(bos_token_id=0, eos_token_id=[1, 2], do_sample=True, temperature=0.6, top_p=0.9)
    for i, (name, cfg) in enumerate(cases.items()):
        src = make_hf(tmp_path / name, cfg, seed + i)
        make_hf_tokenizer(src)
        if name == "llama":
            transformers.GenerationConfig(**gen).save_pretrained(src)
        convert.from_hf(src, str(tmp_path / f"{name}_ck"), tensor_parallel=1, log=quiet)
        back = str(tmp_path / f"{name}_back")
        convert.to_hf(str(tmp_path / f"{name}_ck"), back, log=quiet)
        written = json.load(open(os.path.join(back, "config.json")))
        source = json.load(open(os.path.join(src, "config.json")))
        rope = source["rope_parameters"]
        assert written["rope_parameters"] == rope, name
        assert written.get("rope_theta") == rope["rope_theta"], (name, written.get("rope_theta"))
        scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
        assert "rope_scaling" in written and written["rope_scaling"] == scaling, (name, written.get("rope_scaling"))
        # each schema alone reads as the source's rope (transformers 5 converts the 4.x keys itself)
        for drop in (("rope_theta", "rope_scaling"), ("rope_parameters",)):
            edited = str(tmp_path / f"{name}_without_{drop[0]}")
            os.makedirs(edited)
            json.dump({k: v for k, v in written.items() if k not in drop}, open(os.path.join(edited, "config.json"), "w"))
            assert transformers.AutoConfig.from_pretrained(edited).rope_parameters == \
                transformers.AutoConfig.from_pretrained(src).rope_parameters, (name, drop)
        assert written["eos_token_id"] == source["eos_token_id"] and written["bos_token_id"] == source["bos_token_id"]
        if name == "llama":
            assert written["eos_token_id"] == [1, 2]
            ours = json.load(open(os.path.join(back, "generation_config.json")))
            theirs = json.load(open(os.path.join(src, "generation_config.json")))
            assert {k: v for k, v in ours.items() if k != "transformers_version"} == \
                {k: v for k, v in theirs.items() if k != "transformers_version"}
            g = transformers.GenerationConfig.from_pretrained(back)
            assert g.eos_token_id == [1, 2] and g.do_sample and g.temperature == 0.6 and g.top_p == 0.9


# ---------------------------------------------------------------- item 12 (b): a window that binds

TEXT = ("The state of the Union is strong. We the people of the United States, in order to form a more perfect "
        "union, establish justice and insure domestic tranquility, do ordain this constitution.")


def test_a_mistral_sliding_window_converts_trains_where_it_binds_and_comes_back(tmp_path):
    """Mistral-7B-v0.1 has sliding_window 4096 (every layer). from-hf makes it the model's own window
    (--window-size W-1,0, in the checkpoint's architecture and the printed flags, with --use-flash-attn);
    our logits equal transformers' at a length the window binds (old code: from-hf recorded it beside the
    model and the job refused longer sequences); a job whose flags leave the window out is refused in one
    line naming it (the resume compares it as any architecture field); the job with the printed flags trains
    a document longer than the window (its first loss is transformers'), and its save keeps the window, the
    architecture, the eos list and the generation config, which to-hf writes back."""

    from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
    from tests.test_checkpoint_resume import _run_jobs
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("mistral sliding window")
    cfg = transformers.MistralConfig(**common(vocab_size=HF_VOCAB_SIZE, sliding_window=WINDOW, eos_token_id=[1, 2]))
    src = make_hf(tmp_path / "mistral", cfg, seed)
    make_hf_tokenizer(src)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=[1, 2], temperature=0.7, do_sample=True) \
        .save_pretrained(src)
    ck = str(tmp_path / "ck")
    lines = []
    convert.from_hf(src, ck, tensor_parallel=1, log=lines.append)
    meta = CheckpointReader(ck).model_meta
    assert (meta["window_size"], meta["window_attn_skip_freq"]) == ([WINDOW - 1, 0], None), meta
    assert any(f"sliding window of {WINDOW} tokens" in ln for ln in lines), lines
    close(our_logits(ck, tokens_for(seed)), hf_logits(src, tokens_for(seed)))

    # the job: one document of exactly one sample's length, longer than the window (every sample is it)
    tok_dir = os.path.join(ck, "iter_0000000", "tokenizer")
    from tests.test_vocab_size import one_document_dataset

    prefix, doc = one_document_dataset(tmp_path, tok_dir, TEXT)
    seq = len(doc)
    assert WINDOW < seq <= POS, seq
    (flags,) = [ln.removeprefix("  model flags: ").split() for ln in lines if ln.startswith("  model flags: ")]
    window_flags = ["--window-size", f"{WINDOW - 1},0", "--use-flash-attn"]
    assert " ".join(window_flags) in " ".join(flags), flags
    without = [f for f in flags if f not in window_flags]
    common_argv = ["--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3",
                   "--lr-warmup-iters", "0", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0",
                   "--no-progress-bar", "--split", "100,0,0", "--fp32", "--skip-memory-check", "--seed", str(seed),
                   "--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tok_dir,
                   "--load", ck, "--seq-length", str(seq)]
    log = str(tmp_path / "log.jsonl")
    jobs = [("job", [*without, *common_argv]),
            ("job", [*flags, *common_argv, "--save", str(tmp_path / "out"), "--log-jsonl", log])]
    out = run_world(_run_jobs, 1, jobs, str(tmp_path / "cache"), timeout=400)[0]
    msg = out[0].get("error", "")
    assert "\n" not in msg and f"--window-size: [{WINDOW - 1}, 0] in the checkpoint, None here" in msg, out[0]
    assert out[1].get("rc") == 0, out[1]
    assert f"sliding window {WINDOW - 1},0 ({WINDOW} tokens) on every layer" in out[1]["stdout"], out[1]["stdout"]
    with open(log) as f:
        losses = {r["iteration"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}
    tokens, labels = doc[None, :], torch.cat([doc[1:], doc[:1]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(hf(tokens).logits[0].double(), labels).item()
    assert losses[1] == pytest.approx(ref, rel=1e-5), (losses[1], ref)

    # the trained checkpoint keeps what to-hf writes back
    saved = CheckpointReader(str(tmp_path / "out"))
    assert saved.model_meta["window_size"] == [WINDOW - 1, 0] and saved.manifest["hf_architecture"] == \
        "MistralForCausalLM"
    back = str(tmp_path / "back")
    convert.to_hf(str(tmp_path / "out"), back, log=quiet)
    written = json.load(open(os.path.join(back, "config.json")))
    assert written["architectures"] == ["MistralForCausalLM"] and written["sliding_window"] == WINDOW, written
    assert written["eos_token_id"] == [1, 2]
    assert transformers.GenerationConfig.from_pretrained(back).temperature == 0.7
    model = transformers.AutoModelForCausalLM.from_pretrained(back, local_files_only=True)
    assert type(model).__name__ == "MistralForCausalLM" and model.config.sliding_window == WINDOW
    # a family that cannot express the window is refused
    from zo_megatron.errors import UserError
    with pytest.raises(UserError, match="LlamaForCausalLM has no sliding window"):
        convert.to_hf(ck, str(tmp_path / "as_llama"), architecture="LlamaForCausalLM", log=quiet)


# ---------------------------------------------------------------- item 15: what the docs name is converted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLASS = r"`((?:[A-Z][A-Za-z0-9]*)(?:ForCausalLM|LMHeadModel))`"


def documented_classes() -> dict[str, set]:
    """Every Hugging Face class the docs name as converted: the class column of docs/models.md's
    'Supported architectures' table and docs/checkpoints.md's 'Hugging Face architectures' table,
    the README's from-hf/to-hf sentence and convert_checkpoint.py's docstring."""
    import re

    def read(*path):
        return open(os.path.join(ROOT, *path)).read()

    def section(text, heading):
        start = text.index(heading)
        nxt = re.search(r"\n#{1,3} ", text[start + len(heading):])
        return text[start:start + len(heading) + (nxt.start() if nxt else len(text))]

    def table_column(text, col):
        rows = [ln.split("|")[1:-1] for ln in text.splitlines() if ln.startswith("|") and "---" not in ln]
        return {m for r in rows[1:] for m in re.findall(_CLASS, r[col])}

    readme = read("README.md")
    start = readme.index("`from-hf` / `to-hf` also take")
    sentence = readme[start:readme.index(": the checkpoint", start)]
    tool = read("tools", "convert_checkpoint.py")
    return {
        "docs/models.md": table_column(section(read("docs", "models.md"), "## Supported architectures"), 1),
        "docs/checkpoints.md": table_column(section(read("docs", "checkpoints.md"), "### Hugging Face architectures"),
                                            0),
        "README.md": set(re.findall(_CLASS, sentence)),
        "tools/convert_checkpoint.py": set(re.findall(r"\b([A-Z][A-Za-z0-9]*(?:ForCausalLM|LMHeadModel))\b",
                                                      tool[tool.index("Hugging Face architectures:"):][:200])),
    }


def test_every_architecture_the_docs_name_converts(tmp_path):
    """Each class the docs name as supported is built by transformers from a tiny config and goes
    through from-hf (old docs: Qwen3ForCausalLM in models.md's table, which from-hf refuses)."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.hf import SUPPORTED

    seed = fresh_seed("documented architectures")
    named = documented_classes()
    for where, classes in named.items():
        assert classes, where
    every = set().union(*named.values())
    assert {"GPT2LMHeadModel", "LlamaForCausalLM"} <= every, named
    for i, name in enumerate(sorted(every)):
        config_class = getattr(transformers, name).config_class
        if name == "GPT2LMHeadModel":
            cfg = config_class(vocab_size=VOCAB, n_positions=POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS)
        else:                   # mixtures of experts: few, small experts (their defaults are 8 to 128 large ones)
            fields = config_class().to_dict()
            small = {k: v for k, v in dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=24, shared_expert_intermediate_size=24,
                                           n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                                           kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                           v_head_dim=8).items()
                     if k in fields}
            # multi-latent attention (DeepSeek): a key/value head per head, the latent norms' epsilon 1e-6
            mla = dict(num_key_value_heads=HEADS, rms_norm_eps=1e-6) if "kv_lora_rank" in fields else {}
            cfg = config_class(**common(**mla), **small)
        src = make_hf(tmp_path / name, cfg, seed + i)
        assert json.load(open(os.path.join(src, "config.json")))["architectures"] == [name]
        convert.from_hf(src, str(tmp_path / f"{name}_ck"), tensor_parallel=1, log=quiet)
        assert name in SUPPORTED, name


def _job_checkpoint(directory, seed: int, tokenizer: str, **arch) -> str:
    """A weights-only checkpoint of the architecture `arch` with random weights and no recorded Hugging
    Face architecture, as the job's own runs have (to-hf then picks the class)."""
    from zo_megatron.checkpoint.arch import full_meta, param_shapes
    from zo_megatron.checkpoint.convert import _write_weights_checkpoint

    meta = full_meta(arch)
    g = torch.Generator().manual_seed(seed)
    weights = {k: torch.randn(shape, generator=g) * 0.1 + (1.0 if k.endswith("layernorm.weight") else 0.0)
               for k, shape in param_shapes(meta).items()}
    _write_weights_checkpoint(str(directory), weights, meta, tp=1, converted_from="test", args={}, force=False,
                              log=quiet, tokenizer_from=tokenizer)
    return str(directory)


def test_to_hf_of_a_head_dim_other_than_hidden_over_heads(tmp_path, capsys):
    """--kv-channels makes hidden differ from heads x head dim. to-hf writes it exactly as the class that
    can say so: Llama's head_dim (hidden 96, 8 heads of 16); with hidden 40 not a multiple of 6 heads
    transformers' LlamaConfig refuses the config (old code: a raw StrictDataclassClassValidationError
    with --architecture LlamaForCausalLM), so it is written as MistralForCausalLM, and naming Llama is
    one line naming Mistral. GPT-2 has no head_dim: one line naming why and what writes such a model
    (old code: '--hidden-size ... is not divisible' for to-hf, a flag it does not take)."""
    from tests.hf_tokenizer import HF_VOCAB_SIZE, make_hf_tokenizer
    from tests.test_convert_llama import _cli
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("to-hf head_dim")
    tok = make_hf_tokenizer(tmp_path / "tok")
    llama = dict(num_layers=LAYERS, ffn_hidden_size=FFN, vocab_size=HF_VOCAB_SIZE, max_position_embeddings=POS,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                 untie_embeddings_and_output_weights=True)
    cks = {"LlamaForCausalLM": _job_checkpoint(tmp_path / "h96", seed, tok, **llama, hidden_size=96,
                                               num_attention_heads=8, num_query_groups=4, kv_channels=16),
           "MistralForCausalLM": _job_checkpoint(tmp_path / "h40", seed + 1, tok, **llama, hidden_size=40,
                                                 num_attention_heads=6, num_query_groups=2, kv_channels=8)}
    tokens = tokens_for(seed)
    ours = our_logits(cks, tokens)
    for arch, ck in cks.items():
        for given in (None, arch):
            back = str(tmp_path / f"{arch}_{given}")
            convert.to_hf(ck, back, architecture=given, log=quiet)
            assert json.load(open(os.path.join(back, "config.json")))["architectures"] == [arch]
            close(ours[arch], hf_logits(back, tokens))

    gpt2 = _job_checkpoint(tmp_path / "gpt2", seed + 2, tok, num_layers=LAYERS, hidden_size=48, num_attention_heads=4,
                           kv_channels=16, ffn_hidden_size=FFN, vocab_size=HF_VOCAB_SIZE, max_position_embeddings=POS)
    cli = _cli()
    capsys.readouterr()
    for ck, given, says in ((cks["MistralForCausalLM"], "LlamaForCausalLM",
                             ["LlamaConfig refuses it", "not a multiple", "--architecture MistralForCausalLM"]),
                            (gpt2, None, ["GPT2LMHeadModel has no head_dim", "48 / 4 = 12", "the model's is 16",
                                          "to-megatron and to-fp32"]),
                            (gpt2, "GPT2LMHeadModel", ["GPT2LMHeadModel has no head_dim", "to-megatron and to-fp32"])):
        out = str(tmp_path / "refused")
        rc = cli.main(["to-hf", "--load", ck, "--output", out, *(["--architecture", given] if given else [])])
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert all(s in lines[0] for s in says), lines
        assert not os.path.exists(out)
