"""tools/convert_checkpoint.py for dense Qwen3 (`Qwen3ForCausalLM`), against transformers and megatron-core.

Qwen3 is the Llama decoder plus an RMSNorm over each head's queries and keys before RoPE (q_norm,
k_norm: megatron's --qk-layernorm) and a head_dim of its own. Two small random models that
transformers builds itself (hidden 96, 8 heads, 4 KV groups, FFN 200; every weight random, the
q/k norm gains included), with a tokenizer and a config vocabulary larger than the tokenizer's:
untied with head_dim 20 (not hidden / heads = 12) and tied with head_dim 12.
  - HF -> ours (TP 1, 2) -> HF is bit-exact: every tensor and the config's architecture fields;
  - our model built from the from-hf checkpoint (TP 1 and 2, on 2 ranks) gives transformers' logits;
  - the to-megatron files load strictly into megatron-core's own GPTModel (q/k norms from its
    local spec) on both TP ranks with transformers' logits, and from-megatron gives the weights back
    bit for bit;
  - to-hf of a job's checkpoint with q/k norms writes a Qwen3ForCausalLM; what Qwen3 has and
    megatron-core cannot say (attention_bias: biases on q, k, v and o but not the MLP) and a q/k-norm
    model written as Llama are one line each, exit 2.
(Our model's gradients against transformers' Qwen3 at TP 1/2/4: tests/test_model_llama.py.)
"""
import json
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE
from tests.seeds import fresh_seed
from tests.test_convert_llama import (CONFIG_FIELDS, _cli, _edited_copy, _megatron_core_gpt, _our_config, close,
                                      hf_logits, make_hf_model, quiet)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, POS = 96, 8, 4, 200, 2, 64
VOCAB = HF_VOCAB_SIZE + 37
SEQ = 13
TPS = (1, 2)


def qwen3_configs():
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=POS,
                  rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, attention_dropout=0.0, use_sliding_window=False,
                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    return {"untied_d20": transformers.Qwen3Config(**common, head_dim=20, tie_word_embeddings=False),
            "tied_d12": transformers.Qwen3Config(**common, head_dim=HIDDEN // HEADS, tie_word_embeddings=True)}


def _ranks(rank, d, names, tokens):
    """Per TP: our model from each from-hf checkpoint, and megatron-core's GPTModel from the to-megatron files."""
    from zo_megatron.checkpoint import megatron_lm
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import build_gpt_model
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    def gathered(local, ps):
        full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1) if ps.tp_size > 1 else local
        return full[..., :VOCAB].float().clone()

    out = {}
    for tp in TPS:
        next_port()                                  # chosen now, not when the test started
        ps = init_parallel(tp, num_attention_heads=HEADS, hidden_size=HIDDEN)
        b, s = tokens.shape
        for name in names:
            reader = CheckpointReader(os.path.join(d, f"{name}_ck_tp{tp}"))
            cfg = _our_config(reader.model_meta)
            model = build_gpt_model(cfg, ps.tp_rank, tp, 1)
            load_full_params(model, reader.read_weights(), ps.tp_rank, tp, VOCAB)
            with torch.no_grad():
                out[("ours", name, tp)] = gathered(model(tokens), ps)
            sd = megatron_lm.safe_load(os.path.join(d, f"{name}_megatron_tp{tp}", "release",
                                                    f"mp_rank_{ps.tp_rank:02d}", megatron_lm.FILE))
            assert sd["args"].qk_layernorm and sd["args"].kv_channels == reader.model_meta["kv_channels"]
            mc = _megatron_core_gpt(sd["args"], tp)
            mc.load_state_dict(sd["model"], strict=True)
            mc.eval()
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
            with torch.no_grad():
                out[("megatron-core", name, tp)] = gathered(mc(tokens, torch.arange(s).expand(b, s), mask), ps)
        collectives.barrier()
        destroy_parallel()
    return out


def test_qwen3_converts_both_ways_bit_exact_with_transformers_logits(tmp_path):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader

    seed = fresh_seed("convert qwen3")
    d = tmp_path
    names = list(qwen3_configs())
    for i, (name, cfg) in enumerate(qwen3_configs().items()):
        src = make_hf_model(d / name, cfg, seed + i)
        a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
        assert any(k.endswith("self_attn.q_norm.weight") for k in a) and not any(k.endswith(".bias") for k in a)
        cfg_a = json.load(open(os.path.join(src, "config.json")))
        for tp in TPS:
            ck = str(d / f"{name}_ck_tp{tp}")
            convert.from_hf(src, ck, tensor_parallel=tp, log=quiet)
            meta = CheckpointReader(ck).model_meta
            assert meta["qk_layernorm"] and meta["kv_channels"] == cfg.head_dim and meta["layernorm_epsilon"] == 1e-6
            assert meta["untie_embeddings_and_output_weights"] == (not cfg.tie_word_embeddings)
            assert not meta["add_bias_linear"] and not meta["add_qkv_bias"] and meta["rotary_base"] == 1000000
            back = str(d / f"{name}_back_tp{tp}")
            convert.to_hf(ck, back, log=quiet)
            b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
            assert set(a) == set(b), (name, tp, set(a) ^ set(b))
            for k in a:
                assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), (name, tp, k)
            cfg_b = json.load(open(os.path.join(back, "config.json")))
            for f in CONFIG_FIELDS:
                assert cfg_a.get(f) == cfg_b.get(f), (name, tp, f, cfg_a.get(f), cfg_b.get(f))
            convert.to_megatron(ck, str(d / f"{name}_megatron_tp{tp}"), log=quiet)
            convert.from_megatron(str(d / f"{name}_megatron_tp{tp}"), str(d / f"{name}_from_megatron_tp{tp}"),
                                  tensor_parallel=tp, log=quiet)
            ref, again = CheckpointReader(ck), CheckpointReader(str(d / f"{name}_from_megatron_tp{tp}"))
            assert again.model_meta == ref.model_meta, (name, tp)
            wa, wb = ref.read_weights(), again.read_weights()
            assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa), (name, tp)

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 7))
    world = run_world(_ranks, 2, str(d), names, tokens, timeout=300)
    for name in names:
        ref = hf_logits(str(d / name), tokens)
        for tp in TPS:
            for who in ("ours", "megatron-core"):
                for rank_out in world:
                    close(rank_out[(who, name, tp)], ref)


def test_to_hf_writes_q_k_norm_models_as_qwen3_and_refuses_what_qwen3_or_llama_cannot_say(tmp_path, capsys):
    """A job's checkpoint (no recorded HF architecture) with q/k norms: to-hf picks Qwen3ForCausalLM
    (old code: no family took q/k norms) and transformers' logits are our model's; naming
    LlamaForCausalLM is one line. A Qwen3 config with attention_bias (q, k, v and o biased, the MLP not)
    is refused by from-hf in one line: megatron-core biases all linears or only QKV."""
    from tests.test_hf_fidelity import _job_checkpoint, our_logits
    from tests.hf_tokenizer import make_hf_tokenizer
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("to-hf qwen3")
    tok = make_hf_tokenizer(tmp_path / "tok")
    ck = _job_checkpoint(tmp_path / "job", seed, tok, num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                         num_query_groups=GROUPS, kv_channels=20, ffn_hidden_size=FFN, vocab_size=HF_VOCAB_SIZE,
                         max_position_embeddings=POS, position_embedding_type="rope", rotary_base=1000000,
                         normalization="RMSNorm", swiglu=True, add_bias_linear=False, qk_layernorm=True,
                         layernorm_epsilon=1e-6, untie_embeddings_and_output_weights=True)
    back = str(tmp_path / "back")
    convert.to_hf(ck, back, log=quiet)
    cfg = json.load(open(os.path.join(back, "config.json")))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 20 and cfg["rms_norm_eps"] == 1e-6
    tokens = torch.randint(0, HF_VOCAB_SIZE, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    close(our_logits(ck, tokens), hf_logits(back, tokens))

    cli = _cli()
    biased = _edited_copy(back, tmp_path / "biased", attention_bias=True)
    capsys.readouterr()
    for argv, says in ((["to-hf", "--load", ck, "--output", str(tmp_path / "out"), "--architecture",
                         "LlamaForCausalLM"], ["cannot be written as LlamaForCausalLM", "qk_layernorm=True",
                                               "--architecture Qwen3ForCausalLM"]),
                       (["from-hf", "--input", biased, "--output", str(tmp_path / "out"), "--tensor-parallel", "1"],
                        ["attention_bias=True", "not to this mix"])):
        rc = cli.main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert all(s in lines[0] for s in says), lines
        assert not os.path.exists(tmp_path / "out")
