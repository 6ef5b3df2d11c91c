"""tools/convert_checkpoint.py for the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE), against
transformers.

A random Mixtral that transformers builds and saves (hidden 64, 4 heads, 2 KV groups, 4 experts of
FFN 40, top 2; every weight random) with a tokenizer and a config vocabulary larger than it:
  - HF -> ours (TP 2: experts split as the MLP) -> HF is bit-exact: every tensor (experts w1/w2/w3, the router) and the
    config's fields, experts and top-k included;
  - the printed model flags, parsed by the job's parser, give the checkpoint's architecture;
  - our model built from the from-hf checkpoint gives transformers' logits at TP1 x EP2 (alltoall) and
    TP2 with sequence parallelism (2 forked ranks);
  - a Mixtral written as Llama, and a top-1 or jittered Mixtral are one line each, exit 2, nothing written
    (to-megatron / from-megatron of MoE checkpoints: tests/test_convert_megatron_moe.py).
Qwen2-MoE and Qwen3-MoE: HF -> ours -> HF bit-exact and their printed flags (the last test).
(Every gradient and the loss against transformers: tests/test_moe_model.py, through the same mappings.)
"""
import json
import os

import pytest
import torch

from tests.harness import next_port, run_world
from tests.hf_tokenizer import HF_VOCAB_SIZE
from tests.seeds import fresh_seed
from tests.test_convert_llama import CONFIG_FIELDS, _cli, _edited_copy, close, hf_logits, make_hf_model, quiet

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

HIDDEN, HEADS, GROUPS, FFN, LAYERS, EXPERTS, TOPK = 64, 4, 2, 40, 2, 4, 2
VOCAB = HF_VOCAB_SIZE + 37
SEQ = 12
TPS = (2,)
MOE_FIELDS = ("num_local_experts", "num_experts_per_tok", "router_jitter_noise")


def _ranks(rank, d, tokens, layouts):
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.model.config import ARCH_FIELDS
    from zo_megatron.model.sharding import load_full_params
    from zo_megatron.parallel import collectives, destroy_parallel, init_parallel

    out = {}
    for tp, ep, dispatcher, ck_tp in layouts:
        next_port()                                  # chosen now, not when the test started
        ps = init_parallel(tp, expert_parallel=ep)
        reader = CheckpointReader(os.path.join(d, f"ck_tp{ck_tp}"))
        meta = {**{k: reader.model_meta[k] for k in ARCH_FIELDS}, "moe_token_dispatcher_type": dispatcher}
        model = build_gpt_model(GPTConfig(**meta, precision="fp32", sequence_parallel=tp > 1), ps.tp_rank, tp, 1)
        load_full_params(model, reader.read_weights(), ps.tp_rank, tp, VOCAB)
        model.eval()
        with torch.no_grad():
            local = model(tokens)
        full = torch.cat(collectives.all_gather_list(local.contiguous(), ps.tp_group), -1)
        out[(tp, ep, dispatcher)] = full[..., :VOCAB].float().clone()
        collectives.barrier()
        destroy_parallel()
    return out


def test_mixtral_converts_both_ways_bit_exact_with_transformers_logits(tmp_path):
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs

    seed = fresh_seed("convert mixtral")
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                     num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=64,
                                     rms_norm_eps=1e-5, num_local_experts=EXPERTS, num_experts_per_tok=TOPK,
                                     tie_word_embeddings=False, sliding_window=None, bos_token_id=0, eos_token_id=1,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    src = make_hf_model(tmp_path / "src", cfg, seed)
    a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in a
    cfg_a = json.load(open(os.path.join(src, "config.json")))
    lines = []
    for tp in TPS:
        ck = str(tmp_path / f"ck_tp{tp}")
        convert.from_hf(src, ck, tensor_parallel=tp, log=lines.append)
        meta = CheckpointReader(ck).model_meta
        assert (meta["num_experts"], meta["moe_router_topk"], meta["moe_ffn_hidden_size"]) == (EXPERTS, TOPK, FFN)
        assert not meta["moe_router_pre_softmax"] and meta["moe_aux_loss_coeff"] == 0.0
        back = str(tmp_path / f"back_tp{tp}")
        convert.to_hf(ck, back, log=quiet)
        b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
        assert set(a) == set(b), (tp, set(a) ^ set(b))
        for k in a:
            assert b[k].dtype == torch.float32 and torch.equal(a[k], b[k]), (tp, k)
        cfg_b = json.load(open(os.path.join(back, "config.json")))
        for f in CONFIG_FIELDS + MOE_FIELDS:
            assert cfg_a.get(f) == cfg_b.get(f), (tp, f, cfg_a.get(f), cfg_b.get(f))
    (flags,) = {ln.removeprefix("  model flags: ") for ln in lines if ln.startswith("  model flags: ")}
    args = build_parser().parse_args(flags.split())
    ours = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=args.vocab_size, precision="fp32")
    assert ours.arch_meta() == CheckpointReader(str(tmp_path / "ck_tp2")).model_meta, flags

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    layouts = [(1, 2, "alltoall", 2), (2, 1, "allgather", 2)]
    world = run_world(_ranks, 2, str(tmp_path), tokens, layouts, timeout=300)
    ref = hf_logits(src, tokens)
    for rank_out in world:
        for layout in layouts:
            close(rank_out[layout[:3]], ref)


def test_what_mixtral_conversion_refuses_is_one_line(tmp_path, capsys):
    from zo_megatron.checkpoint import convert

    seed = fresh_seed("mixtral refusals")
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None)
    src = make_hf_model(tmp_path / "src", cfg, seed)
    ck = str(tmp_path / "ck")
    convert.from_hf(src, ck, tensor_parallel=1, log=quiet)
    cli = _cli()
    out = str(tmp_path / "out")
    capsys.readouterr()
    for argv, says in (
            (["to-hf", "--load", ck, "--output", out, "--architecture", "LlamaForCausalLM"],
             ["cannot be written as LlamaForCausalLM", "has no experts"]),
            (["from-hf", "--input", _edited_copy(src, tmp_path / "top1", num_experts_per_tok=1), "--output", out,
              "--tensor-parallel", "1"], ["num_experts_per_tok=1", "no exact mapping"]),
            (["from-hf", "--input", _edited_copy(src, tmp_path / "jitter", router_jitter_noise=0.1), "--output", out,
              "--tensor-parallel", "1"], ["router_jitter_noise=0.1", "--moe-input-jitter-eps"])):
        rc = cli.main(argv)
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "%" not in ln]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
        assert all(s in lines[0] for s in says), lines
        assert not os.path.exists(out)


def test_qwen_moe_families_round_trip_bit_exact_and_their_flags_give_the_model(tmp_path):
    """Qwen2-MoE (gated shared expert, QKV biases, norm_topk_prob false, a dense layer 1) and Qwen3-MoE
    (q/k norms, head_dim 24): HF -> ours (TP 2) -> HF bit-exact, config fields included; the printed
    flags (--moe-layer-freq [1,0], --moe-router-pre-softmax, --moe-shared-expert-*) give the checkpoint's
    architecture. (Their logits and gradients against transformers: tests/test_moe_model.py.)"""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.model import GPTConfig
    from zo_megatron.training.arguments import build_parser
    from zo_megatron.training.model_flags import architecture_kwargs, moe_kwargs

    seed = fresh_seed("convert qwen moe")
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=GROUPS, max_position_embeddings=64, rms_norm_eps=1e-6, num_experts_per_tok=TOPK,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, intermediate_size=56,
                  moe_intermediate_size=FFN, num_experts=EXPERTS,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    configs = {"qwen2_moe": transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=48,
                                                        norm_topk_prob=False, mlp_only_layers=[1]),
               "qwen3_moe": transformers.Qwen3MoeConfig(**common, norm_topk_prob=True, head_dim=24)}
    fields = CONFIG_FIELDS + ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                              "norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "qkv_bias")
    want = {"qwen2_moe": dict(moe_layer_freq=[1, 0], moe_router_pre_softmax=True, add_qkv_bias=True,
                              moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True),
            "qwen3_moe": dict(moe_layer_freq=1, moe_router_pre_softmax=False, qk_layernorm=True, kv_channels=24,
                              moe_shared_expert_intermediate_size=None)}
    for i, (name, cfg) in enumerate(configs.items()):
        src = make_hf_model(tmp_path / name, cfg, seed + i)
        lines = []
        ck = str(tmp_path / f"{name}_ck")
        convert.from_hf(src, ck, tensor_parallel=2, log=lines.append)
        meta = CheckpointReader(ck).model_meta
        for k, v in want[name].items():
            assert meta[k] == v, (name, k, meta[k], v)
        back = str(tmp_path / f"{name}_back")
        convert.to_hf(ck, back, log=quiet)
        a = safetensors_torch.load_file(os.path.join(src, "model.safetensors"))
        b = safetensors_torch.load_file(os.path.join(back, "model.safetensors"))
        assert set(a) == set(b), (name, set(a) ^ set(b))
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
        cfg_a, cfg_b = (json.load(open(os.path.join(d, "config.json"))) for d in (src, back))
        for f in fields:
            assert cfg_a.get(f) == cfg_b.get(f), (name, f, cfg_a.get(f), cfg_b.get(f))
        (flags,) = [ln.removeprefix("  model flags: ") for ln in lines if ln.startswith("  model flags: ")]
        args = build_parser().parse_args(flags.split())
        ours = GPTConfig(**architecture_kwargs(args), **moe_kwargs(args), vocab_size=args.vocab_size,
                         precision="fp32")
        assert ours.arch_meta() == meta, (name, flags)
