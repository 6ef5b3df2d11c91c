"""--moe-router-num-groups / --moe-router-group-topk: group-limited routing (DeepSeek-V2's device-limited
and DeepSeek-V3's node-limited routing; megatron-core's group_limited_topk).

- One MoE layer of our model (sigmoid scores, an expert bias, 8 experts in 4 groups, 2 groups and 4 experts
  per token, normalised and scaled weights, a shared expert) equals transformers' DeepseekV3MoE, an
  independent implementation of DeepSeek-V3's router, on the same weights: every output element (fp32);
  the same layer without the group limit does not (the test tells them apart).
- The job at EP 2 with the groups on the EP ranks (device-limited routing) trains as the single-process
  torch reference, every iteration's loss; the checkpoint records the two fields, to-megatron writes them
  under Megatron-LM's names and from-megatron reads them back; the Hugging Face MoE families refuse them.
- What megatron-core would run silently is one line each.
"""
import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_moe_job import EP2, ITERS, _argv, _close, _reference_world, _run

HIDDEN, FFN, SHARED, EXPERTS, TOPK, GROUPS, GROUP_TOPK, SCALE = 32, 24, 40, 8, 4, 4, 2, 2.5


def _layer_vs_deepseek_v3(rank, seed):
    """Our model's MoE layer and DeepseekV3MoE with the same weights on the same hidden states; also
    our layer without the group limit."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed, num_attention_heads=4, hidden_size=HIDDEN)
    moe = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=64, max_position_embeddings=16,
               precision="fp32", position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
               add_bias_linear=False, num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=FFN,
               moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
               moe_router_topk_scaling_factor=SCALE, moe_shared_expert_intermediate_size=SHARED,
               moe_router_load_balancing_type="none")
    grouped = build_gpt_model(GPTConfig(**moe, moe_router_num_groups=GROUPS, moe_router_group_topk=GROUP_TOPK),
                              0, 1, seed).eval()
    ungrouped = build_gpt_model(GPTConfig(**moe), 0, 1, seed).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in grouped.named_parameters():
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
        layer = grouped.gpt.decoder.layers[0].mlp
        layer.router.expert_bias.copy_(torch.randn(EXPERTS, generator=gen) * 0.3)   # it moves the choice
    ungrouped.load_state_dict(grouped.state_dict(), strict=True)

    cfg = transformers.DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=FFN, n_routed_experts=EXPERTS,
                                        num_experts_per_tok=TOPK, n_group=GROUPS, topk_group=GROUP_TOPK,
                                        norm_topk_prob=True, routed_scaling_factor=SCALE,
                                        n_shared_experts=1,
                                        hidden_act="silu")
    hf = DeepseekV3MoE(cfg).eval()
    hf.shared_experts = type(hf.shared_experts)(cfg, intermediate_size=SHARED)    # megatron-core's size
    sd = {k: v.detach() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        hf.gate.weight.copy_(sd["router.weight"])
        hf.gate.e_score_correction_bias.copy_(sd["router.expert_bias"])
        for e in range(EXPERTS):
            hf.experts.gate_up_proj[e].copy_(sd[f"experts.local_experts.{e}.linear_fc1.weight"])   # [gate; up]
            hf.experts.down_proj[e].copy_(sd[f"experts.local_experts.{e}.linear_fc2.weight"])
        fc1 = sd["shared_experts.linear_fc1.weight"]
        hf.shared_experts.gate_proj.weight.copy_(fc1[:SHARED])
        hf.shared_experts.up_proj.weight.copy_(fc1[SHARED:])
        hf.shared_experts.down_proj.weight.copy_(sd["shared_experts.linear_fc2.weight"])
        x = torch.randn(6, 3, HIDDEN, generator=gen)                       # [s, b, h]
        ours = layer(x)[0]
        plain = ungrouped.gpt.decoder.layers[0].mlp(x)[0]
        ref = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)
    return ours, plain, ref


def test_a_layer_routes_as_deepseek_v3_s_group_limited_router():
    seed = fresh_seed("moe group routing vs DeepseekV3MoE")
    ours, plain, ref = run_world(_layer_vs_deepseek_v3, 1, seed, timeout=180)[0]
    scale = ref.abs().max()
    assert ((ours - ref).abs().max() / scale).item() < 1e-5, seed
    # without the limit the same weights route elsewhere: the comparison tells the two apart
    assert ((plain - ref).abs().max() / scale).item() > 1e-2, seed


DEVICE_LIMITED = ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]


def test_the_job_at_ep2_with_device_limited_routing_trains_as_the_torch_reference(tmp_path):
    """4 experts in 2 groups (one per EP rank), each token's top 2 from one group: the job at EP 2
    trains as the single-process reference (the same model flags), every iteration's loss; the
    checkpoint records the groups and the Megatron-LM conversions carry them."""
    from zo_megatron.checkpoint import convert
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.checkpoint.megatron_args import megatron_args, meta_from_args
    from zo_megatron.errors import UserError

    seed = fresh_seed("moe group routing job")
    ck = tmp_path / "ck"
    argv = [*_argv(seed), *DEVICE_LIMITED]
    rows, r = _run(tmp_path, "ep2", [*argv, *EP2, "--save", str(ck)])
    ref, _ = run_world(_reference_world, 1, argv, str(tmp_path / "cache"), timeout=120)[0]
    got = [rows[i]["loss"] for i in range(1, ITERS + 1)]
    assert all(_close(g, w) for g, w in zip(got, ref)), (got, ref)
    meta = CheckpointReader(str(ck)).model_meta
    assert (meta["moe_router_num_groups"], meta["moe_router_group_topk"]) == (2, 1), meta
    args = megatron_args(meta, tp=1, iteration=ITERS, divisible_by=128, seq_length=32, precision="fp32")
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (2, 1)
    back = meta_from_args(args, meta["vocab_size"], "x")
    assert back == meta, {k: (back[k], meta[k]) for k in meta if back.get(k) != meta[k]}
    args.moe_router_group_topk = None           # Megatron-LM routes without groups then: so is the model read
    assert meta_from_args(args, meta["vocab_size"], "x")["moe_router_num_groups"] is None
    log = []
    convert.to_megatron(str(ck), str(tmp_path / "mlm"), expert_parallel=2, log=log.append)
    assert any("note: launch Megatron-LM with --moe-router-num-groups 2 --moe-router-group-topk 1" in line
               for line in log), log
    with pytest.raises(UserError, match="group-limited routing"):
        convert.to_hf(str(ck), str(tmp_path / "hf"), log=lambda _: None)


@pytest.mark.parametrize("flags, words", [
    (["--moe-router-num-groups", "2"], "without --moe-router-group-topk"),
    (["--moe-router-group-topk", "1"], "add --moe-router-num-groups"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], "does not divide --num-experts 4"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], "choose 1 to --moe-router-num-groups 2"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "3"], "--moe-router-topk 2 < --moe-router-group-topk 3"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"], "exceeds the 1 experts"),
])
def test_what_megatron_core_would_run_silently_is_one_line(flags, words):
    from zo_megatron.errors import ConfigError
    from zo_megatron.training.arguments import parse_args

    with pytest.raises(ConfigError) as e:
        parse_args([*_argv(1), *flags])
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
