"""--moe-router-enable-expert-bias / --moe-router-bias-update-rate: aux-loss-free load balancing
(megatron-core's router bias; the job's update, training/expert_bias.py; its checkpoint keys,
checkpoint/content.py `buffers/`).

The update is held to the rule computed here from every rank's routing maps (exactly, at EP 2 on 2
ranks); the job at EP 2 to a single-process torch reference that updates the bias by that rule from
the routing maps it sees (the losses within fp32 reduction order, the bias exactly but for a near-tie
routing a token elsewhere); checkpoints keep the bias: a resume is bit for bit, a resume at another
EP and an offline reshard carry it; what the conversions cannot write is refused in one line.
"""
from __future__ import annotations


import pytest
import torch

from tests.harness import run_world
from tests.seeds import fresh_seed
from tests.test_moe_job import EP2, ITERS, LAYOUTS, MOE, RTOL, _run

RATE = 0.05
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        str(RATE)]


ODD_ITERS = 3      # after an odd number of updates (each +-rate, 0 at exactly the mean) the bias is rarely 0


def _argv(seed, iters=ITERS):
    return [*MOE, *BIAS, "--seed", str(seed), "--train-iters", str(iters)]


def _update_world(rank, seed):
    """Two forward/backward passes of different batches per rank, then ExpertBias.update(); the routing
    maps each router produced (the test sums them over ranks), the bias before and after, and the
    routing of one more forward, with the logits that chose it."""
    from zo_megatron.model import GPTConfig, build_gpt_model
    from zo_megatron.parallel import collectives, init_parallel
    from zo_megatron.training.expert_bias import ExpertBias

    ps = init_parallel(1, seed=seed, expert_parallel=2)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16,
                    swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                    num_experts=4, moe_router_topk=2, moe_router_score_function="sigmoid",
                    moe_token_dispatcher_type="alltoall", moe_router_enable_expert_bias=True,
                    moe_router_bias_update_rate=RATE, precision="fp32")
    model = build_gpt_model(cfg, 0, 1, seed)
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    start = [torch.randn(4, generator=torch.Generator().manual_seed(seed + 7 + i)) * 0.1 for i in range(len(routers))]
    for r, b in zip(routers, start):
        r.expert_bias.copy_(b)
    maps, logits = [[] for _ in routers], [[] for _ in routers]
    for i, r in enumerate(routers):
        r.register_forward_hook(lambda _m, _i, out, i=i: maps[i].append(out[1].clone()))

        def gating(x, _gating=r.gating, i=i):        # the logits the router routes by, as it computed them
            out = _gating(x)
            logits[i].append(out.detach().clone())
            return out
        r.gating = gating
    gen = torch.Generator().manual_seed(seed + 100 * rank)
    for _ in range(2):
        tokens = torch.randint(0, 128, (2, 16), generator=gen)
        model.loss(tokens, tokens).backward()
    ExpertBias(model, RATE).update()
    counted = [torch.cat(m).sum(0) for m in maps]
    all_counts = [collectives.all_gather_list(c.float().contiguous(), None) for c in counted]
    after = [r.expert_bias.clone() for r in routers]
    left = [r.local_tokens_per_expert.clone() for r in routers]
    for m, lg in zip(maps, logits):
        m.clear()
        lg.clear()
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    model.loss(tokens, tokens).backward()
    return dict(start=start, all_counts=all_counts, after=after, left=left,
                next_maps=[m[0] for m in maps], next_logits=[lg[0] for lg in logits])


def test_the_update_is_megatron_s_rule_over_every_rank_and_the_bias_picks_the_experts():
    """bias += rate x sign(mean - counts) with the counts of both ranks' routing maps summed, the local
    counts then zero; the next forward chooses each token's top-k by sigmoid(logits) + bias (the bias
    changes the choice, not the weights)."""
    seed = fresh_seed("expert bias update")
    out = run_world(_update_world, 2, seed, timeout=180)
    for o in out:
        for layer, (start, counts, after, left) in enumerate(zip(o["start"], o["all_counts"], o["after"], o["left"])):
            total = sum(c.double() for c in counts)
            # the bias is fp32: one fp32 addition of +-rate per element (as megatron-core's)
            want = start + torch.sign(total.mean() - total).float() * torch.tensor(RATE, dtype=torch.float32)
            assert total.sum() == 2 * 2 * 2 * 16 * 2, total          # ranks x passes x tokens x top-k
            assert torch.equal(after, want), (layer, after, want)
            assert torch.equal(left, torch.zeros(4)), left
        for routing, lg, bias in zip(o["next_maps"], o["next_logits"], o["after"]):
            scores = torch.sigmoid(lg.float().reshape(-1, 4))
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, torch.topk(scores + bias, 2).indices, True)
            assert torch.equal(routing.reshape(-1, 4).bool(), chosen)
    assert torch.equal(out[0]["after"][0], out[1]["after"][0])              # one bias on every rank


def _reference_world(rank, argv, cache):
    """The single-process torch reference of tests/test_moe_job.py, the bias updated here by the rule
    from the routing maps its routers produced in each iteration: (losses, final bias per layer)."""
    from tests.test_moe_job import _reference_world as moe_reference

    import zo_megatron.model as zm

    routers, seen = [], []
    build = zm.build_gpt_model

    def build_and_watch(*a, **k):
        model = build(*a, **k)
        for r in (m for m in model.modules() if getattr(m, "expert_bias", None) is not None):
            routers.append(r)
            r.register_forward_hook(lambda _m, _i, out: seen.append(out[1].sum(0).double()))
            # the update, once per iteration: before the optimizer step (the reference's clip_grad_norm_)
        return model

    clip = torch.nn.utils.clip_grad_norm_

    def update_then_clip(params, max_norm):
        counts = torch.stack(seen).view(-1, len(routers), 4).sum(0)        # micro-batches, then per layer
        for r, c in zip(routers, counts):
            r.expert_bias.add_((RATE * torch.sign(c.mean() - c)).float())
            r.local_tokens_per_expert.zero_()
        seen.clear()
        return clip(params, max_norm)

    zm.build_gpt_model, torch.nn.utils.clip_grad_norm_ = build_and_watch, update_then_clip
    try:
        losses, _ = moe_reference(rank, argv, cache)
    finally:
        zm.build_gpt_model, torch.nn.utils.clip_grad_norm_ = build, clip
    return losses, [r.expert_bias.clone() for r in routers]


def _saved_bias(ck, iteration) -> list[torch.Tensor]:
    from zo_megatron.checkpoint.content import BUFFERS
    from zo_megatron.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(str(ck), iteration)
    keys = sorted(k for k in reader.metadata.state_dict_metadata if k.startswith(BUFFERS))
    assert keys and all(k.endswith(".mlp.router.expert_bias") for k in keys), keys
    got = reader.read_full(keys)
    return [got[k] for k in keys]


@pytest.mark.parametrize("layout", ["EP2", "TP2"])
def test_the_job_balances_as_the_torch_reference(tmp_path, layout):
    """At EP 2 (alltoall, two engines, DP 2) and at TP 2 with sequence parallelism (each TP rank routes
    its half of the sequence; the counts summed over TP x DP) on 2 ranks: every iteration's loss equals
    the reference's, and the checkpoint's bias is the reference's (a near-tie may route a token
    elsewhere in fp32 and move one element by 2 x rate, as tests/test_moe_job.py allows the token counts
    2 tokens)."""
    seed = fresh_seed(f"expert bias job {layout}")
    ck = tmp_path / "ck"
    iters = ODD_ITERS
    rows, r = _run(tmp_path, layout, [*_argv(seed, iters), *LAYOUTS[layout][0], "--save", str(ck),
                                      "--save-interval", str(iters)])
    ref_losses, ref_bias = run_world(_reference_world, 1, _argv(seed, iters), str(tmp_path / "cache"), timeout=180)[0]
    got = [rows[i]["loss"] for i in range(1, iters + 1)]
    assert all(abs(g - w) <= RTOL * abs(w) for g, w in zip(got, ref_losses)), (seed, got, ref_losses)
    saved = _saved_bias(ck, iters)
    assert len(saved) == len(ref_bias) == 2
    assert any(bool((b != 0).any()) for b in ref_bias)
    off = [(i, e) for i, (s, w) in enumerate(zip(saved, ref_bias)) for e in range(4) if s[e] != w[e]]
    assert len(off) <= 1 and all(abs(saved[i][e] - ref_bias[i][e]) <= 2 * RATE + 1e-6 for i, e in off), \
        (seed, saved, ref_bias)


def test_a_run_with_expert_bias_resumes_bit_for_bit_and_at_another_ep(tmp_path):
    """Saved at iteration 2 and resumed there at EP 2, iterations 3-4 log the uninterrupted run's rows bit
    for bit and end with its bias; resumed at EP 1 the same within fp32 reduction order (the bias read
    whole by every rank). An offline reshard to TP 2 carries the bias unchanged."""
    from zo_megatron.checkpoint.convert import reshard

    seed = fresh_seed("expert bias resume")
    ck, ck2 = tmp_path / "ck", tmp_path / "ck2"
    keys = ("loss", "grad_norm", "tokens_per_expert_min", "tokens_per_expert_max")
    whole, _ = _run(tmp_path, "whole", [*_argv(seed), *EP2, "--save", str(ck), "--save-interval", "1"])
    resumed, r = _run(tmp_path, "resumed", [*_argv(seed), *EP2, "--load", str(ck), "--ckpt-step", "2",
                                            "--save", str(ck2), "--save-interval", "1"])
    assert sorted(resumed) == [3, 4], r.stdout[-2000:]
    assert {i: [whole[i][k] for k in keys] for i in resumed} == {i: [resumed[i][k] for k in keys] for i in resumed}
    for it in (3, 4):
        assert all(torch.equal(a, b) for a, b in zip(_saved_bias(ck, it), _saved_bias(ck2, it))), it
    # after an odd number of updates an element is 0 only if one update found its count exactly at the mean
    assert any(bool((b != 0).any()) for b in _saved_bias(ck, 3))
    ep1, _ = _run(tmp_path, "ep1", [*_argv(seed), "--moe-token-dispatcher-type", "alltoall", "--load", str(ck),
                                    "--ckpt-step", "2"])
    for i in (3, 4):
        assert abs(ep1[i]["loss"] - whole[i]["loss"]) <= RTOL * abs(whole[i]["loss"]), (i, ep1[i], whole[i])
    out = tmp_path / "tp2"
    reshard(str(ck), str(out), target_tp=2, iteration=2, log=lambda *_: None)
    assert all(torch.equal(a, b) for a, b in zip(_saved_bias(ck, 2), _saved_bias(out, 2)))
    # a resume with another rate (a run setting, not the architecture) goes on and says so
    argv = [*_argv(seed), *EP2, "--load", str(ck), "--ckpt-step", "2"]
    argv[argv.index("--moe-router-bias-update-rate") + 1] = "0.01"
    _, r = _run(tmp_path, "rate", argv)
    assert f"this resume changes --moe-router-bias-update-rate: {RATE} in the checkpoint, 0.01 now" in r.stdout, \
        r.stdout[-2000:]


@pytest.mark.parametrize("argv,says", [
    (["--moe-router-enable-expert-bias"], "add --moe-router-score-function sigmoid"),
    (["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
      "-1"], "must be >= 0"),
])
def test_bad_expert_bias_flags_are_one_line(argv, says, tmp_path):
    from tests.test_pretrain import _single

    r = _single([*MOE, "--train-iters", "2", *argv], tmp_path)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr[-2000:]


def _megatron_core_loads(rank, torch_dir, dist_dir):
    """megatron-core's GPTModel from the torch files' saved args (Megatron-LM's config, the bias on),
    loaded strictly from the torch file, and loaded by its own dist_checkpointing from the torch_dist
    directory: each model's router expert biases."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from tests.test_convert_megatron_moe import _megatron_core_moe_gpt
    from tests.test_convert_megatron_pipeline import start_megatron_core_world
    from zo_megatron.checkpoint import megatron_lm

    start_megatron_core_world()
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
        one = megatron_lm.safe_load(str(torch_dir / "iter_0000001" / "mp_rank_00" / megatron_lm.FILE))
        strict = _megatron_core_moe_gpt(one["args"])
        strict.load_state_dict(one["model"], strict=True)
        dist = _megatron_core_moe_gpt(one["args"])
        metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                    "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
        loaded = dist_checkpointing.load({"model": dist.sharded_state_dict(metadata=metadata)},
                                         str(dist_dir / "iter_0000001"), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        dist.load_state_dict(loaded["model"], strict=True)
        bias = {name: {k: v.clone() for k, v in m.state_dict().items() if k.endswith("router.expert_bias")}
                for name, m in (("torch", strict), ("torch_dist", dist))}
        mpu.destroy_model_parallel()
    finally:
        torch.distributed.destroy_process_group()
    return bias


def test_the_megatron_lm_conversions_carry_the_bias_and_to_hf_refuses_it(tmp_path):
    """to-megatron writes the routers' expert bias under megatron-core's name (router.expert_bias, a
    persistent buffer): megatron-core's GPTModel built from the written args loads the torch file
    strictly and the torch_dist directory through its own dist_checkpointing, and holds the job's
    bias; from-megatron of the torch files at EP 2 and of the torch_dist directory gives the bias and
    every weight back bit for bit. to-hf refuses (its MoE families route by softmax, without a bias),
    one line, nothing written."""
    from tests.test_pretrain import _single
    from zo_megatron.checkpoint.arch import job_flags
    from zo_megatron.checkpoint.convert import from_megatron, to_hf, to_megatron
    from zo_megatron.checkpoint.reader import CheckpointReader
    from zo_megatron.errors import UserError

    ck = tmp_path / "ck"
    r = _single([*_argv(fresh_seed("expert bias convert"), 1), "--save", str(ck)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    bias = _saved_bias(ck, 1)
    assert any(bool((b != 0).any()) for b in bias)           # one update: +-rate (0 at exactly the mean)
    with pytest.raises(UserError, match="a softmax router"):        # the bias needs sigmoid: no HF MoE family has it
        to_hf(str(ck), str(tmp_path / "hf"), log=lambda *_: None)
    assert not (tmp_path / "hf").exists()
    assert "--moe-router-enable-expert-bias" in job_flags(CheckpointReader(str(ck)).model_meta).split()
    quiet = lambda *_: None                                             # noqa: E731
    out = {}
    for name, kw in (("torch", {}), ("ep2", {"expert_parallel": 2}), ("torch_dist", {"ckpt_format": "torch_dist"})):
        to_megatron(str(ck), str(tmp_path / name), log=quiet, **kw)
        from_megatron(str(tmp_path / name), str(tmp_path / f"{name}_back"), tensor_parallel=1, log=quiet)
        out[name] = tmp_path / f"{name}_back"
    reader = CheckpointReader(str(ck))
    weights = reader.read_weights()
    for name, back_dir in out.items():
        back = CheckpointReader(str(back_dir))
        assert back.model_meta == reader.model_meta, name
        assert all(torch.equal(a, b) for a, b in zip(_saved_bias(back_dir, 0), bias)), name
        got = back.read_weights()
        assert set(got) == set(weights) and all(torch.equal(got[k], weights[k]) for k in weights), name
    loaded = run_world(_megatron_core_loads, 1, tmp_path / "torch", tmp_path / "torch_dist", timeout=180)[0]
    for fmt, by_name in loaded.items():
        assert len(by_name) == len(bias) == 2, (fmt, sorted(by_name))
        assert all(torch.equal(by_name[k], b) for k, b in zip(sorted(by_name), bias)), fmt


def test_to_fp32_writes_the_bias_beside_the_weights(tmp_path):
    from safetensors.torch import load_file

    from tests.test_pretrain import _single
    from zo_megatron.checkpoint.convert import to_fp32

    ck = tmp_path / "ck"
    r = _single([*_argv(fresh_seed("expert bias to-fp32"), 1), "--save", str(ck)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    to_fp32(str(ck), str(tmp_path / "w.safetensors"), log=lambda *_: None)
    got = load_file(str(tmp_path / "w.safetensors"))
    bias = _saved_bias(ck, 1)
    names = sorted(n for n in got if n.endswith(".mlp.router.expert_bias"))
    assert len(names) == 2 and all(torch.equal(got[n], b) for n, b in zip(names, bias)), names
    assert any(bool((b != 0).any()) for b in bias)           # one update: +-rate (0 at exactly the mean)
