"""Megatron-LM's router run settings: --moe-input-jitter-eps (the router's input times noise uniform in
[1 - eps, 1 + eps], Switch Transformer's jitter) and --moe-router-force-load-balancing (random logits, for
benchmarks), through megatron-core's router. References: the jittered input equals the input times
torch's Uniform(1 - eps, 1 + eps) drawn from the same generator state; forced routing does not depend
on the router's weights (two models with other weights route alike from the same RNG state) and spreads
the tokens evenly."""
import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed

SHAPE = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, vocab_size=97,
             max_position_embeddings=64, precision="fp32", position_embedding_type="rope", normalization="RMSNorm",
             swiglu=True, add_bias_linear=False, num_experts=8, moe_router_topk=2)


def _router(model):
    return next(m for m in model.modules() if type(m).__name__ == "TopKRouter")


def _jitter_world(rank, seed):
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    model = build_gpt_model(GPTConfig(**SHAPE, moe_input_jitter_eps=0.05), 0, 1, seed)
    router, seen = _router(model), {}
    router.register_forward_pre_hook(lambda _m, args: seen.setdefault("input", args[0].detach().clone()))
    gating = router.gating
    router.gating = lambda x: seen.setdefault("jittered", x.detach().clone()) is not None and gating(x)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed + 1)
    model(tokens)
    torch.manual_seed(seed + 1)                 # no random op runs before the router (no dropout)
    noise = torch.distributions.uniform.Uniform(torch.tensor(0.95), torch.tensor(1.05)).rsample(seen["input"].shape)
    return seen, noise


def test_the_router_input_is_jittered_as_megatron_core_says():
    seed = fresh_seed("moe input jitter")
    seen, noise = run_world(_jitter_world, 1, seed)[0]
    assert torch.equal(seen["jittered"], seen["input"] * noise)
    assert not torch.equal(seen["jittered"], seen["input"])


def _forced_world(rank, seed, force):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import init_parallel

    init_parallel(1, seed=seed)
    tokens = torch.randint(0, 97, (4, 64), generator=torch.Generator().manual_seed(seed))
    states = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
    maps = []
    for weights_seed in (seed, seed + 7):        # two models: other router (and expert) weights
        model = build_gpt_model(GPTConfig(**SHAPE, moe_router_force_load_balancing=force), 0, 1, weights_seed)
        router = _router(model)
        router.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in states.items()})
        model(tokens)
    return maps


@pytest.mark.parametrize("force", [True, False])
def test_forced_routing_ignores_the_weights_and_spreads_the_tokens(force):
    seed = fresh_seed(f"moe forced load balancing {force}")
    first, second = run_world(_forced_world, 1, seed, force)[0]
    if not force:                                # the learned router routes by its weights
        assert not torch.equal(first, second)
        return
    assert torch.equal(first, second)
    per_expert = first.sum(0).double()           # 256 tokens x top 2 over 8 experts: 64 each on average
    assert per_expert.sum() == 4 * 64 * 2 and per_expert.min() >= 32 and per_expert.max() <= 100, per_expert
