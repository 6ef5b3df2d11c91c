"""--moe-router-dtype (Megatron-LM's; refused before, 11 of its example scripts pass it): a bf16 mixture of
experts routes in fp32 or fp64 -- megatron-core's router computes its logits, and so its scores, in that
dtype -- and in bf16 without it. The probabilities the router hands the experts are checked on a forward
of the model the job builds from its flags."""
import torch

from tests.harness import run_world
from tests.test_moe_job import MOE


def _router_dtypes(rank, extra):
    from megatron.core.transformer.moe.router import Router

    from zo_megatron.data import build_tokenizer
    from zo_megatron.model import build_gpt_model
    from zo_megatron.parallel import init_parallel
    from zo_megatron.training import components
    from zo_megatron.training.arguments import parse_args
    from zo_megatron.training.prelaunch import model_vocab_size

    argv = [a for a in MOE if a != "--fp32"] + ["--bf16", "--train-iters", "1", *extra]
    args = parse_args(argv)
    init_parallel(1, seed=1)
    args.model_vocab_size = model_vocab_size(args, build_tokenizer(tokenizer_type="NullTokenizer",
                                                                   vocab_size=args.vocab_size))
    model = build_gpt_model(components.model_config(args), 0, 1, 1).to(torch.bfloat16)  # as the engine holds it
    seen = []
    for router in (m for m in model.modules() if isinstance(m, Router)):
        router.register_forward_hook(lambda _m, _i, out: seen.append(out[0].dtype))
    tokens = torch.randint(0, 100, (2, 32))
    model.loss(tokens, tokens)
    return seen


def test_the_router_computes_in_the_dtype_asked():
    for extra, want in (([], torch.bfloat16), (["--moe-router-dtype", "fp32"], torch.float32),
                        (["--moe-router-dtype", "fp64"], torch.float64)):
        seen = run_world(_router_dtypes, 1, extra, timeout=120)[0]
        assert seen == [want, want], (extra, seen)          # both MoE layers
